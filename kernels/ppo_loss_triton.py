"""Triton backend of `ppo_loss` (the math is in ppo_loss.py's docstring).

Forward, two launches:
    _token_kernel     one program per BLOCK tokens: the per-token loss terms, the closed-form gradient
                      dloss/dlogp (written out) and the block's share of every statistic, reduced in
                      fp64 and written to row `pid` of a [programs, NSTAT] partials buffer (no atomics,
                      no zeroing);
    _finalize_kernel  one program: sums (and maxes) the partial rows in a fixed order, then writes the
                      loss and the statistics vector. The result does not depend on scheduling
                      (deterministic), and the host never waits: nothing is read back.
Backward is one elementwise multiply of the stored gradient by the upstream scalar (ppo_loss.py).

Per-token inputs are loaded with `mask=valid`, `other=0`: a masked token's values (NaN included) never enter
the arithmetic. Math in fp32 (fp64 for fp64 logp); the sums in fp64. The options that change the code (KL
estimator, clamp, IS mode, dual clip, which optional inputs exist) are constexprs; the numbers are runtime.

Imported only when the triton backend is selected (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["ppo_forward"]

# Tokens per program on a GPU: 1024 fp32 = 8 per thread with 4 warps, a row of partials per 4 KiB of logp.
# Not tuned (no GPU was available when this was written).
_BLOCK_GPU = 1024
# Under the interpreter small blocks make the tiny test batches span several programs (exercising the partial
# sums and the masked last block).
_BLOCK_INTERPRETER = 32
_NSTAT = 16  # partials row width: the 14 statistics of ppo_loss._STATS, padded to a power of two


@triton.jit
def _token_kernel(
    logp_ptr,  # [N] current log-probs (any float dtype)
    old_ptr,  # [N] old log-probs
    adv_ptr,  # [N] advantages
    valid_ptr,  # [N] uint8, nonzero on valid tokens
    ref_ptr,  # [N] reference log-probs (read only if HAS_REF)
    isw_ptr,  # [N] importance weights (read only if HAS_IS)
    weight_ptr,  # [N] aggregation weight u_t (read only if HAS_WEIGHT)
    denom_ptr,  # 0-d D (read only if DENOM_FROM_PTR; a value <= 0 reads as 1)
    grad_ptr,  # [N] out: dloss/dlogp in the compute dtype (written only if NEED_GRAD)
    part_ptr,  # [programs, NSTAT] fp64 out: this program's sums and maxima
    n,
    inv_denom,  # 1 / D when D is a host number
    lo,  # 1 - eps_low
    hi,  # 1 + eps_high
    dual_c,
    kl_coef,
    kl_v,  # kl_clamp_value
    is_lo,
    is_hi,
    CDT: tl.constexpr,  # compute dtype: tl.float32 or tl.float64
    HAS_REF: tl.constexpr,
    HAS_IS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    DENOM_FROM_PTR: tl.constexpr,
    DUAL: tl.constexpr,
    KL_EST: tl.constexpr,  # 0 k1, 1 k2, 2 k3
    KL_CLAMP: tl.constexpr,  # 0 log-ratio, 1 output, 2 none
    IS_MODE: tl.constexpr,  # 0 as given, 1 tis, 2 icepop
    NEED_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    NSTAT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    v = (tl.load(valid_ptr + offs, mask=inb, other=0) != 0) & inb
    vf = v.to(CDT)
    lp = tl.load(logp_ptr + offs, mask=v, other=0.0).to(CDT)
    old = tl.load(old_ptr + offs, mask=v, other=0.0).to(CDT)
    a = tl.load(adv_ptr + offs, mask=v, other=0.0).to(CDT)
    if DENOM_FROM_PTR:
        d = tl.load(denom_ptr).to(CDT)
        d = tl.where(d > 0, d, 1.0)
        u = vf
        if HAS_WEIGHT:
            u = tl.load(weight_ptr + offs, mask=v, other=0.0).to(CDT)
        s = u / d
    else:
        s = vf * inv_denom
        if HAS_WEIGHT:
            s = tl.load(weight_ptr + offs, mask=v, other=0.0).to(CDT) * inv_denom

    log_ratio = lp - old
    ratio_ok = tl.abs(log_ratio) <= 20.0  # RATIO_LOG_CLAMP
    ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -20.0), 20.0))
    unclipped = -a * ratio
    clipped = -a * tl.minimum(tl.maximum(ratio, lo), hi)
    pg = tl.maximum(unclipped, clipped)
    live = (unclipped >= clipped) & ratio_ok  # the gradient flows through -A r
    c_low = v & (a < 0) & (ratio < lo)
    c_high = v & (a > 0) & (ratio > hi)
    capped = tl.zeros([BLOCK], dtype=tl.int1)
    if DUAL:
        cap = -dual_c * a
        capped = v & (a < 0) & (pg > cap)
        pg = tl.where(capped, cap, pg)
        live = live & (~capped)

    w_raw = tl.zeros([BLOCK], CDT)
    w = tl.full([BLOCK], 1.0, CDT)
    modified = tl.zeros([BLOCK], dtype=tl.int1)
    if HAS_IS:
        w_raw = tl.load(isw_ptr + offs, mask=v, other=0.0).to(CDT)
        w = w_raw
        if IS_MODE == 1:
            w = tl.minimum(w_raw, is_hi)
        if IS_MODE == 2:
            w = tl.where((w_raw >= is_lo) & (w_raw <= is_hi), w_raw, 0.0)
        modified = v & (w != w_raw)

    kl = tl.zeros([BLOCK], CDT)
    g_kl = tl.zeros([BLOCK], CDT)
    if HAS_REF:
        dd = lp - tl.load(ref_ptr + offs, mask=v, other=0.0).to(CDT)
        if KL_CLAMP == 0:
            inside = tl.abs(dd) <= kl_v
            dd = tl.minimum(tl.maximum(dd, -kl_v), kl_v)
        if KL_EST == 0:
            kl = dd
            g_kl = tl.full([BLOCK], 1.0, CDT)
        elif KL_EST == 1:
            kl = 0.5 * dd * dd
            g_kl = dd
        else:
            e = tl.exp(-dd)
            kl = e - 1.0 + dd
            g_kl = 1.0 - e
        if KL_CLAMP == 1:
            inside = tl.abs(kl) <= kl_v
            kl = tl.minimum(tl.maximum(kl, -kl_v), kl_v)
        if KL_CLAMP != 2:
            g_kl = tl.where(inside, g_kl, 0.0)
        kl = kl * vf

    if NEED_GRAD:
        g = tl.where(live, -a * ratio, 0.0)
        if HAS_IS:
            g = w * g
        if HAS_REF:
            g = tl.where(kl_coef != 0.0, g + kl_coef * g_kl, g)  # a select: 0 * inf would be NaN
        tl.store(grad_ptr + offs, tl.where(v, s * g, 0.0), mask=inb)

    # This block's statistics, summed in fp64, in the slot order of ppo_loss._STATS.
    ratio_v = ratio * vf
    row = part_ptr + pid.to(tl.int64) * NSTAT
    tl.store(row + 0, tl.sum((s * (w * pg)).to(tl.float64), axis=0))
    tl.store(row + 1, tl.sum((s * kl).to(tl.float64), axis=0))
    tl.store(row + 2, tl.sum(vf.to(tl.float64), axis=0))
    tl.store(row + 3, tl.sum(c_low.to(tl.float64), axis=0))
    tl.store(row + 4, tl.sum(c_high.to(tl.float64), axis=0))
    tl.store(row + 5, tl.sum((c_low | c_high).to(tl.float64), axis=0))
    tl.store(row + 6, tl.sum(capped.to(tl.float64), axis=0))
    tl.store(row + 7, tl.sum(((old - lp) * vf).to(tl.float64), axis=0))
    tl.store(row + 8, tl.sum(ratio_v.to(tl.float64), axis=0))
    tl.store(row + 9, tl.max(tl.where(inb, ratio_v.to(tl.float64), -float("inf")), axis=0))
    tl.store(row + 10, tl.sum(kl.to(tl.float64), axis=0))
    tl.store(row + 11, tl.sum(w_raw.to(tl.float64), axis=0))
    tl.store(row + 12, tl.max(tl.where(inb, w_raw.to(tl.float64), -float("inf")), axis=0))
    tl.store(row + 13, tl.sum(modified.to(tl.float64), axis=0))


@triton.jit
def _finalize_kernel(
    part_ptr,  # [n_parts, NSTAT] fp64 partial statistics
    loss_ptr,  # 0-d out (compute dtype)
    stats_ptr,  # [NUM_STATS] out (compute dtype)
    n_parts,
    kl_coef,
    HAS_REF: tl.constexpr,
    NUM_STATS: tl.constexpr,
    NSTAT: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partial rows per loop step
):
    cols = tl.arange(0, NSTAT)
    is_max = (cols == 9) | (cols == 12)  # ratio_max, is_max: every other slot is a sum
    acc_sum = tl.zeros([NSTAT], tl.float64)
    acc_max = tl.full([NSTAT], -float("inf"), tl.float64)
    for start in range(0, n_parts, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        in_rows = rows[:, None] < n_parts
        x = tl.load(part_ptr + rows[:, None].to(tl.int64) * NSTAT + cols[None, :], mask=in_rows, other=0.0)
        acc_sum += tl.sum(x, axis=0)
        acc_max = tl.maximum(acc_max, tl.max(tl.where(in_rows, x, -float("inf")), axis=0))
    res = tl.where(is_max, acc_max, acc_sum)
    loss = tl.sum(tl.where(cols == 0, res, 0.0), axis=0)
    if HAS_REF:
        loss += kl_coef * tl.sum(tl.where(cols == 1, res, 0.0), axis=0)
    tl.store(loss_ptr, loss)
    tl.store(stats_ptr + cols, res, mask=cols < NUM_STATS)


_KL_ESTIMATORS = {"k1": 0, "k2": 1, "k3": 2}
_KL_CLAMPS = {"log-ratio": 0, "output": 1, "none": 2}
_IS_MODES = {"none": 0, "tis": 1, "icepop": 2}


def ppo_forward(logp, tok, aggregation, opts, need_grad):
    """Same contract as ppo_loss._torch_forward: (loss 0-d, stats [14] sums/maxima, grad [N] or None)."""
    from .ppo_loss import _STATS

    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    dev = logp.device
    n = logp.numel()
    loss = torch.empty((), dtype=cdt, device=dev)
    stats = torch.empty(len(_STATS), dtype=cdt, device=dev)
    grad = torch.empty(n, dtype=cdt, device=dev) if need_grad else None
    if n == 0:
        return loss.zero_(), stats.zero_(), grad
    flat = lambda t: t.reshape(-1).contiguous()
    lp, old, adv = flat(logp), flat(tok["old"]), flat(tok["adv"])
    valid = flat(tok["valid"]).view(torch.uint8)
    ref = flat(tok["ref"]) if opts.has_ref else lp  # placeholders are never read
    isw = flat(tok["isw"]) if opts.has_is else lp
    weight = flat(aggregation.weight) if aggregation.weight is not None else lp
    denom = aggregation.denom
    if denom is None:
        denom = valid.sum()  # token-mean of this call: one count on the device, no host sync
    from_ptr = torch.is_tensor(denom)
    block = _BLOCK_GPU if lp.is_cuda else _BLOCK_INTERPRETER
    programs = triton.cdiv(n, block)
    partials = torch.empty(programs, _NSTAT, dtype=torch.float64, device=dev)
    lo, hi = opts.is_bounds
    with torch.cuda.device(dev) if lp.is_cuda else contextlib.nullcontext():
        _token_kernel[(programs,)](
            lp, old, adv, valid, ref, isw, weight, denom if from_ptr else lp,
            grad if need_grad else lp, partials,
            n, 0.0 if from_ptr else 1.0 / denom,
            1.0 - opts.eps_low, 1.0 + opts.eps_high, float(opts.dual_clip or 0.0), opts.kl_coef,
            opts.kl_clamp_value, float(lo), float(hi),
            CDT=tl.float64 if cdt == torch.float64 else tl.float32,
            HAS_REF=opts.has_ref, HAS_IS=opts.has_is, HAS_WEIGHT=aggregation.weight is not None,
            DENOM_FROM_PTR=from_ptr, DUAL=opts.dual_clip is not None,
            KL_EST=_KL_ESTIMATORS[opts.kl_estimator], KL_CLAMP=_KL_CLAMPS[opts.kl_clamp],
            IS_MODE=_IS_MODES[opts.is_mode], NEED_GRAD=need_grad,
            BLOCK=block, NSTAT=_NSTAT, num_warps=4,
        )  # fmt: skip
        _finalize_kernel[(1,)](
            partials, loss, stats, programs, opts.kl_coef,
            HAS_REF=opts.has_ref, NUM_STATS=len(_STATS), NSTAT=_NSTAT,
            BLOCK_P=128 if lp.is_cuda else 2, num_warps=4,
        )  # fmt: skip
    return loss, stats, grad
