"""The verl and OpenRLHF adapters against transcriptions of those projects' own loss code.

Neither package installs here (verl needs its Ray/omegaconf stack, OpenRLHF needs flash-attn), so each
reference below is a minimal TRANSCRIPTION of the source it names, in plain torch, differentiated by
autograd. The TRL adapter is tested against TRL itself in test_trl_parity.py.
"""

import math

import pytest
import torch
from prorl.kernels.adapters import openrlhf_policy_loss, verl_policy_loss


def _batch(seed=0, b=5, t=8):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6
    ref = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 3.0  # some |k3| > 10: the clamp acts
    rollout = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    lengths = torch.tensor([8, 3, 1, 6, 5])[:b]  # every row has a token (verl's seq modes divide by it)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    adv = torch.randn(b, t, generator=g, dtype=torch.float64) * 1.5
    return logp, old, ref, rollout, mask, adv


def _grad(fn, logp, *args, **kw):
    x = logp.clone().requires_grad_()
    out = fn(x, *args, **kw)
    out[0].backward()
    return out, x.grad


# --------------------------------------------------------------------------------------------------
# TRANSCRIPTION of volcengine/verl, verl/trainer/ppo/core_algos.py @ 012be9d9 (compute_policy_loss_vanilla,
# agg_loss, kl_penalty) and verl/utils/torch_functional.py @ 03c8cca1 (masked_mean); the actor adds
# kl_loss * kl_loss_coef. Modes and estimators this adapter maps only.
# --------------------------------------------------------------------------------------------------


def _verl_masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def _verl_agg_loss(loss_mat, mask, mode):
    if mode == "token-mean":
        return _verl_masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        return torch.mean(torch.sum(loss_mat * mask, dim=-1))
    if mode == "seq-mean-token-mean":
        return torch.mean(torch.sum(loss_mat * mask, dim=-1) / torch.sum(mask, dim=-1))
    if mode == "seq-mean-token-sum-norm":
        return torch.sum(torch.sum(loss_mat * mask, dim=-1)) / mask.shape[-1]
    raise ValueError(mode)


def _verl_kl_penalty(logprob, ref_logprob, kind):
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # low_var_kl / k3
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def _verl_reference(log_prob, old_log_prob, advantages, response_mask, mode, lo, hi, c, ref, coef, kind):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = _verl_masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = _verl_agg_loss(pg_losses, response_mask, mode)
    if ref is not None:
        kld = _verl_kl_penalty(log_prob, ref, kind)
        pg_loss = pg_loss + _verl_agg_loss(kld, response_mask, mode) * coef
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


# end of the verl transcription


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("kind", [None, "low_var_kl", "k1", "mse"])
def test_verl_policy_loss(mode, kind):
    logp, old, ref, _, mask, adv = _batch(seed=1)
    ref = None if kind is None else ref
    lo, hi, c = 0.2, 0.28, 1.5  # c = 1.5 so that the dual clip acts on these ratios
    got, got_grad = _grad(
        lambda x, *a, **k: verl_policy_loss(old, x, *a, **k),  # verl's order: old_log_prob first
        logp,
        adv,
        mask,
        mode,
        clip_ratio_low=lo,
        clip_ratio_high=hi,
        clip_ratio_c=c,
        ref_log_prob=ref,
        kl_loss_coef=0.3,
        kl_loss_type=kind or "low_var_kl",
    )
    args = (old, adv, mask, mode, lo, hi, c, ref, 0.3, kind)
    want, want_grad = _grad(lambda x, *a: _verl_reference(x, *a), logp, *args)
    for name, g, w in zip(("loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"), got, want):
        tol = 1e-7 if "clipfrac" in name else 1e-10  # verl's clip fractions are fp32 (`.float()`)
        torch.testing.assert_close(g.double(), w.double().detach(), rtol=tol, atol=1e-12, msg=name)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    assert got[1] > 0 and got[3] > 0 and got_grad.abs().sum() > 0
    if kind == "low_var_kl":
        k3 = torch.exp(ref - logp) - (ref - logp) - 1
        assert ((k3 > 10) & (mask > 0)).any()  # the output clamp was exercised


def test_verl_defaults_are_symmetric_clip_with_dual_clip_on():
    logp, old, _, _, mask, adv = _batch(seed=2)
    got = verl_policy_loss(old, logp, adv, mask)
    want = _verl_reference(logp, old, adv, mask, "token-mean", 0.2, 0.2, 3.0, None, 0.0, None)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# TRANSCRIPTION of OpenRLHF/OpenRLHF, openrlhf/models/loss.py @ 09f5acef (PolicyLoss.forward) and
# openrlhf/models/utils.py @ 02a26057 (masked_mean, compute_approx_kl); the actor adds kl_loss * kl_coef with
# the KL aggregated by masked_mean. That PolicyLoss has no dual clip; the dual-clip lines follow the
# formula of KERNEL-NOTES.md (loss capped at -c A for A < 0), as in verl's above.
# --------------------------------------------------------------------------------------------------


def _orlhf_masked_mean(tensor, mask, dim=None):
    if mask is None:
        return tensor.mean(dim=dim)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def _orlhf_approx_kl(log_probs, log_probs_base, kl_estimator):
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k2":
        log_ratio = log_ratio**2 / 2.0
    if kl_estimator == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    return log_ratio


def _orlhf_reference(
    log_probs, old_log_probs, advantages, action_mask, lo, hi, token_level, dual, base, coef, est
):
    ratio = (log_probs - old_log_probs).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - lo, 1 + hi) * advantages
    loss = -torch.min(surr1, surr2)
    if dual is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual * advantages), loss)
    loss = (
        _orlhf_masked_mean(loss, action_mask, dim=None)
        if token_level
        else _orlhf_masked_mean(loss, action_mask, dim=-1).mean()
    )
    clip_ratio = _orlhf_masked_mean(torch.lt(surr2, surr1).float(), action_mask, dim=None)
    if base is not None:
        loss = loss + coef * _orlhf_masked_mean(_orlhf_approx_kl(log_probs, base, est), action_mask, dim=None)
    return loss, clip_ratio


# end of the OpenRLHF transcription


# OpenRLHF's actor takes a token mean of the KL; the adapter aggregates it like the policy term: KL cases
# only with token_level_loss
@pytest.mark.parametrize("token_level,est", [(True, None), (False, None), (True, "k1"), (True, "k3")])
@pytest.mark.parametrize("dual", [None, 1.5])
def test_openrlhf_policy_loss(token_level, dual, est):
    logp, old, ref, _, mask, adv = _batch(seed=3)
    base = None if est is None else ref.clamp(min=logp - 5, max=logp + 5)  # keep exp(k3) moderate
    got, got_grad = _grad(
        openrlhf_policy_loss,
        logp,
        old,
        adv,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=dual,
        token_level_loss=token_level,
        base_action_log_probs=base,
        kl_coef=0.1,
        kl_estimator=est or "k1",
    )
    args = (old, adv, mask, 0.2, 0.28, token_level, dual, base, 0.1, est)
    want, want_grad = _grad(lambda x, *a: _orlhf_reference(x, *a), logp, *args)
    tol = dict(rtol=1e-10, atol=1e-12) if est is None else dict(rtol=1e-6, atol=1e-8)  # its KL is fp32
    torch.testing.assert_close(got[0], want[0].detach(), **tol)
    torch.testing.assert_close(got[1].double(), want[1].double(), rtol=1e-7, atol=1e-12)  # fp32 there
    torch.testing.assert_close(got_grad, want_grad, **tol)


def test_openrlhf_without_mask_and_with_is_correction():
    logp, old, _, rollout, _, adv = _batch(seed=4)
    got = openrlhf_policy_loss(logp, old, adv)
    want = _orlhf_reference(logp, old, adv, None, 0.2, 0.2, True, None, None, 0.0, None)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    # the IS mapping is ours (no source above has it): tis = per-token loss times min(exp(old - rollout), hi)
    w = torch.exp(old - rollout)
    tis = openrlhf_policy_loss(
        logp, old, adv, rollout_log_probs=rollout, vllm_is_truncated_threshold=(0.5, 1.2)
    )
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    torch.testing.assert_close(tis[0], (per_token * w.clamp(max=1.2)).mean(), rtol=1e-10, atol=1e-12)
    assert math.isfinite(tis[0].item())
