"""Triton backend of `ppo_loss` (the math is in ppo_loss.py's docstring, the statistics slots and
option codes in _ppo_common.py).

Forward, ONE launch (`_forward_kernel`, one program per BLOCK tokens):
    1. every program computes its tokens' loss terms and closed-form gradient dloss/dlogp (written
       out), reduces its share of every statistic in fp64 and writes it to row `pid` of a [programs,
       NSTAT] partials workspace (torch.empty: no zeroing launch);
    2. then it increments a completion counter with an acq_rel atomic (after a barrier, so the whole
       row is written first); the program that sees `programs - 1` is the last to finish;
    3. the last program sums (and maxes) ALL partial rows in row order 0, 1, 2, ... — a fixed order,
       so the result does not depend on which program finishes last or on scheduling (deterministic)
       — writes the loss and the statistics vector, and resets the counter to 0 for the next call.
    The host never waits: nothing is read back, no count is taken on the host.
Token-mean without a normaliser divides by this call's valid-token count, which is known only in
step 3: the kernel then writes the UNSCALED gradient u_t g_t and the last program writes 1 / count
to a 0-d `grad_scale`; the backward applies it. With a normaliser (a number, or a 0-d tensor read
in-kernel) the gradient is written scaled and `grad_scale` is None. Backward, ONE launch
(`_backward_kernel`): stored gradient x upstream gradient (x grad_scale), cast to logp's dtype in
the same pass.

The completion counter is an int32 on the device, created zeroed once per (device, stream) and left
at 0 by every launch, so concurrent calls on different streams do not share one. (A launch that dies
midway would leave it non-zero; CUDA cannot continue after such a fault anyway.)

Memory ordering: a barrier, then an acq_rel atomic, then volatile loads of the other programs'
partials in the last program — the pattern of Triton's fused layer-norm backward tutorial. On an
H200 the results of 5 repeats of a 4,096-sequence call were bitwise equal
(tests/gpu/test_cuda_paths.py); under the interpreter (tests/kernels/test_ppo_loss_triton.py)
programs run one after another, which exercises the counter, the last-program branch, the
fixed-order reduction and the reset, but not concurrency.

Per-token inputs are loaded with `mask=valid`, `other=0`: a masked token's values (NaN included)
never enter the arithmetic. Math in fp32 (fp64 for fp64 logp); the sums in fp64. The options that
change the code (KL estimator, clamp, IS mode, dual clip, which optional inputs exist) are
constexprs; the numbers are runtime.

Imported only when the triton backend is selected (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._ppo_common import STATS

__all__ = ["ppo_backward", "ppo_forward"]

# Tokens per program on a GPU: 1024 fp32 = 8 per thread with 4 warps, a row of partials per 4 KiB of
# logp. Not tuned.
_BLOCK_GPU = 1024
# Under the interpreter small blocks make the tiny test batches span several programs (exercising
# the partial sums, the completion counter and the masked last block).
_BLOCK_INTERPRETER = 32
_NSTAT = 16  # partials row width: the 14 statistics of _ppo_common.STATS, padded to a power of two

# How the aggregation denominator D reaches the kernel.
_DENOM_HOST, _DENOM_PTR, _DENOM_COUNT = 0, 1, 2


@triton.jit
def _forward_kernel(
    logp_ptr,  # [N] current log-probs (any float dtype)
    old_ptr,  # [N] old log-probs
    adv_ptr,  # [N] advantages, or [N / ADV_ROW_LEN] (one per padded row) if ADV_ROW_LEN > 0
    valid_ptr,  # [N] uint8, nonzero on valid tokens
    ref_ptr,  # [N] reference log-probs (read only if HAS_REF)
    isw_ptr,  # [N] importance weights (read only if HAS_IS)
    weight_ptr,  # [N] aggregation weight u_t (read only if HAS_WEIGHT)
    denom_ptr,  # 0-d D (read only if DENOM_MODE == 1; a value <= 0 reads as 1)
    # [N] out: dloss/dlogp (DENOM_MODE 2: without the 1/D) in the compute dtype (if NEED_GRAD)
    grad_ptr,
    part_ptr,  # [programs, NSTAT] fp64 workspace: each program's sums and maxima
    counter_ptr,  # int32, 0 on entry: programs finished; the last one resets it to 0
    loss_ptr,  # 0-d out (compute dtype)
    # [NUM_STATS] out (compute dtype); [2, NUM_STATS] if MEANS: row 1 = row 0 / valid tokens
    stats_ptr,
    scale_ptr,  # 0-d out: 1 / max(valid tokens, 1) (written only if DENOM_MODE == 2)
    n,
    adv_row_len,  # T of a padded batch with per-row advantages (read only if ADV_PER_ROW)
    inv_denom,  # 1 / D when D is a host number (DENOM_MODE 0)
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
    ADV_PER_ROW: tl.constexpr,
    # 0 host number, 1 0-d tensor, 2 this call's valid-token count (deferred)
    DENOM_MODE: tl.constexpr,
    DUAL: tl.constexpr,
    KL_EST: tl.constexpr,  # 0 k1, 1 k2, 2 k3
    KL_CLAMP: tl.constexpr,  # 0 log-ratio, 1 output, 2 none
    IS_MODE: tl.constexpr,  # 0 as given, 1 tis, 2 icepop
    NEED_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    NSTAT: tl.constexpr,
    NUM_STATS: tl.constexpr,
    MEANS: tl.constexpr,  # also write the per-token means the metrics report (saves two launches)
    BLOCK_P: tl.constexpr,  # partial rows per step of the final reduction
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    v = (tl.load(valid_ptr + offs, mask=inb, other=0) != 0) & inb
    vf = v.to(CDT)
    lp = tl.load(logp_ptr + offs, mask=v, other=0.0).to(CDT)
    old = tl.load(old_ptr + offs, mask=v, other=0.0).to(CDT)
    if ADV_PER_ROW:
        a = tl.load(adv_ptr + offs // adv_row_len, mask=v, other=0.0).to(CDT)
    else:
        a = tl.load(adv_ptr + offs, mask=v, other=0.0).to(CDT)
    s = vf  # s_t = m_t u_t / D (DENOM_MODE 2: m_t u_t, the 1/D comes at the end)
    if HAS_WEIGHT:
        s = tl.load(weight_ptr + offs, mask=v, other=0.0).to(CDT)
    if DENOM_MODE == 0:
        s = s * inv_denom
    if DENOM_MODE == 1:
        d = tl.load(denom_ptr).to(CDT)
        s = s / tl.where(d > 0, d, 1.0)

    log_ratio = lp - old
    ratio_ok = tl.abs(log_ratio) <= 20.0  # RATIO_LOG_CLAMP
    ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -20.0), 20.0))
    unclipped = -a * ratio
    clipped = -a * tl.minimum(tl.maximum(ratio, lo), hi)
    pg = tl.maximum(unclipped, clipped)
    # tl.maximum / tl.minimum return the non-NaN operand: a NaN log-prob or advantage at a valid
    # token gives a NaN loss (as in torch), and a NaN gradient below
    is_nan = (lp - old + a) != (lp - old + a)
    pg = tl.where(is_nan, lp - old + a, pg)
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
        g = tl.where(is_nan, lp - old + a, g)  # NaN at a valid token reaches the gradient too
        tl.store(grad_ptr + offs, tl.where(v, s * g, 0.0), mask=inb)

    # 1. This block's statistics, summed in fp64, in the slot order of _ppo_common.STATS.
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

    # 2. Count this program as finished; the whole row is written before (barrier, then release).
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")

    # 3. The last program to finish reduces every row in a fixed order.
    if done == tl.num_programs(0) - 1:
        n_parts = tl.num_programs(0)
        cols = tl.arange(0, NSTAT)
        is_max = (cols == 9) | (cols == 12)  # ratio_max, is_max: every other slot is a sum
        acc_sum = tl.zeros([NSTAT], tl.float64)
        acc_max = tl.full([NSTAT], -float("inf"), tl.float64)
        for start in range(0, n_parts, BLOCK_P):
            rows = start + tl.arange(0, BLOCK_P)
            in_rows = rows[:, None] < n_parts
            ptrs = part_ptr + rows[:, None].to(tl.int64) * NSTAT + cols[None, :]
            # the row's padding slots are never written
            used = in_rows & (cols[None, :] < NUM_STATS)
            # other programs' rows: not from L1
            x = tl.load(ptrs, mask=used, other=0.0, volatile=True)
            acc_sum += tl.sum(x, axis=0)
            acc_max = tl.maximum(acc_max, tl.max(tl.where(in_rows, x, -float("inf")), axis=0))
        res = tl.where(is_max, acc_max, acc_sum)
        # 1 / valid tokens
        inv = 1.0 / tl.maximum(tl.sum(tl.where(cols == 2, res, 0.0), axis=0), 1.0)
        # token-mean of this call: divide the two aggregated sums by the count now
        if DENOM_MODE == 2:
            res = tl.where((cols == 0) | (cols == 1), res * inv, res)
            tl.store(scale_ptr, inv)
        loss = tl.sum(tl.where(cols == 0, res, 0.0), axis=0)
        if HAS_REF:
            loss += kl_coef * tl.sum(tl.where(cols == 1, res, 0.0), axis=0)
        tl.store(loss_ptr, loss)
        tl.store(stats_ptr + cols, res, mask=cols < NUM_STATS)
        if MEANS:
            tl.store(stats_ptr + NUM_STATS + cols, res * inv, mask=cols < NUM_STATS)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch on this stream


@triton.jit
def _backward_kernel(
    grad_ptr,  # [N] stored gradient (compute dtype)
    g_out_ptr,  # 0-d upstream gradient of the loss
    scale_ptr,  # 0-d grad_scale (read only if HAS_SCALE)
    out_ptr,  # [N] out: dloss/dlogp in logp's dtype
    n,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    g = tl.load(grad_ptr + offs, mask=inb, other=0.0)
    c = tl.load(g_out_ptr).to(g.dtype)
    if HAS_SCALE:
        c = c * tl.load(scale_ptr).to(g.dtype)
    tl.store(out_ptr + offs, g * c, mask=inb)  # the store casts to logp's dtype


_counters: dict[tuple, torch.Tensor] = {}


def _counter(dev: torch.device) -> torch.Tensor:
    """The completion counter of (device, current stream): zeroed once, left at 0 by every
    launch."""
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (str(dev), stream)
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = torch.zeros(1, dtype=torch.int32, device=dev)
    return counter


def _device_ctx(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def ppo_forward(logp, tok, aggregation, opts, need_grad, with_means=False):
    """Same contract as ppo_loss._torch_forward: (loss 0-d, stats [14] sums/maxima, grad [N] or
    None, grad_scale 0-d or None), dloss/dlogp = grad * grad_scale (grad alone when grad_scale is
    None). with_means: stats is [2, 14], row 1 = row 0 / max(valid tokens, 1) (the means the metrics
    report)."""
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    dev = logp.device
    n = logp.numel()
    loss = torch.empty((), dtype=cdt, device=dev)
    stats = torch.empty((2, len(STATS)) if with_means else len(STATS), dtype=cdt, device=dev)
    grad = torch.empty(n, dtype=cdt, device=dev) if need_grad else None
    if n == 0:
        return loss.zero_(), stats.zero_(), grad, None
    flat = lambda t: t.reshape(-1).contiguous()
    lp, old, adv = flat(logp), flat(tok["old"]), flat(tok["adv"])
    valid = flat(tok["valid"]).view(torch.uint8)
    ref = flat(tok["ref"]) if opts.has_ref else lp  # placeholders are never read
    isw = flat(tok["isw"]) if opts.has_is else lp
    weight = flat(aggregation.weight) if aggregation.weight is not None else lp
    denom = aggregation.denom
    if denom is None:
        # token-mean of this call: counted in the kernel, applied in the backward
        mode = _DENOM_COUNT
    else:
        mode = _DENOM_PTR if torch.is_tensor(denom) else _DENOM_HOST
    grad_scale = torch.empty((), dtype=cdt, device=dev) if mode == _DENOM_COUNT else None
    block = _BLOCK_GPU if lp.is_cuda else _BLOCK_INTERPRETER
    programs = triton.cdiv(n, block)
    partials = torch.empty(programs, _NSTAT, dtype=torch.float64, device=dev)
    lo, hi = opts.is_bounds
    with _device_ctx(lp):
        _forward_kernel[(programs,)](
            lp, old, adv, valid, ref, isw, weight, denom if mode == _DENOM_PTR else lp,
            grad if need_grad else lp, partials, _counter(dev), loss, stats,
            grad_scale if grad_scale is not None else loss,
            n, tok["adv_row_len"], 1.0 / denom if mode == _DENOM_HOST else 0.0,
            1.0 - opts.eps_low, 1.0 + opts.eps_high, float(opts.dual_clip or 0.0), opts.kl_coef,
            opts.kl_clamp_value, float(lo), float(hi),
            CDT=tl.float64 if cdt == torch.float64 else tl.float32,
            HAS_REF=opts.has_ref, HAS_IS=opts.has_is, HAS_WEIGHT=aggregation.weight is not None,
            ADV_PER_ROW=tok["adv_row_len"] > 0, DENOM_MODE=mode, DUAL=opts.dual_clip is not None,
            KL_EST=opts.kl_estimator_code, KL_CLAMP=opts.kl_clamp_code,
            IS_MODE=opts.is_mode_code, NEED_GRAD=need_grad,
            BLOCK=block, NSTAT=_NSTAT, NUM_STATS=len(STATS), MEANS=with_means,
            BLOCK_P=128 if lp.is_cuda else 2, num_warps=4,
        )  # fmt: skip
    return loss, stats, grad, (grad_scale if need_grad else None)


def ppo_backward(grad, g_loss, grad_scale, dtype):
    """dloss/dlogp [N] in `dtype`: grad * g_loss (* grad_scale), one launch."""
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    n = grad.numel()
    if n == 0:
        return out
    block = _BLOCK_GPU if grad.is_cuda else _BLOCK_INTERPRETER
    # a no-op for autograd's 0-d upstream gradient
    g_loss = g_loss.to(device=grad.device).reshape(())
    with _device_ctx(grad):
        _backward_kernel[(triton.cdiv(n, block),)](
            grad, g_loss, grad_scale if grad_scale is not None else g_loss, out, n,
            HAS_SCALE=grad_scale is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
