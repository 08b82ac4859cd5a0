"""The step's metrics: accumulated on each rank, reduced over ranks in two collectives, named once.

    acc = StepAccumulator(device)
    acc.sum("tokens", n); acc.max("response_length", lengths.max())   # anywhere in the step
    metrics = step_metrics(acc.reduce())                               # global, by name

Values may be Python numbers or 0-d device tensors (they stay on the device until `reduce`, so the
update loop adds no host sync). `reduce` stacks every sum into one float64 vector and every extremum
into another (minima negated) and all-reduces each once, matched by key: the ranks first agree on
the union of their keys (a rank without data for a key - no token in a micro-batch, no group kept -
contributes 0 to a sum and nothing to an extremum).

Names and meanings (docs/recipe.md §9). A name that verl uses carries verl's meaning (verl 0.9.1,
`compute_policy_loss_vanilla` and `compute_data_metrics`): `actor/pg_clipfrac` is the fraction of
response tokens whose ratio clip is active on either side, `actor/pg_clipfrac_lower` the fraction
capped by the dual clip (0 without it), `actor/ppo_kl` the mean of old - new log-prob (log-ratio
clamped at +-20), `critic/score/*` the verifier's raw scores, `critic/rewards/*` the rewards trained
on (after the stop-properly and length shaping), `response_length/*` and `prompt_length/*` per
sample. prorl's own splits have names of their own: `actor/pg_clipfrac_high` (A > 0, r > 1 +
eps_high) and `actor/pg_clipfrac_low` (A < 0, r < 1 - eps_low).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from prorl.engine.distributed import all_reduce, watchdog

# names every step carries with verl 0.9.1's meaning (metric_utils.compute_data_metrics,
# compute_timing_ metrics, compute_throughout_metrics; the marked_timer phases of RayPPOTrainer.fit;
# dp_actor's actor/*); timing_s/testing is on validation steps. docs/recipe.md §9 lists prorl's own
# names beside them.
VERL_METRICS = (
    "critic/score/mean", "critic/score/max", "critic/score/min",
    "critic/rewards/mean", "critic/rewards/max", "critic/rewards/min",
    "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
    "response_length/mean", "response_length/max", "response_length/min",
    "response_length/clip_ratio",
    "prompt_length/mean", "prompt_length/max", "prompt_length/min", "prompt_length/clip_ratio",
    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
    "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
    "timing_s/update_actor", "timing_s/update_weights", "timing_s/step",
    "perf/total_num_tokens", "perf/time_per_step", "perf/throughput",
)  # fmt: skip


class StepAccumulator:
    """Sums, maxima and minima of one step on this rank; `reduce()` makes them global."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._sum: dict[str, torch.Tensor | float] = {}
        self._max: dict[str, torch.Tensor | float] = {}

    def sum(self, key: str, value) -> None:
        self._sum[key] = self._sum.get(key, 0.0) + value

    def max(self, key: str, value) -> None:
        value = _as_tensor(value, self.device)
        old = self._max.get(key)
        self._max[key] = value if old is None else torch.maximum(old, value)

    def min(self, key: str, value) -> None:
        self.max("-" + key, -value)

    def reduce(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """(sums, maxima, minima) over every rank; extrema no rank registered come back as -inf /
        inf."""
        keys = (sorted(self._sum), sorted(self._max))
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            with watchdog().waiting("all-gather of the metric names"):
                dist.all_gather_object(gathered, keys)
            keys = tuple(sorted(set().union(*(g[i] for g in gathered))) for i in (0, 1))
        for key in keys[0]:
            self._sum.setdefault(key, 0.0)
        for key in keys[1]:
            self._max.setdefault(key, -math.inf)
        sums = self._reduce(self._sum, "sum")
        extrema = self._reduce(self._max, "max")
        maxima = {k: v for k, v in extrema.items() if not k.startswith("-")}
        minima = {k[1:]: -v for k, v in extrema.items() if k.startswith("-")}
        return sums, maxima, minima

    def _reduce(self, values: dict, op: str) -> dict[str, float]:
        if not values:
            return {}
        keys = sorted(values)
        vec = torch.stack([_as_tensor(values[k], self.device) for k in keys])
        return dict(zip(keys, all_reduce(vec, op, what=f"the step's metrics ({op})").tolist()))


def _as_tensor(value, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)


class _Reduced:
    """The global sums and extrema of a step, read by name (0 for a name nobody registered)."""

    def __init__(self, sums: dict[str, float], maxima: dict[str, float], minima: dict[str, float]):
        self.sums, self.maxima, self.minima = sums, maxima, minima
        self.updates = max(maxima.get("updates", 0.0), 1.0)

    def sum(self, key: str) -> float:
        return self.sums.get(key, 0.0)

    def mean(self, num: str, den: str) -> float:
        return self.sums.get(num, 0.0) / max(self.sums.get(den, 0.0), 1.0)

    def max(self, key: str) -> float:
        return _finite(self.maxima.get(key))

    def min(self, key: str) -> float:
        return _finite(self.minima.get(key))


def _finite(x: float | None) -> float:
    return x if x is not None and math.isfinite(x) else 0.0


def step_metrics(
    reduced: tuple[dict[str, float], dict[str, float], dict[str, float]],
    importance: bool = False,
) -> dict[str, float]:
    """The step's metrics (docs/recipe.md §9) from the global sums and extrema the trainer
    registered; `importance`: the sampler-vs-trainer correction is on (rollout/is_*, 0 in a step
    that trains nothing)."""
    s, mx, _ = reduced
    r = _Reduced(*reduced)
    out = _sampling_metrics(r) | _batch_metrics(r) | _update_metrics(r)
    out.update({k: v for k, v in mx.items() if k.startswith("scheduler/")})
    # prorl/rewards/function.py
    for key in (k.split("/", 1)[1] for k in s if k.startswith("reward_extra/")):
        out[f"reward_extra/{key}/mean"] = r.mean(f"reward_extra/{key}", f"reward_extra_n/{key}")
    if "is_weight" in s or importance:
        out["rollout/is_mean"] = r.mean("is_weight", "tokens")
        out["rollout/is_max"] = r.max("is_weight")
        out["rollout/is_frac_modified"] = r.mean("is_modified", "tokens")
    return out


def _sampling_metrics(r: _Reduced) -> dict[str, float]:
    """Sampling and dynamic sampling: every group generated this step, kept or not."""
    return {
        "dynamic_sampling/rounds": r.max("rounds"),
        "dynamic_sampling/sampled_groups": r.sum("groups_seen"),
        "dynamic_sampling/kept_groups": r.sum("groups_kept"),
        "dynamic_sampling/carried_groups": r.sum("groups_carried"),
        "dynamic_sampling/dropped_groups": r.sum("groups_dropped"),
        "dynamic_sampling/pass_rate": r.mean("samples_correct", "samples_seen"),
        "dynamic_sampling/frac_all_correct": r.mean("groups_all_correct", "groups_seen"),
        "dynamic_sampling/frac_all_wrong": r.mean("groups_all_wrong", "groups_seen"),
        "dynamic_sampling/kept_group_fraction": r.mean("groups_passed", "groups_seen"),
        # every response token generated this step, kept or not, per group that passed the filter
        "dynamic_sampling/gen_tokens_per_kept_group": r.mean("generated_tokens", "groups_passed"),
        "dynamic_sampling/generated_tokens": r.sum("generated_tokens"),
        "dynamic_sampling/passed_groups": r.sum("groups_passed"),
        "reward/timeout_frac": r.mean("samples_timeout", "samples_seen"),
        "reward/error_frac": r.mean("samples_error", "samples_seen"),
        # reward workers replaced this step (prorl/rewards/pool.py): died or timed out, broke the
        # reply protocol, recycled (max_calls / max_rss_bytes), hit their memory bound
        "reward/workers_replaced": r.sum("reward_pool/replaced"),
        "reward/protocol_failures": r.sum("reward_pool/protocol_failures"),
        "reward/workers_recycled": r.sum("reward_pool/recycled"),
        "reward/workers_over_memory": r.sum("reward_pool/memory_exceeded"),
    }


def _batch_metrics(r: _Reduced) -> dict[str, float]:
    """The trained batch: per sample."""
    return {
        "critic/score/mean": r.mean("score", "samples"),
        "critic/score/max": r.max("score"),
        "critic/score/min": r.min("score"),
        "critic/rewards/mean": r.mean("reward", "samples"),
        "critic/rewards/max": r.max("reward"),
        "critic/rewards/min": r.min("reward"),
        "critic/advantages/mean": r.mean("advantage", "samples"),
        "critic/advantages/max": r.max("advantage"),
        "critic/advantages/min": r.min("advantage"),
        "reward/length_penalty/mean": r.mean("length_term", "samples"),
        "response_length/mean": r.mean("response_length", "samples"),
        "response_length/max": r.max("response_length"),
        "response_length/min": r.min("response_length"),
        "response_length/clip_ratio": r.mean("truncated", "samples"),
        "prompt_length/mean": r.mean("prompt_length", "samples"),
        "prompt_length/max": r.max("prompt_length"),
        "prompt_length/min": r.min("prompt_length"),
        # at data.max_prompt_tokens
        "prompt_length/clip_ratio": r.mean("prompt_at_limit", "samples"),
    }


def _update_metrics(r: _Reduced) -> dict[str, float]:
    """The update: per token, and per optimizer update."""
    return {
        "actor/pg_loss": r.sum("pg_loss") / r.updates,
        "actor/kl_loss": r.sum("kl_loss") / r.updates,
        "actor/entropy": r.mean("entropy", "tokens"),
        "actor/pg_clipfrac": r.mean("clip_any", "tokens"),
        "actor/pg_clipfrac_lower": r.mean("clip_dual", "tokens"),
        "actor/pg_clipfrac_high": r.mean("clip_high", "tokens"),
        "actor/pg_clipfrac_low": r.mean("clip_low", "tokens"),
        "actor/ppo_kl": r.mean("old_minus_new", "tokens"),
        "actor/kl_mean": r.mean("kl", "tokens"),
        "actor/grad_norm": r.max("grad_norm") / r.updates,
        # sampler vs trainer: |log p_trainer(pi_old) - log p_sampler| per response token
        "rollout/logprob_mismatch": r.mean("mismatch", "tokens"),
        "rollout/logprob_mismatch_max": r.max("mismatch"),
    }


def async_metrics(
    reduced: tuple[dict[str, float], dict[str, float], dict[str, float]],
) -> dict[str, float]:
    """An asynchronous run's own metrics (prorl/async_rl/remote.py registers the sums): staleness in
    updates (the step trained minus the policy version that sampled the group) over the step's
    groups; the groups of later steps already waiting for the trainers when they took this step's;
    the rollout ranks' longest wait for weights within the staleness bound before sampling this step
    (timing_s/wait_trainer; the trainers' wait for groups is timing_s/wait_rollout, rank 0's); with
    a vLLM rollout engine, the largest RMS log-prob gap of its post-sync probe against the rollout
    rank's model copy (async/engine_rms_diff)."""
    s, mx, _ = reduced
    most = mx.get("async_staleness", 0.0)
    return {
        "async/staleness/mean": s.get("async_staleness", 0.0)
        / max(s.get("async_groups", 0.0), 1.0),
        "async/staleness/max": most if math.isfinite(most) else 0.0,
        "async/queue_groups": s.get("async_queue_groups", 0.0),
        "timing_s/wait_trainer": max(mx.get("async_wait_trainer", 0.0), 0.0),
    } | ({"async/engine_rms_diff": mx["async_engine_rms"]} if "async_engine_rms" in mx else {})


def record_loss(acc: StepAccumulator, m: dict, ent_sum, old_logp, sampler_logp) -> None:
    """One micro-batch's loss metrics: ppo_loss's `m` (means over its tokens) weighted back to sums,
    the entropy sum, and the sampler-vs-trainer gap |old_logp - sampler_logp| over its tokens
    [T]."""
    n_tok = m["num_tokens"].double()
    acc.sum("tokens", n_tok)
    acc.sum("pg_loss", m["pg_loss"])
    acc.sum("kl_loss", m["kl_loss"])
    acc.sum("entropy", ent_sum.detach())
    for key, name in (
        ("clipfrac", "clip_any"),
        ("dualclip_frac", "clip_dual"),
        ("clipfrac_high", "clip_high"),
        ("clipfrac_low", "clip_low"),
        ("approx_kl", "old_minus_new"),
        ("kl_mean", "kl"),
    ):
        acc.sum(name, m[key].double() * n_tok)
    gap = (old_logp - sampler_logp).abs()
    acc.sum("mismatch", gap.sum())
    acc.max("mismatch", gap.max() if gap.numel() else -math.inf)
    if "is_mean" in m:
        acc.sum("is_weight", m["is_mean"].double() * n_tok)
        acc.sum("is_modified", m["is_frac_modified"].double() * n_tok)
        acc.max("is_weight", m["is_max"])


def record_batch(acc: StepAccumulator, groups: list, term: torch.Tensor) -> None:
    """Per-sample statistics of the groups trained on (prorl.sampling.Group: scores, rewards,
    lengths); `term` [S]: the length-shaping term of each sample."""

    def values(per_sample):
        return torch.tensor(list(per_sample), dtype=torch.float64)

    acc.sum("samples", sum(len(g.raw) for g in groups))
    acc.sum("truncated", values(t for g in groups for t in g.truncated).sum())
    acc.sum("length_term", term.double().sum())
    for name, v in (
        ("score", values(r for g in groups for r in g.raw)),
        ("reward", values(r for g in groups for r in g.shaped)),
        ("response_length", values(len(t) for g in groups for t in g.responses)),
        ("prompt_length", values(len(g.prompt_ids) for g in groups for _ in g.responses)),
    ):
        acc.sum(name, v.sum())
        acc.max(name, v.max() if v.numel() else -math.inf)
        acc.min(name, v.min() if v.numel() else math.inf)


def perf_metrics(sums: dict[str, float], elapsed: float, world: int) -> dict[str, float]:
    """Time and throughput of a step that took `elapsed` seconds: `timing_s/step`,
    `perf/tokens_per_s` (response tokens trained on per second, all ranks), and verl's
    `perf/total_num_tokens` (prompt + response tokens of the batch), `perf/time_per_step` and
    `perf/throughput` (total tokens per second per rank, verl's "per GPU")."""
    total = sums.get("prompt_length", 0.0) + sums.get("response_length", 0.0)
    seconds = max(elapsed, 1e-9)
    return {
        "timing_s/step": elapsed,
        "perf/tokens_per_s": sums.get("response_length", 0.0) / seconds,
        "perf/total_num_tokens": total,
        "perf/time_per_step": elapsed,
        "perf/throughput": total / seconds / max(world, 1),
    }


def record_memory(acc: StepAccumulator, device: torch.device) -> None:
    """The process's peak accelerator memory since start (CUDA) and the host's used memory, as
    verl logs them; the step's metrics take the largest over the ranks (`memory_metrics`)."""
    if device.type == "cuda":
        acc.max("max_memory_allocated", float(torch.cuda.max_memory_allocated(device)))
        acc.max("max_memory_reserved", float(torch.cuda.max_memory_reserved(device)))
    acc.max("cpu_memory_used", float(_host_memory_used()))


def memory_metrics(maxima: dict[str, float]) -> dict[str, float]:
    """verl's `perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb` (CUDA: torch's peak
    allocated / reserved bytes of any rank) and `perf/cpu_memory_used_gb` (psutil's
    virtual_memory().used: total - available), in GiB."""
    names = {"max_memory_allocated": "perf/max_memory_allocated_gb",
             "max_memory_reserved": "perf/max_memory_reserved_gb",
             "cpu_memory_used": "perf/cpu_memory_used_gb"}  # fmt: skip
    return {name: maxima[key] / 2**30 for key, name in names.items() if key in maxima}


def _host_memory_used() -> int:
    """Bytes of host memory in use: psutil's virtual_memory().used (verl's), or MemTotal -
    MemAvailable from /proc/meminfo (what psutil computes on Linux) without psutil."""
    try:
        import psutil

        return psutil.virtual_memory().used
    except ImportError:
        with open("/proc/meminfo") as f:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in f}
        return (kib["MemTotal"] - kib["MemAvailable"]) * 1024
