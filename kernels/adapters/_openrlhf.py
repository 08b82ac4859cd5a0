"""OpenRLHF's `PolicyLoss` module (0.11.2), fused: same constructor, forward and five outputs.

OpenRLHF's actor builds it from its config and calls it per micro-batch (trainer/ray/ppo_actor.py):

    PolicyLoss(clip_eps_low, clip_eps_high, dual_clip, token_level_loss, policy_loss_type,
               is_correction_level, is_correction_mode, is_correction_gating,
               is_correction_threshold)
    loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = loss_fn(
        log_probs, old_log_probs, advantages, action_mask=, rollout_log_probs=,
        dp_size=, batch_num_tokens=, global_batch_size=)

Mapping onto `ppo_loss` (r = exp(clamp(log_probs - old_log_probs, -20, 20)), as OpenRLHF computes
it):

    token_level_loss=True   sum(l m) / batch_num_tokens * dp_size      token-mean,
                            (batch_num_tokens None: the masked mean)   D = batch_num_tokens / dp
                                                                       (D: this call's valid tokens)
    token_level_loss=False  sum_j [sum_t(l m) / (n_j + 1e-8)] / global_batch_size * dp_size
                            (None: the mean over rows with a valid token) seq-mean-token-mean
    IS correction, token level, ratio gating, w = exp(old_log_probs - rollout_log_probs) (detached):
      mode "mask"           w where low <= w <= high, else 0           is_mode="icepop",
                                                                       bounds (low, high)
      mode "clip"           clamp(w, low, high)                        the clamped w, as given

Not fused, rejected with an error naming the setting: policy_loss_type "gspo" (a sequence-level
ratio), is_correction_level "seq" and the binary_kl / tv gatings. The KL loss stays the actor's own
(compute_approx_kl + aggregate_loss after this call). The `+ 1e-8` counts as in verl's adapter: it
changes only a float64 mask's numbers, and then rides on the per-token weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ppo_loss import ppo_loss

__all__ = ["OpenRLHFPolicyLoss"]

_EPS = 1e-8  # aggregate_loss's per-row denominator adds it


class OpenRLHFPolicyLoss(nn.Module):
    """Drop-in for `openrlhf.models.PolicyLoss` (0.11.2), policy_loss_type "ppo"; arguments as
    there."""

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: tuple[float, float] = (0.5, 5.0),
    ) -> None:
        super().__init__()
        if policy_loss_type != "ppo":
            raise ValueError(
                f"policy_loss_type {policy_loss_type!r} is not fused by prorl (only 'ppo' is); "
                "use openrlhf.models.PolicyLoss for it"
            )
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1.0 (or None), got {dual_clip}")
        for name, value, allowed in (
            ("is_correction_level", is_correction_level, ("off", "token", "seq")),
            ("is_correction_mode", is_correction_mode, ("mask", "clip")),
            ("is_correction_gating", is_correction_gating, ("ratio", "binary_kl", "tv")),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if is_correction_level != "off":
            if is_correction_level != "token" or is_correction_gating != "ratio":
                raise ValueError(
                    f"is_correction_level={is_correction_level!r} with "
                    f"is_correction_gating={is_correction_gating!r} is not fused by prorl (only "
                    "token level with ratio gating is); use openrlhf.models.PolicyLoss for it"
                )
            low, high = is_correction_threshold
            if not 0.0 <= low <= high:
                raise ValueError(
                    "is_correction_threshold must be (low, "
                    f"high), 0 <= low <= high, got {low, high}"
                )
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.dual_clip = dual_clip
        self.token_level_loss = token_level_loss
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | torch.Tensor | None = None,
        global_batch_size: float | torch.Tensor | None = None,
    ):
        """[B, A] inputs -> (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), as OpenRLHF's.

        clip_ratio: fraction of valid tokens on the clipped branch; ppo_kl: mean of old - new
        log-prob (unclamped); vllm_kl: mean of rollout - old log-prob and is_filter_ratio: fraction
        of valid tokens outside the IS band, both None without IS correction. All detached 0-d
        tensors.
        """
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
        if self.token_level_loss:
            agg, count = "token-mean", batch_num_tokens
        else:
            agg, count = "seq-mean-token-mean", global_batch_size
        normalizer = None if count is None else count / dp_size
        row_factor = None
        if not self.token_level_loss and mask.dtype == torch.float64:  # see the module docstring
            n = mask.sum(-1, keepdim=True)
            row_factor = (n / (n + _EPS)).expand_as(mask)

        weights, is_mode, bounds = None, "none", (0.5, 5.0)
        vllm_kl = is_filter_ratio = None
        if self.is_correction_level == "token":
            if rollout_log_probs is None:
                raise ValueError("is_correction_level='token' needs rollout_log_probs")
            low, high = self.is_correction_threshold
            with torch.no_grad():
                w = torch.exp(old_log_probs - rollout_log_probs)
                if self.is_correction_mode == "clip":
                    weights, filtered = w.clamp(min=low, max=high), (w < low) | (w > high)
                else:
                    keep = (w >= low) & (w <= high)
                    if row_factor is None:  # the kernel zeroes the weights outside the band
                        weights, is_mode, bounds = w, "icepop", (low, high)
                    else:
                        weights = torch.where(keep, w, 0.0)
                    filtered = ~keep
                is_filter_ratio = _masked_mean(filtered.float(), action_mask)
                vllm_kl = _masked_mean(rollout_log_probs - old_log_probs, action_mask)
        if row_factor is not None:
            weights = row_factor if weights is None else weights * row_factor
        loss, m = ppo_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            eps_low=self.clip_eps_low,
            eps_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
            is_weights=weights,
            is_mode=is_mode,
            is_bounds=bounds,
            agg=agg,
            normalizer=normalizer,
        )
        return loss, m["clipfrac"], m["approx_kl"], vllm_kl, is_filter_ratio


def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """OpenRLHF's masked_mean over all elements (no epsilon)."""
    return x.mean() if mask is None else (x * mask).sum() / mask.sum()
