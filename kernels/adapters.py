"""Other trainers' policy-loss calls, in their own argument names and conventions, on `ppo_loss`.

Each function takes what the trainer's own loss takes and returns what it returns, computed by one fused
`ppo_loss` call (one kernel each way on CUDA, one OpenMP pass on the CPU). The mapping (KERNEL-NOTES.md):

    TRL GRPOTrainer._compute_loss                 -> trl_grpo_loss
        per_token_logps, old_per_token_logps,        logp, old_logp
        completion_mask, advantages [B] or [B, T]    mask, advantages
        epsilon, epsilon_high                        eps_low, eps_high (epsilon_high defaults to epsilon)
        beta, ref_per_token_logps                    kl_coef, ref_logp with k3 and no clamp
        importance_sampling_ratio                    is_weights, as given (TRL truncates it when sampling)
        loss_type grpo / bnpo / dr_grpo / dapo       agg seq-mean-token-mean / token-mean / constant /
                                                     token-mean, with the normaliser TRL divides by (below)
    verl compute_policy_loss (+ the actor's KL)  -> verl_policy_loss
        old_log_prob, log_prob, response_mask        old_logp, logp, mask
        clip_ratio(_low, _high), clip_ratio_c        eps_low, eps_high, dual_clip (verl: always on, c = 3)
        ref_log_prob, kl_loss_coef, kl_loss_type     ref_logp, kl_coef, k1 ("kl") / k2 ("mse") / k3
                                                     ("low_var_kl", output clamped to +-10)
        loss_agg_mode                                token-mean; seq-mean-token-mean and seq-mean-token-sum
                                                     (normaliser B: verl takes the mean over all rows);
                                                     seq-mean-token-sum-norm -> constant with normaliser T
    OpenRLHF PolicyLoss (+ the actor's KL)       -> openrlhf_policy_loss
        log_probs, old_log_probs, action_mask        logp, old_logp, mask
        clip_eps_low, clip_eps_high, dual_clip       eps_low, eps_high, dual_clip
        token_level_loss True / False                token-mean / seq-mean-token-mean with normaliser B
        rollout_log_probs + vllm_is_correction_type  is_weights = exp(old - rollout), tis / icepop
        base_action_log_probs, kl_coef, kl_estimator ref_logp, kl_coef, k1/k2/k3 (no clamp)

Known differences, all outside normal operation: ours clamps the log-ratio to +-20 (verl does, TRL and
OpenRLHF do not) and gives a masked-out or empty row 0 where masked_mean would give 0/0 = NaN. Across
micro-batches and ranks, pass the trainers' global normaliser: TRL's dapo already is one (num_items_in_batch);
for the others a local count is what the trainers themselves use.
"""

from __future__ import annotations

import torch

from .ppo_loss import ppo_loss

__all__ = ["openrlhf_policy_loss", "trl_grpo_loss", "verl_policy_loss"]


def trl_grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    max_completion_length: int | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """TRL GRPOTrainer's training loss (`_compute_loss`, token-level importance sampling) on [B, T] inputs.

    `gradient_accumulation_steps` is TRL's current_gradient_accumulation_steps (1 in evaluation). Returns the
    0-d loss TRL returns (before its entropy bonus and auxiliary losses, which this does not cover).
    """
    if old_per_token_logps is None:  # TRL's on-policy shortcut
        old_per_token_logps = per_token_logps.detach()
    b = per_token_logps.shape[0]
    accum = float(gradient_accumulation_steps)
    if loss_type == "grpo":
        agg, normalizer = "seq-mean-token-mean", b * accum
    elif loss_type == "bnpo":
        agg, normalizer = "token-mean", completion_mask.sum().clamp(min=1.0) * accum
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        agg, normalizer = "constant", float(b * max_completion_length) * accum
    elif loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError(
                "loss_type='dapo' needs num_items_in_batch (completion tokens of the generation batch)"
            )
        items = torch.as_tensor(num_items_in_batch, device=per_token_logps.device).clamp(min=1.0)
        agg, normalizer = "token-mean", items / num_processes * accum / steps_per_generation
    else:
        raise ValueError(f"loss_type {loss_type!r} is not mapped; use grpo, bnpo, dr_grpo or dapo")
    loss, _ = ppo_loss(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        eps_low=epsilon,
        eps_high=epsilon if epsilon_high is None else epsilon_high,
        ref_logp=ref_per_token_logps if beta != 0.0 else None,
        kl_coef=beta,
        kl_estimator="k3",
        kl_clamp="none",
        is_weights=importance_sampling_ratio,
        agg=agg,
        normalizer=normalizer,
        backend=backend,
    )
    return loss


_VERL_KL = {"kl": ("k1", "none"), "k1": ("k1", "none"), "mse": ("k2", "none"), "k2": ("k2", "none")}
_VERL_KL.update({"low_var_kl": ("k3", "output"), "k3": ("k3", "output")})


def verl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    ref_log_prob: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    rollout_is_weights: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's `compute_policy_loss` ("vanilla" PPO, dual clip) on [bs, L] inputs, plus its actor's KL loss.

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower) as verl does; with `ref_log_prob` the first is
    the actor's `policy_loss = pg_loss + kl_loss_coef * kl_loss` (the KL aggregated with the same mode).
    `rollout_is_weights` (newer verl) multiply the policy term.
    """
    if kl_loss_type not in _VERL_KL:
        raise ValueError(f"kl_loss_type {kl_loss_type!r} is not mapped; use one of {', '.join(_VERL_KL)}")
    b, t = log_prob.shape
    aggs = {
        "token-mean": ("token-mean", None),
        "seq-mean-token-mean": ("seq-mean-token-mean", float(b)),
        "seq-mean-token-sum": ("seq-mean-token-sum", float(b)),
        "seq-mean-token-sum-norm": ("constant", float(t)),
    }
    if loss_agg_mode not in aggs:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not mapped; use one of {', '.join(aggs)}")
    agg, normalizer = aggs[loss_agg_mode]
    estimator, clamp = _VERL_KL[kl_loss_type]
    loss, m = ppo_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        eps_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        eps_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        dual_clip=clip_ratio_c,
        ref_logp=ref_log_prob,
        kl_coef=kl_loss_coef,
        kl_estimator=estimator,
        kl_clamp=clamp,
        kl_clamp_value=10.0,
        is_weights=rollout_is_weights,
        agg=agg,
        normalizer=normalizer,
        backend=backend,
    )
    return loss, m["clipfrac"], m["approx_kl"], m["dualclip_frac"]


def openrlhf_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor | None = None,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_level_loss: bool = True,
    rollout_log_probs: torch.Tensor | None = None,
    vllm_is_correction_type: str = "tis",
    vllm_is_truncated_threshold: tuple[float, float] = (0.5, 5.0),
    base_action_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's `PolicyLoss(...)(log_probs, old_log_probs, advantages, action_mask)` on [B, A] inputs.

    Returns (loss, clip_ratio). With `base_action_log_probs` the loss is the actor's
    `actor_loss + kl_coef * kl_loss`, the KL aggregated like the policy term. `rollout_log_probs` switches on
    the vLLM importance-sampling correction of newer OpenRLHF versions (tis or icepop).
    """
    mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
    is_weights, is_mode = None, "none"
    if rollout_log_probs is not None:
        if vllm_is_correction_type not in ("tis", "icepop"):
            raise ValueError(
                f"vllm_is_correction_type {vllm_is_correction_type!r}: only tis and icepop are mapped"
            )
        is_weights, is_mode = torch.exp(old_log_probs - rollout_log_probs).detach(), vllm_is_correction_type
    loss, m = ppo_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        eps_low=clip_eps_low,
        eps_high=clip_eps_high,
        dual_clip=dual_clip,
        ref_logp=base_action_log_probs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        kl_clamp="none",
        is_weights=is_weights,
        is_mode=is_mode,
        is_bounds=tuple(vllm_is_truncated_threshold),
        agg="token-mean" if token_level_loss else "seq-mean-token-mean",
        normalizer=None if token_level_loss else float(log_probs.shape[0]),
        backend=backend,
    )
    return loss, m["clipfrac"]
