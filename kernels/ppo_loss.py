"""The ProRL v2 policy loss: token-level PPO-Clip with clip-higher, optional dual clip, a KL penalty to
the reference policy and an optional off-policy (sampler vs trainer) importance-sampling correction.

    loss, metrics = ppo_loss(logp, old_logp, advantages, mask, ref_logp=ref, kl_coef=1e-4, ...)

Per valid token (RECIPE.md §3-§4; A = advantage, v = kl_clamp_value):

    r   = exp(clamp(logp - old_logp, -20, 20))
    pg  = max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high))       PPO-Clip, clip-higher (eps_high > eps_low)
    pg  = min(pg, -c A)            where A < 0, if dual_clip = c   dual clip, OFF by default
    d   = logp - ref_logp,  d = clamp(d, -v, v)                   kl_clamp="log-ratio" (default)
    kl  = d (k1) | d^2 / 2 (k2) | exp(-d) - 1 + d (k3)
    kl  = clamp(kl, -v, v)                                        kl_clamp="output" (OpenRLHF's choice)
    w   = is_weights (detached): as given ("none") | min(w, hi) ("tis") | w 1[lo <= w <= hi] ("icepop")
    l   = w pg + kl_coef kl                                       (w scales the policy term only, as TRL/verl)

and loss = sum_t s_t l_t, with the aggregation weight s_t of `agg` (m_t = 1 on valid tokens, n_j = valid
tokens of sequence j, D = `normalizer`):

    token-mean            s_t = m_t / D          D default: valid tokens of this call
    seq-mean-token-mean   s_t = m_t / (n_j D)    D default: sequences of this call with n_j > 0
    seq-mean-token-sum    s_t = m_t / D          D default: as seq-mean-token-mean
    constant (Dr.GRPO)    s_t = m_t / D          D default: B*T for padded input; required when packed

The normaliser must be GLOBAL: when a mini-batch is split over micro-batches and data-parallel ranks, each
call sees only its share, and a local count makes the gradient scale depend on the split (KERNEL-NOTES.md).
Compute it once per mini-batch, before the first micro-batch, without a host sync:

    n = sum(mb.mask.sum() for mb in micro_batches).float()      # this rank's valid tokens (token-mean)
    torch.distributed.all_reduce(n)                              # every rank's
    n = n / world_size      # if the gradients are AVERAGED over ranks (DDP, FSDP): undoes that average
    for mb in micro_batches:
        loss, metrics = ppo_loss(..., normalizer=n); loss.backward()

(for the seq-mean modes count sequences instead: `(mask.sum(-1) > 0).sum()` padded). Summed over all
micro-batches and ranks, `loss` is then exactly the global token-mean, and `metrics["pg_loss"]` and
`metrics["kl_loss"]` are this call's share of it.

Gradient. Only `logp` is differentiable (old_logp, ref_logp, advantages and is_weights are constants).
The loss is linear in the per-token terms, so its gradient is known in the forward pass, in closed form:

    dloss/dlogp_t = s_t (w_t g_pg + kl_coef g_kl)
    g_pg = -A r   where the unclipped branch is taken (and the ratio and dual clips are inactive), else 0
    g_kl = 1 | d | 1 - exp(-d)   (k1 | k2 | k3), 0 where a clamp is active

The forward pass stores it (4 bytes per token) and the backward pass is one multiply by the upstream
gradient: one elementwise launch (on triton also the cast to logp's dtype, and for a token-mean without a
normaliser the 1 / count that the one-launch forward learns only at its end).
`ppo_loss_reference` is the same math written the way verl and TRL write it, in float64, differentiated by
autograd; the tests hold every backend to it.

Backends. Layout checks are shared torch code; a backend supplies one function, (logp, per-token inputs,
aggregation, options) -> (loss, statistics vector of sums, gradient, gradient scale or None), registered in
`_FORWARDS` (dloss/dlogp = gradient * scale; only triton returns a scale, see below). The
aggregation reaches it as s_t = m_t u_t / D with u_t per token (only seq-mean-token-mean has one; else 1)
and D a number, a 0-d tensor, or "count the valid tokens" (token-mean without a normaliser), so that the
kernels compute s_t in their own pass:
    native  (CPU)   one OpenMP pass over the tokens, vectorised (kernels/csrc/ppo_loss.cpp)
    triton  (CUDA)  ONE launch: each program writes its block's partial sums to a workspace; the last
                    program to finish (an atomic completion counter) reduces them in a fixed order
                    (deterministic) into the loss, the statistics and the metric means. Backward: ONE
                    launch. No host sync either way. Interpreter-verified only (kernels/
                    ppo_loss_triton.py). Around it only allocations and views, for bool masks and padded
                    [B] advantages (read in place); a numeric mask (`!= 0`), the seq-mean weights and a
                    normaliser tensor of another dtype each cost one small torch op before the launch.
    torch           a dozen elementwise passes (the readable version of the same math)

Layouts. Padded: every per-token input [B, T], advantages [B] (one per sequence) or [B, T]. Packed: every
per-token input [N], advantages [N], or [S] together with `cu_seqlens` [S + 1] (the varlen convention:
sequence j holds tokens cu_seqlens[j]:cu_seqlens[j+1]); the seq-mean modes need `cu_seqlens` when packed,
tokens outside [cu_seqlens[0], cu_seqlens[-1]) count as masked. Masked tokens may hold anything (NaN
included): they give 0 and get exactly 0 gradient; a call with no valid token gives loss 0.

Metrics (detached tensors on the input's device; nothing here syncs with the host):
    pg_loss, kl_loss        the policy and KL terms aggregated like `loss` (loss = pg_loss + kl_coef kl_loss)
    num_tokens              valid tokens of this call
    clipfrac_low, clipfrac_high, clipfrac
                            fraction of valid tokens clipped (zero gradient): A < 0 and r < 1 - eps_low;
                            A > 0 and r > 1 + eps_high; either (TRL's clip_ratio/{low,high,region}_mean)
    dualclip_frac           fraction capped by the dual clip (A < 0 and -A r > -c A)
    approx_kl               mean of old_logp - logp (verl's actor/ppo_kl)
    kl_mean                 mean per-token KL estimate (0 without ref_logp)
    ratio_mean, ratio_max   of r over valid tokens (max 0 when empty)
    is_mean, is_max, is_frac_modified
                            of the raw is_weights, and the fraction truncated (tis) or zeroed (icepop);
                            only when is_weights is given
Means are over this call's valid tokens: to combine calls weight them by num_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _backend

__all__ = ["ppo_loss", "ppo_loss_reference"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CLAMPS = ("log-ratio", "output", "none")
IS_MODES = ("none", "tis", "icepop")
RATIO_LOG_CLAMP = 20.0

# Slots of the statistics vector a backend returns (sums unless marked max).
# Slot order is shared with kernels/csrc/ppo_loss.cpp and kernels/ppo_loss_triton.py.
_STATS = (
    "pg kl n clip_low clip_high clip dual old_minus_new ratio ratio_max kl_sum is_sum is_max is_modified"
).split()
_MAX_SLOTS = (_STATS.index("ratio_max"), _STATS.index("is_max"))


# --------------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------------


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k2",
    kl_clamp: str = "log-ratio",
    kl_clamp_value: float = 10.0,
    is_weights: torch.Tensor | None = None,
    is_mode: str = "none",
    is_bounds: tuple[float, float] = (0.5, 5.0),
    agg: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-Clip-Higher + KL loss, aggregated; see the module docstring for the math and the layouts.

    Args:
        logp: [B, T] or packed [N] log-probs of the sampled tokens under the current policy (fp32/bf16/
            fp16/fp64), the only differentiable input.
        old_logp: like logp, under the policy that collected the batch (pi_old).
        advantages: [B] or [B, T] (padded); [N], or [S] with cu_seqlens (packed).
        mask: like logp, bool or numeric; nonzero marks a valid (response) token.
        eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] (v2: 0.2, 0.28).
        dual_clip: c > 1 caps the loss of A < 0 tokens at -c A; None (default) disables it.
        ref_logp: like logp, under the reference policy; None disables the KL term.
        kl_coef: beta, the weight of the KL term (RECIPE.md default 1e-4 is the caller's to pass).
        kl_estimator: "k1" | "k2" | "k3" on d = logp - ref_logp.
        kl_clamp: "log-ratio" clamps d to [-v, v] first; "output" clamps the estimate; "none".
        kl_clamp_value: v (10.0).
        is_weights: like logp, sampler-vs-trainer importance weights exp(old_logp - sampler_logp); detached.
        is_mode: "none" (use as given) | "tis" (truncate at is_bounds[1]) | "icepop" (zero outside is_bounds).
        is_bounds: (lo, hi) for tis/icepop.
        agg: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum" | "constant".
        normalizer: the GLOBAL denominator D (Python number or 0-d tensor); None uses this call's count.
        cu_seqlens: [S + 1] int32/int64 sequence boundaries of a packed batch.
        backend: "native" | "triton" | "torch"; default by device (see `_backend.resolve`).

    Returns:
        (loss, metrics): a 0-d fp32 (fp64 for fp64 input) differentiable loss and a dict of detached 0-d
        tensors (module docstring).
    """
    _check_options(
        eps_low, eps_high, dual_clip, kl_estimator, kl_clamp, kl_clamp_value, is_mode, is_bounds, agg
    )
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    name = _backend.resolve(logp.device, backend)
    tok = _flatten(
        logp,
        old_logp,
        advantages,
        mask,
        ref_logp,
        is_weights,
        cu_seqlens,
        need_seq=agg.startswith("seq-"),
        row_advantages=name == "triton",  # it reads [B] advantages of a padded batch in place
    )
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    aggregation = _aggregation(tok, agg, normalizer, cdt)
    opts = _Options.of(
        eps_low,
        eps_high,
        dual_clip,
        ref_logp,
        kl_coef,
        kl_estimator,
        kl_clamp,
        kl_clamp_value,
        is_weights,
        is_mode,
        is_bounds,
    )
    loss, stats = _PPOLoss.apply(logp, tok, aggregation, opts, name)
    return loss, _metrics(stats, opts)


@dataclass(frozen=True)
class _Options:
    """The scalar options, in one object that backends read (a triton kernel: as constexprs)."""

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

    @classmethod
    def of(
        cls,
        eps_low,
        eps_high,
        dual_clip,
        ref_logp,
        kl_coef,
        kl_estimator,
        kl_clamp,
        kl_clamp_value,
        is_weights,
        is_mode,
        is_bounds,
    ) -> _Options:
        """The options of one call, from the public arguments (after `_check_options`)."""
        return cls(
            eps_low=float(eps_low),
            eps_high=float(eps_high),
            dual_clip=dual_clip,
            has_ref=ref_logp is not None,
            kl_coef=float(kl_coef),
            kl_estimator=kl_estimator,
            kl_clamp=kl_clamp,
            kl_clamp_value=float(kl_clamp_value),
            has_is=is_weights is not None,
            is_mode=is_mode,
            is_bounds=tuple(is_bounds),
        )


class _PPOLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, tok, aggregation, opts, backend):
        forward = _FORWARDS[backend]
        kw = {"with_means": True} if backend == "triton" else {}  # the kernel also writes the metric means
        loss, stats, grad, grad_scale = forward(
            logp.reshape(-1), tok, aggregation, opts, need_grad=ctx.needs_input_grad[0], **kw
        )
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for `stats` (a launch on CUDA)
        ctx.save_for_backward(grad, grad_scale)
        ctx.shape, ctx.dtype, ctx.backend = logp.shape, logp.dtype, backend
        return loss, stats

    @staticmethod
    def backward(ctx, g_loss, g_stats):
        grad, grad_scale = ctx.saved_tensors
        if g_loss is None:  # materialize_grads is off: nothing flowed into the loss
            return None, None, None, None, None
        if ctx.backend == "triton":  # one launch: product, scale and cast to logp's dtype
            from . import ppo_loss_triton

            g = ppo_loss_triton.ppo_backward(grad, g_loss, grad_scale, ctx.dtype)
        else:
            g = grad * g_loss if grad_scale is None else grad * (g_loss * grad_scale)
            g = g.to(ctx.dtype)
        return g.view(ctx.shape), None, None, None, None


# --------------------------------------------------------------------------------------------------
# Layout and aggregation weights (shared by every backend)
# --------------------------------------------------------------------------------------------------


def _check_options(
    eps_low, eps_high, dual_clip, kl_estimator, kl_clamp, kl_clamp_value, is_mode, is_bounds, agg
):
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    choices = {
        "kl_estimator": (kl_estimator, KL_ESTIMATORS),
        "kl_clamp": (kl_clamp, KL_CLAMPS),
        "is_mode": (is_mode, IS_MODES),
        "agg": (agg, AGG_MODES),
    }
    for what, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")
    if not kl_clamp_value > 0:
        raise ValueError(f"kl_clamp_value must be > 0, got {kl_clamp_value}")
    lo, hi = is_bounds
    if not 0.0 <= lo <= hi:
        raise ValueError(f"is_bounds must satisfy 0 <= lo <= hi, got {is_bounds}")


def _flatten(
    logp, old_logp, advantages, mask, ref_logp, is_weights, cu_seqlens, need_seq, row_advantages=False
):
    """Check shapes and return the per-token inputs flattened to [N], plus the sequence layout.

    row_advantages: a padded batch's [B] advantages stay [B] (tok["adv_row_len"] = T, the backend reads
    advantage offs // T) instead of being broadcast to a [N] copy; tok["adv_row_len"] is 0 otherwise."""
    if not logp.is_floating_point():
        raise TypeError(f"logp must be floating point, got {logp.dtype}")
    if logp.dim() not in (1, 2):
        raise ValueError(f"logp must be [B, T] (padded) or [N] (packed), got shape {tuple(logp.shape)}")
    named = {"old_logp": old_logp, "mask": mask, "ref_logp": ref_logp, "is_weights": is_weights}
    for name, t in named.items():
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
    dev = logp.device
    n = logp.numel()
    valid = mask.reshape(-1) if mask.dtype == torch.bool else mask.reshape(-1) != 0
    seq, num_seqs, adv_row_len = None, None, 0
    if logp.dim() == 2:
        b, t = logp.shape
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is for packed [N] inputs; padded [B, T] rows are the sequences")
        if advantages.shape == (b,) and row_advantages:
            adv, adv_row_len = advantages, t
        elif advantages.shape == (b,):
            adv = advantages[:, None].expand(b, t).reshape(-1)
        elif advantages.shape == (b, t):
            adv = advantages.reshape(-1)
        else:
            raise ValueError(f"advantages {tuple(advantages.shape)} must be [B]={b} or [B, T]=({b}, {t})")
        num_seqs = b
        if need_seq:
            seq = torch.arange(b, device=dev)[:, None].expand(b, t).reshape(-1)
    else:
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
    flat = lambda x: None if x is None else x.reshape(-1)
    return {
        "valid": valid,
        "old": flat(old_logp),
        "adv": adv,
        "adv_row_len": adv_row_len,
        "ref": flat(ref_logp),
        "isw": flat(is_weights),
        "seq": seq,
        "num_seqs": num_seqs,
        "padded_shape": tuple(logp.shape) if logp.dim() == 2 else None,
    }


@dataclass(frozen=True)
class _Aggregation:
    """s_t = m_t u_t / D (module docstring), in the form the kernels take it.

    weight: [N] u_t in the compute dtype, 0 on masked tokens; None means u_t = 1.
    denom:  D as a Python number > 0, a 0-d tensor on the device (a value <= 0 reads as 1), or None: the
            number of valid tokens of this call (at least 1), counted by the backend.
    """

    weight: torch.Tensor | None
    denom: float | torch.Tensor | None


def _aggregation(tok, agg, normalizer, cdt) -> _Aggregation:
    """The aggregation of `agg`. No host sync: counts stay on the device, and a Python-number denominator
    stays a Python scalar (no host-to-device copy)."""
    weight, denom = None, normalizer
    if agg == "seq-mean-token-mean" or (agg == "seq-mean-token-sum" and normalizer is None):
        m = tok["valid"].to(cdt)
        per_seq = _seq_sum(m, tok)  # [S] valid tokens per sequence
        if agg == "seq-mean-token-mean":
            weight = m / per_seq.clamp_min(1.0)[tok["seq"]]
        if normalizer is None:
            denom = (per_seq > 0).sum()  # sequences with a valid token; 0 reads as 1: loss 0, not 0/0
    if normalizer is None and agg == "constant":
        if tok["padded_shape"] is None:
            raise ValueError("agg='constant' on a packed batch needs a normalizer (e.g. S * max_len)")
        denom = float(math.prod(tok["padded_shape"]))
    if torch.is_tensor(denom):
        denom = denom.to(device=tok["valid"].device, dtype=cdt)
    elif denom is not None:
        denom = float(denom)
    return _Aggregation(weight, denom)


def _scale(tok, aggregation, cdt):
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
    return x.new_zeros(max(tok["num_seqs"], 1)).index_add_(0, tok["seq"], x)  # S = 0: one empty slot


# --------------------------------------------------------------------------------------------------
# Backends: per-token terms, the weighted sum, the closed-form gradient and the statistics
# --------------------------------------------------------------------------------------------------


def _torch_forward(logp, tok, aggregation, opts, need_grad):
    """Returns (loss 0-d, stats [len(_STATS)] sums and maxima, grad [N] or None, grad_scale) in the compute
    dtype; dloss/dlogp = grad * grad_scale, or grad itself when grad_scale is None (always, here)."""
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    scale = _scale(tok, aggregation, cdt)
    valid = tok["valid"]
    zero = torch.zeros((), dtype=cdt, device=logp.device)
    clean = lambda x: torch.where(valid, x.to(cdt), zero)  # masked tokens may hold NaN/inf: never read them
    lp, old, adv = clean(logp), clean(tok["old"]), clean(tok["adv"])
    vf = valid.to(cdt)

    log_ratio = lp - old
    ratio_ok = log_ratio.abs() <= RATIO_LOG_CLAMP
    ratio = torch.exp(log_ratio.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
    lo, hi = 1.0 - opts.eps_low, 1.0 + opts.eps_high
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(lo, hi)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    live = (pg_unclipped >= pg_clipped) & ratio_ok  # the gradient flows through -A r
    clip_low = valid & (adv < 0) & (ratio < lo)
    clip_high = valid & (adv > 0) & (ratio > hi)
    if opts.dual_clip is not None:
        cap = -opts.dual_clip * adv
        capped = (adv < 0) & (pg > cap)
        pg = torch.where(capped, cap, pg)
        live = live & ~capped
        dual = valid & capped
    else:
        dual = torch.zeros_like(valid)

    if opts.has_is:
        w_raw = clean(tok["isw"])
        w = _apply_is_mode(w_raw, opts)
        is_modified = valid & (w != w_raw)
    else:
        w = None
    wpg = pg if w is None else w * pg

    if opts.has_ref:
        kl, kl_grad = _kl_and_grad(lp - clean(tok["ref"]), opts)
        kl = kl * vf
    else:
        kl = kl_grad = None

    pg_sum = (scale * wpg).sum()
    kl_sum = (scale * kl).sum() if kl is not None else zero
    loss = pg_sum + opts.kl_coef * kl_sum if kl is not None else pg_sum

    grad = None
    if need_grad:
        g_pg = torch.where(live, -adv * ratio, zero)
        if w is not None:
            g_pg = w * g_pg
        if kl_grad is not None and opts.kl_coef != 0.0:
            g_pg = g_pg + opts.kl_coef * kl_grad
        grad = scale * g_pg

    ratio_v = ratio * vf
    stats = torch.stack(
        [
            pg_sum,
            kl_sum,
            vf.sum(),
            clip_low.to(cdt).sum(),
            clip_high.to(cdt).sum(),
            (clip_low | clip_high).to(cdt).sum(),
            dual.to(cdt).sum(),
            ((old - lp) * vf).sum(),
            ratio_v.sum(),
            ratio_v.amax() if ratio_v.numel() else zero,
            kl.sum() if kl is not None else zero,
            w_raw.sum() if w is not None else zero,
            w_raw.amax() if w is not None and w_raw.numel() else zero,
            is_modified.to(cdt).sum() if w is not None else zero,
        ]
    )
    return loss, stats, grad, None


def _apply_is_mode(w, opts):
    lo, hi = opts.is_bounds
    if opts.is_mode == "tis":
        return w.clamp(max=hi)
    if opts.is_mode == "icepop":
        return torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
    return w


def _kl_and_grad(d, opts):
    """Per-token KL estimate on d = logp - ref_logp and its derivative in d (0 where a clamp is active)."""
    v = opts.kl_clamp_value
    one = torch.ones_like(d)
    if opts.kl_clamp == "log-ratio":
        inside = d.abs() <= v
        d = d.clamp(-v, v)
    if opts.kl_estimator == "k1":
        kl, g = d, one
    elif opts.kl_estimator == "k2":
        kl, g = 0.5 * d * d, d
    else:
        e = torch.exp(-d)
        kl, g = e - 1.0 + d, 1.0 - e
    if opts.kl_clamp == "log-ratio":
        g = torch.where(inside, g, torch.zeros_like(g))
    elif opts.kl_clamp == "output":
        g = torch.where(kl.abs() <= v, g, torch.zeros_like(g))
        kl = kl.clamp(-v, v)
    return kl, g


def _native_forward(logp, tok, aggregation, opts, need_grad):
    """The torch.ops.prorl.ppo_forward kernel (kernels/csrc/ppo_loss.cpp); same contract as _torch_forward."""
    denom = aggregation.denom
    loss, stats, grad = torch.ops.prorl.ppo_forward(
        logp,
        tok["old"],
        tok["adv"],
        tok["valid"],
        tok["ref"],
        tok["isw"],
        aggregation.weight,
        denom if torch.is_tensor(denom) else None,
        0.0 if denom is None or torch.is_tensor(denom) else denom,  # 0: count the valid tokens
        opts.eps_low,
        opts.eps_high,
        opts.dual_clip or 0.0,  # 0: off
        opts.kl_coef,
        KL_ESTIMATORS.index(opts.kl_estimator),
        KL_CLAMPS.index(opts.kl_clamp),
        opts.kl_clamp_value,
        IS_MODES.index(opts.is_mode),
        *opts.is_bounds,
        need_grad,
    )
    return loss, stats, (grad if need_grad else None), None


def _triton_forward(logp, tok, aggregation, opts, need_grad, with_means=False):
    from . import ppo_loss_triton

    return ppo_loss_triton.ppo_forward(logp, tok, aggregation, opts, need_grad, with_means)


_FORWARDS = {"torch": _torch_forward, "native": _native_forward, "triton": _triton_forward}


def _metrics(stats, opts):
    """The metrics dict from a statistics vector of sums: two tensor ops, the rest are views (no syncs).
    A [2, len(_STATS)] `stats` (the triton kernel's) holds the per-token means in row 1: views only."""
    if stats.dim() == 2:
        stats, per_token = stats[0], stats[1]
    else:
        per_token = stats / stats[_STATS.index("n")].clamp_min(1.0)
    s = dict(zip(_STATS, stats.unbind()))
    mean = dict(zip(_STATS, per_token.unbind()))
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


def _combine_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Statistics of two disjoint token sets from each one's (sums add, maxima take the max)."""
    out = a + b
    idx = list(_MAX_SLOTS)
    out[idx] = torch.maximum(a[idx], b[idx])
    return out


# --------------------------------------------------------------------------------------------------
# Plain float64 reference (what every backend is tested against)
# --------------------------------------------------------------------------------------------------


def ppo_loss_reference(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low=0.2,
    eps_high=0.28,
    dual_clip=None,
    ref_logp=None,
    kl_coef=0.0,
    kl_estimator="k2",
    kl_clamp="log-ratio",
    kl_clamp_value=10.0,
    is_weights=None,
    is_mode="none",
    is_bounds=(0.5, 5.0),
    agg="token-mean",
    normalizer=None,
    cu_seqlens=None,
):
    """Unfused float64 reference, one sequence at a time, differentiated by autograd w.r.t. `logp`.

    Same arguments as `ppo_loss`; masked tokens must hold finite values. Returns (loss, metrics) with
    pg_loss, kl_loss, num_tokens, clipfrac_low, clipfrac_high, dualclip_frac, approx_kl, kl_mean, ratio_mean.
    """
    f64 = lambda x: None if x is None else x.double()
    padded_numel = logp.numel()
    if logp.dim() == 2:  # padded: the same as packed with one sequence per row
        b, t = logp.shape
        cu_seqlens = torch.arange(b + 1) * t
        logp, old_logp, mask, ref_logp, is_weights, advantages = (
            None if x is None else x.reshape(-1) if x.dim() == 2 else x
            for x in (logp, old_logp, mask, ref_logp, is_weights, advantages)
        )
    n = logp.shape[0]
    bounds = [0, n] if cu_seqlens is None else cu_seqlens.tolist()
    per_seq_adv = advantages.shape[0] != n
    rows = []  # per sequence j: (logp, old, adv, mask, ref, isw), each [T_j]
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        adv = advantages[j].expand(b - a) if per_seq_adv else advantages[a:b]
        rows.append([None if x is None else x[a:b] for x in (logp, old_logp, mask, ref_logp, is_weights)])
        rows[-1].insert(2, adv)
    lo, hi = 1 - eps_low, 1 + eps_high
    seq_pg, seq_kl, counts, tot = (
        [],
        [],
        [],
        {"low": 0.0, "high": 0.0, "dual": 0.0, "akl": 0.0, "kl": 0.0, "ratio": 0.0},
    )
    for lp, old, adv, m, ref, isw in rows:
        lp, old, adv, ref, isw, m = f64(lp), f64(old), f64(adv), f64(ref), f64(isw), (m != 0).double()
        ratio = torch.exp(torch.clamp(lp - old, -RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
        pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, lo, hi))
        if dual_clip is not None:
            capped = torch.minimum(pg, -dual_clip * adv)
            tot["dual"] += float((((adv < 0) & (pg > -dual_clip * adv)).double() * m).sum())
            pg = torch.where(adv < 0, capped, pg)
        if isw is not None:
            w = isw.detach()
            if is_mode == "tis":
                w = torch.clamp(w, max=is_bounds[1])
            elif is_mode == "icepop":
                w = w * ((w >= is_bounds[0]) & (w <= is_bounds[1])).double()
            pg = pg * w
        kl = torch.zeros_like(lp)
        if ref_logp is not None:
            d = lp - ref
            if kl_clamp == "log-ratio":
                d = torch.clamp(d, -kl_clamp_value, kl_clamp_value)
            if kl_estimator == "k1":
                kl = d
            elif kl_estimator == "k2":
                kl = 0.5 * d**2
            else:
                kl = torch.exp(-d) - 1 + d
            if kl_clamp == "output":
                kl = torch.clamp(kl, -kl_clamp_value, kl_clamp_value)
        seq_pg.append((pg * m).sum())
        seq_kl.append((kl * m).sum())
        counts.append(float(m.sum()))
        with torch.no_grad():
            tot["low"] += float((((adv < 0) & (ratio < lo)).double() * m).sum())
            tot["high"] += float((((adv > 0) & (ratio > hi)).double() * m).sum())
            tot["akl"] += float(((old - lp) * m).sum())
            tot["kl"] += float((kl * m).sum())
            tot["ratio"] += float((ratio * m).sum())
    n_tok = sum(counts)
    n_seq = sum(c > 0 for c in counts)
    if normalizer is not None:
        denom = float(normalizer)
    else:
        denom = {"token-mean": n_tok, "constant": float(padded_numel)}.get(agg, n_seq)
    denom = denom if denom > 0 else 1.0
    if agg == "seq-mean-token-mean":
        pg_l = sum(p / max(c, 1.0) for p, c in zip(seq_pg, counts)) / denom
        kl_l = sum(k / max(c, 1.0) for k, c in zip(seq_kl, counts)) / denom
    else:
        pg_l, kl_l = sum(seq_pg) / denom, sum(seq_kl) / denom
    if not torch.is_tensor(pg_l):  # no sequence at all: keep a graph to differentiate
        pg_l = pg_l + 0.0 * logp.double().sum()
    loss = pg_l + kl_coef * kl_l
    nn = max(n_tok, 1.0)
    metrics = {"pg_loss": pg_l.detach(), "kl_loss": torch.as_tensor(kl_l).detach(), "num_tokens": n_tok}
    metrics.update(
        {
            f"{k}": tot[v] / nn
            for k, v in (
                ("clipfrac_low", "low"),
                ("clipfrac_high", "high"),
                ("dualclip_frac", "dual"),
                ("approx_kl", "akl"),
                ("kl_mean", "kl"),
                ("ratio_mean", "ratio"),
            )
        }
    )
    return loss, metrics
