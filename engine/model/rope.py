"""Rotary position embeddings and the scaling variants Llama / Qwen configs use.

Each variant only changes the inverse frequencies (and, for YaRN, a scale on cos/sin); the formulas
follow `transformers.modeling_rope_utils` so that logits match it. The frequencies are recomputed in
fp32 on each forward from the config (head_dim/2 numbers, negligible work) instead of living in a
buffer: nothing to re-initialise after building the model on the meta device, and `model.to(bf16)`
cannot round them.

Supported: default, linear, dynamic (NTK), llama3, yarn. `dynamic` is per sequence here: a sequence
longer than `max_position_embeddings` gets the base grown for its own length (max position + 1),
which is what `transformers` computes for that sequence run alone. `transformers` instead uses the
longest sequence of the whole batch, and caches grown frequencies across calls; both would make a
sequence's logits depend on what else is packed with it (and on call history), which an RL loss
comparing logprobs cannot afford.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_inv_freq(
    cfg: ModelConfig, device: torch.device | None, seq_len: torch.Tensor | None = None
):
    """Inverse frequencies and cos/sin scale for `cfg.rope`.

    Args:
        seq_len: `dynamic` only: [N] int, the length (max position + 1) of each token's sequence.
    Returns:
        (inv_freq fp32 [head_dim // 2], or [N, head_dim // 2] for `dynamic` with seq_len;
        attention_scaling).
    """
    rope, dim = cfg.rope, cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [dim/2]
    base = rope.theta
    kind = rope.rope_type
    if kind == "default":
        return 1.0 / (base**exponents), 1.0
    if kind == "linear":
        return 1.0 / (base**exponents) / rope.factor, 1.0
    if kind == "dynamic":
        if seq_len is None:
            return 1.0 / (base**exponents), 1.0
        n = seq_len.double().clamp(min=cfg.max_position_embeddings)[:, None]  # [N, 1]
        grown = base * ((rope.factor * n / cfg.max_position_embeddings) - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
        # base rounded to fp32 first, as transformers does
        return 1.0 / (grown.float() ** exponents), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(1.0 / (base**exponents), rope), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(base**exponents, dim, rope)
    raise ValueError(f"unsupported RoPE type {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp in
    between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, rope) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, extrapolate high ones, a linear ramp
    between."""
    factor, base, original = rope.factor, rope.theta, rope.original_max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low)
    ).clamp(0, 1)
    extrapolation = 1 - ramp  # [dim/2] weight of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def sequence_lengths(position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] length (max position + 1) of the sequence each packed token belongs to; no host sync."""
    n, num_seqs = position_ids.shape[0], cu_seqlens.shape[0] - 1
    seq = torch.searchsorted(
        cu_seqlens[1:].long(), torch.arange(n, device=position_ids.device), right=True
    )
    longest = torch.zeros(num_seqs, dtype=torch.long, device=position_ids.device)
    longest = longest.scatter_reduce(0, seq, position_ids.long(), "amax", include_self=False)  # [B]
    return longest[seq] + 1


def rope_cos_sin(cfg: ModelConfig, position_ids: torch.Tensor, cu_seqlens: torch.Tensor):
    """cos/sin tables for packed tokens.

    Args:
        position_ids: [N] integer. cu_seqlens: [B+1] (used by `dynamic` only).
    Returns:
        cos, sin: [N, head_dim] fp32, the two halves repeated (the `rotate_half` layout HF
            checkpoints use).
    """
    seq_len = (
        sequence_lengths(position_ids, cu_seqlens) if cfg.rope.rope_type == "dynamic" else None
    )
    inv_freq, scaling = rope_inv_freq(cfg, position_ids.device, seq_len)
    freqs = position_ids.float()[:, None] * inv_freq  # [N, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, head_dim] by cos/sin [N, head_dim] (fp32); computed in fp32, returned in
    x.dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)
