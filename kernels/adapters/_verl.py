"""verl's registered policy loss ("vanilla" PPO with dual clip), on `ppo_loss`.

verl (0.9.1) looks a policy loss up by `actor.policy_loss.loss_mode` and calls it with keywords

    pg_loss, pg_metrics = fn(old_log_prob=, log_prob=, advantages=, response_mask=, loss_agg_mode=,
                             config=actor_config, rollout_is_weights=)

(verl/workers/utils/losses.py). `verl_policy_loss` has that signature and returns what
`core_algos.compute_policy_loss_vanilla` returns, so
`register_policy_loss("prorl")(verl_policy_loss)` is all a verl run needs (kernels/ADAPTERS.md). The
KL and entropy terms stay verl's own: the actor adds them after this call.

What it reads from `config` (an ActorConfig or DictConfig), as verl does: clip_ratio,
clip_ratio_low, clip_ratio_high (None -> clip_ratio), clip_ratio_c (dual clip, always on, default 3)
and global_batch_info, which verl's engines fill before every micro-batch with the global
normalisers that agg_loss takes:

    loss_agg_mode            loss                                             ppo_loss agg
    token-mean               sum(l m) / batch_num_tokens * dp_size            token-mean
    token-sum                sum(l m) * dp_size                               constant
    seq-mean-token-sum       sum_j sum_t(l m) / global_batch_size * dp_size   seq-mean-token-sum
    seq-mean-token-sum-norm  the same / loss_scale_factor (default: L)        seq-mean-token-sum
    seq-mean-token-mean      sum_j [sum_t(l m) / (n_j + 1e-8)] / global_batch_size * dp_size
                                                                              seq-mean-token-mean

with m = response_mask, n_j = the valid tokens of row j and L the padded length.

batch_num_tokens / global_batch_size default to this call's valid tokens / rows with a valid token
(verl refuses the default when dp_size > 1, and so does this). verl's `+ 1e-8` only changes a
float64 mask's numbers (in fp32, n + 1e-8 rounds to n; a bool mask's count becomes fp32): for those
the factor n_j / (n_j + 1e-8) rides on the per-token weights, so that float64 results agree to
round-off.
"""

from __future__ import annotations

import torch

from .._ppo_common import RATIO_LOG_CLAMP
from ..ppo_loss import ppo_loss

__all__ = ["verl_policy_loss"]

_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
_BATCH_INFO = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
_EPS = 1e-8  # verl's masked_mean / agg_loss denominators add it


def verl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl 0.9.1's `compute_policy_loss_vanilla`, fused: same arguments, same (pg_loss,
    pg_metrics).

    Args:
        old_log_prob, log_prob: [bs, L] log-probs under the rollout-time and the current policy.
        advantages: [bs, L] (or [bs]).
        response_mask: [bs, L], bool or numeric.
        loss_agg_mode: one of verl's five (module docstring).
        config: verl's actor config (clip ratios, clip_ratio_c, global_batch_info).
        rollout_is_weights: [bs, L] rollout-correction weights that multiply the per-token policy
            loss.

    Returns:
        (pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}): the 0-d loss
        and Python floats with verl's meanings: the fraction of valid tokens clipped on either side,
        the mean of old - new log-prob (log-ratio clamped at +-20), the fraction capped by the dual
        clip.
    """
    if config is None:
        raise ValueError("verl_policy_loss needs `config`, the actor config verl passes as config=")
    clip_ratio = config.clip_ratio
    eps_low = clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    eps_high = clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"config.clip_ratio_c must be > 1 (verl's dual clip), got {clip_ratio_c}")
    agg, normalizer = _aggregation(response_mask, loss_agg_mode, _batch_info(config))

    weights = rollout_is_weights
    if response_mask.dtype == torch.float64 and agg == "seq-mean-token-mean":
        n = response_mask.sum(-1, keepdim=True)  # verl divides row sums by n + 1e-8; ppo_loss by n
        factor = (n / (n + _EPS)).expand_as(response_mask)
        weights = factor if weights is None else weights * factor
    pg_loss, m = ppo_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=clip_ratio_c,
        is_weights=weights,
        agg=agg,
        normalizer=normalizer,
    )

    with torch.no_grad():
        valid = response_mask.bool()
        den = response_mask.sum() + _EPS  # verl's masked_mean denominator, in verl's dtype
        log_ratio = (old_log_prob - log_prob).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
        ppo_kl = torch.where(valid, log_ratio, 0.0).mul(response_mask).sum() / den
        pg_clipfrac = m["clipfrac"] * m["num_tokens"] / den
        pg_clipfrac_lower = m["dualclip_frac"] * m["num_tokens"] / den
        values = torch.stack(
            [x.double() for x in (pg_clipfrac, ppo_kl, pg_clipfrac_lower)]
        ).tolist()
    return pg_loss, dict(
        zip(("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"), values)
    )


def _batch_info(config) -> dict:
    info = dict(getattr(config, "global_batch_info", None) or {})
    unknown = set(info) - set(_BATCH_INFO)
    if unknown:
        raise ValueError(
            f"config.global_batch_info has keys verl's agg_loss does not take: {sorted(unknown)}; "
            f"expected {', '.join(_BATCH_INFO)}"
        )
    return info


def _aggregation(mask, loss_agg_mode, info):
    """(ppo_loss agg, normalizer D) for verl's agg_loss(loss_agg_mode, **global_batch_info)."""
    if loss_agg_mode not in _AGG_MODES:
        raise ValueError(
            f"loss_agg_mode {loss_agg_mode!r} is not one of verl's {', '.join(_AGG_MODES)}"
        )
    dp_size = info.get("dp_size") or 1
    if loss_agg_mode == "token-sum":
        return "constant", 1.0 / dp_size
    if loss_agg_mode == "token-mean":
        agg, count, name = "token-mean", info.get("batch_num_tokens"), "batch_num_tokens"
    else:
        agg, count, name = loss_agg_mode, info.get("global_batch_size"), "global_batch_size"
    if count is None and dp_size > 1:
        raise ValueError(
            f"config.global_batch_info[{name!r}] is required when dp_size > 1 (as in verl)"
        )
    if loss_agg_mode == "seq-mean-token-sum-norm":
        agg = "seq-mean-token-sum"
        if count is None:
            count = (mask.sum(-1) > 0).sum()  # rows with a valid token, on the device
        scale = info.get("loss_scale_factor")
        return agg, count * (mask.shape[-1] if scale is None else scale) / dp_size
    return agg, None if count is None else count / dp_size
