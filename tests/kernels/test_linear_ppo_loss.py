"""linear_ppo_loss (hidden states -> loss, 6NDV) against the float64 composition of two references.

The reference is `ppo_loss_reference(linear_logprob_entropy_reference(hidden, weight, labels, T),
...)`: full float64 logits, log_softmax, then the per-sequence loss loop, differentiated by autograd
w.r.t. hidden and weight. Nothing in it shares code with the fused path under test (row blocks of
stored logits, closed-form loss gradient computed during the forward). Every backend runs every
case: torch, native (when built), triton (CPU tensors under the interpreter; tiny shapes).
"""

import math

import pytest
import torch
from prorl.kernels import (
    linear_logprob_entropy,
    linear_logprob_entropy_reference,
    linear_ppo_loss,
    ppo_loss,
    ppo_loss_reference,
)

LOSS_OPTIONS = dict(ref_logp=None, kl_coef=0.2, kl_estimator="k3", dual_clip=1.5, eps_high=0.28)


def _case(shape=(40,), d=16, v=300, temperature=0.7, seed=0):
    """hidden [*shape, D], weight [V, D], labels (one ignored), and loss inputs around the true
    log-probs."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, d, generator=g)
    w = torch.randn(v, d, generator=g) / math.sqrt(d) * 3
    y = torch.randint(0, v, shape, generator=g)
    y.view(-1)[3] = -100
    y.view(-1)[0], y.view(-1)[-1] = 0, v - 1  # first and last vocabulary columns
    mask = torch.rand(shape, generator=g) > 0.2
    true_lp, _ = linear_logprob_entropy_reference(h, w, y, temperature)  # float64
    # old / ref log-probs near the true ones: ratios spread over every clip branch
    old = (true_lp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.4).float()
    ref = (true_lp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.4).float()
    isw = torch.exp(torch.randn(shape, generator=g) * 0.5)
    return h, w, y, old, ref, mask, isw


def _ours(h, w, y, old, adv, mask, **kw):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, metrics = linear_ppo_loss(hh, ww, y, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad, metrics


def _reference(h, w, y, old, adv, mask, *, temperature, entropy_coef=0.0, **kw):
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    lp, ent = linear_logprob_entropy_reference(hh, ww, y, temperature)
    valid = (mask != 0) & (y != -100)
    loss, metrics = ppo_loss_reference(lp, old, adv, valid, **kw)
    if entropy_coef:  # token-mean only: the entropy aggregated like the loss
        loss = loss - entropy_coef * (ent * valid).sum() / valid.sum()
    loss.backward()
    metrics["entropy_mean"] = float((ent.detach() * valid).sum() / valid.sum())
    return loss.detach(), hh.grad, ww.grad, metrics


def _compare(got, want):
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(got[2].double(), want[2], rtol=1e-4, atol=2e-6)
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0
    for k in (
        "pg_loss",
        "kl_loss",
        "num_tokens",
        "clipfrac_low",
        "clipfrac_high",
        "approx_kl",
        "entropy_mean",
    ):
        want_k = torch.as_tensor(want[3][k], dtype=torch.float64)
        torch.testing.assert_close(got[3][k].double(), want_k, rtol=1e-4, atol=2e-6, msg=k)


# one block of all 40 rows; 14 blocks, the last of 1 row
@pytest.mark.parametrize("rows", [None, 3])
def test_packed_token_mean_matches_reference(backend, rows):
    h, w, y, old, ref, mask, _ = _case()
    adv = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    kw = dict(LOSS_OPTIONS, ref_logp=ref, temperature=0.7)
    chunk = None if rows is None else 4 * w.shape[0] * rows
    got = _ours(h, w, y, old, adv, mask, backend=backend, chunk_bytes=chunk, **kw)
    want = _reference(h, w, y, old, adv, mask, **kw)
    _compare(got, want)
    assert (
        got[3]["clipfrac_low"] > 0 and got[3]["clipfrac_high"] > 0 and got[3]["dualclip_frac"] > 0
    )


def test_padded_seq_mean_with_is_weights(backend):
    h, w, y, old, ref, mask, isw = _case(shape=(3, 7), seed=2)
    adv = torch.tensor([1.0, -0.5, 0.8])
    kw = dict(
        ref_logp=ref,
        kl_coef=0.1,
        is_weights=isw,
        is_mode="tis",
        is_bounds=(0.5, 1.5),
        temperature=1.3,
    )
    kw["agg"] = "seq-mean-token-mean"
    got = _ours(h, w, y, old, adv, mask, backend=backend, chunk_bytes=4 * w.shape[0] * 5, **kw)
    want = _reference(h, w, y, old, adv, mask, **kw)
    _compare(got, want)
    assert 0 < got[3]["is_frac_modified"] < 1


def test_entropy_bonus(backend):
    h, w, y, old, _, mask, _ = _case(seed=3)
    adv = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    kw = dict(temperature=0.9, entropy_coef=0.05)
    got = _ours(h, w, y, old, adv, mask, backend=backend, chunk_bytes=4 * w.shape[0] * 8, **kw)
    want = _reference(h, w, y, old, adv, mask, **kw)
    _compare(got, want)
    torch.testing.assert_close(
        got[3]["entropy_loss"].double(), torch.tensor(want[3]["entropy_mean"], dtype=torch.float64)
    )


def test_equals_the_unfused_composition(backend):
    """Same math as linear_logprob_entropy followed by ppo_loss, in one op (same backend, fp32)."""
    h, w, y, old, ref, mask, _ = _case(seed=5)
    adv = torch.randn(y.shape, generator=torch.Generator().manual_seed(6))
    kw = dict(LOSS_OPTIONS, ref_logp=ref)
    got = _ours(h, w, y, old, adv, mask, temperature=0.7, backend=backend, **kw)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, _ = linear_logprob_entropy(hh, ww, y, 0.7, backend=backend)
    loss, _ = ppo_loss(lp, old, adv, mask & (y != -100), backend=backend, **kw)
    loss.backward()
    torch.testing.assert_close(got[0], loss.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], hh.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[2], ww.grad, rtol=1e-4, atol=1e-7)


def test_bf16_inputs(backend):
    """bf16 hidden/weight: fp32 arithmetic, compared with float64 on the same (rounded) inputs."""
    h, w, y, old, ref, mask, _ = _case(seed=7)
    h, w = h.bfloat16(), w.bfloat16()
    adv = torch.randn(y.shape, generator=torch.Generator().manual_seed(8))
    kw = dict(ref_logp=ref, kl_coef=0.1, temperature=0.7)
    got = _ours(h, w, y, old, adv, mask, backend=backend, chunk_bytes=4 * w.shape[0] * 6, **kw)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    want = _reference(h.float(), w.float(), y, old, adv, mask, **kw)
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-4, atol=2e-6)
    # the gradients are rounded to bf16 once at the end: 2^-8 relative
    torch.testing.assert_close(got[1].double(), want[1], rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(got[2].double(), want[2], rtol=8e-3, atol=1e-5)


def test_all_masked_gives_zero_loss_and_grads(backend):
    h, w, y, old, ref, mask, _ = _case(seed=9)
    adv = torch.ones(y.shape)
    loss, gh, gw, m = _ours(
        h, w, y, old, adv, torch.zeros_like(mask), ref_logp=ref, kl_coef=0.1, backend=backend
    )
    assert loss.item() == 0.0 and (gh == 0).all() and (gw == 0).all()
    assert all(torch.isfinite(t).all() for t in m.values())


def test_upstream_scale_frozen_head_and_no_grad(backend):
    h, w, y, old, _, mask, _ = _case(seed=10)
    adv = torch.randn(y.shape, generator=torch.Generator().manual_seed(11))
    base = _ours(h, w, y, old, adv, mask, backend=backend)
    hh = h.clone().requires_grad_()
    loss, _ = linear_ppo_loss(hh, w, y, old, adv, mask, backend=backend)  # LM head frozen
    (3.0 * loss).backward(retain_graph=True)
    torch.testing.assert_close(hh.grad, 3.0 * base[1])
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()  # the gradients were scaled in place: a second backward would be wrong
    with torch.no_grad():
        loss, metrics = linear_ppo_loss(h, w, y, old, adv, mask, backend=backend)
    torch.testing.assert_close(loss, base[0])


def test_bad_input():
    h, w, y, old, _, mask, _ = _case()
    adv = torch.ones(y.shape)
    with pytest.raises(ValueError, match="leading dims"):
        linear_ppo_loss(h[:-1], w, y, old, adv, mask)
    with pytest.raises(TypeError, match="dtype"):
        linear_ppo_loss(h.double(), w.double(), y, old, adv, mask)
    bad = y.clone()
    bad[1] = w.shape[0]
    with pytest.raises(IndexError):
        linear_ppo_loss(h, w, bad, old, adv, mask)
    with pytest.raises(ValueError, match="agg"):
        linear_ppo_loss(h, w, y, old, adv, mask, agg="mean")


def test_on_policy_old_logp_none_and_per_token_outputs(backend):
    """old_logp=None: old is the current log-prob itself, detached (the float64 reference gets its
    own log-probs, detached, as TRL's on-policy shortcut does); metrics["logp"] / ["entropy"] are
    the per-token log-probs and entropies (0 at the ignored label)."""
    h, w, y, _, _, mask, _ = _case(seed=3)
    adv = torch.randn(40, generator=torch.Generator().manual_seed(4))
    ours = _ours(h, w, y, None, adv, mask, temperature=0.7, backend=backend, **LOSS_OPTIONS)
    true_lp, true_ent = linear_logprob_entropy_reference(h, w, y, 0.7)
    theirs = _reference(h, w, y, true_lp.detach(), adv, mask, temperature=0.7, **LOSS_OPTIONS)
    torch.testing.assert_close(ours[0].double(), theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1].double(), theirs[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[2].double(), theirs[2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[3]["logp"].double(), true_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[3]["entropy"].double(), true_ent, rtol=1e-5, atol=1e-5)
    assert ours[3]["logp"].view(-1)[3] == 0 and ours[3]["clipfrac"] == 0  # ignored label; ratio 1
