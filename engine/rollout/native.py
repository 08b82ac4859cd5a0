"""A batched KV-cache sampler on prorl's own decoder (CPU and CUDA), in the manner of gpt-fast.

One `generate` call:
1. prefill: every distinct prompt once, packed (no padding), through the decoder's own layers; each
   layer's keys/values are written to a preallocated cache [rows, S_max, Hkv, hd] and copied to the n
   rows that sample from that prompt;
2. decode: one token per active row per step. Rows that sampled a stop token leave the work: when fewer
   than half the cache rows are active, the cache is compacted to the active rows;
3. sampling: logits in fp32, / temperature, top-k / top-p, then inverse-CDF sampling with one uniform per
   row drawn from a counter-based hash of (seed, prompt index, sample index, position): the same tokens
   whatever the batch composition, resumable, and without a generator per row.

Attention in decode is SDPA over the cache with a per-row length mask (GQA heads via enable_gqa). The
decode step is a plain function of tensors and can be wrapped by torch.compile (`compile=True`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import make_context
from ..model.decoder import Decoder
from ..model.rope import rope_cos_sin
from .base import Generator, Rollouts, Sample, SamplingParams

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values < 2^32; no overflow:
    both multipliers are < 2^31."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seed: int, prompt_index, sample_index, position) -> torch.Tensor:
    """Uniform [0, 1) float64 per row from the counters (int64 tensors of one shape)."""
    h = _mix32(torch.full_like(prompt_index, seed & _MASK32))
    h = _mix32(h ^ (prompt_index & _MASK32))
    h = _mix32(h ^ (sample_index & _MASK32))
    h1 = _mix32(h ^ (position & _MASK32))
    h2 = _mix32(h1 ^ 0x5BD1E995)
    return (h1.double() + h2.double() / 2**32) / 2**32


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor):
    """logits [B, V] fp32 -> (tokens [B] int64, logprobs [B] fp32 under softmax(logits / T))."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    z = logits / params.temperature
    logprobs = torch.log_softmax(z, -1)
    probs = logprobs.exp()
    if params.top_k > 0 or params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if params.top_k > 0:
            keep[:, params.top_k :] = False
        if params.top_p < 1.0:
            keep &= (sorted_p.cumsum(-1) - sorted_p) < params.top_p  # the smallest prefix with mass >= p
        sorted_p = sorted_p * keep
    else:
        sorted_p, order = probs, None
    cdf = sorted_p.double().cumsum(-1)  # [B, V]
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    # never land on a zero-probability entry (target == cdf exactly at the end of a run of zeros)
    tokens = (order.gather(1, idx) if order is not None else idx).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


class NativeGenerator(Generator):
    """Samples from a `Decoder` (the trained model itself, or a copy kept for inference).

    Args:
        model: the decoder. The generator holds a reference; `update_weights` copies new values into its
            parameters in place (no reallocation), so a colocated trainer that samples from the very
            model it trains needs no update at all.
        compile: wrap the decode step with torch.compile.
    """

    def __init__(self, model: Decoder, compile: bool = False):
        self.model = model
        self._decode = torch.compile(self._decode_step, dynamic=True) if compile else self._decode_step

    @torch.no_grad()
    def update_weights(self, named_tensors) -> None:
        params = dict(self.model.named_parameters())
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        for name, value in items:
            if name not in params:
                raise KeyError(f"update_weights: the model has no parameter {name!r}")
            params[name].copy_(value)

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> Rollouts:
        model, cfg = self.model, self.model.config
        device = model.embed_tokens.weight.device
        if not prompt_token_ids or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("generate: every prompt needs at least one token")
        num_prompts, n = len(prompt_token_ids), params.n
        rows = num_prompts * n
        lengths = torch.tensor([len(p) for p in prompt_token_ids], device=device)
        s_max = int(lengths.max()) + params.max_new_tokens
        dtype = model.embed_tokens.weight.dtype
        cache_shape = (rows, s_max, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: masked-out slots still enter SDPA's products, and garbage there can be NaN
        k_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in model.layers]
        v_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in model.layers]

        # 1. prefill the distinct prompts, packed; copy each prompt's K/V to its n rows
        flat = torch.tensor([t for p in prompt_token_ids for t in p], device=device)
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        hidden = self._prefill(flat, cu, lengths, n, k_cache, v_cache)  # [N, D] final-normed
        last = hidden[cu[1:].long() - 1]  # [P, D] hidden of each prompt's last token
        logits = model.logits(last).float().repeat_interleave(n, 0)  # [rows, V]

        prompt_idx = torch.arange(num_prompts, device=device).repeat_interleave(n)  # [rows]
        sample_idx = torch.arange(n, device=device).repeat(num_prompts)
        pos = lengths.repeat_interleave(n)  # [rows] position of the next token
        active = torch.arange(rows, device=device)  # original row id of each live row
        cache_rows = torch.arange(rows, device=device)  # its row in the (possibly compacted) cache
        out_tokens = torch.zeros(rows, params.max_new_tokens, dtype=torch.long, device=device)
        out_logps = torch.zeros(rows, params.max_new_tokens, dtype=torch.float32, device=device)
        out_len = torch.zeros(rows, dtype=torch.long, device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        stop_ids = torch.tensor(params.stop_token_ids or [-1], device=device)

        for t in range(params.max_new_tokens):
            u = counter_uniform(params.seed, prompt_idx[active], sample_idx[active], pos[active])
            tokens, logps = sample_tokens(logits, params, u)
            out_tokens[active, t] = tokens
            out_logps[active, t] = logps
            out_len[active] = t + 1
            done = torch.isin(tokens, stop_ids)
            stopped[active[done]] = True
            keep = ~done
            if t + 1 == params.max_new_tokens or not bool(keep.any()):
                break
            # 2. finished rows leave the work; compact the cache when they are the majority
            live = keep.nonzero().squeeze(1)  # positions in `active`
            if live.numel() < k_cache[0].shape[0] // 2:
                k_cache = [k[cache_rows[live]] for k in k_cache]
                v_cache = [v[cache_rows[live]] for v in v_cache]
                cache_rows = torch.arange(live.numel(), device=device)
            else:
                cache_rows = cache_rows[live]
            active, tokens = active[live], tokens[live]
            logits = self._decode(
                tokens, pos[active], cache_rows, k_cache, v_cache, int(pos[active].max()) + 1
            )
            pos[active] += 1

        # 3. host copies, one per tensor
        toks, lps, lens, stp = out_tokens.tolist(), out_logps.tolist(), out_len.tolist(), stopped.tolist()
        samples = [
            Sample(
                prompt_index=r // n,
                sample_index=r % n,
                token_ids=toks[r][: lens[r]],
                logprobs=lps[r][: lens[r]],
                finish_reason="stop" if stp[r] else "length",
            )
            for r in range(rows)
        ]
        return Rollouts(samples)

    # ---------------------------------------------------------------------------------------------
    def _prefill(self, flat, cu, lengths, n, k_cache, v_cache):
        model = self.model
        positions = torch.cat([torch.arange(int(length), device=flat.device) for length in lengths])
        attn = model.attention_backend(flat.device)
        ctx = attn.prepare(make_context(flat.shape[0], cu, int(lengths.max())))
        cos, sin = rope_cos_sin(model.config, positions, cu)
        row_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=flat.device), lengths)
        x = model.embed_tokens(flat)
        for li, layer in enumerate(model.layers):
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h, cos, sin)  # [N, H, hd], rotated
            for j in range(n):  # the prompt's K/V go to each of its n sample rows
                rows = row_of_token * n + j
                k_cache[li][rows, positions] = k
                v_cache[li][rows, positions] = v
            a = attn(q, k, v, ctx, layer.self_attn.head_dim**-0.5)
            x = x + layer.self_attn.o_proj(a.reshape(a.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)

    def _decode_step(self, tokens, pos, cache_rows, k_cache, v_cache, s_cur: int):
        """One token for each active row: tokens [B], pos [B] -> next logits [B, V] fp32."""
        model = self.model
        b = tokens.shape[0]
        cu = torch.arange(b + 1, dtype=torch.int32, device=tokens.device)
        cos, sin = rope_cos_sin(model.config, pos, cu)
        mask = (torch.arange(s_cur, device=tokens.device)[None, :] <= pos[:, None])[:, None, None, :]
        x = model.embed_tokens(tokens)
        for li, layer in enumerate(model.layers):
            sa = layer.self_attn
            q, k, v = sa.qkv(layer.input_layernorm(x), cos, sin)  # [B, H, hd]
            k_cache[li][cache_rows, pos] = k
            v_cache[li][cache_rows, pos] = v
            keys = k_cache[li][cache_rows, :s_cur].transpose(1, 2)  # [B, Hkv, S, hd]
            vals = v_cache[li][cache_rows, :s_cur].transpose(1, 2)
            a = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, vals, attn_mask=mask, scale=sa.head_dim**-0.5, enable_gqa=True
            )  # [B, Hq, 1, hd]
            x = x + sa.o_proj(a.reshape(b, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.logits(model.norm(x)).float()
