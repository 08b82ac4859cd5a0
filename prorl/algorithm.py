"""The algorithmic pieces of ProRL v2 that are not loss kernels, as small pure functions.

What ProRL does differently from textbook GRPO (docs/recipe.md):
- advantages are REINFORCE++-baseline: centre on the group mean, then whiten over the whole global
  batch (token-weighted), instead of dividing by each group's own std
  (`prorl.kernels.group_advantages`);
- PPO-Clip is asymmetric ("clip-higher", eps_low 0.2 / eps_high 0.28) so rare tokens can still grow;
- groups whose raw rewards are all equal carry no signal and are dropped *before* advantages are
  computed, and the batch is refilled with new prompts (dynamic sampling, `keep_groups`);
- a k2 KL penalty to a reference policy that is periodically reset to the current policy
  (`ReferenceResetPolicy`), so the run can go on improving for thousands of steps;
- a cosine length penalty that is switched on and off on a schedule (`length_penalty_on`,
  `cosine_length_eta`), and responses cut at the length limit get no reward (`stop_properly`).

Everything here is a function of its arguments (or a small object with `state_dict`), so each
docs/recipe.md worked number is a unit test, and resuming a run restores the exact same decisions.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

# --------------------------------------------------------------------------------------------------
# Reward shaping (docs/recipe.md §5)
# --------------------------------------------------------------------------------------------------


def stop_properly(
    rewards: torch.Tensor, truncated: torch.Tensor, c_stop: float = 0.0
) -> torch.Tensor:
    """A response cut by the length limit gets R * c_stop (default 0) - never more than R itself, so
    that with a verifier whose wrong answers score below 0 (verl-style -1/+1) running out of length
    does not beat answering wrong. rewards [B], truncated [B] bool."""
    return torch.where(truncated, torch.minimum(rewards * c_stop, rewards), rewards)


def cosine_length_eta(
    lengths: torch.Tensor, max_len: int, eta_min: float, eta_max: float
) -> torch.Tensor:
    """eta(t) = eta_min + 0.5 (eta_max - eta_min)(1 + cos(pi t / T)); t = response tokens, T =
    max_len."""
    t = lengths.to(torch.float64).clamp(0, max_len)
    return (eta_min + 0.5 * (eta_max - eta_min) * (1.0 + torch.cos(math.pi * t / max_len))).to(
        torch.float32
    )


def length_penalty_on(step: int, k_on: int, k_off: int) -> bool:
    """The cosine length term is on for k_on steps, then off for k_off steps, repeating (from step
    0)."""
    if k_on <= 0:
        return False
    if k_off <= 0:
        return True
    return step % (k_on + k_off) < k_on


def cosine_length_shaping(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    correct: torch.Tensor,
    *,
    max_len: int,
    lam: float = 0.5,
    eta: tuple[float, float] = (-1.0, 0.0),
    wrong_eta: tuple[float | None, float | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """R' = R + lam * eta(t) for responses that stopped properly; returns (R', the term added).

    eta = (eta_min, eta_max) of the cosine schedule. Wrong answers use wrong_eta = (min, max) when
    given (the Demystifying-Long-CoT variant; a None end is eta's), else the same eta as correct
    ones. Truncated responses get no term (they are handled by `stop_properly`). Whether the
    schedule is on this step is the caller's (`length_penalty_on`).
    """
    (eta_min, eta_max), (wrong_min, wrong_max) = eta, wrong_eta
    value = cosine_length_eta(lengths, max_len, eta_min, eta_max)
    if wrong_min is not None or wrong_max is not None:
        eta_wrong = cosine_length_eta(
            lengths,
            max_len,
            eta_min if wrong_min is None else wrong_min,
            eta_max if wrong_max is None else wrong_max,
        )
        value = torch.where(correct, value, eta_wrong)
    term = torch.where(truncated, torch.zeros_like(value), lam * value)
    return rewards + term, term


def overlong_buffer_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0
):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer_len, then linear down to
    -factor."""
    over = (lengths.to(torch.float32) - (max_len - buffer_len)).clamp(min=0)
    return -factor * (over / max(buffer_len, 1)).clamp(max=1.0)


# --------------------------------------------------------------------------------------------------
# Dynamic sampling (docs/recipe.md §6)
# --------------------------------------------------------------------------------------------------


def keep_groups(
    raw_rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int | None = None
):
    """The dynamic-sampling keep rule (GroupSampler.collect runs it): per group, True iff its RAW
    rewards are not all equal. Decided per group, never per sample.

    raw_rewards [B] float, group_index [B] int64 in [0, G). Returns keep [G] bool (no Python loop).
    """
    g = int(group_index.max()) + 1 if num_groups is None else num_groups
    r = raw_rewards.to(torch.float64)
    hi = torch.full((g,), -math.inf, dtype=torch.float64).scatter_reduce(0, group_index, r, "amax")
    lo = torch.full((g,), math.inf, dtype=torch.float64).scatter_reduce(0, group_index, r, "amin")
    return hi > lo


def group_pass_counts(
    raw_rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int
) -> dict:
    """The sums behind the pass-rate metrics (binary rewards: correct iff reward >= 1), by the
    StepAccumulator keys prorl/metrics.py turns into `dynamic_sampling/pass_rate`,
    `frac_all_correct` and `frac_all_wrong`: groups seen, all-correct and all-wrong groups, correct
    samples."""
    correct = (raw_rewards >= 1.0).to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(correct)
    )
    n_correct = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, correct)
    return {
        "groups_seen": num_groups,
        "groups_all_correct": int((n_correct == count).sum()),
        "groups_all_wrong": int((n_correct == 0).sum()),
        "samples_correct": int(correct.sum()),
    }


# --------------------------------------------------------------------------------------------------
# Reference-policy reset (docs/recipe.md §7)
# --------------------------------------------------------------------------------------------------


@dataclass
class ReferenceResetPolicy:
    """Decides when pi_ref <- current policy: every `interval` steps, on a KL spike, or on stalled
    validation.

    KL spike: this step's mean KL > kl_spike_factor x the median of the last `window` steps' KL, and
    at least `kl_floor` (a spike of noise near 0 is no reason to reset). The window holds only steps
    more than `window` steps after the reference was last set (the run's start or a reset): the KL
    to a new reference starts at 0 and rises for a while, and against a window of that rise the
    ordinary rise reads as a spike (it fired ~22 steps after every reset); so the rule can first
    fire 2 x `window` + 1 steps after a reset. Stall: no validation improvement for `patience`
    evaluations (0 = off). The optimizer is reset too only if `reset_optimizer` (v1 behaviour); the
    caller does the actual copy. Its state (not its settings) is checkpointed.
    """

    interval: int = 300
    kl_spike_factor: float = 5.0
    kl_floor: float = 0.0
    window: int = 20
    patience: int = 0
    reset_optimizer: bool = False
    kl_history: list[float] = field(default_factory=list)
    best_val: float = -math.inf
    evals_since_best: int = 0
    last_reset_step: int = 0
    num_resets: int = 0

    def observe_validation(self, score: float) -> None:
        if score > self.best_val:
            self.best_val, self.evals_since_best = score, 0
        else:
            self.evals_since_best += 1

    def should_reset(self, step: int, mean_kl: float) -> str | None:
        """Record this step's KL; return why to reset now ('interval' | 'kl_spike' | 'stall'), or
        None."""
        reason = None
        if self.interval > 0 and step - self.last_reset_step >= self.interval:
            reason = "interval"
        elif self.kl_spike_factor > 0 and len(self.kl_history) >= self.window:
            median = statistics.median(self.kl_history[-self.window :])
            if median > 0 and mean_kl > self.kl_spike_factor * median and mean_kl >= self.kl_floor:
                reason = "kl_spike"
        if reason is None and self.patience > 0 and self.evals_since_best >= self.patience:
            reason = "stall"
        if step - self.last_reset_step > self.window:  # past the post-reset rise
            self.kl_history = (self.kl_history + [float(mean_kl)])[-max(self.window, 1) :]
        return reason

    def record_reset(self, step: int) -> None:
        self.last_reset_step, self.num_resets = step, self.num_resets + 1
        self.kl_history.clear()  # KL to the new reference restarts from 0
        self.evals_since_best = 0

    STATE = ("kl_history", "best_val", "evals_since_best", "last_reset_step", "num_resets")

    def state_dict(self) -> dict:
        """What the decisions so far left behind; the settings come from this run's config (a resume
        may change them)."""
        return {
            k: (list(v) if isinstance(v, list) else v)
            for k, v in vars(self).items()
            if k in self.STATE
        }

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            if k in self.STATE:
                setattr(self, k, list(v) if isinstance(v, list) else v)
            elif not hasattr(self, k):  # a setting saved by an older version is ignored
                raise KeyError(f"unknown ReferenceResetPolicy state key {k!r}")


# --------------------------------------------------------------------------------------------------
# Off-policy correction and schedules
# --------------------------------------------------------------------------------------------------


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    """Raw per-token off-policy weights w = exp(old_logp - sampler_logp), detached (log-ratio
    clamped to +-20): the correction for the drift between the sampler and the trainer. Truncating
    (TIS) or masking (ICE-POP) them is `ppo_loss`'s `is_mode` / `is_bounds`, applied once there,
    where `is_frac_modified` measures it on these raw weights."""
    return torch.exp((old_logp - sampler_logp).detach().clamp(-20, 20))


def scheduled_value(step: int, schedule: dict[int, int] | None, default: int) -> int:
    """A value that changes at given steps, e.g. max response tokens {0: 4096, 1000: 8192}."""
    value = default
    for start in sorted(schedule or {}):
        if step >= start:
            value = schedule[start]
    return value


# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------


def token_budget_chunks(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Split consecutive sequences into micro-batches of at most `budget` tokens, in order.

    Returns [start, end) index ranges covering all of `lengths`; a sequence longer than the budget
    gets a micro-batch of its own (it is never cut: attention needs the whole sequence). budget <=
    0: one chunk.
    """
    if budget <= 0:
        return [(0, len(lengths))] if lengths else []
    chunks, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if used and used + n > budget:
            chunks.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        chunks.append((start, len(lengths)))
    return chunks


def loss_normalizer(
    agg: str, mask: torch.Tensor, cu_seqlens: torch.Tensor, max_new: int
) -> torch.Tensor:
    """This rank's share of the ppo_loss normaliser D of one mini-batch (sum it over ranks).

    token-mean: valid tokens; seq-mean-token-mean / seq-mean-token-sum: sequences with a valid
        token;
    constant (Dr.GRPO): sequences x the response budget `max_new`. `mask` [N] packed, `cu_seqlens`
        [S+1].
    """
    if agg == "token-mean":
        return mask.sum().double()
    per_seq = torch.segment_reduce(mask.double(), "sum", offsets=cu_seqlens.long())
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return (per_seq > 0).sum().double()
    if agg == "constant":
        return torch.tensor(
            float(per_seq.numel() * max_new), dtype=torch.float64, device=mask.device
        )
    raise ValueError(f"unknown aggregation {agg!r}")
