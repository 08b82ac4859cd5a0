"""linear_logprob_entropy (native and torch backends) against the float64 reference.

The reference is a plain, unfused float64 torch computation (full logits, log_softmax, gather,
entropy from the probabilities) differentiated by autograd: independent of the chunked code under
test. The Triton backend has its own test module.
"""

import math

import pytest
import torch
from prorl.kernels import linear_logprob_entropy, linear_logprob_entropy_reference, native_available
from prorl.kernels.linear_logprob_entropy import tile_shape

# the triton backend: test_linear_logprob_entropy_triton.py (tiny shapes for the interpreter, the
# tile kernels on their own)
pytestmark = pytest.mark.backends("torch", "native")


def _case(n, d, v, dtype, seed=0, scale=2.0, ignore=()):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * scale).to(dtype)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d) * 4).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    for i in ignore:
        y[i] = -100
    g_lp = torch.randn(n, generator=g)
    g_ent = torch.randn(n, generator=g)
    return h, w, y, g_lp, g_ent


def _run(fn, h, w, y, g_lp, g_ent, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    lp, ent = fn(h, w, y, **kw)
    (lp * g_lp.to(lp.dtype) + ent * g_ent.to(ent.dtype)).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _reference(h, w, y, g_lp, g_ent, temperature=1.0):
    h, w = h.double(), w.double()  # exact upcast of the same inputs; gradients come out in float64
    return _run(
        lambda a, b, c: linear_logprob_entropy_reference(a, b, c, temperature), h, w, y, g_lp, g_ent
    )


def _assert_close_fp32(got, ref, rtol=2e-5, atol=2e-5):
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref):
        assert a.dtype in (torch.float32,), name
        torch.testing.assert_close(
            a.double(), b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    "n,d,v,chunk_bytes",
    [
        (64, 32, 1000, 4 * 64 * 300),  # several vocab tiles, last one partial (1000 = 3*300 + 100)
        (33, 17, 777, 4 * 8 * 256),  # several row blocks AND vocab tiles, D odd, V odd
        (1, 5, 3, None),  # N = 1, V smaller than the minimum tile
        (50, 24, 4096, None),  # one tile covers everything
    ],
)
def test_matches_float64_reference(backend, n, d, v, chunk_bytes):
    h, w, y, g_lp, g_ent = _case(n, d, v, torch.float32, ignore=(0,) if n > 1 else ())
    got = _run(
        linear_logprob_entropy, h, w, y, g_lp, g_ent, backend=backend, chunk_bytes=chunk_bytes
    )
    _assert_close_fp32(got, _reference(h, w, y, g_lp, g_ent))


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_temperature(backend, temperature):
    h, w, y, g_lp, g_ent = _case(40, 16, 500, torch.float32, seed=1)
    got = _run(
        linear_logprob_entropy,
        h,
        w,
        y,
        g_lp,
        g_ent,
        temperature=temperature,
        backend=backend,
        chunk_bytes=4 * 40 * 256,
    )
    _assert_close_fp32(got, _reference(h, w, y, g_lp, g_ent, temperature))


def test_ignored_rows_are_zero_with_zero_gradient(backend):
    h, w, y, g_lp, g_ent = _case(12, 8, 300, torch.float32, ignore=(2, 5, 11))
    lp, ent, gh, gw = _run(linear_logprob_entropy, h, w, y, g_lp, g_ent, backend=backend)
    for i in (2, 5, 11):
        assert lp[i] == 0 and ent[i] == 0
        assert torch.all(gh[i] == 0)
    # weight gradient equals the one computed from the valid rows alone
    keep = y != -100
    _, _, _, gw_valid = _run(
        linear_logprob_entropy, h[keep], w, y[keep], g_lp[keep], g_ent[keep], backend=backend
    )
    torch.testing.assert_close(gw, gw_valid, rtol=1e-5, atol=1e-6)


def test_all_rows_ignored_gives_zeros_not_nan(backend):
    h, w, y, g_lp, g_ent = _case(6, 8, 100, torch.float32, ignore=range(6))
    lp, ent, gh, gw = _run(linear_logprob_entropy, h, w, y, g_lp, g_ent, backend=backend)
    for t in (lp, ent, gh, gw):
        assert torch.all(t == 0), t


def test_only_one_output_used(backend):
    """Backward with an upstream gradient for logp only (entropy unused) and vice versa."""
    h, w, y, g_lp, g_ent = _case(20, 12, 400, torch.float32, seed=3)
    zero = torch.zeros_like(g_lp)
    for a, b in ((g_lp, zero), (zero, g_ent)):
        hh = h.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        lp, ent = linear_logprob_entropy(hh, ww, y, backend=backend)
        ((lp * a).sum() if b is zero else (ent * b).sum()).backward()
        ref = _reference(h, w, y, a, b)
        torch.testing.assert_close(hh.grad.double(), ref[2], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(ww.grad.double(), ref[3], rtol=2e-5, atol=2e-5)


def test_extreme_logits_no_nan(backend):
    """Peaked distributions where most probabilities underflow to 0 in fp32 (the 0 * -inf trap)."""
    h, w, y, g_lp, g_ent = _case(16, 8, 256, torch.float32, scale=60.0)
    got = _run(linear_logprob_entropy, h, w, y, g_lp, g_ent, backend=backend)
    for t in got:
        assert torch.isfinite(t).all()
    ref = _reference(h, w, y, g_lp, g_ent)
    torch.testing.assert_close(got[1].double(), ref[1], rtol=1e-4, atol=1e-4)  # entropy
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-5, atol=1e-3)  # logp (|z| ~ 1e3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, dtype):
    """bf16/fp16 inputs: fp32 outputs; error no worse than a small multiple of plain torch's own.

    Plain torch here means the same unfused chain run in the input dtype (what a trainer would do
    without the op); its error against float64 on the same rounded inputs sets the scale.
    """
    h, w, y, g_lp, g_ent = _case(48, 40, 700, dtype, seed=4)
    got = _run(
        linear_logprob_entropy, h, w, y, g_lp, g_ent, backend=backend, chunk_bytes=4 * 48 * 256
    )
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert got[2].dtype == dtype and got[3].dtype == dtype
    ref = _reference(h, w, y, g_lp, g_ent)

    def plain(a, b, c):
        logits = a @ b.t()
        logprobs = torch.log_softmax(logits, -1)
        return logprobs.gather(1, c[:, None]).squeeze(1), -(logprobs.exp() * logprobs).sum(-1)

    base = _run(plain, h, w, y, g_lp, g_ent)
    for name, a, b, p in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, base):
        err = (a.double() - b).abs().max().item()
        base_err = (p.double() - b).abs().max().item()
        assert err <= 2 * base_err + 1e-6, (
            f"{name}: error {err:.3g} vs plain {dtype} torch {base_err:.3g}"
        )


def test_leading_dims_and_return_entropy_false(backend):
    h, w, y, _, _ = _case(12, 8, 64, torch.float32)
    lp, ent = linear_logprob_entropy(
        h.view(3, 4, 8), w, y.view(3, 4), backend=backend, return_entropy=False
    )
    assert lp.shape == (3, 4) and ent is None
    ref_lp, _ = linear_logprob_entropy_reference(h, w, y)
    torch.testing.assert_close(lp.reshape(-1).double(), ref_lp, rtol=1e-5, atol=1e-5)


def test_same_rows_same_result(backend):
    """Recomputing the same batch gives bit-identical log-probs (old_logp vs logp on-policy: ratio
    1).

    Not asserted: invariance to the batch's composition. MKL/cuBLAS pick their blocking by the
    matrix shape, so a row's log-prob can move in the last bits when other rows join the batch.
    """
    h, w, y, _, _ = _case(64, 16, 900, torch.float32)
    a, _ = linear_logprob_entropy(h, w, y, backend=backend)
    b, _ = linear_logprob_entropy(h.clone(), w.clone(), y, backend=backend)
    assert torch.equal(a, b)
    part, _ = linear_logprob_entropy(h[:7], w, y[:7], backend=backend)
    torch.testing.assert_close(a[:7], part, rtol=1e-6, atol=1e-5)


def test_backends_agree():
    if not native_available():
        pytest.skip("native library not built")
    h, w, y, g_lp, g_ent = _case(30, 20, 1100, torch.float32, seed=7)
    a = _run(
        linear_logprob_entropy, h, w, y, g_lp, g_ent, backend="native", chunk_bytes=4 * 30 * 256
    )
    b = _run(linear_logprob_entropy, h, w, y, g_lp, g_ent, backend="torch")
    for x, z in zip(a, b):
        torch.testing.assert_close(x, z, rtol=2e-5, atol=2e-5)


def test_bad_inputs_raise_clear_errors():
    h, w, y, _, _ = _case(4, 8, 16, torch.float32)
    with pytest.raises(IndexError, match="labels must lie"):
        linear_logprob_entropy(h, w, torch.tensor([0, 1, 16, 2]))
    with pytest.raises(ValueError, match="disagree on D"):
        linear_logprob_entropy(h[:, :7], w, y)
    with pytest.raises(TypeError, match="share a dtype"):
        linear_logprob_entropy(h.double(), w, y)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_entropy(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        linear_logprob_entropy(h, w, y, backend="cuda")


def test_tile_shape_respects_budget():
    for n, v, budget in [
        (16384, 151936, 1 << 30),
        (2048, 151936, 16 << 20),
        (10**6, 1000, 1 << 20),
        (3, 5, 1),
    ]:
        rows, cols = tile_shape(n, v, budget)
        assert 1 <= rows <= n and 1 <= cols <= v
        assert rows * cols * 4 <= max(budget, 4 * min(v, 256)), (n, v, budget, rows, cols)
