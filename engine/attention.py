"""Causal attention over packed (varlen) sequences, behind one small interface.

Every backend takes q [N, Hq, d], k/v [Nk, Hkv, d] (tokens of all sequences concatenated, GQA heads
not repeated) and an `AttentionContext` built once per forward from `cu_seqlens`, and returns [N,
Hq, d]. Tokens attend only to earlier tokens of their own sequence. The context carries separate q
and k boundaries (the flash-attn varlen convention). When they differ, sequence i has Lq_i <= Lk_i
and its queries are the LAST Lq_i positions of its keys (causal mask aligned bottom-right, as
flash-attn >= 2.1): this is how a group's responses attend to one shared copy of their prompt
(`shared_prefix_context`; the keys of each response are gathered as [prompt keys, own keys] by
`kv_index`, see engine/model/decoder.py). `sdpa` and `flash` support it; `flex` supports
self-attention only.

Backends (`get_attention_backend(name)`):
- `sdpa`  : `F.scaled_dot_product_attention`, sequences bucketed by length into a few padded calls
            (one causal call for a sequence alone). Measured earlier on this CPU (1 thread, 14/2
            heads, d=64, fwd+bwd): one call per sequence 8x256 tokens 204 ms vs 1553 ms for one call
            with an [N, N] block-diagonal mask (it pays for all N^2 pairs); buckets pay only for
            padding within similar lengths, and cut the calls of an RL step's ~150 short segments
            per layer to a handful (`python -m benchmarks rl_step`). Needs the lengths on the host
            (one sync per forward) and is excluded from torch.compile graphs.
- `flex`  : FlexAttention with a document-causal BlockMask, no host sync. Compiled by default (the
            eager fallback materialises all N^2 scores; it is what the CPU tests use,
            `compile=False`). On this CPU torch 2.13 compiles it in 25-40 s cold. On the CPU torch
            2.13 has no FlexAttention backward ("does not support backward on CPU"): there it serves
            evaluation/rollout only.
- `flash` : flash-attn 2 `flash_attn_varlen_func` (CUDA, fp16/bf16), from the `[gpu]` extra.
Default: `flash` on CUDA for fp16/bf16 compute when flash-attn (>= 2.1, whose causal mask is aligned
bottom-right, as the shared-prompt layout needs) is importable, else `sdpa`; chosen per compute
dtype, so an fp32 model on a GPU with flash-attn installed runs SDPA.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .choices import ATTENTION


# SDPA kernels allowed on CUDA: cuDNN's attention is left out. It builds an execution plan for every
# new shape, and bucketed RL batches bring new shapes every step: on an H200 (torch 2.11) a
# 3M-parameter policy's RL step spent ~1.4 s of host time in _cudnn_attention_backward/forward per
# step; without cuDNN the reference pass went from ~420 to ~40 ms and the update from ~840 to ~80 ms
# (benchmarks/gpu/profile_step.py, the SDPA-family toggles).
def cuda_sdpa_backends() -> list[SDPBackend]:
    """The SDPA kernels enabled right now (by default, or by a caller's own `sdpa_kernel` context),
    minus cuDNN's: what `SDPAAttention` allows on CUDA. Empty when cuDNN is the only one enabled."""
    b = torch.backends.cuda
    enabled = (
        (SDPBackend.FLASH_ATTENTION, b.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, b.mem_efficient_sdp_enabled()),
        (SDPBackend.MATH, b.math_sdp_enabled()),
    )
    return [kernel for kernel, on in enabled if on]


@dataclass
class AttentionContext:
    """Sequence boundaries shared by every layer of one forward.

    num_tokens: N, the number of packed query tokens.
    cu_seqlens_q/k: [B+1] int32 offsets of each sequence in the packed q / k tensors.
    max_seqlen_q/k: longest sequence (host ints, needed by flash-attn; None = computed when needed).
    kv_index: None (keys are the layer's own k/v) or [Nk] int64 rows of the layer's k/v that form
        the packed keys (a shared prefix gathered once per sequence that uses it).
    extra: per-backend data built by `prepare` (host lengths, a BlockMask, ...).
    """

    num_tokens: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    kv_index: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class AttentionBackend:
    """Interface: `prepare(ctx)` once per forward, then `__call__(q, k, v, ctx, scale)` per
    layer."""

    name = "base"

    def prepare(self, ctx: AttentionContext) -> AttentionContext:
        return ctx

    def __call__(self, q, k, v, ctx: AttentionContext, scale: float) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _self_attention_only(ctx: AttentionContext) -> None:
        if ctx.cu_seqlens_k is not ctx.cu_seqlens_q:
            raise NotImplementedError(
                "this attention backend supports self-attention only (no separate key boundaries, "
                "e.g. a shared prompt prefix): use 'sdpa' or 'flash'"
            )


class SDPAAttention(AttentionBackend):
    """`scaled_dot_product_attention` over buckets of similar-length sequences (see the module
    docstring).

    `prepare` sorts the sequences by key length and groups them while padding stays small (padded
    area <= PAD_SLACK x the real q x k area, mask <= MAX_MASK elements); each bucket is one SDPA
    call on [B, H, Lq_max, Lk_max] with a boolean mask (valid keys, causal aligned bottom-right),
    gathered from and scattered back to the packed rows by index. A bucket of one sequence with as
    many queries as keys is a plain `is_causal` call. Many short sequences (RL responses) then cost
    a few calls instead of one each; long ones stay alone.
    """

    name = "sdpa"
    PAD_SLACK = 1.5
    MAX_MASK = 2**24  # elements of one bucket's [B, Lq, Lk] mask (16 MB): long sequences go alone

    def prepare(self, ctx):
        lq = ctx.cu_seqlens_q.diff().tolist()  # host sync, once per forward
        lk = lq if ctx.cu_seqlens_k is ctx.cu_seqlens_q else ctx.cu_seqlens_k.diff().tolist()
        if any(b < a for a, b in zip(lq, lk)):
            raise ValueError("every sequence needs at least as many keys as queries")
        start_q = [0]
        start_k = [0]
        for a, b in zip(lq, lk):
            start_q.append(start_q[-1] + a)
            start_k.append(start_k[-1] + b)
        device = ctx.cu_seqlens_q.device
        plans = []
        # sequences without queries produce no output rows
        live = [i for i, n in enumerate(lq) if n > 0]
        for part in self._buckets([lq[i] for i in live], [lk[i] for i in live]):
            bucket = [live[j] for j in part]
            if len(bucket) == 1 and lq[bucket[0]] == lk[bucket[0]]:
                i = bucket[0]
                plans.append(("causal", start_q[i], lq[i], start_k[i], lk[i]))
                continue
            plans.append(self._padded_plan(bucket, lq, lk, start_q, start_k, device))
        ctx.extra["sdpa_plans"] = plans
        return ctx

    @staticmethod
    def _padded_plan(bucket, lq, lk, start_q, start_k, device):
        """One padded SDPA call for the sequences in `bucket`: gather indices, mask, output rows;
        built with a few vectorised ops on `device` (a per-sequence loop of small host ops cost ~70
        ms per RL step on an H200 host, profiled with benchmarks/gpu/profile_step.py)."""

        def as_t(xs):
            return torch.tensor(xs, dtype=torch.long).to(device, non_blocking=True)

        bq, bk = as_t([lq[i] for i in bucket]), as_t([lk[i] for i in bucket])
        sq, sk = as_t([start_q[i] for i in bucket]), as_t([start_k[i] for i in bucket])
        mq, mk = max(lq[i] for i in bucket), max(lk[i] for i in bucket)
        tq = torch.arange(mq, device=device)
        tk = torch.arange(mk, device=device)
        real_q = tq[None, :] < bq[:, None]  # [b, mq]
        real_k = tk[None, :] < bk[:, None]  # [b, mk]
        # padded slots read row 0 (any real row: their outputs are dropped, their keys masked out)
        q_idx = torch.where(real_q, sq[:, None] + tq[None, :], 0)
        k_idx = torch.where(real_k, sk[:, None] + tk[None, :], 0)
        # causal aligned bottom-right: query t of a sequence sees keys j <= t + (Lk - Lq)
        causal = tk[None, None, :] <= tq[None, :, None] + (bk - bq)[:, None, None]
        mask = causal & real_k[:, None, :] & real_q[:, :, None]
        mask[:, :, 0] |= ~real_q  # padded queries see one key: no all-masked row (NaN)
        rows_out = (torch.arange(len(bucket), device=device)[:, None] * mq + tq[None, :])[real_q]
        pos = 0  # does the bucket hold every row, in order? then its output needs no scatter
        for i in bucket:
            if start_q[i] != pos:
                break
            pos += lq[i]
        if pos == start_q[-1]:
            where = (0, start_q[-1])
        else:
            where = (sq[:, None] + tq[None, :])[real_q]
        return ("padded", q_idx.view(-1), k_idx.view(-1), mask[:, None], rows_out, where)

    @classmethod
    def _buckets(cls, lq: list[int], lk: list[int]) -> list[list[int]]:
        order = sorted(range(len(lq)), key=lambda i: (lk[i], lq[i]))
        buckets, cur, real, mq = [], [], 0, 0
        for i in order:
            area = lq[i] * lk[i]
            new_mq = max(mq, lq[i])
            padded = (len(cur) + 1) * new_mq * lk[i]
            if cur and (padded > cls.PAD_SLACK * (real + area) or padded > cls.MAX_MASK):
                buckets.append(cur)
                cur, real, new_mq = [], 0, lq[i]
            cur.append(i)
            real += area
            mq = new_mq
        if cur:
            buckets.append(cur)
        return buckets

    @torch.compiler.disable  # data-dependent bucket shapes would recompile for every batch
    def __call__(self, q, k, v, ctx, scale):
        if not q.is_cuda:
            return self._attend(q, k, v, ctx, scale)
        allowed = cuda_sdpa_backends()
        if not allowed:  # the caller asked for cuDNN alone
            return self._attend(q, k, v, ctx, scale)
        with sdpa_kernel(allowed):
            return self._attend(q, k, v, ctx, scale)

    def _attend(self, q, k, v, ctx, scale):
        n, hq, d = q.shape
        pieces = []  # (output rows, where they go: a (start, end) range or a row index)
        for plan in ctx.extra["sdpa_plans"]:
            if plan[0] == "causal":
                _, s0, length, k0, _ = plan
                qs, ks, vs = (
                    t[a : a + length].transpose(0, 1)[None] for t, a in ((q, s0), (k, k0), (v, k0))
                )
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
                )
                pieces.append((o[0].transpose(0, 1), (s0, s0 + length)))
            else:
                _, q_idx, k_idx, mask, rows_out, where = plan
                b, mq, mk = mask.shape[0], mask.shape[2], mask.shape[3]
                qs = q.index_select(0, q_idx).view(b, mq, hq, d).transpose(1, 2)
                ks = k.index_select(0, k_idx).view(b, mk, k.shape[1], d).transpose(1, 2)
                vs = v.index_select(0, k_idx).view(b, mk, v.shape[1], v.shape[-1]).transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
                )
                pieces.append(
                    (o.transpose(1, 2).reshape(b * mq, hq, -1).index_select(0, rows_out), where)
                )
        if len(pieces) == 1 and isinstance(pieces[0][1], tuple) and pieces[0][1] == (0, n):
            return pieces[0][0]  # one plan covering every row, in order
        out = q.new_zeros(n, hq, v.shape[-1])  # zeros: rows of zero-length sequences stay defined
        for piece, where in pieces:
            if isinstance(where, tuple):
                out[where[0] : where[1]] = piece
            else:
                out[where] = piece
        return out


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

        ctx.extra["block_mask"] = create_block_mask(
            document_causal, None, None, n, n, device=cu.device
        )
        return ctx

    def __call__(self, q, k, v, ctx, scale):
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, d]
        with warnings.catch_warnings():  # eager was asked for; torch warns that it is unfused
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = self._fn(
                q4, k4, v4, block_mask=ctx.extra["block_mask"], scale=scale, enable_gqa=True
            )
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
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flash-attn computes in fp16/bf16 only, got {q.dtype}: use model.dtype=bfloat16, "
                "or attention='sdpa' (the default picks SDPA for fp32)"
            )
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


# the names are engine/choices.py's (checked by the config before torch is loaded)
BACKENDS = dict(zip(ATTENTION, (SDPAAttention, FlexAttention, FlashAttention)))


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend_name(device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """`flash` on CUDA for fp16/bf16 compute (`dtype`; None: assume half precision) when flash-attn
    is installed, otherwise `sdpa`."""
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if torch.device(device).type == "cuda" and half and flash_attn_available():
        return "flash"
    return "sdpa"


def get_attention_backend(
    name: str | AttentionBackend | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
):
    """A backend instance from its name (`sdpa`, `flex`, `flash`), None (the default for `device`
    and the compute `dtype`), or an instance (returned as is)."""
    if isinstance(name, AttentionBackend):
        return name
    name = name or default_backend_name(device, dtype)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]()


def make_context(
    num_tokens: int,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    cu_seqlens_k: torch.Tensor | None = None,
    kv_index: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> AttentionContext:
    """Context for `num_tokens` packed tokens split by [B+1] offsets `cu_seqlens`: self-attention,
    or with `cu_seqlens_k` and `kv_index` each sequence's keys gathered from the layer's k/v (a
    shared prefix; `max_seqlen_k` its longest key run). The longest lengths, when the caller knows
    them, spare flash-attn's `prepare` a host sync each."""
    cu_seqlens = cu_seqlens.to(torch.int32)
    if cu_seqlens_k is None:
        return AttentionContext(num_tokens, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    if kv_index is None:
        raise ValueError("cu_seqlens_k needs kv_index (the rows of k/v that form the packed keys)")
    cu_k = cu_seqlens_k.to(torch.int32)
    return AttentionContext(num_tokens, cu_seqlens, cu_k, max_seqlen, max_seqlen_k, kv_index.long())


def shared_prefix_layout(
    prompt_lengths: list[int], response_lengths: list[list[int]]
) -> dict[str, torch.Tensor | int]:
    """Host-side layout of groups packed as [prompt, response_1, ..., response_n] per group, each
    prompt once, built with torch ops on the CPU (no per-token Python loop: 2.2M tokens in ~0.1 s).

    Segments (the attention's sequences) are every prompt and every response, in token order. A
    prompt attends to itself (causal); a response attends to its group's prompt and to its own
    earlier tokens. Returns int64 CPU tensors: `cu_q` [S+1] segment offsets, `cu_k` [S+1] offsets
    of the gathered keys, `kv_index` [Nk] token row of every gathered key, `position_ids` [N] (a
    response continues its prompt's positions), `segment_of_response` (segment index of each
    response, group-major); and ints `max_q`, `max_k` (the longest segment and key run).
    """
    lp = torch.tensor(prompt_lengths, dtype=torch.long)  # [G]
    counts = torch.tensor([len(r) for r in response_lengths], dtype=torch.long)  # [G]
    lr = torch.tensor([x for r in response_lengths for x in r], dtype=torch.long)  # [S_r]
    groups, segments = len(prompt_lengths), len(prompt_lengths) + lr.numel()
    prompt_seg = torch.arange(groups) + torch.cumsum(counts, 0) - counts  # [G]
    is_prompt = torch.zeros(segments, dtype=torch.bool)
    is_prompt[prompt_seg] = True
    group_of = torch.repeat_interleave(torch.arange(groups), counts + 1)  # [S] segment -> group
    seg_len = torch.zeros(segments, dtype=torch.long)
    seg_len[prompt_seg], seg_len[~is_prompt] = lp, lr
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    pre = torch.where(is_prompt, 0, lp[group_of])  # keys before a segment's own: its prompt's
    seg_k = seg_len + pre
    prompt_start = seg_start[prompt_seg][group_of]  # [S] first row of the segment's prompt
    key_seg = torch.repeat_interleave(torch.arange(segments), seg_k)  # [Nk]
    j = torch.arange(key_seg.numel()) - (torch.cumsum(seg_k, 0) - seg_k)[key_seg]
    own = seg_start[key_seg] + j - pre[key_seg]
    kv_index = torch.where(j < pre[key_seg], prompt_start[key_seg] + j, own)
    tok_seg = torch.repeat_interleave(torch.arange(segments), seg_len)  # [N]
    positions = torch.arange(tok_seg.numel()) - seg_start[tok_seg] + pre[tok_seg]
    zero = torch.zeros(1, dtype=torch.long)
    return dict(
        cu_q=torch.cat([zero, torch.cumsum(seg_len, 0)]),
        cu_k=torch.cat([zero, torch.cumsum(seg_k, 0)]),
        kv_index=kv_index,
        position_ids=positions,
        segment_of_response=torch.nonzero(~is_prompt).flatten(),
        max_q=int(seg_len.max()) if segments else 0,
        max_k=int(seg_k.max()) if segments else 0,
    )
