"""Triton tile kernels of `linear_logprob_entropy` (the elementwise half of the chunked plan).

The driver in `linear_logprob_entropy.py` computes each fp32 logits tile x [rows, cols] (columns
c0..c0+cols of the vocabulary) with cuBLAS and hands it to the two functions of `TritonTileOps`:

    update_stats: merge the tile into the running per-row (m, s, b, z_y) of the module docstring,
                  b = sum (z - m) e^(z - m) kept relative to the running max m;
    tile_grad:    overwrite the tile with dL/dx = -(g_lp + g_H (z - E_p[z])) p + g_lp 1[j = y]
                  (g_lp, g_H arrive already multiplied by 1/T and zeroed on ignored rows).

Both kernels run one program per tile row and loop over its columns in BLOCK_V chunks, so a row's
statistics stay in registers and the tile is read once (update_stats) or read and written once
(tile_grad): they are bandwidth-bound passes over the tile, one exp per element. This module is
imported only when the triton backend is selected (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1 in the tests).

Not used, on purpose: `@triton.autotune` (fails in the interpreter without `do_bench=`) and
`tl.make_block_ptr` (removed in triton 3.9); block sizes come from `_launch_config`.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["TritonTileOps", "tile_grad", "update_stats"]

# Widest column block of one program. 4096 fp32 = 16 KiB of registers per program with 8 warps (16
# per thread), the size Liger's cross-entropy uses; not tuned.
_MAX_BLOCK_V_GPU = 4096
# Under the interpreter a small block makes tiny test vocabularies span several blocks (exercising
# the loop and the masked last block); larger blocks would only be faster, not different.
_MAX_BLOCK_V_INTERPRETER = 128


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _update_stats_kernel(
    x_ptr,  # [rows, cols] fp32 raw logits tile (before 1/T)
    labels_ptr,  # [rows] int64 vocabulary ids (ignored rows already replaced by a valid id)
    m_ptr,  # [rows] fp32 running max of z, updated in place
    s_ptr,  # [rows] fp32 running sum e^(z - m), updated in place
    b_ptr,  # [rows] fp32 running sum (z - m) e^(z - m), updated in place
    zy_ptr,  # [rows] fp32 z of the label, written when the label lies in this tile
    n_cols,
    c0,  # vocabulary id of the tile's first column
    inv_t,  # 1 / temperature (fp32)
    stride_xr,
    stride_xc,
    stride_labels,
    stride_m,
    stride_s,
    stride_b,
    stride_zy,
    # columns per loop step: the width of the register vector each program holds
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: rows * stride_xr may exceed 2^31
    x_row = x_ptr + row * stride_xr
    m = tl.load(m_ptr + row * stride_m)
    s = tl.load(s_ptr + row * stride_s)
    b = tl.load(b_ptr + row * stride_b)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        mask = cols < n_cols  # the last block of a tile whose width is not a multiple of BLOCK_V
        z = tl.load(x_row + cols * stride_xc, mask=mask, other=-float("inf")) * inv_t
        new_m = tl.maximum(m, tl.max(z, axis=0))  # finite: every block has at least one real column
        # d = z - m_new <= 0; masked lanes get d = 0 and e = 0, so d * e is 0 there (not -inf * 0 =
        # NaN).
        d = tl.where(mask, z - new_m, 0.0)
        # tl.exp lowers to ex2.approx(d * log2(e)) on NVIDIA GPUs
        e = tl.where(mask, tl.exp(d), 0.0)
        alpha = tl.exp(m - new_m)
        # b is sum (z - m) e^(z - m): re-centre the old sum on the new max before adding this
        # block's.
        b = alpha * (b + (m - new_m) * s) + tl.sum(d * e, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = new_m
    tl.store(m_ptr + row * stride_m, m)
    tl.store(s_ptr + row * stride_s, s)
    tl.store(b_ptr + row * stride_b, b)
    local = tl.load(labels_ptr + row * stride_labels) - c0
    inside = (local >= 0) & (local < n_cols)
    local = tl.where(inside, local, 0)  # keep the (masked-off) address inside the tile
    z_y = tl.load(x_row + local * stride_xc, mask=inside, other=0.0) * inv_t
    tl.store(zy_ptr + row * stride_zy, z_y, mask=inside)


@triton.jit
def _tile_grad_kernel(
    x_ptr,  # [rows, cols] fp32 raw logits tile, overwritten with dL/dx
    labels_ptr,  # [rows] int64 vocabulary ids
    lse_ptr,  # [rows] fp32 log-sum-exp of z
    ez_ptr,  # [rows] fp32 E_p[z]
    g_lp_ptr,  # [rows] fp32 upstream grad of logp, times 1/T, 0 on ignored rows
    g_ent_ptr,  # [rows] fp32 upstream grad of entropy, times 1/T, 0 on ignored rows
    n_cols,
    c0,  # vocabulary id of the tile's first column
    inv_t,  # 1 / temperature (fp32)
    stride_xr,
    stride_xc,
    stride_labels,
    stride_lse,
    stride_ez,
    stride_g_lp,
    stride_g_ent,
    # columns per loop step: the width of the register vector each program holds
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: rows * stride_xr may exceed 2^31
    x_row = x_ptr + row * stride_xr
    lse = tl.load(lse_ptr + row * stride_lse)
    ez = tl.load(ez_ptr + row * stride_ez)
    g_lp = tl.load(g_lp_ptr + row * stride_g_lp)
    g_ent = tl.load(g_ent_ptr + row * stride_g_ent)
    local = tl.load(labels_ptr + row * stride_labels) - c0
    # A row with no upstream gradient (ignored) gets exact zeros; its logits are not even read (the
    # masked load issues no memory traffic), without a branch.
    active = (g_lp != 0.0) | (g_ent != 0.0)
    n_read = tl.where(active, n_cols, 0)  # columns to load: none on an inactive row
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        mask = cols < n_cols
        z = tl.load(x_row + cols * stride_xc, mask=cols < n_read, other=0.0) * inv_t
        p = tl.exp(z - lse)
        # Entropy term with (z - E_p[z]), not (log p + H): no 0 * (-inf) where p underflows.
        g = tl.where(active, -(g_lp + g_ent * (z - ez)) * p, 0.0)
        # + g_lp at the label column (0 + 0 stays 0 when ignored)
        g += tl.where(cols == local, g_lp, 0.0)
        tl.store(x_row + cols * stride_xc, g, mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers (allocate nothing: every output is a caller's tensor updated in place)
# --------------------------------------------------------------------------------------------------


def _launch_config(x: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a tile x [rows, cols]: next power of two of cols, capped."""
    cap = _MAX_BLOCK_V_GPU if x.is_cuda else _MAX_BLOCK_V_INTERPRETER
    block_v = min(triton.next_power_of_2(max(x.shape[1], 1)), cap)
    num_warps = 8 if block_v >= 2048 else 4  # Liger's heuristic for row-wise softmax kernels
    return block_v, num_warps


def _device_guard(x: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tile's.
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _check_tile(
    x: torch.Tensor, labels: torch.Tensor, rows: tuple[torch.Tensor, ...], written: bool
) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(
            f"tile must be a 2-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}"
        )
    if written and any(st <= 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        raise ValueError(f"tile written in place must not overlap itself, got strides {x.stride()}")
    if labels.shape != (x.shape[0],) or labels.dtype != torch.int64:
        raise ValueError(
            f"labels must be int64 [{x.shape[0]}], got {labels.dtype} {tuple(labels.shape)}"
        )
    for t in rows:
        if t.shape != (x.shape[0],) or t.dtype != torch.float32:
            raise ValueError(
                f"row statistics must be float32 [{x.shape[0]}], got {t.dtype} {tuple(t.shape)}"
            )
    if any(t.device != x.device for t in (labels, *rows)):
        raise ValueError("tile, labels and row statistics must be on one device")


def update_stats(x, labels, c0, inv_t, m, s, b, zy, *, block_v: int | None = None) -> None:
    """In place: merge tile x [r, c] fp32 (raw logits of columns c0..c0+c) into (m, s, b, zy) [r]
    fp32.

    x is only read. `block_v` overrides the column block (a power of two; for tests).
    """
    _check_tile(x, labels, (m, s, b, zy), written=False)
    if x.numel() == 0:
        return
    bv, num_warps = _launch_config(x)
    bv = block_v or bv
    with _device_guard(x):
        _update_stats_kernel[(x.shape[0],)](
            x, labels, m, s, b, zy,
            x.shape[1], int(c0), float(inv_t),
            x.stride(0), x.stride(1), labels.stride(0),
            m.stride(0), s.stride(0), b.stride(0), zy.stride(0),
            BLOCK_V=bv, num_warps=num_warps,
        )  # fmt: skip


def tile_grad(x, labels, c0, inv_t, lse, ez, g_lp, g_ent, *, block_v: int | None = None) -> None:
    """In place: x [r, c] fp32 raw logits -> dL/dx = -(g_lp + g_ent (z - ez)) p + g_lp 1[j = label -
    c0].

    lse, ez, g_lp, g_ent: [r] fp32 (g_lp and g_ent already times 1/T). Rows with g_lp == g_ent == 0
    become exact zeros. `block_v` overrides the column block (a power of two; for tests).
    """
    _check_tile(x, labels, (lse, ez, g_lp, g_ent), written=True)
    if x.numel() == 0:
        return
    bv, num_warps = _launch_config(x)
    bv = block_v or bv
    with _device_guard(x):
        _tile_grad_kernel[(x.shape[0],)](
            x, labels, lse, ez, g_lp, g_ent,
            x.shape[1], int(c0), float(inv_t),
            x.stride(0), x.stride(1), labels.stride(0),
            lse.stride(0), ez.stride(0), g_lp.stride(0), g_ent.stride(0),
            BLOCK_V=bv, num_warps=num_warps,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The tile-ops object the chunked driver uses (same signatures and semantics as `_TorchTileOps`)
# --------------------------------------------------------------------------------------------------


class TritonTileOps:
    @staticmethod
    def update_stats(x, labels, c0, inv_t, m, s, b, zy):
        """Merge one tile x [r, c] (raw logits, columns c0..c0+c) into the running (m, s, b,
        z_y)."""
        update_stats(x, labels, c0, inv_t, m, s, b, zy)

    @staticmethod
    def tile_grad(x, labels, c0, inv_t, lse, ez, g_lp, g_ent):
        """In place: x [r, c] raw logits -> dL/dx = (g_lp (1[j=y] - p) - g_ent p (z - E_p[z])) /
        T."""
        tile_grad(x, labels, c0, inv_t, lse, ez, g_lp, g_ent)
