"""A NaN at a valid token reaches the gradient, on every backend; one at a masked token is ignored.

Expected values come from float64 autograd through TRL's GRPO formula (`_trl_loss`, no log-ratio
clamp; the batches keep |log-ratio| < 20, where ppo_loss's clamp is inactive): it turns a NaN
log-prob, old log-prob or advantage into a NaN gradient at that token (and, through the LM head, in
every weight-gradient entry), which is what lets a trainer's gradient-norm guard fire. TRL
multiplies by the mask, so a masked NaN would poison its loss: the reference gets a finite value
there (ppo_loss never reads masked tokens).
"""

import pytest
import torch
from prorl.kernels import linear_logprob_entropy_reference, linear_ppo_loss, ppo_loss

NAN = float("nan")
KW = dict(eps_low=0.2, eps_high=0.28, agg="token-mean")


def _trl_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, **_):
    """TRL 1.16 GRPOTrainer's per-token loss (loss_type="bnpo"), float64, differentiable in logp."""
    ratio = torch.exp(logp - old.double())
    adv = adv.double()
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    return (per_token * mask).sum() / mask.sum(), None


def _batch(where, dtype=torch.float32):
    """[2, 5] inputs; `where` names the input holding a NaN at the valid token (0, 1); every input
    also holds a NaN at the masked token (1, 4). Returns (inputs with NaNs, the same with the masked
    NaN -> 0)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 5, generator=g, dtype=dtype) * 2
    old = logp + 0.3 * torch.randn(2, 5, generator=g, dtype=dtype)
    adv = torch.randn(2, 5, generator=g, dtype=dtype)
    mask = torch.ones(2, 5)
    mask[1, 4] = 0
    named = {"logp": logp, "old": old, "adv": adv}
    finite = {k: v.clone() for k, v in named.items()}
    for v in named.values():
        v[1, 4] = NAN
    if where is not None:
        named[where][0, 1] = NAN
        finite[where][0, 1] = NAN
    return named, finite, mask


@pytest.mark.parametrize("where", ["logp", "old", "adv"])
def test_ppo_loss_nan_at_a_valid_token_reaches_the_gradient(where, backend):
    named, finite, mask = _batch(where)
    x = named["logp"].clone().requires_grad_()
    loss, _ = ppo_loss(x, named["old"], named["adv"], mask, backend=backend, **KW)
    loss.backward()
    y = finite["logp"].double().requires_grad_()
    ref, _ = _trl_loss(y, finite["old"], finite["adv"], mask, **KW)
    ref.backward()
    assert torch.isnan(loss) and torch.isnan(ref)
    assert torch.isnan(x.grad[0, 1]) and torch.isnan(y.grad[0, 1])
    torch.testing.assert_close(x.grad.double(), y.grad, equal_nan=True, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(x.grad[mask.bool()].view(-1)[2:]).all() and x.grad[1, 4] == 0


def test_ppo_loss_nan_at_masked_tokens_is_ignored(backend):
    named, finite, mask = _batch(None)
    x = named["logp"].clone().requires_grad_()
    loss, _ = ppo_loss(x, named["old"], named["adv"], mask, backend=backend, **KW)
    loss.backward()
    y = finite["logp"].double().requires_grad_()
    ref, _ = _trl_loss(y, finite["old"], finite["adv"], mask, **KW)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=1e-5, atol=1e-7)


def _linear_case(where):
    g = torch.Generator().manual_seed(1)
    n, d, v = 10, 8, 24
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) * 0.3
    labels = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        logp = linear_logprob_entropy_reference(hidden.double(), weight.double(), labels)[0]
    old = (logp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(n, generator=g)
    mask = torch.ones(n)
    mask[9] = 0
    finite_old, finite_adv = old.clone(), adv.clone()
    old[9], adv[9] = NAN, NAN
    if where is not None:
        for t in (old, finite_old) if where == "old" else (adv, finite_adv):
            t[2] = NAN
    return hidden, weight, labels, old, adv, mask, finite_old, finite_adv


@pytest.mark.parametrize("where", [None, "old", "adv"])
def test_linear_ppo_loss_nan_handling(where, backend):
    hidden, weight, labels, old, adv, mask, finite_old, finite_adv = _linear_case(where)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = linear_ppo_loss(h, w, labels, old, adv, mask, backend=backend, **KW)
    loss.backward()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp_ref = linear_logprob_entropy_reference(hr, wr, labels)[0]
    ref, _ = _trl_loss(logp_ref, finite_old, finite_adv, mask, **KW)
    ref.backward()
    if where is None:  # masked NaNs only: ignored
        assert (
            torch.isfinite(loss) and torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
        )
    else:
        assert torch.isnan(loss) and torch.isnan(h.grad[2]).all() and torch.isnan(w.grad).all()
    torch.testing.assert_close(h.grad.double(), hr.grad, equal_nan=True, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), wr.grad, equal_nan=True, rtol=1e-4, atol=1e-6)
