"""The Triton ppo_loss backend's launch structure under the Triton interpreter (CPU, tiny shapes).

On CUDA the op is ONE forward and ONE backward launch with no host sync. Here every Triton launch
is counted, and every torch op the call runs outside those launches is recorded (a
TorchDispatchMode): the forward must be exactly one `_forward_kernel` launch and the backward one
`_backward_kernel` launch, with nothing but allocations and views around them. Values are held to
`ppo_loss_reference` (float64, autograd). The interpreter runs a grid's programs one after another,
so these tests exercise the completion counter, the last-program reduction and the counter reset,
but not truly concurrent programs (tests/gpu/test_cuda_paths.py does). test_ppo_loss.py runs every
other case on this backend too.
"""

import contextlib

import pytest
import torch
from prorl.kernels import ppo_loss, ppo_loss_reference
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.usefixtures("triton_interpreted")

# ops that allocate or view, never compute (no kernel launch on CUDA, or a metadata-only one)
NO_LAUNCH = {
    "empty",
    "view",
    "detach",
    "select",
    "unbind",
    "alias",
    "_reshape_alias",
    "as_strided",
    "expand",
}


class _Recorder(TorchDispatchMode):
    """Torch ops run outside the counted Triton launches (the interpreter's own copies are
    inside)."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.inside = [], [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _CountingKernel:
    def __init__(self, kernel, name, rec):
        self.kernel, self.name, self.rec = kernel, name, rec

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.rec.launches.append(self.name)
            self.rec.inside = True
            try:
                return launch(*args, **kwargs)
            finally:
                self.rec.inside = False

        return run


@contextlib.contextmanager
def _record(monkeypatch):
    from prorl.kernels import ppo_loss_triton as T

    rec = _Recorder()
    for name in ("_forward_kernel", "_backward_kernel"):
        monkeypatch.setattr(T, name, _CountingKernel(getattr(T, name), name, rec))
    with rec:
        yield rec
    monkeypatch.undo()


def _batch(b=5, t=29, seed=0, dtype=torch.float32):
    """Padded [B, T] inputs spanning several 32-token programs, the last one partial; NaN in the
    padding."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    ref = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    lengths = torch.tensor([t, 1, t // 2, 0, t - 3])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    nan_pad = lambda x: torch.where(mask, x, float("nan")).to(dtype)
    return nan_pad(logp), nan_pad(old), adv.to(dtype), mask, nan_pad(ref)


def _warm_up():
    """The completion counter is created (zero-filled: one launch) on the first call per device and
    stream."""
    logp, old, adv, mask, _ = _batch()
    ppo_loss(logp, old, adv, mask, backend="triton")


KW = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator="k3", dual_clip=3.0)


def _reference(logp, old, adv, mask, ref, normalizer=None, upstream=1.0):
    clean = lambda x: torch.where(mask, x.double(), 0.0)
    lp = clean(logp).requires_grad_()
    loss, metrics = ppo_loss_reference(
        lp, clean(old), adv.double(), mask, ref_logp=clean(ref), normalizer=normalizer, **KW
    )
    (loss * upstream).backward()
    return loss.detach(), lp.grad, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("normalizer", [None, "tensor", "number"])
def test_one_forward_and_one_backward_launch(monkeypatch, dtype, normalizer):
    logp, old, adv, mask, ref = _batch(dtype=dtype)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    d = {None: None, "tensor": torch.tensor(100.0, dtype=cdt), "number": 100.0}[normalizer]
    lp = logp.clone().requires_grad_()
    upstream = torch.tensor(3.0, dtype=cdt)
    _warm_up()
    with _record(monkeypatch) as fwd:
        loss, metrics = ppo_loss(
            lp, old, adv, mask, ref_logp=ref, normalizer=d, backend="triton", **KW
        )
    assert fwd.launches == ["_forward_kernel"]
    assert set(fwd.ops) <= NO_LAUNCH, (
        f"forward ran torch compute ops: {sorted(set(fwd.ops) - NO_LAUNCH)}"
    )
    with _record(monkeypatch) as bwd:
        loss.backward(upstream)
    assert bwd.launches == ["_backward_kernel"]
    assert set(bwd.ops) <= NO_LAUNCH, (
        f"backward ran torch compute ops: {sorted(set(bwd.ops) - NO_LAUNCH)}"
    )

    want_loss, want_grad, want_m = _reference(
        logp, old, adv, mask, ref, d and float(d), upstream=3.0
    )
    tol = dict(rtol=1e-5, atol=1e-6) if dtype != torch.float64 else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(loss.double(), want_loss, **tol)
    assert lp.grad.dtype == dtype and bool(torch.isfinite(lp.grad).all())
    # the gradient is stored in bf16
    gtol = tol if dtype != torch.bfloat16 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(lp.grad.double(), want_grad.to(dtype).double(), **gtol)
    for key in (
        "clipfrac_low",
        "clipfrac_high",
        "dualclip_frac",
        "approx_kl",
        "kl_mean",
        "ratio_mean",
    ):
        torch.testing.assert_close(
            metrics[key].double(), torch.tensor(want_m[key], dtype=torch.float64), **tol
        )
    assert float(metrics["num_tokens"]) == want_m["num_tokens"] == float(mask.sum())


def test_packed_per_token_advantages_one_launch(monkeypatch):
    logp, old, adv, mask, ref = _batch(b=4, t=40, seed=1)
    adv_tok = adv[:, None].expand_as(logp).contiguous()
    flat = lambda x: x.reshape(-1)
    lp = flat(logp).clone().requires_grad_()
    args, one = (flat(old), flat(adv_tok), flat(mask)), torch.tensor(1.0)
    _warm_up()
    with _record(monkeypatch) as rec:
        loss, _ = ppo_loss(lp, *args, ref_logp=flat(ref), backend="triton", **KW)
        loss.backward(one)
    assert rec.launches == ["_forward_kernel", "_backward_kernel"]
    assert set(rec.ops) <= NO_LAUNCH, sorted(set(rec.ops) - NO_LAUNCH)
    want_loss, want_grad, _ = _reference(logp, old, adv, mask, ref)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.grad.double(), flat(want_grad), rtol=1e-5, atol=1e-6)


def test_completion_counter_left_at_zero_between_calls():
    """Each call leaves the last-program counter at 0, so the next call's reduction runs: three
    calls in a row each equal the float64 reference. (Bitwise determinism under concurrent programs
    needs a GPU: tests/gpu/test_cuda_paths.py; the interpreter runs programs one after another.)"""
    from prorl.kernels import ppo_loss_triton as T

    # 10 programs of 32 tokens, the last partial
    logp, old, adv, mask, ref = _batch(b=5, t=61, seed=2)
    want_loss, want_grad, _ = _reference(logp, old, adv, mask, ref)
    for _ in range(3):
        lp = logp.clone().requires_grad_()
        loss, _ = ppo_loss(lp, old, adv, mask, ref_logp=ref, backend="triton", **KW)
        loss.backward()
        assert all(int(c.item()) == 0 for c in T._counters.values()), "completion counter not reset"
        torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lp.grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_no_valid_token_deferred_count():
    logp, old, adv, mask, ref = _batch()
    none = torch.zeros_like(mask)
    lp = logp.clone().requires_grad_()
    loss, metrics = ppo_loss(lp, old, adv, none, ref_logp=ref, backend="triton", **KW)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(metrics["num_tokens"]) == 0.0
    assert torch.equal(lp.grad, torch.zeros_like(lp.grad))
