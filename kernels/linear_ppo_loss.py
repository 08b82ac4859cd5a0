"""The PPO-Clip-Higher + KL loss straight from hidden states, fused with the LM head:

    loss, metrics = linear_ppo_loss(hidden [N, D], weight [V, D], labels [N], old_logp, advantages,
                                    mask, ...)

equals `ppo_loss(linear_logprob_entropy(hidden, weight, labels, T)[0], old_logp, advantages, mask,
...)` (optionally minus entropy_coef times the entropy aggregated like the loss), in 6NDV matmul
FLOPs instead of 8.

Why 6 and how. The unfused pair streams the logits once forward (2NDV, for lse) and recomputes them
in backward (2NDV) before the two gradient products dhidden = dZ W and dweight = dZ^T hidden (4NDV):
8NDV. The loss gradient of a token is known in closed form once its logp is (ppo_loss's docstring),
so the backward products could run during the forward, on logits already computed, if a row's logits
were still at hand when its lse is known. That needs the row's logits over the WHOLE vocabulary at
once, so this op keeps the logits of a block of R rows in a workspace [R, V] fp32 and does
everything for that block before the next:

    for each block of R rows:
        Z = H_R W^T                          2 R D V   one GEMM into the workspace
        m, s, b, z_y over the row (T applied)          read-only pass over Z (`update_stats`)
        logp, H, then the ppo_loss backend on the R tokens -> dloss/dlogp (G), block statistics
        Z <- dL/dZ in place                            one pass over Z (tile op `tile_grad`)
        dH_R  = dZ W                         2 R D V   written once
        dW   += dZ^T H_R                     2 R D V   fp32; block 0's GEMM writes it (no zero fill)

6NDV in all, no recompute: the gradients are computed in the forward (as Liger's fused linear cross
entropy does) and kept until backward, which multiplies them by the upstream scalar (in place, so
backward runs once). Designs not taken: streaming lse first and recomputing the logits for the
gradients is 8NDV with a one-tile workspace (that is `linear_logprob_entropy` + `ppo_loss`);
accumulating dH online during the lse pass (as flash attention accumulates P V) still needs a second
logits pass for dW, so it is 8NDV too.

What the bound costs. Workspace: the [R, V] fp32 block (R = chunk_bytes // (4 V); the torch backend
adds a copy and its own temporaries), plus an fp32 dW accumulator when the weight is not fp32 (an
fp32 weight's gradient accumulates in place, never zero-filled), and an fp32 copy of hidden and
weight for bf16/fp16 on the CPU. With several row blocks dW is read and written once per block (8 V
D bytes), which is why R should not be small: the default budget is room for 256 rows on the CPU
(156 MiB at V = 152K; dW traffic ~1/32 of the GEMM time at D = 896 on two cores) and 1 GiB on CUDA.
Elementwise work is O(N V): two passes over each block.

The chunked plan's pieces come from linear_logprob_entropy (`mm_f32` and each backend's `tile_ops`;
the native ones are kernels/csrc/softmax_tiles.h), the per-token loss from ppo_loss's backends
(`FORWARDS`). Layouts, options and metrics are those of `ppo_loss` (kernels/_ppo_common.py), plus
`entropy_mean` (over valid tokens) and `entropy_loss` (entropy aggregated like the loss).
"""

from __future__ import annotations

import torch

from . import _backend
from ._ppo_common import (
    STATS,
    Aggregation,
    PPOOptions,
    aggregation_weights,
    check_aggregation,
    combine_stats,
    flatten_inputs,
    metrics_from_stats,
    token_scale,
)
from .linear_logprob_entropy import mm_f32, tile_ops
from .ppo_loss import FORWARDS

__all__ = ["linear_ppo_loss"]

_DEFAULT_CPU_ROWS = 256


def linear_ppo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
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
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-Clip-Higher + KL loss from hidden states and the LM head, fused (module docstring).

    Args:
        hidden: [N, D] packed or [B, T, D] padded fp32/bf16/fp16 final hidden states;
            differentiable.
        weight: [V, D] LM-head weight, same dtype; differentiable.
        labels: [N] or [B, T] int64 sampled token ids; `ignore_index` rows count as masked.
        old_logp, advantages, mask, ref_logp, is_weights, cu_seqlens, eps_*, dual_clip, kl_*, is_*,
            agg, normalizer: as `ppo_loss`, shaped like labels (advantages also [B], or [S] with
            cu_seqlens). old_logp None: on-policy, old_logp is the current log-prob itself,
            detached (ratio 1; TRL's shortcut when it skips the old log-prob pass).
        temperature: the sampling temperature, applied in fp32 before the log-softmax.
        entropy_coef: subtracts entropy_coef * sum_t s_t H_t (entropy aggregated like the loss;
            verl's entropy_coeff). 0 (default) costs nothing.
        chunk_bytes: budget of the [R, V] fp32 logits workspace; default: 256 rows (CPU), 1 GiB
            (CUDA).
        backend: "native" | "triton" | "torch"; default by device.

    Returns:
        (loss, metrics): 0-d fp32 loss (gradients flow to hidden and weight) and ppo_loss's metrics
        plus entropy_mean and entropy_loss, all detached device tensors, and the per-token `logp`
        and `entropy` (fp32, labels' shape, 0 at ignored labels) that a trainer's own metrics may
        need.
    """
    opts = PPOOptions(
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, has_ref=ref_logp is not None,
        kl_coef=kl_coef, kl_estimator=kl_estimator, kl_clamp=kl_clamp,
        kl_clamp_value=kl_clamp_value, has_is=is_weights is not None, is_mode=is_mode,
        is_bounds=is_bounds,
    )  # fmt: skip
    check_aggregation(agg, normalizer)
    _check_head(hidden, weight, labels, temperature)
    on_policy = old_logp is None
    old_logp = _old_logp(old_logp, labels)
    y = labels.reshape(-1).long()
    keep = _kept_labels(y, ignore_index, weight.shape[0])
    like = {"old_logp": old_logp, "mask": mask, "ref_logp": ref_logp, "is_weights": is_weights}
    tok = flatten_inputs(old_logp, advantages, cu_seqlens, like, need_seq=agg.startswith("seq-"))
    tok["valid"] = tok["valid"] & keep
    aggregation = aggregation_weights(tok, agg, normalizer, torch.float32)
    # a call-local token count, resolved now: every row block needs the total
    if aggregation.denom is None:
        aggregation = Aggregation(aggregation.weight, tok["valid"].sum().to(torch.float32))
    h = hidden.reshape(-1, hidden.shape[-1])
    name = _backend.resolve(h.device, backend)
    if chunk_bytes is None:  # 1 GiB on CUDA, 256 rows of fp32 logits on the CPU
        chunk_bytes = (1 << 30) if h.is_cuda else max(16 << 20, 4 * len(weight) * _DEFAULT_CPU_ROWS)
    safe_y = torch.where(keep, y, torch.zeros_like(y))
    settings = (float(entropy_coef), 1.0 / float(temperature), name, int(chunk_bytes), on_policy)
    loss, stats, ent, tok_logp, tok_ent = _LinearPPOLoss.apply(
        h, weight, safe_y, tok, aggregation, opts, settings
    )
    metrics = metrics_from_stats(stats, opts)
    metrics["entropy_mean"] = ent[1] / stats[STATS.index("n")].clamp_min(1.0)
    metrics["entropy_loss"] = ent[0]
    metrics["logp"] = torch.where(keep, tok_logp, 0.0).view(labels.shape)
    metrics["entropy"] = torch.where(keep, tok_ent, 0.0).view(labels.shape)
    return loss, metrics


def _old_logp(old_logp: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
    """old_logp, checked to be shaped like labels; None (on-policy): a zero placeholder, each row
    block then uses its own detached log-probs (`loss_block`)."""
    if old_logp is None:
        return torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    if old_logp.shape != labels.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)} must have labels' shape {tuple(labels.shape)}"
        )
    return old_logp


def _check_head(hidden, weight, labels, temperature) -> None:
    """hidden [..., D], weight [V, D] of one fp32/bf16/fp16 dtype, labels [...], temperature > 0."""
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            "need hidden [..., D] and weight [V, D], got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match "
            f"hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    if hidden.dtype != weight.dtype or hidden.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        raise TypeError(
            "hidden and weight must share a dtype among "
            f"fp32/bf16/fp16, got {hidden.dtype}, {weight.dtype}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _kept_labels(y, ignore_index: int, vocab: int):
    """[N] bool: the labels that are not ignore_index (on the CPU, checked to lie in [0, V))."""
    keep = y != ignore_index
    if y.device.type == "cpu" and bool(keep.any()):  # cheap here; on CUDA it would be a host sync
        if y[keep].min() < 0 or y[keep].max() >= vocab:
            raise IndexError(
                f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}"
            )
    return keep


class _LinearPPOLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, tok, aggregation, opts, settings):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, stats, ent, logp, entropy, gh, gw = _fused_forward(
            hidden, weight, labels, tok, aggregation, opts, settings, (need_h, need_w)
        )
        ctx.mark_non_differentiable(stats, ent, logp, entropy)
        ctx.save_for_backward(gh, gw)
        ctx.need, ctx.consumed = (need_h, need_w), False
        return loss, stats, ent, logp, entropy

    @staticmethod
    def backward(ctx, g_loss, *_):
        if ctx.consumed:
            raise RuntimeError(
                "linear_ppo_loss: backward runs once (its gradients are scaled in place)"
            )
        ctx.consumed = True
        gh, gw = ctx.saved_tensors
        # computed in the forward: scale by the upstream gradient (skip 1.0 where checking is free)
        if not (g_loss.device.type == "cpu" and float(g_loss) == 1.0):
            gh = gh.mul_(g_loss.to(gh.dtype)) if ctx.need[0] else gh
            gw = gw.mul_(g_loss.to(gw.dtype)) if ctx.need[1] else gw
        return (
            (gh if ctx.need[0] else None),
            (gw if ctx.need[1] else None),
            None,
            None,
            None,
            None,
            None,
        )


def _mm_into(out, a, b):
    """out [M, N] fp32 = a @ b: fp32 operands straight into `out`; bf16/fp16 CUDA ones multiply
    natively."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        torch.mm(a, b, out=out)
        return
    try:
        torch.mm(a, b, out_dtype=torch.float32, out=out)  # CUDA, torch >= 2.8 (bf16 ran on an H200)
    except (RuntimeError, TypeError):
        out.copy_(mm_f32(a, b))


def _fused_forward(hidden, weight, labels, tok, aggregation, opts, settings, need):
    """loss, stats, (entropy_loss, entropy_sum), per-token logp and entropy [N], dloss/dhidden,
    dloss/dweight: see the module docstring. need = (dloss/dhidden needed, dloss/dweight needed)."""
    run = _FusedRun(hidden, weight, settings, need)
    for r0 in range(0, run.n, run.rows):
        r1 = min(run.n, r0 + run.rows)
        y = labels[r0:r1]
        x, lse, ez, logp, entropy = run.logits_block(r0, r1, y)
        g_lp, scale = run.loss_block(r0, r1, (logp, entropy), tok, aggregation, opts)
        if run.need_grad:
            run.grad_block(r0, r1, (x, y, lse, ez), g_lp, scale)
    return run.results()


class _FusedRun:
    """The state of one fused forward: the precision plan, the [R, V] fp32 logits workspace, and the
    loss, statistics, per-token outputs and gradients accumulated block by block."""

    def __init__(self, hidden, weight, settings, need):
        self.entropy_coef, self.inv_t, self.backend, chunk_bytes, self.on_policy = settings
        self.need_h, self.need_w = need
        self.need_grad = self.need_h or self.need_w
        self.hidden_dtype, self.weight_dtype = hidden.dtype, weight.dtype
        n, d = hidden.shape
        v = weight.shape[0]
        self.n, self.v = n, v
        f32 = self.f32 = dict(dtype=torch.float32, device=hidden.device)
        self.ops = tile_ops(self.backend)
        # its update_stats overwrites the tile: a copy
        self.copy_before_stats = self.backend == "torch"
        self.low_cuda = low_cuda = hidden.is_cuda and hidden.dtype != torch.float32
        # fp32 on the CPU: GEMMs into fp32 buffers
        self.h_all = hidden if low_cuda else hidden.float()
        self.w_all = weight if low_cuda else weight.float()
        self.rows = max(1, min(n, chunk_bytes // (4 * v)))
        self.loss = torch.zeros((), **f32)
        self.stats = torch.zeros(len(STATS), **f32)
        self.ent = torch.zeros(2, **f32)  # sum_t s_t H_t, sum over valid tokens of H_t
        self.tok_logp, self.tok_ent = torch.empty(n, **f32), torch.empty(n, **f32)
        self.gh = (
            torch.empty(n, d, dtype=hidden.dtype, device=hidden.device) if self.need_h else None
        )
        # fp32 dW: the first row block's GEMM writes it (beta = 0) and the others add to it, so it
        # is never zero-filled (a [V, D] fill is ~3% of the op at D = 896); low-precision CUDA
        # accumulates.
        self.gw_written = not low_cuda and n > 0
        gw = torch.empty(v, d, **f32) if self.gw_written else torch.zeros(v, d, **f32)
        self.gw = gw if self.need_w else None
        # low-precision CUDA dW: [w_cols, D] at a time
        self.w_cols = max(256, chunk_bytes // (4 * d))
        self.buf = torch.empty(self.rows * v, **f32)
        low_h = self.need_h and hidden.dtype != torch.float32
        self.gh_rows = torch.empty(self.rows, d, **f32) if low_h else None

    def logits_block(self, r0: int, r1: int, y):
        """The block's logits [R, V] fp32 (before 1/T) in the workspace, and per row lse, the
        expected logit, logp and entropy."""
        nr, f32 = r1 - r0, self.f32
        x = self.buf[: nr * self.v].view(nr, self.v)
        _mm_into(x, self.h_all[r0:r1], self.w_all.t())
        m = torch.full((nr,), -3.0e38, **f32)
        s, b, zy = torch.zeros(nr, **f32), torch.zeros(nr, **f32), torch.zeros(nr, **f32)
        self.ops.update_stats(
            x.clone() if self.copy_before_stats else x, y, 0, self.inv_t, m, s, b, zy
        )
        log_s = torch.log(s)
        lse, ez = m + log_s, m + b / s
        logp, entropy = zy - lse, log_s - b / s
        self.tok_logp[r0:r1], self.tok_ent[r0:r1] = logp, entropy
        return x, lse, ez, logp, entropy

    def loss_block(self, r0: int, r1: int, per_token, tok, aggregation, opts):
        """The ppo_loss backend on the block's tokens: adds its loss, entropy terms and statistics;
        returns dloss/dlogp [R] and the entropy's aggregation weights (None without
        entropy_coef)."""
        logp, entropy = per_token
        part = {
            k: (t[r0:r1] if torch.is_tensor(t) and k != "padded_shape" else t)
            for k, t in tok.items()
        }
        if self.on_policy:
            part["old"] = logp
        part["padded_shape"] = None  # rows of the block are tokens; the aggregation weights are set
        weights = aggregation.weight[r0:r1] if aggregation.weight is not None else None
        block_agg = Aggregation(weights, aggregation.denom)
        forward = FORWARDS[self.backend]
        block_loss, block_stats, g_lp, g_scale = forward(
            logp, part, block_agg, opts, self.need_grad
        )
        if g_scale is not None:  # not reached: the denominator is always resolved above
            g_lp = g_lp * g_scale
        coef = self.entropy_coef
        scale = token_scale(part, block_agg, torch.float32) if coef != 0.0 else None
        ent_terms = torch.stack(
            [
                (scale * entropy).sum() if scale is not None else self.loss.new_zeros(()),
                torch.where(part["valid"], entropy, 0.0).sum(),
            ]
        )
        self.ent += ent_terms
        self.loss += block_loss if scale is None else block_loss - coef * ent_terms[0]
        self.stats = combine_stats(self.stats, block_stats)
        return g_lp, scale

    def grad_block(self, r0: int, r1: int, block, g_lp, scale) -> None:
        """dL/dZ in the workspace, then the block's dH rows and its share of dW."""
        x, y, lse, ez = block
        inv_t = self.inv_t
        g_ent = (
            (-self.entropy_coef * inv_t) * scale if scale is not None else torch.zeros_like(g_lp)
        )
        g = (g_lp * inv_t).contiguous()
        self.ops.tile_grad(x, y, 0, inv_t, lse, ez, g, g_ent.contiguous())  # x <- dL/dx
        dx = x.to(self.hidden_dtype) if self.low_cuda else x  # [R, V]
        h = self.h_all[r0:r1]
        if self.need_h:
            out = self.gh[r0:r1] if self.gh_rows is None else self.gh_rows[: r1 - r0]
            _mm_into(out, dx, self.w_all)
            if self.gh_rows is not None:
                self.gh[r0:r1].copy_(out)
        if self.need_w and self.gw_written and r0 == 0:
            torch.mm(dx.t(), h, out=self.gw)
        elif self.need_w and self.gw_written:
            self.gw.addmm_(dx.t(), h)
        # bf16/fp16 products, fp32 results, added tile by tile (bf16 ran on an H200)
        elif self.need_w:
            for c0 in range(0, self.v, self.w_cols):
                self.gw[c0 : c0 + self.w_cols] += mm_f32(dx[:, c0 : c0 + self.w_cols].t(), h)

    def results(self):
        gw = self.gw.to(self.weight_dtype) if self.gw is not None else None
        empty = torch.empty(0, **self.f32)
        gh = self.gh if self.need_h else empty
        gw = gw if self.need_w else empty
        return self.loss, self.stats, self.ent, self.tok_logp, self.tok_ent, gh, gw
