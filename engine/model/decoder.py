"""One decoder for the Llama / Qwen2 / Qwen3 family, on packed sequences.

Plain math, no parallelism code (engine/parallel.py shards it; FP8 is a converter). Module and
parameter names mirror the Hugging Face ones below the `model.` prefix
(`layers.3.self_attn.q_proj.weight`), so loading and saving are a prefix change and `fully_shard`
can wrap each `Block`.

Sequences are packed: `input_ids [N]` holds all tokens back to back and `cu_seqlens [B+1]` the
offsets, so no compute is spent on padding. `forward` returns the final-normed hidden states; the LM
head belongs to the loss (`prorl.kernels.linear_logprob_entropy(hidden, model.lm_head_weight,
...)`), which never materialises [N, V] logits. `logits()` exists for evaluation and tests.

Precision: RMSNorm statistics and RoPE are computed in fp32 and cast back, as `transformers` does
for norms (it applies RoPE in the activation dtype; fp32 here is at least as accurate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionContext, get_attention_backend, make_context
from .config import ModelConfig
from .rope import apply_rope, rope_cos_sin


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in fp32, the product in the input
    dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention with optional qkv/o bias and q/k RMSNorm (Qwen3), RoPE, varlen
    backends."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, D] -> q [N, Hq, hd], k [N, Hkv, hd] (normed if Qwen3, rotated), v [N, Hkv, hd]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, attn: AttentionBackend, ctx: AttentionContext) -> torch.Tensor:
        """x [N, D], cos/sin [N, head_dim] fp32 -> [N, D]."""
        q, k, v = self.qkv(x, cos, sin)
        # shared prefix: each sequence's keys gathered (backward sums them)
        if ctx.kv_index is not None:
            k, v = k.index_select(0, ctx.kv_index), v.index_select(0, ctx.kv_index)
        out = attn(q, k, v, ctx, self.head_dim**-0.5)  # [N, Hq, hd]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder returning final-normed hidden states.

    Build on any device, including `meta` (then `to_empty` + `init_weights`, or `load_hf`).
    `attention` is a backend name (`sdpa`, `flex`, `flash`), an `AttentionBackend`, or None for the
    default of the device the input lives on.
    """

    def __init__(self, cfg: ModelConfig, attention: str | AttentionBackend | None = None):
        super().__init__()
        self.config = cfg
        self.attention = attention
        self._backends: dict[str, AttentionBackend] = {}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [V, D]: the embedding when tied, else `lm_head.weight`."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits [..., V] in the weight dtype (evaluation and tests; training
        uses the fused loss ops on `lm_head_weight`)."""
        return F.linear(hidden, self.lm_head_weight)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random init like `transformers`: normal(0, initializer_range) weights, zero biases, unit
        norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def attention_backend(
        self, device: torch.device, dtype: torch.dtype | None = None
    ) -> AttentionBackend:
        """The backend for compute on `device` in `dtype` (the default depends on both: flash-attn
        only for fp16/bf16); `dtype` None: the embedding's, which under FSDP mixed precision is the
        compute dtype while a forward runs."""
        if isinstance(self.attention, AttentionBackend):
            return self.attention
        dtype = dtype or self.embed_tokens.weight.dtype
        key = f"{self.attention}/{device.type}/{dtype}"
        if key not in self._backends:
            self._backends[key] = get_attention_backend(self.attention, device, dtype)
        return self._backends[key]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        kv_index: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        Packed (training): input_ids [N] int64, cu_seqlens [B+1] int32 (None: one sequence),
        position_ids [N] (None: 0, 1, ... restarting at each sequence start) -> [N, D].
        Padded (convenience): input_ids [B, T], attention_mask [B, T] (1 = token, 0 = padding;
        None = all tokens) -> [B, T, D], zeros at padding. Each row's tokens are packed in order
        and, unless position_ids [B, T] is given, numbered from 0 as `generate` does.
        max_seqlen (max_seqlen_k: of the keys, shared prefix): longest sequence, if the caller
        knows it (saves flash-attn a host sync).
        Shared prefix (packed only): `cu_seqlens_k` [B+1] and `kv_index` [Nk] give each sequence of
        `cu_seqlens` its keys, gathered from all tokens' keys (see engine/attention.py,
        `shared_prefix_layout`, which also gives the position_ids this needs).
        """
        if input_ids.dim() == 2:
            return self._forward_padded(input_ids, attention_mask, position_ids)
        if attention_mask is not None:
            raise ValueError(
                "attention_mask is only for padded [B, T] input; packed input uses cu_seqlens"
            )
        n = input_ids.shape[0]
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=input_ids.device)
        if position_ids is None:
            if cu_seqlens_k is not None:
                raise ValueError(
                    "a shared-prefix layout needs its position_ids (shared_prefix_layout)"
                )
            position_ids = packed_position_ids(cu_seqlens, n)

        attn = self.attention_backend(input_ids.device)
        context = make_context(
            n, cu_seqlens, max_seqlen, cu_seqlens_k=cu_seqlens_k, kv_index=kv_index,
            max_seqlen_k=max_seqlen_k,
        )  # fmt: skip
        ctx = attn.prepare(context)
        cos, sin = rope_cos_sin(self.config, position_ids, cu_seqlens)  # [N, head_dim] fp32

        x = self.embed_tokens(input_ids)  # [N, D]
        for layer in self.layers:
            x = layer(x, cos, sin, attn, ctx)
        return self.norm(x)

    def _forward_padded(self, input_ids, attention_mask, position_ids):
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        keep = attention_mask.bool()  # [B, T]
        lengths = keep.sum(1)
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [B+1]
        packed_pos = position_ids[keep] if position_ids is not None else None
        hidden = self.forward(input_ids[keep], packed_pos, cu_seqlens)  # [N, D]
        out = hidden.new_zeros(b, t, hidden.shape[-1])
        out[keep] = hidden
        return out


def packed_position_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Positions 0..len-1 of every packed sequence: cu_seqlens [B+1] -> [N] int64 (no host sync)."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device)
    # [N] sequence of each token
    seq = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
    return tokens - cu_seqlens.long()[seq]
