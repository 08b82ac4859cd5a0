"""Attention backends against a float64 reference (explicit document-causal mask) and each other."""

import pytest
import torch
from prorl.engine.attention import (
    FlashAttention,
    FlexAttention,
    SDPAAttention,
    default_backend_name,
    flash_attn_available,
    get_attention_backend,
    make_context,
)
from prorl.engine.model import load_hf, packed_position_ids
from tiny_hf import hf_logits_per_sequence

LENGTHS = [5, 0, 17, 1, 9]  # includes an empty and a one-token sequence
HQ, HKV, D = 4, 2, 16


def reference_attention(q, k, v, cu, scale):
    """float64, explicit [N, N] mask: same sequence and not in the future; GQA by repeating k/v
    heads."""
    q, k, v = (t.double() for t in (q, k, v))
    n = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long())  # [N]
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [N, Hq, d]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _inputs(dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)], cu.to(device)


def _check_against_reference(backend, dtype=torch.float32, device="cpu", atol=1e-5, backward=True):
    (q, k, v), cu = _inputs(dtype, device)
    if not backward:
        q, k, v = (t.detach() for t in (q, k, v))
    scale = D**-0.5
    out = backend(q, k, v, backend.prepare(make_context(q.shape[0], cu)), scale)
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference_attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), cu.cpu(), scale)
    assert (out.detach().cpu().double() - ref).abs().max().item() <= atol
    if not backward:
        return
    # backward: gradients of a fixed projection of the output
    upstream = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    (out.double().cpu() * upstream).sum().backward()
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    (reference_attention(*leaves, cu.cpu(), scale) * upstream).sum().backward()
    for ours, theirs in zip((q, k, v), leaves):
        assert (ours.grad.cpu().double() - theirs.grad).abs().max().item() <= atol * 10


def test_sdpa_matches_reference():
    _check_against_reference(SDPAAttention())


def test_cuda_sdpa_kernels_respect_the_callers_choice():
    """On CUDA the backend leaves out cuDNN's attention but keeps a caller's own restriction (the
    enabled kernels are global flags, read here on any device)."""
    from prorl.engine.attention import cuda_sdpa_backends
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert cuda_sdpa_backends() == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel([SDPBackend.MATH]):
        assert cuda_sdpa_backends() == [SDPBackend.MATH]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert cuda_sdpa_backends() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sdpa_cuda_matches_reference():
    _check_against_reference(SDPAAttention(), device="cuda", atol=1e-4)


# torch 2.13 FlexAttention on the CPU is forward-only ("FlexAttention does not support backward on
# CPU"): usable for evaluation and rollout there, not for training. The backward is checked on CUDA
# only.
def test_flex_eager_matches_reference():
    # Eager mode runs an unfused path that materialises the scores.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    atol = 1e-4 if device == "cuda" else 1e-5
    backward = device == "cuda"
    _check_against_reference(
        FlexAttention(compile=False), device=device, backward=backward, atol=atol
    )


def test_flex_cpu_backward_is_refused_by_torch():
    (q, k, v), cu = _inputs()
    backend = FlexAttention(compile=False)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        backend(q, k, v, backend.prepare(make_context(q.shape[0], cu)), D**-0.5)


@pytest.mark.slow
def test_flex_compiled_matches_reference():
    # Compiled FlexAttention (inductor's CPU template): ~40 s cold to compile on this 2-core
    # machine.
    _check_against_reference(FlexAttention(compile=True), backward=False)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA in torch 2.13"
)
def test_flex_compiled_cuda_matches_reference():
    _check_against_reference(FlexAttention(compile=True), device="cuda", atol=1e-4)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_attn_available()),
    reason="flash-attn varlen needs a CUDA device and the flash-attn package (the [gpu] extra)",
)
def test_flash_matches_reference():
    _check_against_reference(FlashAttention(), dtype=torch.bfloat16, device="cuda", atol=2e-2)


def test_flash_without_package_names_the_extra():
    if flash_attn_available():
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ImportError, match=r"prorl\[gpu\]"):
        get_attention_backend("flash")


def test_backend_selection():
    assert default_backend_name("cpu") == "sdpa"
    assert isinstance(get_attention_backend(None, "cpu"), SDPAAttention)
    assert isinstance(get_attention_backend("flex"), FlexAttention)
    backend = SDPAAttention()
    assert get_attention_backend(backend) is backend
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope")


def test_packed_position_ids():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    assert packed_position_ids(cu, 7).tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_decoder_backends_agree(hf_checkpoint, packed_batch):
    """SDPA and (eager) FlexAttention inside the full model give the same logits as transformers."""
    import transformers

    path = hf_checkpoint("qwen3")
    ids, cu = packed_batch
    ref = hf_logits_per_sequence(transformers.AutoModelForCausalLM.from_pretrained(path), ids, cu)
    with torch.no_grad():
        sdpa = load_hf(path, attention="sdpa")
        flex = load_hf(path, attention=FlexAttention(compile=False))
        sdpa_logits = sdpa.logits(sdpa(ids, cu_seqlens=cu))
        flex_logits = flex.logits(flex(ids, cu_seqlens=cu))
    print(
        "sdpa vs flex max abs logit difference "
        f"{(sdpa_logits - flex_logits).abs().max().item():.2e}"
    )
    assert (sdpa_logits - flex_logits).abs().max().item() <= 1e-4
    assert (flex_logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "lq,extra",
    [
        ([1, 3, 3, 4, 50, 2, 7, 1], [0, 2, 0, 5, 0, 1, 3, 9]),
        # sequences without queries (an empty response after its shared prompt; an empty segment)
        ([0, 3, 0, 0, 4, 0, 1], [4, 2, 0, 0, 5, 3, 9]),
    ],
)
def test_sdpa_separate_key_lengths_match_reference(lq, extra):
    """Queries that are the last Lq of Lk keys (a shared prompt prefix), bucketed into few padded
    calls."""
    lk = [a + b for a, b in zip(lq, extra)]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), HQ, D, generator=gen, requires_grad=True)
    k = torch.randn(sum(lk), HKV, D, generator=gen, requires_grad=True)
    v = torch.randn(sum(lk), HKV, D, generator=gen, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    backend = SDPAAttention()
    ctx = backend.prepare(
        make_context(q.shape[0], cu_q, cu_seqlens_k=cu_k, kv_index=torch.arange(sum(lk)))
    )
    assert 1 <= len(ctx.extra["sdpa_plans"]) < len(lq)  # bucketed: fewer calls than sequences
    out = backend(q, k, v, ctx, D**-0.5)
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * upstream).sum().backward()

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qd, kd, vd = leaves
    rep = HQ // HKV
    refs = []
    for i in range(len(lq)):
        qs = qd[cu_q[i] : cu_q[i + 1]]
        ks = kd[cu_k[i] : cu_k[i + 1]].repeat_interleave(rep, dim=1)
        vs = vd[cu_k[i] : cu_k[i + 1]].repeat_interleave(rep, dim=1)
        allowed = torch.ones(lq[i], lk[i], dtype=torch.bool).tril(lk[i] - lq[i])
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * D**-0.5
        refs.append(
            torch.einsum(
                "hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vs
            )
        )
    ref = torch.cat(refs)
    assert (out.detach().double() - ref).abs().max().item() <= 1e-5
    (ref * upstream).sum().backward()
    for ours, theirs in zip((q, k, v), leaves):
        assert (ours.grad.double() - theirs.grad).abs().max().item() <= 1e-4


def test_default_backend_follows_the_compute_dtype(monkeypatch):
    """flash-attn computes in fp16/bf16 only: on a GPU with flash-attn installed the default is SDPA
    for an fp32 model (the embedded default's dtype), flash for bf16."""
    import prorl.engine.attention as attention

    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert default_backend_name("cuda", torch.float32) == "sdpa"
    assert default_backend_name("cuda", torch.bfloat16) == "flash"
    assert default_backend_name("cuda", torch.float16) == "flash"
    assert default_backend_name("cpu", torch.bfloat16) == "sdpa"


def test_flash_refuses_fp32_with_a_clear_error(monkeypatch):
    """A stand-in for flash_attn (its documented rule: fp16/bf16 inputs) shows that an explicit
    attention='flash' with fp32 compute fails with our message, not deep inside the kernel."""
    import sys
    import types

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
        assert q.dtype in (torch.float16, torch.bfloat16), "flash-attn: fp16/bf16 only"
        raise AssertionError("not reached in this test")

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen)
    )
    backend = get_attention_backend("flash")
    q = torch.zeros(4, 2, 8)
    ctx = backend.prepare(make_context(4, torch.tensor([0, 4], dtype=torch.int32)))
    with pytest.raises(ValueError, match="fp16/bf16 only, got torch.float32"):
        backend(q, q, q, ctx, 1.0)
