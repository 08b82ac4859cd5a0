"""Causal attention over packed (varlen) sequences, behind one small interface.

Every backend takes q [N, Hq, d], k/v [N, Hkv, d] (tokens of all sequences concatenated, GQA heads not
repeated) and an `AttentionContext` built once per forward from `cu_seqlens`, and returns [N, Hq, d].
Tokens attend only to earlier tokens of their own sequence. The context carries separate q and k
boundaries (the flash-attn varlen convention) so that a KV-cache decode step (rollout) can later pass
cached keys without a new signature; today every backend requires them to be the same.

Backends (`get_attention_backend(name)`):
- `sdpa`  : `F.scaled_dot_product_attention(is_causal=True)` once per sequence. Runs anywhere. Measured on
            this CPU (1 thread, 14/2 heads, d=64, fwd+bwd): 8x256 tokens 204 ms vs 1553 ms for one call
            with an [N, N] block-diagonal mask; 32x64 tokens 75 ms vs 1413 ms; [1500, 300, 200, 48]
            481 ms vs 1495 ms - the mask pays for all N^2 pairs. The loop needs the lengths on the host
            (one sync per forward) and is excluded from torch.compile graphs.
- `flex`  : FlexAttention with a document-causal BlockMask, no host sync. Compiled by default (the
            eager fallback materialises all N^2 scores; it is what the CPU tests use, `compile=False`).
            On this CPU torch 2.13 compiles it in 25-40 s cold. On the CPU torch 2.13 has no FlexAttention
            backward ("does not support backward on CPU"): there it serves evaluation/rollout only.
- `flash` : flash-attn 2 `flash_attn_varlen_func` (CUDA, fp16/bf16), from the `[gpu]` extra.
Default: `flash` on CUDA when flash-attn is importable, else `sdpa`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class AttentionContext:
    """Sequence boundaries shared by every layer of one forward.

    num_tokens: N, the number of packed query tokens.
    cu_seqlens_q/k: [B+1] int32 offsets of each sequence in the packed q / k tensors.
    max_seqlen_q/k: longest sequence (host ints, needed by flash-attn; None = computed when needed).
    extra: per-backend data built by `prepare` (host lengths, a BlockMask, ...).
    """

    num_tokens: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class AttentionBackend:
    """Interface: `prepare(ctx)` once per forward, then `__call__(q, k, v, ctx, scale)` per layer."""

    name = "base"

    def prepare(self, ctx: AttentionContext) -> AttentionContext:
        return ctx

    def __call__(self, q, k, v, ctx: AttentionContext, scale: float) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _self_attention_only(ctx: AttentionContext) -> None:
        if ctx.cu_seqlens_k is not ctx.cu_seqlens_q:
            raise NotImplementedError("separate key boundaries (KV cache) are not implemented yet")


class SDPAAttention(AttentionBackend):
    """One `scaled_dot_product_attention(is_causal=True)` call per sequence (see the module docstring)."""

    name = "sdpa"

    def prepare(self, ctx):
        self._self_attention_only(ctx)
        ctx.extra["lengths"] = ctx.cu_seqlens_q.diff().tolist()  # host sync, once per forward
        return ctx

    @torch.compiler.disable  # data-dependent split sizes would recompile for every batch
    def __call__(self, q, k, v, ctx, scale):
        lengths = ctx.extra["lengths"]
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, d]
        outs = [
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            for qs, ks, vs in zip(q4.split(lengths, 2), k4.split(lengths, 2), v4.split(lengths, 2))
        ]
        return torch.cat(outs, dim=2)[0].transpose(0, 1)  # [N, Hq, d]


class FlexAttention(AttentionBackend):
    """FlexAttention with document masking: token i sees token j iff same sequence and j <= i."""

    name = "flex"

    def __init__(self, compile: bool = True):
        from torch.nn.attention.flex_attention import flex_attention

        self.compile = compile
        self._fn = torch.compile(flex_attention) if compile else flex_attention

    def prepare(self, ctx):
        from torch.nn.attention.flex_attention import create_block_mask

        self._self_attention_only(ctx)
        n, cu = ctx.num_tokens, ctx.cu_seqlens_q
        tokens = torch.arange(n, device=cu.device, dtype=cu.dtype)
        doc = torch.searchsorted(cu[1:], tokens, right=True)  # [N] sequence index of each token

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        ctx.extra["block_mask"] = create_block_mask(document_causal, None, None, n, n, device=cu.device)
        return ctx

    def __call__(self, q, k, v, ctx, scale):
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, d]
        with warnings.catch_warnings():  # eager was asked for; torch warns that it is unfused
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = self._fn(q4, k4, v4, block_mask=ctx.extra["block_mask"], scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)  # [N, Hq, d]


class FlashAttention(AttentionBackend):
    """flash-attn 2 varlen kernel (CUDA, fp16/bf16); GQA is handled by the kernel."""

    name = "flash"

    def __init__(self):
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as exc:
            raise ImportError(
                "attention backend 'flash' needs the flash-attn package (CUDA only): "
                "pip install 'prorl[gpu]' (or pip install flash-attn --no-build-isolation); "
                "use attention='sdpa' or 'flex' otherwise"
            ) from exc
        self._fn = flash_attn_varlen_func

    def prepare(self, ctx):
        if ctx.max_seqlen_q is None:
            ctx.max_seqlen_q = int(ctx.cu_seqlens_q.diff().max())  # host sync
        if ctx.max_seqlen_k is None:
            ctx.max_seqlen_k = int(ctx.cu_seqlens_k.diff().max())
        return ctx

    def __call__(self, q, k, v, ctx, scale):
        return self._fn(
            q,
            k,
            v,
            ctx.cu_seqlens_q,
            ctx.cu_seqlens_k,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
        )


BACKENDS = {"sdpa": SDPAAttention, "flex": FlexAttention, "flash": FlashAttention}


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend_name(device: torch.device | str) -> str:
    """`flash` on CUDA when flash-attn is installed, otherwise `sdpa`."""
    if torch.device(device).type == "cuda" and flash_attn_available():
        return "flash"
    return "sdpa"


def get_attention_backend(name: str | AttentionBackend | None, device: torch.device | str = "cpu"):
    """A backend instance from its name (`sdpa`, `flex`, `flash`), None (the default for `device`), or
    an instance (returned as is)."""
    if isinstance(name, AttentionBackend):
        return name
    name = name or default_backend_name(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]()


def make_context(
    num_tokens: int, cu_seqlens: torch.Tensor, max_seqlen: int | None = None
) -> AttentionContext:
    """Self-attention context for `num_tokens` packed tokens split by [B+1] offsets `cu_seqlens`."""
    cu_seqlens = cu_seqlens.to(torch.int32)
    return AttentionContext(num_tokens, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
