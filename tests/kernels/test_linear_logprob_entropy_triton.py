"""linear_logprob_entropy, triton backend, on CPU tensors under the Triton interpreter.

The references are independent of the code under test: for the whole op, the plain unfused float64
computation (`linear_logprob_entropy_reference`, differentiated by autograd); for the two tile
kernels, their defining formulas evaluated in float64. Shapes are tiny because the interpreter is
slow; the interpreter block cap (128 columns) and small `chunk_bytes` still give several row blocks,
several vocabulary tiles, several column blocks per tile and a masked partial last block.

What this cannot check: compiled GPU code (register pressure, ex2.approx accuracy, the bf16/fp16
CUDA path of the driver, which multiplies in the input dtype); run the module's cases on a GPU for
that.
"""

import os

# before triton (or prorl, which may import it) is imported
os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")


def _interpreter_problem() -> str | None:
    """Why the triton kernels would not run interpreted in this process, or None."""
    knobs = getattr(triton, "knobs", None)
    on = knobs.runtime.interpret if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"
    if not on:
        return (
            "TRITON_INTERPRET is not 1 in this process (set to something else before this module)"
        )
    mod = sys.modules.get("prorl.kernels.linear_logprob_entropy_triton")
    # kernels are decorated at import: interpreted only if imported with the flag on
    if mod is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod._update_stats_kernel, InterpretedFunction):
            return (
                "the triton kernels were already compiled for GPU in this process (run this "
                "module alone)"
            )
    return None


if _interpreter_problem():
    pytest.skip(_interpreter_problem(), allow_module_level=True)

from prorl.kernels import linear_logprob_entropy, linear_logprob_entropy_reference  # noqa: E402
from prorl.kernels import linear_logprob_entropy_triton as tt  # noqa: E402
from prorl.kernels.linear_logprob_entropy import tile_shape  # noqa: E402


def _case(n, d, v, dtype, seed=0, scale=2.0, ignore=()):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * scale).to(dtype)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d) * 4).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[0], y[-1] = 0, v - 1  # the first and last vocabulary columns (first and last tile)
    for i in ignore:
        y[i] = -100
    return h, w, y, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _run(fn, h, w, y, g_lp, g_ent, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    lp, ent = fn(h, w, y, **kw)
    (lp * g_lp.to(lp.dtype) + ent * g_ent.to(ent.dtype)).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _triton(h, w, y, g_lp, g_ent, **kw):
    return _run(linear_logprob_entropy, h, w, y, g_lp, g_ent, backend="triton", **kw)


def _reference(h, w, y, g_lp, g_ent, temperature=1.0):
    h, w = h.double(), w.double()  # exact upcast of the same inputs; gradients come out in float64
    return _run(
        lambda a, b, c: linear_logprob_entropy_reference(a, b, c, temperature), h, w, y, g_lp, g_ent
    )


def _assert_close_fp32(got, ref, rtol=2e-5, atol=2e-5):
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(
            a.double(), b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


# --------------------------------------------------------------------------------------------------
# The whole op against the float64 reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,d,v,temperature,chunk_bytes",
    [
        # row blocks 3+3+1, vocab tiles 256+256+88: D odd, V odd-sized tail
        (7, 9, 600, 1.0, 4 * 3 * 256),
        (5, 6, 300, 0.7, 4 * 2 * 256),  # temperature < 1, 3 row blocks, tiles 256+44
        (6, 8, 200, 1.6, None),  # temperature > 1, one tile of 200 columns = 128 + masked 72
        (1, 5, 37, 1.0, None),  # N = 1, a single masked block of 64
    ],
)
def test_matches_float64_reference(n, d, v, temperature, chunk_bytes):
    rows, cols = tile_shape(n, v, chunk_bytes or (16 << 20))
    # the case really has several row/vocab tiles
    assert chunk_bytes is None or (rows < n and cols < v)
    h, w, y, g_lp, g_ent = _case(n, d, v, torch.float32, ignore=(1,) if n > 2 else ())
    got = _triton(h, w, y, g_lp, g_ent, temperature=temperature, chunk_bytes=chunk_bytes)
    _assert_close_fp32(got, _reference(h, w, y, g_lp, g_ent, temperature))
    if n > 2:  # the ignored row: exact zeros, and no gradient into its hidden state
        assert got[0][1] == 0 and got[1][1] == 0 and torch.all(got[2][1] == 0)


def test_all_rows_ignored_gives_zeros_not_nan():
    h, w, y, g_lp, g_ent = _case(4, 6, 150, torch.float32, ignore=range(4))
    for t in _triton(h, w, y, g_lp, g_ent, chunk_bytes=4 * 2 * 256):
        assert torch.all(t == 0), t  # t == 0 is False for NaN


def test_extreme_logits_no_nan():
    """Peaked rows where most probabilities underflow to 0 in fp32 (the 0 * -inf trap)."""
    h, w, y, g_lp, g_ent = _case(4, 8, 160, torch.float32, scale=60.0)
    got = _triton(h, w, y, g_lp, g_ent)
    assert all(torch.isfinite(t).all() for t in got)
    ref = _reference(h, w, y, g_lp, g_ent)
    torch.testing.assert_close(got[1].double(), ref[1], rtol=1e-4, atol=1e-4)  # entropy
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-5, atol=1e-3)  # logp (|z| ~ 1e3)


def test_entropy_unused_and_leading_dims():
    """return_entropy=False: backward gets no entropy gradient (None upstream); [B, T, D] input."""
    h, w, y, g_lp, _ = _case(6, 4, 90, torch.float32, seed=2)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    hb, yb = hh.view(2, 3, 4), y.view(2, 3)
    lp, ent = linear_logprob_entropy(hb, ww, yb, backend="triton", return_entropy=False)
    assert lp.shape == (2, 3) and ent is None
    (lp.reshape(-1) * g_lp).sum().backward()
    ref = _reference(h, w, y, g_lp, torch.zeros_like(g_lp))
    for a, b in zip((lp.detach().reshape(-1), hh.grad, ww.grad), (ref[0], ref[2], ref[3])):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)


def test_bf16_within_small_multiple_of_plain_torch_error():
    """bf16 inputs: fp32 outputs; error at most 2x that of the same unfused chain run in plain bf16.

    (flash-attention's criterion.) Both are measured against float64 on the same bf16-rounded
    inputs. On the CPU the driver upcasts the tiles to fp32, so the kernels' own error is far below
    the bound; the gradients are returned in bf16 and their rounding is what the comparison mostly
    sees.
    """
    h, w, y, g_lp, g_ent = _case(6, 10, 300, torch.bfloat16, seed=4, ignore=(2,))
    got = _triton(h, w, y, g_lp, g_ent, chunk_bytes=4 * 4 * 256)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    ref = _reference(h, w, y, g_lp, g_ent)

    def plain(a, b, c):
        logprobs = torch.log_softmax(a @ b.t(), -1)
        valid = c != -100
        lp = logprobs.gather(1, torch.where(valid, c, 0)[:, None]).squeeze(1)
        return lp * valid, -(logprobs.exp() * logprobs).sum(-1) * valid

    base = _run(plain, h, w, y, g_lp, g_ent)
    for name, a, b, p in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, base):
        err = (a.double() - b).abs().max().item()
        base_err = (p.double() - b).abs().max().item()
        assert base_err > 0, name  # the bound is not vacuous
        assert err <= 2 * base_err + 1e-6, (
            f"{name}: error {err:.3g} vs plain bf16 torch {base_err:.3g}"
        )


# --------------------------------------------------------------------------------------------------
# The two tile kernels against their formulas in float64 (several column blocks, strided tiles)
# --------------------------------------------------------------------------------------------------


def _stats_reference(z, labels):
    """(m, s, b, z_y) of the module docstring from the full float64 logits z [r, V]."""
    m = z.amax(1)
    e = torch.exp(z - m[:, None])
    return m, e.sum(1), ((z - m[:, None]) * e).sum(1), z.gather(1, labels[:, None]).squeeze(1)


@pytest.mark.parametrize("transposed", [False, True])
def test_update_stats_over_tiles(transposed):
    g = torch.Generator().manual_seed(5)
    r, v, inv_t = 5, 100, 1 / 0.8
    x = torch.randn(r, v, generator=g) * 5
    x[3] += 40.0  # a row whose max arrives late relative to its first tile
    x[4] -= 150.0  # all logits negative: a masked lane read as 0 instead of -inf would be the max
    labels = torch.tensor([0, 99, 37, 38, 64])
    m, s, b, zy = torch.full((r,), -3.0e38), torch.zeros(r), torch.zeros(r), torch.zeros(r)
    for c0, c1 in ((0, 37), (37, 64), (64, 100)):  # uneven tiles; block_v=16 leaves masked tails
        tile = x[:, c0:c1].clone()
        if transposed:  # same values, column-major storage
            tile = tile.t().contiguous().t()
        before = tile.clone()
        tt.update_stats(tile, labels, c0, inv_t, m, s, b, zy, block_v=16)
        assert torch.equal(tile, before)  # the tile is only read
    ref = _stats_reference(x.double() * inv_t, labels)
    for name, a, e in zip("msbz", (m, s, b, zy), ref):
        torch.testing.assert_close(
            a.double(), e, rtol=1e-5, atol=1e-5, msg=lambda msg, n=name: f"{n}: {msg}"
        )


@pytest.mark.parametrize("transposed", [False, True])
def test_tile_grad_formula_and_exact_zero_rows(transposed):
    g = torch.Generator().manual_seed(6)
    r, cols, c0, inv_t = 6, 45, 20, 1 / 1.3
    full = torch.randn(r, 80, generator=g) * 3  # raw logits of all 80 columns
    z64 = full.double() * inv_t
    lse = torch.logsumexp(z64, 1)
    ez = (torch.softmax(z64, 1) * z64).sum(1)
    g_lp, g_ent = torch.randn(r, generator=g), torch.randn(r, generator=g)
    g_lp[2] = g_ent[2] = 0.0  # an ignored row
    g_ent[4] = 0.0  # logp gradient only
    g_lp[5] = 0.0  # entropy gradient only
    # inside the tile (cols 20..64) for rows 0, 1, 2, 4
    labels = torch.tensor([20, 64, 30, 3, 40, 79])
    x = full[:, c0 : c0 + cols].clone()
    if transposed:
        x = x.t().contiguous().t()
    lse32, ez32 = lse.float(), ez.float()
    lse32[2] = ez32[2] = float("nan")  # whatever the ignored row's statistics, its gradient is zero
    tt.tile_grad(x, labels, c0, inv_t, lse32, ez32, g_lp, g_ent, block_v=16)

    z = z64[:, c0 : c0 + cols]
    p = torch.exp(z - lse[:, None])
    ref = -(g_lp.double()[:, None] + g_ent.double()[:, None] * (z - ez[:, None])) * p
    local = labels - c0
    for i in range(r):
        if 0 <= local[i] < cols:
            ref[i, local[i]] += g_lp[i]
    torch.testing.assert_close(x.double(), ref, rtol=1e-5, atol=1e-6)
    # exact +0 on the ignored row
    assert torch.equal(x[2], torch.zeros(cols)) and not x[2].signbit().any()


def test_launch_config_and_input_checks():
    assert tt._launch_config(torch.empty(2, 37)) == (64, 4)
    assert tt._launch_config(torch.empty(2, 1000))[0] == tt._MAX_BLOCK_V_INTERPRETER
    x, lab, row = torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64), torch.zeros(3)
    with pytest.raises(ValueError, match="float32"):
        tt.update_stats(x.double(), lab, 0, 1.0, row, row, row, row)
    with pytest.raises(ValueError, match="int64"):
        tt.tile_grad(x, lab.int(), 0, 1.0, row, row, row, row)
    with pytest.raises(ValueError, match="overlap"):
        tt.tile_grad(torch.zeros(8).expand(3, 8), lab, 0, 1.0, row, row, row, row)
