"""Per-token log-probabilities and entropies straight from hidden states and the LM-head weight.

    logp, entropy = linear_logprob_entropy(hidden [N, D], weight [V, D], labels [N], temperature=T)

is what an RL trainer needs from the LM head: log p(label) and the entropy H of the
temperature-scaled distribution z = (hidden @ weight.T) / temperature, without materialising the [N,
V] logits. The op streams over tiles of z, keeping per row in fp32 (docs/ops.md):

    m = max z,   s = sum e^(z - m),   b = sum (z - m) e^(z - m),   z_y
    lse = m + log s,   logp = z_y - lse,   H = log s - b / s,   E_p[z] = m + b / s

(b is kept relative to the running max so that H = log s - b/s never subtracts two large numbers).
It saves lse and E_p[z] for backward, which recomputes each tile of z and forms

    dL/dz = g_lp * (1[j = y] - p) - g_H * p * (z - E_p[z])

with separate upstream gradients for logp (g_lp) and entropy (g_H); the entropy term is written with
(z - E_p[z]) rather than (log p + H), which would give 0 * (-inf) = NaN where p underflows. Then
dhidden = dL/dz @ W / T and dW = (dL/dz)^T @ hidden / T. FLOPs: 2NDV forward, 6NDV backward.

Backends (see `_backend.py`): `native` (C++/OpenMP, CPU), `triton` (CUDA), `torch` (chunked,
anywhere). All use the same chunked plan: the matmuls go to the vendor BLAS (MKL / cuBLAS) tile by
tile, in fp32 (bf16/fp16 inputs on CUDA multiply in their own dtype with fp32 output), and the
backend's own kernel does the exponentials and reductions on each tile.

Memory: besides inputs, outputs and gradients, the workspace is one tile of z of at most
`chunk_bytes` (default 16 MiB on CPU, 1 GiB on CUDA; rows are split too when N alone would exceed
it), plus O(N) statistics, an fp32 [N, D] gradient accumulator and an fp32 copy of one [Vc, D]
weight tile: bounded independently of N x V.
"""

from __future__ import annotations

import torch

from . import _backend
from .reference import linear_logprob_entropy_reference

__all__ = ["linear_logprob_entropy", "linear_logprob_entropy_reference"]

_MIN_TILE_COLS = 256


# --------------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------------


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = True,
    *,
    backend: str | None = None,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `labels` and entropy under softmax(hidden @ weight.T / temperature), fused.

    Args:
        hidden: [..., D] fp32/bf16/fp16 hidden states (the final norm's output).
        weight: [V, D] LM-head weight, same dtype as `hidden`.
        labels: [...] int64 next-token ids; rows equal to `ignore_index` give 0 and get 0 gradient.
            Under sequence packing the caller builds labels per sequence (the last token of a packed
            sequence has no target: give it `ignore_index`).
        temperature: the sampling temperature; applied in fp32, before the log-softmax and entropy.
        return_entropy: if False the second output is None.
        backend: "native" | "triton" | "torch"; default by device (see `_backend.resolve`).
        chunk_bytes: workspace budget for one tile of logits (see module docstring).

    Returns:
        (logp, entropy): fp32 tensors of shape labels.shape. Differentiable w.r.t. hidden and
        weight; backward takes upstream gradients for both outputs.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden [..., {hidden.shape[-1]}] and weight [V, {weight.shape[-1]}] disagree on D"
        )
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, D], got shape {tuple(weight.shape)}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match "
            f"hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"unsupported dtype {hidden.dtype}; use float32, bfloat16 or float16")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).long()
    if h.device.type == "cpu" and y.numel():  # cheap here; on CUDA it would be a host sync
        valid = y != ignore_index
        if valid.any() and (y[valid].min() < 0 or y[valid].max() >= weight.shape[0]):
            raise IndexError(
                f"labels must lie in [0, {weight.shape[0]}) or equal ignore_index={ignore_index}"
            )
    name = _backend.resolve(h.device, backend)
    if chunk_bytes is None:
        chunk_bytes = (1 << 30) if h.is_cuda else (16 << 20)
    logp, ent = _LinearLogprobEntropy.apply(
        h, weight, y, float(temperature), int(ignore_index), name, int(chunk_bytes)
    )
    return logp.view(lead), (ent.view(lead) if return_entropy else None)


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, ignore_index, backend, chunk_bytes):
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        inv_t = 1.0 / temperature
        if backend == "native":
            logp, ent, lse, ez = torch.ops.prorl.lle_forward(
                hidden, weight, safe_labels, inv_t, chunk_bytes
            )
        else:
            logp, ent, lse, ez = _chunked_forward(
                hidden, weight, safe_labels, inv_t, chunk_bytes, tile_ops(backend)
            )
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logp = torch.where(valid, logp, zero)
        ent = torch.where(valid, ent, zero)
        ctx.save_for_backward(hidden, weight, safe_labels, valid, lse, ez)
        ctx.inv_t, ctx.backend, ctx.chunk_bytes = inv_t, backend, chunk_bytes
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, valid, lse, ez = ctx.saved_tensors
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        g_lp = zero.expand(labels.shape) if g_lp is None else g_lp
        g_ent = zero.expand(labels.shape) if g_ent is None else g_ent
        # Ignored rows contribute nothing; multiplying by 1/T here saves a pass over each tile.
        g_lp = torch.where(valid, g_lp.float(), zero).mul_(ctx.inv_t).contiguous()
        g_ent = torch.where(valid, g_ent.float(), zero).mul_(ctx.inv_t).contiguous()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.backend == "native":
            gh, gw = torch.ops.prorl.lle_backward(
                hidden,
                weight,
                labels,
                lse,
                ez,
                g_lp,
                g_ent,
                ctx.inv_t,
                ctx.chunk_bytes,
                need_h,
                need_w,
            )
        else:
            plan = (ctx.inv_t, ctx.chunk_bytes, tile_ops(ctx.backend))
            gh, gw = _chunked_backward(
                hidden, weight, labels, (lse, ez), (g_lp, g_ent), plan, (need_h, need_w)
            )
        return (gh if need_h else None), (gw if need_w else None), None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# The chunked plan shared by the torch and triton backends (the native backend is the same in C++)
# --------------------------------------------------------------------------------------------------


def tile_shape(n_rows: int, n_cols: int, chunk_bytes: int) -> tuple[int, int]:
    """Rows and columns of one fp32 logits tile within `chunk_bytes` (at least 1 x min(V, 256))."""
    min_cols = min(n_cols, _MIN_TILE_COLS)
    rows = max(1, min(n_rows, chunk_bytes // (4 * min_cols)))
    cols = max(min_cols, min(n_cols, chunk_bytes // (4 * rows)))
    return rows, cols


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[K, N] with an fp32 result; low-precision CUDA inputs multiply natively (fp32
    out)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return torch.mm(a.float(), b.float())


def _chunked_forward(hidden, weight, labels, inv_t, chunk_bytes, ops):
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    m = torch.full((n,), -3.0e38, dtype=torch.float32, device=dev)
    s = torch.zeros(n, dtype=torch.float32, device=dev)
    b = torch.zeros(n, dtype=torch.float32, device=dev)
    zy = torch.zeros(n, dtype=torch.float32, device=dev)
    if n == 0:
        return zy, zy.clone(), zy.clone(), zy.clone()
    low_cuda = hidden.is_cuda and hidden.dtype != torch.float32
    h_all = hidden if low_cuda else hidden.float()
    rows, cols = tile_shape(n, v, chunk_bytes)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        h = h_all[r0:r1]
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            x = mm_f32(h, weight[c0:c1].t())  # [rows, cols] fp32 logits tile (before 1/T)
            ops.update_stats(x, labels[r0:r1], c0, inv_t, m[r0:r1], s[r0:r1], b[r0:r1], zy[r0:r1])
    log_s = torch.log(s)
    lse = m + log_s
    logp = zy - lse
    ent = log_s - b / s
    ez = m + b / s
    return logp, ent, lse, ez


def _chunked_backward(hidden, weight, labels, row_stats, grads, plan, need):
    """dloss/dhidden and dloss/dweight, tile by tile. row_stats = (lse, ez) [N] from the forward;
    grads = (g_lp, g_ent) [N], already multiplied by 1/T and zeroed on ignored rows; plan = (inv_t,
    chunk_bytes, tile ops); need = (dhidden needed, dweight needed)."""
    (lse, ez), (g_lp, g_ent), (inv_t, chunk_bytes, ops), (need_h, need_w) = (
        row_stats,
        grads,
        plan,
        need,
    )
    n, v = hidden.shape[0], weight.shape[0]
    low_cuda = hidden.is_cuda and hidden.dtype != torch.float32
    h_all = hidden if low_cuda else hidden.float()
    gh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    rows, cols = tile_shape(max(n, 1), v, chunk_bytes)
    one_pass = rows >= n  # each dW tile is then written exactly once: no fp32 accumulator needed
    if need_w:
        gw = (
            torch.empty_like(weight)
            if one_pass
            else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        )
        if n == 0:
            gw.zero_()
    else:
        gw = None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        h = h_all[r0:r1]
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            w = weight[c0:c1]
            x = mm_f32(h, w.t())
            # in place: x becomes dL/dx for this tile, [rows, cols] fp32
            ops.tile_grad(
                x, labels[r0:r1], c0, inv_t, lse[r0:r1], ez[r0:r1], g_lp[r0:r1], g_ent[r0:r1]
            )
            dx = x.to(hidden.dtype) if low_cuda else x
            if need_h:
                gh[r0:r1] += mm_f32(dx, w if low_cuda else w.float())
            if need_w:
                gw_tile = mm_f32(dx.t(), h)
                if one_pass:
                    gw[c0:c1].copy_(gw_tile)
                else:
                    gw[c0:c1] += gw_tile
    if gh is not None:
        gh = gh.to(hidden.dtype)
    if gw is not None:
        gw = gw.to(weight.dtype)
    return gh, gw


# --------------------------------------------------------------------------------------------------
# Tile ops: the elementwise half of the chunked plan, one object per backend with the same two
# functions
# --------------------------------------------------------------------------------------------------


class _TorchTileOps:
    @staticmethod
    def update_stats(x, labels, c0, inv_t, m, s, b, zy):
        """Merge one tile x [r, c] (raw logits, columns c0..c0+c) into the running (m, s, b,
        z_y)."""
        z = x.mul_(inv_t)
        tile_m = z.amax(dim=1)
        new_m = torch.maximum(m, tile_m)
        z.sub_(new_m[:, None])  # z - m_new (<= 0)
        e = torch.exp(z)
        alpha = torch.exp(m - new_m)
        # b is sum (z - m) e^(z - m): re-centre the old sum on the new max before adding the tile's.
        b.mul_(alpha).add_((m - new_m) * s * alpha).add_((z * e).sum(dim=1))
        s.mul_(alpha).add_(e.sum(dim=1))
        local = labels - c0
        inside = (local >= 0) & (local < x.shape[1])
        picked = z.gather(1, local.clamp(0, x.shape[1] - 1)[:, None]).squeeze(1) + new_m
        zy.copy_(torch.where(inside, picked, zy))
        m.copy_(new_m)

    @staticmethod
    def tile_grad(x, labels, c0, inv_t, lse, ez, g_lp, g_ent):
        """In place: x [r, c] raw logits -> dL/dx = (g_lp (1[j=y] - p) - g_ent p (z - E_p[z])) /
        T."""
        z = x.mul_(inv_t)
        p = torch.exp(z - lse[:, None])
        # -(g_lp + g_ent (z - Ez)) * p, then + g_lp at the label column
        z.sub_(ez[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
        local = labels - c0
        inside = (local >= 0) & (local < x.shape[1])
        idx = local.clamp(0, x.shape[1] - 1)[:, None]
        z.scatter_add_(1, idx, torch.where(inside, g_lp, torch.zeros_like(g_lp))[:, None])


class _NativeTileOps:
    """The tile ops of softmax_tiles.h, for linear_ppo_loss's native backend (this op's native
    backend runs its whole chunked plan in C++)."""

    @staticmethod
    def update_stats(x, labels, c0, inv_t, m, s, b, zy):
        torch.ops.prorl.tile_update_stats(x, labels, c0, inv_t, m, s, b, zy)

    @staticmethod
    def tile_grad(x, labels, c0, inv_t, lse, ez, g_lp, g_ent):
        torch.ops.prorl.tile_grad(x, labels, c0, inv_t, lse, ez, g_lp, g_ent)


def tile_ops(backend: str):
    """The tile ops of `backend`: update_stats(x, labels, c0, inv_t, m, s, b, zy) merges a
    raw-logits tile into the running row statistics (the torch one overwrites x, the others only
    read it), tile_grad(x, labels, c0, inv_t, lse, ez, g_lp, g_ent) overwrites it with dL/dx."""
    if backend == "torch":
        return _TorchTileOps
    if backend == "native":
        return _NativeTileOps
    if backend == "triton":
        from . import linear_logprob_entropy_triton

        return linear_logprob_entropy_triton.TritonTileOps
    raise ValueError(f"backend {backend!r} has no tile ops")
