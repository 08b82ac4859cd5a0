"""OpenRLHFPolicyLoss against OpenRLHF 0.11.2: its PolicyLoss, its normalisers, its actor's step.

The expected numbers come from OpenRLHF's own `openrlhf.models.loss.PolicyLoss` on the same float64
inputs, with the global normalisers computed by OpenRLHF's own `openrlhf.utils.loss_utils`; the
snippet of kernels/ADAPTERS.md is run and then OpenRLHF's own `ActorPPOTrainer` builds and calls the
loss. Needs openrlhf in the environment: .ci/peers.sh installs it (with --no-deps) in a separate
venv.
"""

from types import SimpleNamespace

import pytest
import torch
from peer_stubs import OPENRLHF_STUBS, adapters_snippet, stub_missing

stub_missing("openrlhf", OPENRLHF_STUBS)
orl_loss = pytest.importorskip(
    "openrlhf.models.loss",
    reason="openrlhf is not installed here (.ci/peers.sh installs openrlhf 0.11.2)",
)
from openrlhf.utils import loss_utils  # noqa: E402
from prorl.kernels.adapters import OpenRLHFPolicyLoss  # noqa: E402

SHAPES = [(1, 1), (3, 7), (16, 64)]
IS_SETTINGS = {
    "off": {},
    "mask": dict(
        is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.7, 1.6)
    ),
    "clip": dict(
        is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.7, 1.6)
    ),
}
NAMES = ("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio")


def _batch(b, t, seed, mask_dtype=torch.float64):
    """Random [b, t] inputs: clipping on both sides, dual-clip caps, |log-ratio| > 20, IS weights
    outside the band on both sides, an empty row."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.8
    far = torch.rand(b, t, generator=g) < 0.1
    old = torch.where(
        far, logp + 25 * torch.sign(torch.randn(b, t, generator=g, dtype=torch.float64)), old
    )
    rollout = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(b, t, generator=g, dtype=torch.float64) * 1.5
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if b > 1:
        lengths[0], lengths[-1] = t, 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(mask_dtype)
    return logp, old, rollout, adv, mask


def _batch_info(mask, kind, seed):
    """The normaliser keywords OpenRLHF's actor passes, from OpenRLHF's own loss_utils."""
    if kind == "none":  # PolicyLoss's defaults: this call's masked means
        return {}
    if kind == "local":  # what training_step computes for one micro-batch on one process
        return loss_utils.get_loss_batch_info(None, mask)
    # an optimizer step of two micro-batches (gradient accumulation) on each of two data-parallel
    # ranks
    # more rows than this one
    other = _batch(mask.shape[0] + 3, mask.shape[1], seed=seed + 1000)[-1]
    info = loss_utils._optimizer_step_loss_norm([mask, other], None, 2, 2)
    # the other rank's share too
    return {k: v * 2 if torch.is_tensor(v) else v for k, v in info.items()}


def _run(cls, kw, logp, old, rollout, adv, mask, info):
    x = logp.clone().requires_grad_()
    out = cls(**kw)(x, old, adv, action_mask=mask, rollout_log_probs=rollout, **info)
    assert len(out) == 5
    out[0].backward()
    return out, x.grad


def _assert_same(ours, theirs, rel=1e-9):
    (o, og), (t, tg) = ours, theirs
    for name, a, b in zip(NAMES, o, t):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(
            a.detach().double(), b.detach().double(), rtol=rel, atol=1e-12, msg=name
        )
    torch.testing.assert_close(og, tg, rtol=1e-9, atol=1e-12 * tg.abs().max().item())


@pytest.mark.parametrize("info_kind", ["none", "local", "global"])
@pytest.mark.parametrize("is_setting", list(IS_SETTINGS))
@pytest.mark.parametrize("dual_clip", [None, 1.5])
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_openrlhf(shape, token_level_loss, dual_clip, is_setting, info_kind):
    seed = 10 * SHAPES.index(shape) + 2 * token_level_loss + (dual_clip is not None)
    logp, old, rollout, adv, mask = _batch(*shape, seed=seed)
    kw = dict(
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, token_level_loss=token_level_loss
    )
    kw.update(IS_SETTINGS[is_setting])
    info = _batch_info(mask, info_kind, seed)
    theirs = _run(orl_loss.PolicyLoss, kw, logp, old, rollout, adv, mask, info)
    ours = _run(OpenRLHFPolicyLoss, kw, logp, old, rollout, adv, mask, info)
    _assert_same(ours, theirs)
    if shape == (16, 64):  # the random batch reaches every branch
        valid = mask > 0
        assert ((logp - old).abs()[valid] > 20).any() and (mask.sum(-1) == 0).any()
        assert theirs[0][1] > 0 and theirs[1].abs().sum() > 0
        if is_setting != "off":
            w = torch.exp(old - rollout)[valid]
            assert (w < 0.7).any() and (w > 1.6).any() and theirs[0][4] > 0


@pytest.mark.parametrize("is_setting", list(IS_SETTINGS))
@pytest.mark.parametrize("token_level_loss", [True, False])
def test_bool_mask_as_openrlhf_passes_it(token_level_loss, is_setting):
    """OpenRLHF's action_mask is a bool tensor: its clip and filter fractions are float32 then."""
    logp, old, rollout, adv, mask = _batch(8, 33, seed=7, mask_dtype=torch.bool)
    kw = dict(token_level_loss=token_level_loss, dual_clip=2.0) | IS_SETTINGS[is_setting]
    info = _batch_info(mask, "global", 7)
    theirs = _run(orl_loss.PolicyLoss, kw, logp, old, rollout, adv, mask, info)
    ours = _run(OpenRLHFPolicyLoss, kw, logp, old, rollout, adv, mask, info)
    _assert_same(ours, theirs, rel=1e-6)


def test_without_mask():
    logp, old, rollout, adv, _ = _batch(4, 6, seed=8)
    theirs = _run(orl_loss.PolicyLoss, {}, logp, old, rollout, adv, None, {})
    ours = _run(OpenRLHFPolicyLoss, {}, logp, old, rollout, adv, None, {})
    _assert_same(ours, theirs)


@pytest.mark.parametrize(
    "kw,named",
    [
        (dict(policy_loss_type="gspo"), "policy_loss_type 'gspo'"),
        (dict(is_correction_level="seq"), "is_correction_level='seq'"),
        (
            dict(
                is_correction_level="token",
                is_correction_gating="tv",
                is_correction_threshold=(0, 0.1),
            ),
            "'tv'",
        ),
    ],
)
def test_settings_openrlhf_has_and_we_do_not_fuse_are_refused_by_name(kw, named):
    orl_loss.PolicyLoss(**kw)  # a valid OpenRLHF setting
    with pytest.raises(ValueError, match=named):
        OpenRLHFPolicyLoss(**kw)


@pytest.mark.parametrize(
    "kw,named", [(dict(dual_clip=0.9), "dual_clip"), (dict(is_correction_mode="drop"), "mode")]
)
def test_invalid_settings_are_refused_as_in_openrlhf(kw, named):
    with pytest.raises((AssertionError, ValueError), match=named):
        orl_loss.PolicyLoss(**kw)
    with pytest.raises(ValueError, match=named):
        OpenRLHFPolicyLoss(**kw)


# --------------------------------------------------------------------------------------------------
# The snippet of kernels/ADAPTERS.md, then OpenRLHF's own ActorPPOTrainer builds and calls the loss
# --------------------------------------------------------------------------------------------------


def _actor_args(**actor):
    """The parts of OpenRLHF's config that ActorPPOTrainer.__init__ and training_step read."""
    ns = SimpleNamespace
    actor = (
        dict(
            eps_clip_low_high=(0.2, 0.28),
            dual_clip=1.5,
            loss_agg_mode="token-mean",
            policy_loss_type="ppo",
            aux_loss_coef=0.0,
            entropy_coef=None,
        )
        | actor
    )
    return ns(
        train=ns(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False),
        actor=ns(**actor),
        algo=ns(
            advantage=ns(
                is_correction_level="token",
                is_correction_mode="mask",
                is_correction_gating="ratio",
                is_correction_threshold=(0.7, 1.6),
            ),
            kl=ns(use_loss=True, init_coef=0.01, estimator="k3", unbiased_gradient=False),
        ),
        ds=ns(packing_samples=False),
        vllm=ns(sync_backend="gloo"),
    )


def _training_step(ppo_actor, args, batch, loss_batch_info):
    """ActorPPOTrainer(...).training_step(experience, ...) on one micro-batch; (metrics, d loss / d
    logp)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    logp, old, rollout, adv, mask = batch
    x = logp.clone().requires_grad_()
    base = logp + torch.randn(
        logp.shape, generator=torch.Generator().manual_seed(0), dtype=logp.dtype
    )
    strategy = SimpleNamespace(
        args=args,
        ring_attn_group=None,
        backward=lambda loss, model, optim: loss.backward(),
        optimizer_step=lambda *a, **k: None,
        get_grad_norm=lambda model: 0.0,
    )

    class Actor:  # the policy model: its forward returns our log-probs
        def train(self):
            pass

        def __call__(self, *args, **kwargs):
            return x, SimpleNamespace(aux_loss=None)

    scheduler = SimpleNamespace(get_last_lr=lambda: [1e-6])
    trainer = ppo_actor.ActorPPOTrainer(strategy, Actor(), None, None, scheduler)
    experience = Experience(
        sequences=torch.ones(mask.shape, dtype=torch.long),
        attention_mask=torch.ones(mask.shape, dtype=torch.long),
        action_mask=mask,
        action_log_probs=old,
        base_action_log_probs=base,
        rollout_log_probs=rollout,
        advantages=adv,
    )
    out = trainer.training_step(experience, kl_ctl=0.01, step=0, loss_batch_info=loss_batch_info)
    return trainer.actor_loss_fn, out["metrics"], x.grad


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("window", [False, True])
def test_snippet_in_openrlhfs_actor_training_step(monkeypatch, loss_agg_mode, window):
    stub_missing("openrlhf", OPENRLHF_STUBS)
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    # what ActorPPOTrainer.__init__ needs a GPU or a process group for, and the loss does not use
    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *a, **k: None)
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(ppo_actor, "PolicyLoss", orl_loss.PolicyLoss)
    args = _actor_args(loss_agg_mode=loss_agg_mode)
    batch = _batch(6, 10, seed=9, mask_dtype=torch.bool)
    # None: training_step computes it
    info = _batch_info(batch[-1], "global", 9) if window else None
    loss_fn, theirs, theirs_grad = _training_step(ppo_actor, args, batch, info)
    assert type(loss_fn) is orl_loss.PolicyLoss

    exec(adapters_snippet("openrlhf"), {})
    loss_fn, ours, ours_grad = _training_step(ppo_actor, args, batch, info)
    assert type(loss_fn) is OpenRLHFPolicyLoss
    assert loss_fn.token_level_loss == (loss_agg_mode == "token-mean") and loss_fn.dual_clip == 1.5

    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-9, atol=1e-12)
    assert theirs_grad.abs().sum() > 0
    assert set(ours) == set(theirs) and {
        "ppo_clip_ratio",
        "ppo_kl",
        "vllm_kl",
        "is_filter_ratio",
    } <= set(ours)
    for k, v in theirs.items():  # clip and filter fractions are float32 in OpenRLHF (bool mask)
        torch.testing.assert_close(
            torch.as_tensor(ours[k]).double(),
            torch.as_tensor(v).double(),
            rtol=1e-6,
            atol=1e-9,
            msg=k,
        )
