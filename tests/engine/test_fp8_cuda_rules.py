"""CUDA's `torch._scaled_mm` rules on the CPU (tests/helpers/scaled_mm_standin.py) and the FP8 paths
that must obey them: torchao's backward on packed batches whose token count is not a multiple of 16.

The reference for what is allowed is CUDA's source (`_scaled_mm_out_cuda`, `_scaled_gemm`, cited in
the stand-in's docstring), not the CPU kernel, which accepts every case below."""

import copy
import dataclasses

import pytest
import scaled_mm_standin
import torch
from dist_helpers import TINY_QWEN2, random_decoder
from prorl.engine.fp8 import FP8Training
from prorl.kernels import linear_logprob_entropy

from prorl import packing

pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'prorl[fp8]'")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.tensor(1.0)


@pytest.fixture(autouse=True)
def cuda_scaled_mm_rules(monkeypatch):
    scaled_mm_standin.patch(monkeypatch)


def _fp8(rows, cols, dtype=E4M3, col_major=False):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 1000 + cols))
    return (x.t().contiguous().t() if col_major else x).to(dtype)


def test_allowed_calls_run_the_cpu_kernel():
    a, b = _fp8(32, 48), _fp8(48, 16, col_major=True)
    want = (a.float() @ b.float()).to(torch.bfloat16)  # float32 accumulation of exact fp8 values
    got = torch._scaled_mm(a, b, ONE, ONE, out_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    rowwise = torch._scaled_mm(a, b, torch.ones(32, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    assert torch.equal(rowwise, want)
    # e4m3 x e5m2
    torch._scaled_mm(a, _fp8(48, 16, E5M2, col_major=True), ONE, ONE, out_dtype=torch.bfloat16)
    torch._scaled_mm(_fp8(33, 48), b, ONE, ONE, out_dtype=torch.bfloat16)  # M is free


@pytest.mark.parametrize(
    "case, match",
    [
        (
            lambda: (_fp8(32, 50), _fp8(50, 16, col_major=True), ONE, ONE),
            "trailing dimension of mat1",
        ),
        (lambda: (_fp8(32, 48), _fp8(48, 20, col_major=True), ONE, ONE), r"mat2 shape \(48x20\)"),
        (lambda: (_fp8(32, 48, E5M2), _fp8(48, 16, E5M2, True), ONE, ONE), "two Float8_e5m2"),
        (lambda: (_fp8(32, 48), _fp8(48, 16), ONE, ONE), "row-major and column-major"),
        (
            lambda: (_fp8(32, 48).t().contiguous().t(), _fp8(48, 16, col_major=True), ONE, ONE),
            "row-major",
        ),
        (
            lambda: (_fp8(32, 48), _fp8(48, 16, col_major=True), torch.ones(32), ONE),
            "Invalid scaling",
        ),
        (
            lambda: (_fp8(32, 48), _fp8(48, 16, col_major=True), ONE.double(), ONE),
            "Invalid scaling",
        ),
        (
            lambda: (_fp8(32, 48).float(), _fp8(48, 16, col_major=True).float(), ONE, ONE),
            "Float8 matrix",
        ),
    ],
)
def test_calls_cuda_refuses_are_refused(case, match):
    with pytest.raises(scaled_mm_standin.CudaRuleError, match=match):
        torch._scaled_mm(*case(), out_dtype=torch.bfloat16)


def test_bias_and_output_dtype_rules():
    a, b = _fp8(32, 48), _fp8(48, 16, col_major=True)
    with pytest.raises(scaled_mm_standin.CudaRuleError, match="Float32"):
        torch._scaled_mm(
            a, b, ONE, ONE, bias=torch.zeros(16, dtype=torch.bfloat16), out_dtype=torch.float32
        )
    with pytest.raises(scaled_mm_standin.CudaRuleError, match="Bias must be size 16"):
        torch._scaled_mm(
            a, b, ONE, ONE, bias=torch.zeros(8, dtype=torch.bfloat16), out_dtype=torch.bfloat16
        )
    torch._scaled_mm(
        a, b, ONE, ONE, bias=torch.zeros(16, dtype=torch.bfloat16), out_dtype=torch.bfloat16
    )


# -- torchao's FP8 backward and the token count ----------------------------------------------------

BLOCK = dataclasses.replace(TINY_QWEN2, num_layers=1)


def _train_pass(model, tokens: int, pad_multiple: int = 1):
    """Forward + backward of one packed batch of `tokens` tokens (two sequences) through `model`, as
    the trainer runs it (`packing.hidden_states`, padded to `pad_multiple`). Returns (logp,
    grads)."""
    ids = torch.randint(
        0, BLOCK.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)
    )
    seqs = ids[: tokens // 3].tolist(), ids[tokens // 3 :].tolist()
    batch = packing.pack([(s[:1], [s[1:]]) for s in seqs], share=False)
    hidden = packing.hidden_states(model, batch, pad_multiple=pad_multiple)
    logp, _ = linear_logprob_entropy(
        hidden, model.lm_head_weight, batch.labels, return_entropy=False
    )
    logp.sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_backward_needs_token_counts_that_are_multiples_of_16(recipe):
    """The weight-gradient GEMM grad_out.t() @ input has the token count as its inner dim: 48 tokens
    pass CUDA's rule, 50 fail in the backward (the forward passes: there the tokens are M)."""
    model = FP8Training("torchao", recipe, emulate=False).convert(
        random_decoder(0, BLOCK).to(torch.bfloat16)
    )
    _train_pass(copy.deepcopy(model), 48)
    with pytest.raises(scaled_mm_standin.CudaRuleError, match="divisible by 16"):
        _train_pass(copy.deepcopy(model), 50)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_padding_to_the_token_multiple_makes_any_count_train(recipe):
    """The trainer pads each pass to `FP8Training.token_multiple` with a dummy sequence nothing
    reads: odd counts train, with the log-probs and gradients of the unpadded batch up to FP8
    rounding (the dummy's activations enter a tensorwise scale) - checked against the bf16 model's
    own, where padding is exact."""
    spec = FP8Training("torchao", recipe, emulate=False)
    assert spec.token_multiple == 16
    bf16 = random_decoder(0, BLOCK).to(torch.bfloat16)
    model = spec.convert(copy.deepcopy(bf16))
    for tokens in (50, 37, 17):
        want_logp, want = _train_pass(copy.deepcopy(bf16), tokens)
        padded_logp, padded = _train_pass(copy.deepcopy(bf16), tokens, pad_multiple=16)
        assert torch.equal(padded_logp, want_logp)  # bf16: the dummy sequence changes nothing
        logp, grads = _train_pass(copy.deepcopy(model), tokens, pad_multiple=spec.token_multiple)
        # nats; e4m3: ~5% per GEMM
        assert float((logp.float() - want_logp.float()).abs().max()) < 0.1
        for name in ("layers.0.mlp.up_proj.weight", "layers.0.self_attn.q_proj.weight"):
            rel = float(
                (grads[name].float() - want[name].float()).norm() / want[name].float().norm()
            )
            assert rel < 0.2, (tokens, name, rel)


def test_layers_whose_dims_cuda_refuses_stay_unconverted():
    """A Linear with a dim that is not a multiple of 16 would fail CUDA's mat2 rule in its
    forward."""
    cfg = dataclasses.replace(BLOCK, intermediate_size=72)  # gate/up/down: 72 x 32, 32 x 72
    model = FP8Training("torchao", emulate=False).convert(random_decoder(0, cfg))
    kinds = {
        n.rpartition(".")[2]: type(m).__name__
        for n, m in model.named_modules()
        if n.startswith("layers.0.")
    }
    assert kinds["up_proj"] == kinds["down_proj"] == "Linear" and kinds["q_proj"] == "Float8Linear"
    _train_pass(model.to(torch.bfloat16), 48)  # runs under CUDA's rules
