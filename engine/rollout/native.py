"""A batched KV-cache sampler on prorl's own decoder (CPU and CUDA), in the manner of gpt-fast.

One `generate` call:
1. prefill: every distinct prompt once, packed (no padding), through the decoder's own layers; each
   layer's keys/values are written to a preallocated cache [rows, Hkv, S_max, hd] (one row per
   sample; a prompt's K/V go to its n rows);
2. decode: one token per cache row per step, all rows at once (static shapes between compactions).
   Row r writes its step-t token at its own position len_r + t, so prompts of different lengths need
   no padding recomputed; an additive -inf bias [rows, S_max], opened one slot per step, hides the
   unwritten slots. Rows that sampled a stop token leave the work: once at most 3/4 of the cache
   rows are live, the cache (and every per-row tensor) is compacted to the live rows;
3. sampling: logits in fp32, / temperature, top-k / top-p, then inverse-CDF sampling with one
   uniform per row drawn from a counter-based hash of (seed, prompt index, sample index, position):
   the same tokens whatever the batch composition, resumable, and without a generator per row. The
   uniforms of the whole call are hashed up front (one [rows, max_new_tokens] table) and RoPE
   cos/sin come from one table of positions, so a step runs no setup work.

Attention in decode is two batched matmuls over a view of the cache (q grouped [rows, Hkv, G, hd]
for GQA, softmax in fp32): no copy of the cache per step. Measured on this 2-core CPU (1 thread,
tiny checkpoint, B=64), the cache gather and SDPA's flash kernel for one query took 53% of the old
decode step; see benchmarks/rollout.py for the numbers against `transformers.generate`.

The decode step is a plain function of tensors and can be wrapped by torch.compile (`compile=True`,
dynamic shapes: one compile serves every batch size, attended length and compaction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import make_context
from ..model.decoder import Decoder
from ..model.rope import apply_rope, rope_cos_sin
from .base import Generator, Rollouts, Sample, SamplingParams, host_available_bytes

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values < 2^32; no
    overflow: both multipliers are < 2^31."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seed: int, prompt_index, sample_index, position) -> torch.Tensor:
    """Uniform [0, 1) float64 per element from the counters (int64 tensors that broadcast
    together)."""
    prompt_index, sample_index, position = torch.broadcast_tensors(
        prompt_index, sample_index, position
    )
    h = _mix32(torch.full_like(prompt_index, seed & _MASK32))
    h = _mix32(h ^ (prompt_index & _MASK32))
    h = _mix32(h ^ (sample_index & _MASK32))
    h1 = _mix32(h ^ (position & _MASK32))
    h2 = _mix32(h1 ^ 0x5BD1E995)
    return (h1.double() + h2.double() / 2**32) / 2**32


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor):
    """logits [B, V] fp32 -> (tokens [B] int64, logprobs [B] fp32 under softmax(logits / T)).

    The draw: the token whose interval of the (truncated, unnormalised) float64 CDF holds uniform x
    total. Top-k uses `topk` (k entries sorted), top-p alone a full sort; neither is paid when not
    requested.
    """
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(-1)
    z = logits if params.temperature == 1 else logits / params.temperature
    m = z.amax(-1, keepdim=True)
    e = (z - m).exp_()  # [B, V] unnormalised probabilities, the largest 1
    total = e.sum(-1, dtype=torch.float64)  # [B]
    order = None
    if params.top_k > 0 or params.top_p < 1.0:
        if params.top_k > 0:
            e, order = e.topk(min(params.top_k, e.shape[1]), -1)  # sorted, descending
        else:
            e, order = e.sort(-1, descending=True)
        if params.top_p < 1.0:  # over the top-k renormalised, as vLLM and transformers apply it
            p = e.double() / (
                e.sum(-1, keepdim=True, dtype=torch.float64) if params.top_k > 0 else total[:, None]
            )
            e = e * ((p.cumsum(-1) - p) < params.top_p)  # the smallest prefix with mass >= p
    cdf = e.double().cumsum(-1)  # [B, V or k]
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    tokens = (order.gather(1, idx) if order is not None else idx).squeeze(1)
    logprobs = z.gather(1, tokens[:, None]).squeeze(1) - m.squeeze(1) - total.log().float()
    return tokens, logprobs


class _Rows:
    """The decode loop's per-row state: the working rows (finished ones leave, compacted together
    with the KV cache) and the output rows they are flushed to (original row order)."""

    def __init__(self, row_len, steps: int, tables, cache):
        rows, device = row_len.shape[0], row_len.device
        self.ids = torch.arange(rows, device=device)  # original row of each cache row
        self.pos = row_len.clone()  # position of the token each row samples next
        self.tok = torch.zeros(rows, steps, dtype=torch.long, device=device)
        self.lp = torch.zeros(rows, steps, dtype=torch.float32, device=device)
        self.alive = torch.ones(rows, dtype=torch.bool, device=device)
        self.len = torch.zeros(rows, dtype=torch.long, device=device)
        self.stop = torch.zeros(rows, dtype=torch.bool, device=device)
        # uniforms [rows, steps], RoPE (cos, sin) [S_max, hd] by position, attention bias [rows,
        # S_max]
        self.uniforms, self.rope, self.bias = tables
        self.cache = cache  # (K, V) per layer [rows, Hkv, S_max, hd]
        self.out = [torch.zeros_like(x) for x in (self.tok, self.lp, self.len, self.stop)]

    def flush(self) -> None:  # working rows -> output rows
        for out, x in zip(self.out, (self.tok, self.lp, self.len, self.stop)):
            out[self.ids] = x

    def compact(self, tokens):
        """Keep the live rows only (cache included); returns their `tokens`."""
        self.flush()
        keep = self.alive.nonzero().squeeze(1)
        self.cache = tuple([c[keep] for c in layers] for layers in self.cache)
        self.ids, self.pos, self.bias, self.uniforms = (
            x[keep] for x in (self.ids, self.pos, self.bias, self.uniforms)
        )
        self.tok, self.lp, self.len, self.stop = (
            x[keep] for x in (self.tok, self.lp, self.len, self.stop)
        )
        self.alive = self.alive[keep]
        return tokens[keep]


class NativeGenerator(Generator):
    """Samples from a `Decoder` (the trained model itself, or a copy kept for inference).

    Args:
        model: the decoder. The generator holds a reference; `update_weights` copies new values into
            its parameters in place (no reallocation), so a colocated trainer that samples from the
            very model it trains needs no update at all.
        compile: wrap the decode step with torch.compile (dynamic shapes). Measured on this CPU in
            benchmarks/rollout.py (provider `prorl-compile`): it compiles once per process (~25 s
            cold on the 2-core machine) and then removes most of the per-op overhead, which matters
            only for small models; for larger ones the matmuls dominate.
    """

    def __init__(self, model: Decoder, compile: bool = False):
        self.model = model
        self._fused, self._fused_key = [], None
        self._decode = (
            torch.compile(self._decode_step, dynamic=True) if compile else self._decode_step
        )

    @torch.no_grad()
    def update_weights(self, named_tensors) -> None:
        params = dict(self.model.named_parameters())
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        for name, value in items:
            if name not in params:
                raise KeyError(f"update_weights: the model has no parameter {name!r}")
            params[name].copy_(value)

    def cache_bytes(self, num_prompts: int, n: int, seq_len: int) -> int:
        """Peak bytes of the KV cache of one `generate` call of `num_prompts` prompts x n samples,
        at most `seq_len` tokens each: K and V of every layer [rows, Hkv, seq_len, hd], allocated at
        once, plus up to 3/4 of it again while the rows are compacted (the new cache is built before
        the old one goes)."""
        cfg, elem = self.model.config, self.model.embed_tokens.weight.element_size()
        # K and V, every layer
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
        return int(1.75 * num_prompts * n * seq_len * per_token)

    def free_bytes(self) -> int:
        """Memory free now where the cache would go: the GPU's (cudaMemGetInfo), or the host's
        available."""
        device = self.model.embed_tokens.weight.device
        if device.type == "cuda":
            torch.cuda.empty_cache()  # PyTorch's cached blocks (the trainer's freed ones) count
            return torch.cuda.mem_get_info(device)[0]
        return host_available_bytes()

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, on_finished=None
    ) -> Rollouts:
        if not prompt_token_ids or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("generate: every prompt needs at least one token")
        device = self.model.embed_tokens.weight.device
        host_lengths = [len(p) for p in prompt_token_ids]
        lengths = torch.tensor(host_lengths, device=device)
        l_max, steps = max(host_lengths), params.max_new_tokens
        logits, k_cache, v_cache = self._start(prompt_token_ids, lengths, params.n, l_max + steps)
        rows = self._rows(params, lengths, l_max + steps, k_cache, v_cache)
        self._decode_loop(rows, logits, params, l_max, on_finished)
        # 3. host copies, one per tensor
        toks, lps, lens, stp = (x.tolist() for x in rows.out)
        n = params.n
        samples = [
            Sample(
                prompt_index=i // n,
                sample_index=i % n,
                token_ids=toks[i][: lens[i]],
                logprobs=lps[i][: lens[i]],
                finish_reason="stop" if stp[i] else "length",
            )
            for i in range(len(toks))
        ]
        return Rollouts(samples)

    def _start(self, prompt_token_ids, lengths, n: int, s_max: int):
        """1. the KV cache of every row [rows, Hkv, S_max, hd] per layer, the distinct prompts
        prefilled packed (each prompt's K/V go to its n rows), and the first logits [rows, V]
        fp32."""
        model, cfg = self.model, self.model.config
        device, dtype = lengths.device, model.embed_tokens.weight.dtype
        cache_shape = (len(prompt_token_ids) * n, cfg.num_kv_heads, s_max, cfg.head_dim)
        # zeros, not empty: masked-out slots still enter the products, and garbage there can be NaN
        k_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in model.layers]
        v_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in model.layers]
        flat = torch.tensor([t for p in prompt_token_ids for t in p], device=device)
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        hidden = self._prefill(flat, cu, lengths, n, k_cache, v_cache)  # [N, D] final-normed
        last = hidden[cu[1:].long() - 1]  # [P, D] hidden of each prompt's last token
        logits = model.logits(last).float().repeat_interleave(n, 0)  # [rows, V]
        return logits, k_cache, v_cache

    def _rows(self, params: SamplingParams, lengths, s_max: int, k_cache, v_cache) -> _Rows:
        """The per-call tables (uniforms of every (row, step), RoPE of every position, the attention
        bias) and the per-row state."""
        cfg, device = self.model.config, lengths.device
        num_prompts, n, steps = lengths.shape[0], params.n, params.max_new_tokens
        row_len = lengths.repeat_interleave(n)  # [rows]
        prompt_idx = torch.arange(num_prompts, device=device).repeat_interleave(n)
        sample_idx = torch.arange(n, device=device).repeat(num_prompts)
        step = torch.arange(steps, device=device)
        uniforms = counter_uniform(
            params.seed, prompt_idx[:, None], sample_idx[:, None], row_len[:, None] + step
        )  # [rows, steps] float64
        # RoPE: one sequence per position, so `dynamic` RoPE sees length pos + 1, as a decode token
        # does
        all_pos = torch.arange(s_max, device=device)
        rope = rope_cos_sin(cfg, all_pos, torch.arange(s_max + 1, device=device))
        bias = torch.zeros(row_len.shape[0], s_max, dtype=k_cache[0].dtype, device=device)
        bias.masked_fill_(all_pos[None, :] >= row_len[:, None], float("-inf"))  # [rows, S_max]
        return _Rows(row_len, steps, (uniforms, rope, bias), (k_cache, v_cache))

    def _decode_loop(self, rows: _Rows, logits, params: SamplingParams, l_max: int, on_finished):
        """2. sample a token for every live row, then decode it, until every row stopped or hit
        max_new_tokens; finished rows leave the work once at most 3/4 of the rows are live."""
        steps, device = params.max_new_tokens, logits.device
        cos_table, sin_table = rows.rope
        stop_ids = list(params.stop_token_ids)
        stop_t = torch.tensor(stop_ids, device=device)
        fused = self._fused_weights()
        unfinished = rows.alive.shape[0]  # rows not yet reported to on_finished
        for t in range(steps):
            tokens, logps = sample_tokens(logits, params, rows.uniforms[:, t])
            rows.tok[:, t] = tokens
            rows.lp[:, t] = logps
            if stop_ids:
                rows.len += rows.alive
                one = len(stop_ids) == 1
                hit = rows.alive & (tokens == stop_ids[0] if one else torch.isin(tokens, stop_t))
                rows.stop |= hit
                rows.alive &= ~hit
                live = int(rows.alive.sum())
            else:
                live = rows.alive.shape[0]
            if on_finished is not None and live < unfinished:  # rows that sampled a stop token
                on_finished(unfinished - live)
                unfinished = live
            if t + 1 == steps or live == 0:
                break
            if live <= rows.alive.shape[0] * 3 // 4:
                tokens = rows.compact(tokens)
            r = torch.arange(tokens.shape[0], device=device)
            rows.bias[r, rows.pos] = 0.0  # the slot this step writes becomes visible
            s = l_max + t + 1  # rows attend to slots < s: every row's pos is below it
            rope = (cos_table[rows.pos], sin_table[rows.pos])
            logits = self._decode(tokens, rows.pos, r, rope, rows.bias, rows.cache, s, fused)
            rows.pos += 1
        if not stop_ids:
            rows.len.fill_(t + 1)
        rows.flush()
        if on_finished is not None and unfinished:  # the rows cut at max_new_tokens
            on_finished(unfinished)

    # ---------------------------------------------------------------------------------------------
    def _prefill(self, flat, cu, lengths, n, k_cache, v_cache):
        model = self.model
        positions = torch.cat([torch.arange(int(length), device=flat.device) for length in lengths])
        attn = model.attention_backend(flat.device)
        ctx = attn.prepare(make_context(flat.shape[0], cu, int(lengths.max())))
        cos, sin = rope_cos_sin(model.config, positions, cu)
        row_of_token = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=flat.device), lengths
        )
        x = model.embed_tokens(flat)
        for li, layer in enumerate(model.layers):
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h, cos, sin)  # [N, H, hd], rotated
            for j in range(n):  # the prompt's K/V go to each of its n sample rows
                rows = row_of_token * n + j
                k_cache[li][rows, :, positions] = k
                v_cache[li][rows, :, positions] = v
            a = attn(q, k, v, ctx, layer.self_attn.head_dim**-0.5)
            x = x + layer.self_attn.o_proj(a.reshape(a.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)

    def _fused_weights(self) -> list[tuple]:
        """Per layer (W_qkv, b_qkv, W_gate_up, b_gate_up): the decode step's matmuls fused, 5 -> 2
        per layer.

        Copies of the model's weights, rebuilt when any parameter changed since the last call
        (tensor version counters: an optimizer step, `update_weights`, `load_state_dict` and `.data`
        swaps all change them), so a sampler on the very model being trained never samples stale
        weights.
        """
        params = list(self.model.parameters())
        key = tuple((p.data_ptr(), p._version) for p in params)
        if key != self._fused_key:
            fused = []
            with torch.no_grad():
                for layer in self.model.layers:
                    sa, mlp = layer.self_attn, layer.mlp
                    projs = (sa.q_proj, sa.k_proj, sa.v_proj)
                    w_qkv = torch.cat([m.weight for m in projs])
                    b_qkv = (
                        torch.cat([m.bias for m in projs]) if sa.q_proj.bias is not None else None
                    )
                    w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                    b_gu = (
                        torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
                        if mlp.gate_proj.bias is not None
                        else None
                    )
                    fused.append((w_qkv, b_qkv, w_gu, b_gu))
            self._fused, self._fused_key = fused, key
        return self._fused

    def _decode_step(self, tokens, pos, rows, rope, bias, cache, s: int, fused):
        """One token for every cache row: tokens/pos/rows (= arange) [R], rope = (cos, sin) [R, hd],
        bias [R, S_max], cache = (K, V) per layer -> next logits [R, V] fp32. Attends to cache slots
        [0, s)."""
        model = self.model
        (cos, sin), (k_cache, v_cache) = rope, cache
        r = tokens.shape[0]
        mask = bias[:, None, None, :s]  # [R, 1, 1, s]
        x = model.embed_tokens(tokens)
        fast_norm = x.dtype == torch.float32  # F.rms_norm is bit-identical to RMSNorm in fp32 only

        def norm(module, h):
            return (
                F.rms_norm(h, module.weight.shape, module.weight, module.eps)
                if fast_norm
                else module(h)
            )

        for li, layer in enumerate(model.layers):
            sa, (w_qkv, b_qkv, w_gu, b_gu) = layer.self_attn, fused[li]
            hq, hkv, hd = sa.num_heads, sa.num_kv_heads, sa.head_dim
            qkv = F.linear(norm(layer.input_layernorm, x), w_qkv, b_qkv)  # [R, (Hq + 2 Hkv) hd]
            v = qkv[:, (hq + hkv) * hd :].view(r, hkv, hd)
            if sa.q_norm is None:  # rotate q and k together
                qk = apply_rope(qkv[:, : (hq + hkv) * hd].view(r, hq + hkv, hd), cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]
            else:
                q = apply_rope(norm(sa.q_norm, qkv[:, : hq * hd].view(r, hq, hd)), cos, sin)
                k = apply_rope(
                    norm(sa.k_norm, qkv[:, hq * hd : (hq + hkv) * hd].view(r, hkv, hd)), cos, sin
                )
            kc, vc = k_cache[li], v_cache[li]  # [R, Hkv, S_max, hd]
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            q = q.reshape(r, hkv, hq // hkv, hd) * hd**-0.5  # [R, Hkv, G, hd]: GQA groups
            scores = torch.matmul(q, kc[:, :, :s].transpose(2, 3)) + mask  # [R, Hkv, G, s]
            probs = scores.float().softmax(-1).to(q.dtype)
            a = torch.matmul(probs, vc[:, :, :s])  # [R, Hkv, G, hd]
            x = x + sa.o_proj(a.reshape(r, -1))
            gate, up = F.linear(norm(layer.post_attention_layernorm, x), w_gu, b_gu).chunk(2, -1)
            x = x + layer.mlp.down_proj(F.silu(gate) * up)
        return model.logits(norm(model.norm, x)).float()
