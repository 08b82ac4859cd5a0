"""What `ppo_loss`, its triton backend and `linear_ppo_loss` share: the option values, the options
object, the statistics-slot layout, the input layouts and the aggregation weights (ppo_loss.py's
docstring has the math). Torch code only; no backend lives here.

The option tuples (options.py) are the public list of allowed values (exported by `prorl.kernels`);
an option's position in its tuple is the integer code that the native and triton kernels take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .options import AGG_MODES, IS_MODES, KL_CLAMPS, KL_ESTIMATORS

__all__ = [
    "AGG_MODES",
    "IS_MODES",
    "KL_CLAMPS",
    "KL_ESTIMATORS",
    "MAX_SLOTS",
    "RATIO_LOG_CLAMP",
    "STATS",
    "Aggregation",
    "PPOOptions",
    "aggregation_weights",
    "check_aggregation",
    "combine_stats",
    "flatten_inputs",
    "metrics_from_stats",
    "token_scale",
]

# |logp - old_logp| bound before exp (kernels/csrc/ppo_loss.cpp and the triton kernel)
RATIO_LOG_CLAMP = 20.0

# Slots of the statistics vector a backend returns: sums, except the maxima in MAX_SLOTS. The native
# kernel (kernels/csrc/ppo_loss.cpp, enum Slot) and the triton kernel (kernels/ppo_loss_triton.py)
# write them in this order.
STATS = tuple(
    "pg kl n clip_low clip_high clip dual old_minus_new ratio ratio_max "
    "kl_sum is_sum is_max is_modified".split()
)
MAX_SLOTS = (STATS.index("ratio_max"), STATS.index("is_max"))


# --------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PPOOptions:
    """The scalar options of one call, in one object that backends read (a triton kernel: as
    constexprs). Built from the public keyword arguments and checked on construction (ValueError on
    a bad value); `has_ref` / `has_is`: whether the call passed ref_logp / is_weights."""

    eps_low: float
    eps_high: float
    dual_clip: float | None
    has_ref: bool
    kl_coef: float
    kl_estimator: str
    kl_clamp: str
    kl_clamp_value: float
    has_is: bool
    is_mode: str
    is_bounds: tuple[float, float]

    def __post_init__(self):
        eps_low, eps_high, dual_clip = self.eps_low, self.eps_high, self.dual_clip
        if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
        choices = {
            "kl_estimator": (self.kl_estimator, KL_ESTIMATORS),
            "kl_clamp": (self.kl_clamp, KL_CLAMPS),
            "is_mode": (self.is_mode, IS_MODES),
        }
        for what, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")
        if not self.kl_clamp_value > 0:
            raise ValueError(f"kl_clamp_value must be > 0, got {self.kl_clamp_value}")
        lo, hi = self.is_bounds
        if not 0.0 <= lo <= hi:
            raise ValueError(f"is_bounds must satisfy 0 <= lo <= hi, got {self.is_bounds}")
        # Python floats for kernels
        for name in ("eps_low", "eps_high", "kl_coef", "kl_clamp_value"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "is_bounds", tuple(self.is_bounds))

    @property
    def kl_estimator_code(self) -> int:
        return KL_ESTIMATORS.index(self.kl_estimator)

    @property
    def kl_clamp_code(self) -> int:
        return KL_CLAMPS.index(self.kl_clamp)

    @property
    def is_mode_code(self) -> int:
        return IS_MODES.index(self.is_mode)


def check_aggregation(agg, normalizer) -> None:
    """ValueError unless `agg` is one of AGG_MODES and a numeric `normalizer` is > 0."""
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; choose one of {', '.join(AGG_MODES)}")
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


def flatten_inputs(
    logp, advantages, cu_seqlens, like_logp: dict, *, need_seq, row_advantages=False
):
    """Check shapes and return the per-token inputs flattened to [N], plus the sequence layout.

    like_logp: {"old_logp", "mask", "ref_logp", "is_weights"}, each shaped like logp (None: absent).
    row_advantages: a padded batch's [B] advantages stay [B] (tok["adv_row_len"] = T, the backend
    reads advantage offs // T) instead of being broadcast to a [N] copy; tok["adv_row_len"] is 0
    otherwise."""
    if not logp.is_floating_point():
        raise TypeError(f"logp must be floating point, got {logp.dtype}")
    if logp.dim() not in (1, 2):
        raise ValueError(
            f"logp must be [B, T] (padded) or [N] (packed), got shape {tuple(logp.shape)}"
        )
    for name, t in like_logp.items():
        if t is None:
            continue
        if t.shape != logp.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have logp's shape {tuple(logp.shape)}")
        if t.device != logp.device:
            raise ValueError(f"{name} is on {t.device}, logp on {logp.device}")
        if name != "mask" and not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if not advantages.is_floating_point():
        raise TypeError(f"advantages must be floating point, got {advantages.dtype}")
    if advantages.device != logp.device:
        raise ValueError(f"advantages is on {advantages.device}, logp on {logp.device}")
    mask = like_logp["mask"]
    valid = mask.reshape(-1) if mask.dtype == torch.bool else mask.reshape(-1) != 0
    if logp.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError(
                "cu_seqlens is for packed [N] inputs; padded [B, T] rows are the sequences"
            )
        adv, adv_row_len, seq, num_seqs = _padded_layout(
            logp.shape, advantages, need_seq, row_advantages
        )
    else:
        adv, seq, num_seqs, valid = _packed_layout(
            logp.numel(), advantages, cu_seqlens, need_seq, valid
        )
        adv_row_len = 0
    flat = lambda x: None if x is None else x.reshape(-1)
    return {
        "valid": valid,
        "old": flat(like_logp["old_logp"]),
        "adv": adv,
        "adv_row_len": adv_row_len,
        "ref": flat(like_logp["ref_logp"]),
        "isw": flat(like_logp["is_weights"]),
        "seq": seq,
        "num_seqs": num_seqs,
        "padded_shape": tuple(logp.shape) if logp.dim() == 2 else None,
    }


def _padded_layout(shape, advantages, need_seq: bool, row_advantages: bool):
    """A padded [B, T] batch: (advantages [N] or [B], their row length T or 0, sequence of each
    token [N] or None, B)."""
    b, t = shape
    dev = advantages.device
    adv_row_len = 0
    if advantages.shape == (b,) and row_advantages:
        adv, adv_row_len = advantages, t
    elif advantages.shape == (b,):
        adv = advantages[:, None].expand(b, t).reshape(-1)
    elif advantages.shape == (b, t):
        adv = advantages.reshape(-1)
    else:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B]={b} or [B, T]=({b}, {t})"
        )
    seq = torch.arange(b, device=dev)[:, None].expand(b, t).reshape(-1) if need_seq else None
    return adv, adv_row_len, seq, b


def _packed_layout(n: int, advantages, cu_seqlens, need_seq: bool, valid):
    """A packed [N] batch: (advantages [N], sequence of each token [N] or None, S or None, valid [N]
    without the tokens outside every sequence)."""
    dev = valid.device
    seq, num_seqs = None, None
    if cu_seqlens is not None:
        if (
            cu_seqlens.dim() != 1
            or cu_seqlens.numel() < 1
            or cu_seqlens.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [S + 1]")
        num_seqs = cu_seqlens.numel() - 1
        pos = torch.arange(n, device=dev, dtype=cu_seqlens.dtype)
        seq = torch.searchsorted(cu_seqlens.to(dev), pos, right=True) - 1  # [N], -1 or S: outside
        inside = (seq >= 0) & (seq < num_seqs)
        valid = valid & inside
        seq = seq.clamp(0, max(num_seqs - 1, 0))
    elif need_seq:
        raise ValueError("the seq-mean aggregations of a packed batch need cu_seqlens")
    if advantages.shape == (n,):
        adv = advantages
    elif cu_seqlens is not None and advantages.shape == (num_seqs,):
        adv = advantages[seq] if num_seqs > 0 else advantages.new_zeros(n)
    else:
        raise ValueError(
            f"packed advantages {tuple(advantages.shape)} must be [N]={n}, or [S] with cu_seqlens"
        )
    return adv, seq, num_seqs, valid


# --------------------------------------------------------------------------------------------------
# Aggregation weights
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Aggregation:
    """s_t = m_t u_t / D (ppo_loss.py's docstring), in the form the kernels take it.

    weight: [N] u_t in the compute dtype, 0 on masked tokens; None means u_t = 1.
    denom:  D as a Python number > 0, a 0-d tensor on the device (a value <= 0 reads as 1), or None:
            the number of valid tokens of this call (at least 1), counted by the backend.
    """

    weight: torch.Tensor | None
    denom: float | torch.Tensor | None


def aggregation_weights(tok, agg, normalizer, cdt) -> Aggregation:
    """The aggregation of `agg`. No host sync: counts stay on the device, and a Python-number
    denominator stays a Python scalar (no host-to-device copy)."""
    weight, denom = None, normalizer
    if agg == "seq-mean-token-mean" or (agg == "seq-mean-token-sum" and normalizer is None):
        m = tok["valid"].to(cdt)
        per_seq = _seq_sum(m, tok)  # [S] valid tokens per sequence
        if agg == "seq-mean-token-mean":
            weight = m / per_seq.clamp_min(1.0)[tok["seq"]]
        if normalizer is None:
            # sequences with a valid token; 0 reads as 1: loss 0, not 0/0
            denom = (per_seq > 0).sum()
    if normalizer is None and agg == "constant":
        if tok["padded_shape"] is None:
            raise ValueError(
                "agg='constant' on a packed batch needs a normalizer (e.g. S * max_len)"
            )
        denom = float(math.prod(tok["padded_shape"]))
    if torch.is_tensor(denom):
        denom = denom.to(device=tok["valid"].device, dtype=cdt)
    elif denom is not None:
        denom = float(denom)
    return Aggregation(weight, denom)


def token_scale(tok, aggregation, cdt):
    """s_t [N] in `cdt` (0 on masked tokens), materialised: what the torch backend multiplies by."""
    m = aggregation.weight if aggregation.weight is not None else tok["valid"].to(cdt)
    denom = aggregation.denom
    if denom is None:
        denom = tok["valid"].sum().to(cdt)
    if torch.is_tensor(denom):
        return m / torch.where(denom > 0, denom, torch.ones_like(denom))
    return m * (1.0 / denom)


def _seq_sum(x, tok):
    """Per-sequence sums of a per-token [N] tensor -> [S]."""
    if tok["padded_shape"] is not None:
        return x.view(tok["padded_shape"]).sum(-1)
    # S = 0: one empty slot
    return x.new_zeros(max(tok["num_seqs"], 1)).index_add_(0, tok["seq"], x)


# --------------------------------------------------------------------------------------------------
# Statistics -> metrics
# --------------------------------------------------------------------------------------------------


def metrics_from_stats(stats, opts):
    """The metrics dict from a statistics vector of sums: two tensor ops, the rest are views (no
    syncs). A [2, len(STATS)] `stats` (the triton kernel's) holds the per-token means in row 1:
    views only."""
    if stats.dim() == 2:
        stats, per_token = stats[0], stats[1]
    else:
        per_token = stats / stats[STATS.index("n")].clamp_min(1.0)
    s = dict(zip(STATS, stats.unbind()))
    mean = dict(zip(STATS, per_token.unbind()))
    out = {
        "pg_loss": s["pg"],
        "kl_loss": s["kl"],
        "num_tokens": s["n"],
        "clipfrac_low": mean["clip_low"],
        "clipfrac_high": mean["clip_high"],
        "clipfrac": mean["clip"],
        "dualclip_frac": mean["dual"],
        "approx_kl": mean["old_minus_new"],
        "kl_mean": mean["kl_sum"],
        "ratio_mean": mean["ratio"],
        "ratio_max": s["ratio_max"],
    }
    if opts.has_is:
        out.update(is_mean=mean["is_sum"], is_max=s["is_max"], is_frac_modified=mean["is_modified"])
    return out


def combine_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Statistics of two disjoint token sets from each one's (sums add, maxima take the max)."""
    out = a + b
    idx = list(MAX_SLOTS)
    out[idx] = torch.maximum(a[idx], b[idx])
    return out
