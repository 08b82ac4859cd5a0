"""What a translated verl config trains, against verl 0.9.1's own functions: the advantage
estimators (`compute_grpo_outcome_advantage`,
`compute_reinforce_plus_plus_baseline_outcome_advantage`) and the optimizer (`build_optimizer`),
called on the inputs prorl gets, with prorl's settings from `--verl-config` (prorl/verl_compat)."""

import os

import pytest
import torch
from peer_stubs import VERL_STUBS, stub_missing

stub_missing("verl", VERL_STUBS)
core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not installed here (.ci/peers.sh installs verl 0.9.1)",
)
import numpy as np  # noqa: E402
from prorl.engine.optim import Optimizer  # noqa: E402
from prorl.kernels import group_advantages  # noqa: E402
from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer  # noqa: E402

from prorl.train import parse_config  # noqa: E402

VERL = os.path.dirname(core_algos.__file__)
PPO_TRAINER = os.path.join(os.path.dirname(VERL), "config", "ppo_trainer.yaml")
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
BASE = ["--verl-config", PPO_TRAINER, "trainer.total_training_steps=10", f"{R}n=4",
        "actor_rollout_ref.model.path=/m"]  # fmt: skip


def _cfg(*extra):
    return parse_config([*BASE, *extra])[0]


def _batch(seed, groups=5, n=4, t=7):
    """Rewards (some groups all equal, one of 0/1 rewards), response masks of varied length."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups * n,), generator=g).double()
    rewards[:n] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rewards[n : 2 * n] = 1.0
    rewards[2 * n :] += torch.rand(len(rewards) - 2 * n, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (groups * n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    token_rewards = torch.zeros(groups * n, t, dtype=torch.float64)
    token_rewards[torch.arange(groups * n), lengths - 1] = (
        rewards  # verl: the score on the last token
    )
    index = np.repeat(np.arange(groups), n)
    return rewards, lengths, mask, token_rewards, index


def _prorl_adv(cfg, rewards, lengths, n):
    a = cfg.algorithm
    groups = torch.arange(len(rewards) // n).repeat_interleave(n)
    return group_advantages(
        rewards, groups, mode=a.advantage, std_unbiased=a.grpo_std_unbiased,
        lengths=lengths.double(), weighting=a.whiten_weighting,
    )  # fmt: skip


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_is_verls_grpo(norm, seed):
    cfg = _cfg("algorithm.adv_estimator=grpo", f"algorithm.norm_adv_by_std_in_grpo={norm}")
    rewards, lengths, mask, token_rewards, index = _batch(seed)
    verl, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, index, norm_adv_by_std_in_grpo=norm
    )
    mine = _prorl_adv(cfg, rewards, lengths, 4)
    torch.testing.assert_close(mine[:, None] * mask, verl, rtol=1e-12, atol=1e-12)
    if norm:  # the numbers: rewards [1, 0, 0, 0] -> 1.5, not the population std's 1.732
        assert verl[0, 0].item() == pytest.approx(1.5, rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_plus_plus_baseline_is_verls_up_to_bessels_factor(seed):
    """verl whitens over the batch's T response tokens with the unbiased variance; prorl with the
    population one: prorl's advantages are verl's x sqrt(T / (T - 1)) (docs/verl.md says so)."""
    cfg = _cfg("algorithm.adv_estimator=reinforce_plus_plus_baseline")
    rewards, lengths, mask, token_rewards, index = _batch(seed)
    verl, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_rewards, mask, index
    )
    mine = _prorl_adv(cfg, rewards, lengths, 4)
    tokens = mask.sum()
    bessel = torch.sqrt(tokens / (tokens - 1))
    torch.testing.assert_close(mine[:, None] * mask, verl * bessel, rtol=1e-6, atol=1e-9)


def test_weight_decay_is_verls_adamw():
    """One AdamW step from the same weights and gradients: prorl's optimizer with the translated
    optim settings, verl's build_optimizer with the same verl keys."""
    keys = {"lr": 0.1, "weight_decay": 0.3, "betas": [0.8, 0.95]}
    no_clip = [f"{A}optim.clip_grad=1e9", f"{A}grad_clip=1e9"]  # verl clips outside its AdamW
    cfg = _cfg(
        *(f"{A}optim.{k}={v}" for k, v in keys.items()), *no_clip, "algorithm.adv_estimator=grpo"
    )
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
    theirs = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for p in (*ours.parameters(), *theirs.parameters()):
            p.add_(1.0)  # norm weights and biases away from 0, where decay shows
    x = torch.randn(5, 4, dtype=torch.float64)
    opt = Optimizer(ours, cfg.optim)
    verl_opt = build_optimizer(theirs.parameters(), FSDPOptimizerConfig(**keys))
    for model in (ours, theirs):
        model(x).square().sum().backward()
    opt.step()
    verl_opt.step()
    for mine, verls in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(mine, verls, rtol=1e-12, atol=1e-12)


def test_the_key_list_is_verls():
    """prorl/verl_compat/verl_0_9_1_ppo_trainer.json is verl's composed trainer config; the keys
    prorl takes from verl's dataclasses are fields of them, at those defaults; every key refused
    away from its default is one of verl's."""
    from verl.workers.config import RolloutConfig

    from prorl.verl_compat.files import flatten, load_file, resolve
    from prorl.verl_compat.keys import (
        CHANGES_TRAINING,
        DATACLASS_ONLY,
        VERL_TEMPLATE,
        default,
        known,
    )

    generated = os.path.join(os.path.dirname(PPO_TRAINER), "_generated_ppo_trainer.yaml")
    assert VERL_TEMPLATE == flatten(load_file(generated))
    verls = resolve(load_file(generated), [])
    assert {k: default(k) for k in verls} == verls
    fields = {f.name: f for f in RolloutConfig.__dataclass_fields__.values()}
    for key, value in DATACLASS_ONLY.items():
        name = key.rsplit(".", 1)[1]
        assert name in fields and key not in VERL_TEMPLATE
        assert fields[name].default == value
    assert all(known(k) for k in CHANGES_TRAINING)


def test_a_recipe_finds_verls_ppo_trainer_on_its_search_path(tmp_path):
    """`hydra.searchpath: [pkg://verl.trainer.config]` reads verl's own ppo_trainer.yaml; the
    copy prorl ships (used when verl is not installed) composes to the same run."""
    from prorl.verl_compat.files import load_file, resolve

    recipe = (
        "hydra:\n  searchpath:\n    - SEARCH\ndefaults:\n  - ppo_trainer\n  - _self_\n"
        "data: {train_batch_size: 64, max_response_length: 2048}\n"
    )
    mine, verls = tmp_path / "shipped.yaml", tmp_path / "verls.yaml"
    mine.write_text(recipe.replace("SEARCH", "file:///nonexistent"))
    verls.write_text(recipe.replace("SEARCH", "pkg://verl.trainer.config"))
    a, b = resolve(load_file(str(mine)), []), resolve(load_file(str(verls)), [])
    b.pop("model_engine")  # the hydra choice itself, which verl's generated file leaves out
    assert a == b and b["actor_rollout_ref.rollout.response_length"] == 2048
