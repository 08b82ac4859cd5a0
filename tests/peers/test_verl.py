"""verl_policy_loss against verl 0.9.1 itself, called the way verl calls a registered policy loss.

The expected numbers come from verl's own `compute_policy_loss_vanilla` (looked up by its registered
name, "vanilla"), on the same float64 inputs and the same real actor config. Needs verl in the
environment: .ci/peers.sh installs it (with --no-deps) in a separate venv and runs this directory
there.
"""

import math

import pytest
import torch
from peer_stubs import VERL_STUBS, adapters_snippet, stub_missing

stub_missing("verl", VERL_STUBS)
core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not installed here (.ci/peers.sh installs verl 0.9.1)",
)
from prorl.kernels.adapters import verl_policy_loss  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402

MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]
SHAPES = [(1, 1), (3, 7), (16, 64)]
TOL = dict(rtol=1e-9, atol=1e-12)
METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def _config(**kw):
    kw = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5) | kw
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kw)


def _batch(b, t, seed, mask_dtype=torch.float64):
    """Random [b, t] inputs: clipping on both sides, dual-clip caps, |log-ratio| > 20, an empty
    row."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.8
    far = torch.rand(b, t, generator=g) < 0.1  # log-ratios beyond the +-20 clamp
    old = torch.where(
        far, logp + 25 * torch.sign(torch.randn(b, t, generator=g, dtype=torch.float64)), old
    )
    adv = torch.randn(b, t, generator=g, dtype=torch.float64) * 1.5
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if b > 1:
        lengths[0], lengths[-1] = t, 0  # a full row and an empty one
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(mask_dtype)
    isw = torch.exp(torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3)
    return logp, old, adv, mask, isw


def _global_info(mask, kind):
    """config.global_batch_info as verl's engines fill it: this micro-batch is a share of a larger
    batch."""
    if kind == "none":
        return {}
    tokens, rows = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    info = dict(
        dp_size=2,
        batch_num_tokens=3 * tokens + 1,
        global_batch_size=3 * rows + 2,
        loss_scale_factor=None,
    )
    if kind == "tensor":  # counts as device tensors, and a fixed loss_scale_factor
        info.update(
            batch_num_tokens=torch.tensor(info["batch_num_tokens"]),
            loss_scale_factor=2 * mask.shape[1] + 1,
        )
    return info


def _call(name, logp, old, adv, mask, isw, mode, config):
    """verl's call of a registered policy loss (verl/workers/utils/losses.py), and the gradient."""
    x = logp.clone().requires_grad_()
    fn = core_algos.get_policy_loss_fn(name)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=x,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=isw,
    )
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The registration of kernels/ADAPTERS.md, run as written."""
    exec(adapters_snippet("verl-python"), {})
    assert core_algos.get_policy_loss_fn("prorl") is verl_policy_loss


@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("info_kind", ["none", "ints", "tensor"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_verl(shape, mode, info_kind, with_is):
    logp, old, adv, mask, isw = _batch(*shape, seed=10 * SHAPES.index(shape) + MODES.index(mode))
    isw = isw if with_is else None
    config = _config()
    config.global_batch_info.update(_global_info(mask, info_kind))
    theirs = _call("vanilla", logp, old, adv, mask, isw, mode, config)
    ours = _call("prorl", logp, old, adv, mask, isw, mode, config)
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    torch.testing.assert_close(
        ours[1], theirs[1], rtol=1e-9, atol=1e-12 * theirs[1].abs().max().item()
    )
    assert set(ours[2]) == set(theirs[2]) == set(METRICS)
    for k in METRICS:
        assert isinstance(ours[2][k], float)
        assert ours[2][k] == pytest.approx(theirs[2][k], rel=1e-9, abs=1e-12), k
    if shape == (16, 64):  # the random batch reaches every branch
        valid = mask > 0
        assert ((logp - old).abs()[valid] > 20).any() and (mask.sum(-1) == 0).any()
        assert theirs[2]["actor/pg_clipfrac"] > 0 and theirs[2]["actor/pg_clipfrac_lower"] > 0
        assert theirs[1].abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
def test_bool_mask_as_verl_engines_pass_it(mode):
    """verl's ppo_loss passes response_mask.to(bool): verl's clip fractions are then float32."""
    logp, old, adv, mask, isw = _batch(8, 33, seed=3, mask_dtype=torch.bool)
    config = _config()
    config.global_batch_info.update(_global_info(mask, "ints"))
    theirs = _call("vanilla", logp, old, adv, mask, isw, mode, config)
    ours = _call("prorl", logp, old, adv, mask, isw, mode, config)
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    torch.testing.assert_close(
        ours[1], theirs[1], rtol=1e-9, atol=1e-12 * theirs[1].abs().max().item()
    )
    for k in METRICS:
        assert ours[2][k] == pytest.approx(theirs[2][k], rel=1e-6, abs=1e-9), k


def test_config_defaults_and_dictconfig():
    """clip_ratio_low/high None fall back to clip_ratio; a DictConfig without clip_ratio_c gets
    verl's 3.0."""
    from omegaconf import OmegaConf

    logp, old, adv, mask, isw = _batch(6, 12, seed=4)
    adv = adv * 3  # so that the default dual clip (c = 3) caps something
    config = OmegaConf.create(
        dict(clip_ratio=0.25, clip_ratio_low=None, clip_ratio_high=None, global_batch_info={})
    )
    theirs = _call("vanilla", logp, old, adv, mask, None, "token-mean", config)
    ours = _call("prorl", logp, old, adv, mask, None, "token-mean", config)
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    assert ours[2] == pytest.approx(theirs[2], rel=1e-9, abs=1e-12)
    assert theirs[2]["actor/pg_clipfrac_lower"] > 0


def test_dp_size_without_global_counts_is_refused_as_in_verl():
    logp, old, adv, mask, _ = _batch(3, 5, seed=5)
    config = _config()
    config.global_batch_info.update(dp_size=2)
    for mode, key in (
        ("token-mean", "batch_num_tokens"),
        ("seq-mean-token-mean", "global_batch_size"),
    ):
        with pytest.raises(ValueError, match="required when dp_size > 1"):
            _call("vanilla", logp, old, adv, mask, None, mode, config)
        with pytest.raises(ValueError, match=key):
            _call("prorl", logp, old, adv, mask, None, mode, config)


# --------------------------------------------------------------------------------------------------
# The verl-config snippet of kernels/ADAPTERS.md, through verl's own plugin import and its engine
# loss
# --------------------------------------------------------------------------------------------------


def _engine_loss(config, logp, old, adv, mask, isw, prompt_len=2):
    """verl.workers.utils.losses.ppo_loss, the loss verl's engine workers run per micro-batch, on a
    padded batch; returns (policy loss, d loss / d logp, metrics). The model's flat log-probs hold
    `logp` at the positions verl slices the response from (one before each response token)."""
    import tensordict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    b, t = logp.shape
    lengths = mask.sum(-1).long()
    valid = mask.bool()
    # where row j's response log-probs start
    starts = torch.cumsum(prompt_len + lengths, 0) - lengths - 1
    positions = (starts[:, None] + torch.arange(t)[None, :])[valid]
    flat = torch.zeros(int((prompt_len + lengths).sum()), dtype=logp.dtype)
    flat[positions] = logp[valid]
    flat.requires_grad_()
    attention = torch.cat([torch.ones(b, prompt_len), mask.float()], dim=1).long()
    fields = dict(
        prompts=torch.ones(b, prompt_len, dtype=torch.long),
        responses=torch.ones(b, t, dtype=torch.long),
        attention_mask=attention,
        response_mask=mask.long(),
        old_log_probs=old,
        advantages=adv,
    )
    if isw is not None:
        fields["rollout_is_weights"] = isw
    data = tensordict.TensorDict(fields, batch_size=[b])
    tokens, rows = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    tu.assign_non_tensor(data, dp_size=2, batch_num_tokens=3 * tokens, global_batch_size=3 * rows)
    loss, metrics = ppo_loss(config, {"log_probs": flat}, data)
    (grad,) = torch.autograd.grad(loss, flat)
    return (
        loss.detach(),
        grad,
        {k: v.aggregate() if hasattr(v, "aggregate") else v for k, v in metrics.items()},
    )


@pytest.mark.parametrize("mode", MODES)
def test_config_snippet_runs_in_verls_engine_loss(mode):
    import sys

    from omegaconf import OmegaConf
    from verl.utils.import_utils import import_external_libs

    overrides = OmegaConf.from_dotlist(adapters_snippet("verl-config").split())
    # a fresh worker: nothing registered "prorl" yet; verl imports the model config's external_lib
    core_algos.POLICY_LOSS_REGISTRY.pop("prorl", None)
    sys.modules.pop(overrides.actor_rollout_ref.model.external_lib, None)
    import_external_libs(overrides.actor_rollout_ref.model.external_lib)
    loss_mode = overrides.actor_rollout_ref.actor.policy_loss.loss_mode
    assert core_algos.get_policy_loss_fn(loss_mode) is verl_policy_loss

    logp, old, adv, mask, isw = _batch(5, 9, seed=6)
    mask[1, :] = 0  # an empty response (still has its prompt)
    results = []
    for name in ("vanilla", loss_mode):
        config = _config(loss_agg_mode=mode, policy_loss=PolicyLossConfig(loss_mode=name))
        results.append(_engine_loss(config, logp, old, adv, mask, isw))
    theirs, ours = results
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    assert theirs[1].abs().sum() > 0
    assert set(ours[2]) == set(theirs[2])
    for k in theirs[2]:  # the engine passes a bool mask: verl's clip fractions are float32 there
        rel = 1e-6 if "clipfrac" in k else 1e-9
        assert ours[2][k] == pytest.approx(theirs[2][k], rel=rel, abs=1e-12), k
    assert math.isfinite(theirs[2]["actor/pg_loss"])
