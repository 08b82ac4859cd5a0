"""TRL's GRPOTrainer loss (1.16), fused: `trl_compute_loss` replaces `GRPOTrainer._compute_loss`.

    class FusedGRPOTrainer(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return trl_compute_loss(self, model, inputs)

It runs the model forward as TRL does, computes the loss with one `ppo_loss` call and logs the
metrics TRL's own method logs (kl, entropy, clip_ratio/low_mean, high_mean, region_mean, low_min,
high_max). `trl_grpo_loss` is the loss alone, from tensors. TRL's names -> ppo_loss:

    per_token_logps, old_per_token_logps            logp, old_logp (None: TRL's on-policy shortcut)
    completion_mask (x tool_mask), advantages       mask, advantages [B] or [B, T]
    epsilon_low / epsilon_high                      eps_low / eps_high
    beta, ref_per_token_logps                       kl_coef, ref_logp with k3 and no clamp
    use_bias_correction_kl (TRL's default True)     k3 times TRL's ratio exp(logp - old), below
    importance_sampling_ratio [B, T] or [B, 1]      is_weights as given (TRL truncated or masked it)
    loss_type grpo / bnpo / dr_grpo / dapo          agg seq-mean-token-mean / token-mean / constant
                                                    / token-mean with TRL's normaliser (_normaliser
                                                    below)

One difference from TRL, outside normal operation: the policy ratio is clamped at |logp - old| <= 20
(as verl and OpenRLHF do; TRL does not). A token beyond it on the clipped side gives TRL's numbers;
on the other side TRL's loss follows exp(logp - old) and ours stays at exp(+-20) with zero gradient.

The bias-corrected KL, k3(d) exp(logp - old), is not one of ppo_loss's terms: it is added in torch
(a few elementwise passes) with ppo_loss's aggregation weights; with use_bias_correction_kl=False
the KL is fused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ppo_loss import ppo_loss

__all__ = ["trl_compute_loss", "trl_grpo_loss"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# what TRL's _compute_loss passes on to the model forward besides the token ids and the attention
# mask
_FORWARD_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


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
    use_bias_correction_kl: bool = True,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    max_completion_length: int | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """TRL GRPOTrainer's training loss (token-level importance sampling) on [B, T] inputs; defaults
    as TRL's.

    `gradient_accumulation_steps` is TRL's current_gradient_accumulation_steps; pass 1 for it and
    for `steps_per_generation` in evaluation. `importance_sampling_ratio` is TRL's inputs entry,
    applied only where TRL applies it (use_vllm and vllm_importance_sampling_correction). Returns
    the 0-d loss TRL's `_compute_loss` returns when the entropy bonus and the auxiliary loss are
    off.
    """
    settings = TRLLossSettings(
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        beta=beta,
        use_bias_correction_kl=use_bias_correction_kl,
        num_items_in_batch=num_items_in_batch,
        num_processes=num_processes,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        max_completion_length=max_completion_length,
    )
    tensors = dict(
        per_token_logps=per_token_logps,
        old_per_token_logps=old_per_token_logps,
        advantages=advantages,
        mask=completion_mask,
        ref_per_token_logps=ref_per_token_logps,
        importance_sampling_ratio=importance_sampling_ratio,
    )
    loss, _ = _loss_and_metrics(tensors, settings, backend=backend)
    return loss


def trl_compute_loss(trainer, model, inputs: dict) -> torch.Tensor:
    """`GRPOTrainer._compute_loss(model, inputs)` of TRL 1.16 on `trainer`, with the loss fused.

    Settings TRL's method handles and this does not raise a ValueError naming them: loss types other
    than grpo / bnpo / dr_grpo / dapo, importance_sampling_level="sequence", top_entropy_quantile <
    1, off_policy_mask_threshold, delta, the entropy bonus and the router auxiliary loss.
    """
    _check_supported(trainer)
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    per_token_logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        model,
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([prompt_mask, completion_mask], dim=1),
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=False,
        **{k: inputs.get(k) for k in _FORWARD_INPUTS},
    )
    train = trainer.model.training
    tensors = trl_loss_tensors(trainer, inputs, per_token_logps, mask)
    loss, m = _loss_and_metrics(tensors, TRLLossSettings.of(trainer, inputs), per_row_clip=True)

    log_trl_metrics(trainer, m, (entropies * mask).sum(), train)
    return loss


def log_trl_metrics(trainer, m: dict, entropy_sum: torch.Tensor, train: bool) -> None:
    """Log what TRL's _compute_loss logs from _loss_and_metrics's `m` (per_row_clip) and the masked
    entropy sum: token means over every process (one reduce for all), per-row extremes gathered."""
    from trl.trainer.utils import nanmax, nanmin

    with torch.no_grad():
        n = m["num_tokens"]
        local = [m["clipfrac_low"] * n, m["clipfrac_high"] * n, m["clipfrac"] * n, n]
        local.append(entropy_sum.to(n.dtype))
        if trainer.beta != 0.0:
            local.append(m["kl_sum"].to(n.dtype))
        totals = trainer.accelerator.reduce(torch.stack(local), reduction="sum")
        means = (totals / totals[3].clamp(min=1.0)).tolist()
        low_min = nanmin(trainer.accelerator.gather(m["row_clip_low"])).item()
        high_max = nanmax(trainer.accelerator.gather(m["row_clip_high"])).item()
    logged = trainer._metrics["train" if train else "eval"]
    if trainer.beta != 0.0:
        logged["kl"].append(means[5])
    logged["entropy"].append(means[4])
    logged["clip_ratio/low_mean"].append(means[0])
    logged["clip_ratio/high_mean"].append(means[1])
    logged["clip_ratio/region_mean"].append(means[2])
    logged["clip_ratio/low_min"].append(low_min)
    logged["clip_ratio/high_max"].append(high_max)


def _check_supported(trainer, who: str = "trl_compute_loss") -> None:
    args = trainer.args
    unsupported = {
        "loss_type": (trainer.loss_type, trainer.loss_type not in LOSS_TYPES),
        "importance_sampling_level": (
            trainer.importance_sampling_level,
            trainer.importance_sampling_level != "token",
        ),
        "top_entropy_quantile": (trainer.top_entropy_quantile, trainer.top_entropy_quantile < 1.0),
        "off_policy_mask_threshold": (
            trainer.off_policy_mask_threshold,
            trainer.off_policy_mask_threshold is not None,
        ),
        "delta": (args.delta, args.delta is not None),
        "entropy bonus (entropy_coef)": (
            getattr(args, "entropy_coef", None),
            trainer._entropy_bonus_enabled,
        ),
        "router auxiliary loss (output_router_logits)": (True, trainer.aux_loss_enabled),
    }
    bad = [f"{name}={value!r}" for name, (value, is_bad) in unsupported.items() if is_bad]
    if bad:
        raise ValueError(
            f"{who} does not fuse {', '.join(bad)}; it covers loss_type {', '.join(LOSS_TYPES)} "
            "with token-level importance sampling: use GRPOTrainer itself for these settings"
        )


@dataclass(frozen=True)
class TRLLossSettings:
    """GRPOTrainer's loss settings, named as TRL names them. `gradient_accumulation_steps` is TRL's
    current_gradient_accumulation_steps; it and `steps_per_generation` are 1 in evaluation."""

    loss_type: str
    epsilon_low: float
    epsilon_high: float
    beta: float
    use_bias_correction_kl: bool
    num_items_in_batch: torch.Tensor | float | None
    num_processes: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    max_completion_length: int | None

    @classmethod
    def of(cls, trainer, inputs: dict) -> TRLLossSettings:
        """The settings of `trainer` (a GRPOTrainer) for the batch `inputs`."""
        train = trainer.model.training
        return cls(
            loss_type=trainer.loss_type,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            beta=trainer.beta,
            use_bias_correction_kl=trainer.args.use_bias_correction_kl,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=trainer.accelerator.num_processes,
            gradient_accumulation_steps=trainer.current_gradient_accumulation_steps if train else 1,
            steps_per_generation=trainer.args.steps_per_generation if train else 1,
            max_completion_length=trainer.max_completion_length,
        )


def trl_loss_tensors(trainer, inputs: dict, per_token_logps, mask) -> dict:
    """The loss's tensors, by TRL's names, from `inputs`; the IS ratio only where TRL applies it
    (use_vllm and vllm_importance_sampling_correction)."""
    use_is = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    return dict(
        per_token_logps=per_token_logps,
        old_per_token_logps=inputs.get("old_per_token_logps"),
        advantages=inputs["advantages"],
        mask=mask,
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        importance_sampling_ratio=inputs.get("importance_sampling_ratio") if use_is else None,
    )


def _normaliser(s: TRLLossSettings, mask):
    """(ppo_loss agg, D) for TRL's loss_type: what TRL divides the masked sum (per row for grpo)
    by."""
    b, accum = mask.shape[0], float(s.gradient_accumulation_steps)
    if s.loss_type == "grpo":
        return "seq-mean-token-mean", float(b * accum)
    if s.loss_type == "bnpo":
        return "token-mean", mask.sum().clamp(min=1.0) * accum
    if s.loss_type == "dr_grpo":
        if s.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return "constant", float(b * s.max_completion_length * accum)
    if s.loss_type == "dapo":
        if s.num_items_in_batch is None:
            raise ValueError(
                "loss_type='dapo' needs num_items_in_batch "
                "(completion tokens of the generation batch)"
            )
        items = torch.as_tensor(s.num_items_in_batch, device=mask.device).clamp(min=1.0)
        return "token-mean", items / s.num_processes * accum / s.steps_per_generation
    raise ValueError(f"loss_type {s.loss_type!r} is not fused; use one of {', '.join(LOSS_TYPES)}")


def _is_weights(ratio, like):
    """TRL's importance_sampling_ratio as ppo_loss's is_weights: the sequence-level modes' [B, 1]
    expanded to [B, T]."""
    return ratio.expand_as(like) if ratio is not None and ratio.shape != like.shape else ratio


def _loss_and_metrics(tensors: dict, s: TRLLossSettings, backend=None, per_row_clip=False):
    """The loss and ppo_loss's metrics, plus kl_sum (the masked sum of TRL's per_token_kl) and, with
    `per_row_clip`, TRL's per-row clip fractions row_clip_low / row_clip_high [B] (NaN for an empty
    row). `tensors`: TRL's per_token_logps, old_per_token_logps, advantages, mask,
    ref_per_token_logps, importance_sampling_ratio."""
    logp, mask, advantages = tensors["per_token_logps"], tensors["mask"], tensors["advantages"]
    old = tensors["old_per_token_logps"]
    if old is None:  # TRL's on-policy shortcut
        old = logp.detach()
    ref = tensors["ref_per_token_logps"]
    agg, normalizer = _normaliser(s, mask)
    with_kl = s.beta != 0.0
    fused_kl = with_kl and not s.use_bias_correction_kl
    loss, m = ppo_loss(
        logp,
        old,
        advantages,
        mask,
        eps_low=s.epsilon_low,
        eps_high=s.epsilon_high,
        ref_logp=ref if fused_kl else None,
        kl_coef=s.beta if fused_kl else 0.0,
        kl_estimator="k3",
        kl_clamp="none",
        is_weights=_is_weights(tensors["importance_sampling_ratio"], logp),
        agg=agg,
        normalizer=normalizer,
        backend=backend,
    )
    m = dict(m)
    if fused_kl:
        m["kl_sum"] = m["kl_mean"] * m["num_tokens"]
    elif with_kl:  # TRL's per_token_kl = k3(logp - ref) * exp(logp - old), aggregated like the loss
        valid = mask.bool()
        delta = torch.where(valid, ref - logp, 0.0)
        ratio = torch.exp(torch.where(valid, logp - old, 0.0))
        per_token_kl = torch.where(valid, (torch.exp(delta) - delta - 1) * ratio, 0.0)
        loss = loss + s.beta * _aggregate(per_token_kl, valid, agg, normalizer)
        m["kl_sum"] = per_token_kl.detach().sum()
    if per_row_clip:
        m.update(row_clip_fractions(logp, old, advantages, mask, s.epsilon_low, s.epsilon_high))
    return loss, m


def row_clip_fractions(logp, old, advantages, mask, epsilon_low, epsilon_high) -> dict:
    """TRL's per-row clip fractions row_clip_low / row_clip_high [B] (NaN for an empty row)."""
    with torch.no_grad():
        coef = torch.exp(logp - old)
        adv = advantages if advantages.dim() == 2 else advantages[:, None]
        low = ((coef < 1 - epsilon_low) & (adv < 0)).float()
        high = ((coef > 1 + epsilon_high) & (adv > 0)).float()
        count = mask.sum(-1)
        return {
            "row_clip_low": (low * mask).sum(-1) / count,
            "row_clip_high": (high * mask).sum(-1) / count,
        }


def _aggregate(x, valid, agg, normalizer):
    """sum_t s_t x_t with ppo_loss's aggregation weights s_t for TRL's (agg, normalizer)."""
    if agg == "seq-mean-token-mean":
        x = x / valid.sum(-1, keepdim=True).clamp(min=1)
    return x.sum() / normalizer
