"""CUDA's rules for `torch._scaled_mm`, enforced on the CPU (whose kernel takes any shape, layout).

torch 2.13's CPU `_scaled_mm` is a reference kernel that multiplies whatever it is given; CUDA's
checks (`_scaled_mm_out_cuda` and `_scaled_gemm` in aten/src/ATen/native/cuda/ScaledBlas.cpp,
formerly Blas.cpp) refuse many calls the CPU runs, so a CPU test of an FP8 path proves nothing about
a GPU run unless these rules are applied. `checked_scaled_mm` raises where CUDA raises, with CUDA's
message, then calls the real CPU kernel:

- shapes: mat1 and mat2 2-D with matching inner dims; "Expected trailing dimension of mat1 to be
  divisible by 16" and "mat2 shape (K x N) must be divisible by 16" (both dims). In torchao's
  backward the weight-gradient GEMM `grad_out.t() @ input` has the TOKEN COUNT as its inner dim, so
  a packed batch of 50 tokens trains on the CPU and fails on the GPU;
- layout: "Only multiplication of row-major and column-major matrices is supported by cuBLASLt" -
  mat1 row-major, mat2 column-major (torchao's `preprocess_addmm` arranges both);
- dtypes: both operands float8; "Multiplication of two Float8_e5m2 matrices is not supported" (CUDA,
  cuBLASLt's restriction; e4m3 x e5m2 is allowed - torchao's tensorwise gradients use it);
- scales (`get_joint_scaling`, "Invalid scaling configuration"): tensorwise - both float32 with one
  element; rowwise - float32, scale_a [M, 1] and scale_b [1, N], both contiguous; the block-wise
  schemes (MX, DeepSeek 128x128) are not modelled here and raise;
- scale_result a float32 scalar; bias of N elements, bf16 or fp16, not with a float32 output;
  rowwise output bf16, fp16 or fp32 (the CUTLASS path's rule);
- every tensor on one device.

torchao 0.18 (`torchao/float8/float8_ops.py`, `addmm_float8_unwrapped`) calls `torch._scaled_mm` by
attribute at each call, so replacing the attribute reaches every FP8 GEMM of a converted model; its
`emulate=True` path never calls it. Use `patch(monkeypatch)` in a test (the FP8 tests do, autouse)
or `install()` in a spawned worker process, which the test's monkeypatch does not reach.
"""

from __future__ import annotations

import torch

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# the kernel the checks wrap (also when this module is imported again after `install`)
_ORIGINAL = getattr(torch._scaled_mm, "unchecked", torch._scaled_mm)


class CudaRuleError(RuntimeError):
    """A `_scaled_mm` call CUDA would refuse (the message is CUDA's)."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise CudaRuleError(message)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(t.size(1), 1)


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= max(t.size(0), 1)


def _scaling(mat1, mat2, scale_a, scale_b) -> str:
    """ "tensorwise" | "rowwise", as `get_joint_scaling` picks it; else CUDA's configuration
    error."""
    f32 = scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    if f32 and scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    m, n = mat1.size(0), mat2.size(1)
    if (
        f32
        and scale_a.dim() == 2
        and tuple(scale_a.shape) == (m, 1)
        and scale_a.is_contiguous()
        and scale_b.dim() == 2
        and tuple(scale_b.shape) == (1, n)
        and scale_b.t().is_contiguous()
    ):
        return "rowwise"
    raise CudaRuleError(
        "Invalid scaling configuration (CUDA "
        "_scaled_mm): TensorWise needs float32 singleton scales, "
        f"RowWise float32 scale_a ({m}, 1) and scale_b (1, {n}), both contiguous; got scale_a "
        f"{scale_a.dtype} {tuple(scale_a.shape)}, scale_b {scale_b.dtype} {tuple(scale_b.shape)}"
    )


def check(
    mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """Raise CudaRuleError where CUDA's `_scaled_mm` would refuse these arguments (module
    docstring)."""
    _check(mat1.dim() == 2, "mat1 must be a matrix")
    _check(mat2.dim() == 2, "mat2 must be a matrix")
    k1, k2 = mat1.size(1), mat2.size(0)
    _check(
        k1 == k2,
        f"mat1 and mat2 shapes cannot be multiplied ({mat1.size(0)}x{k1} and {k2}x{mat2.size(1)})",
    )
    scaling = _scaling(mat1, mat2, scale_a, scale_b)
    _check(
        scale_result is None or (scale_result.numel() == 1 and scale_result.dtype == torch.float32),
        "scale_result must be a float scalar",
    )
    n = mat2.size(1)
    _check(
        bias is None or bias.numel() == n,
        f"Bias must be size {n} but got {None if bias is None else bias.numel()}",
    )
    _check(
        k1 % 16 == 0,
        "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
        f"({mat1.size(0)}x{k1}).",
    )
    _check(k2 % 16 == 0 and n % 16 == 0, f"mat2 shape ({k2}x{n}) must be divisible by 16")
    _check(mat1.dtype in FLOAT8, f"Expected mat1 to be Float8 matrix got {mat1.dtype}")
    _check(mat2.dtype in FLOAT8, f"Expected mat2 to be Float8 matrix got {mat2.dtype}")
    _check(
        not (mat1.dtype == torch.float8_e5m2 and mat2.dtype == torch.float8_e5m2),
        "Multiplication of two Float8_e5m2 matrices is not supported",
    )
    out = out_dtype or mat1.dtype
    if bias is not None:
        _check(out != torch.float32, "Bias is not supported when out_dtype is set to Float32")
        _check(
            bias.dtype in (torch.bfloat16, torch.float16),
            f"Bias must be BFloat16 or Half, but got {bias.dtype}",
        )
    if scaling == "rowwise":
        _check(
            out in (torch.bfloat16, torch.float16, torch.float32),
            "Only bf16, fp16, and fp32 high precision "
            "output types are supported for row-wise scaling.",
        )
    tensors = [t for t in (mat1, mat2, scale_a, scale_b, bias, scale_result) if t is not None]
    _check(len({t.device for t in tensors}) == 1, "Expected all tensors to be on the same device")
    _check(
        _row_major(mat1) and _col_major(mat2),
        "Only multiplication of row-major and column-major matrices is supported by cuBLASLt",
    )


def checked_scaled_mm(
    mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """`torch._scaled_mm` that first applies CUDA's checks (`check`), then runs the CPU kernel."""
    check(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
    return _ORIGINAL(
        mat1,
        mat2,
        scale_a,
        scale_b,
        bias=bias,
        scale_result=scale_result,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )


checked_scaled_mm.unchecked = _ORIGINAL


def patch(monkeypatch) -> None:
    """Enforce CUDA's rules for the rest of this test (pytest's monkeypatch undoes it)."""
    monkeypatch.setattr(torch, "_scaled_mm", checked_scaled_mm)


def install() -> None:
    """Enforce CUDA's rules in this process for good (a spawned test worker)."""
    torch._scaled_mm = checked_scaled_mm
