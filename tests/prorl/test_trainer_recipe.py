"""The trainer's algorithm and metrics as docs/recipe.md states them, in-process, tiny reasoner.

- carried-over groups (dynamic sampling's surplus) are trained against the log-probs of the policy
  that sampled them, so their ratio is not 1 and clipping acts on them (§6);
- the sampler-vs-trainer importance weights are truncated / masked once, at the configured bounds
  (§3);
- verl's metric names carry verl's meanings (§9), and `critic/rewards/*` are the rewards trained on;
- rollout seeds are distinct for every round of every rank within a step.

The independent references are plain forwards of the model (`recompute_logprobs`) and
docs/recipe.md's worked numbers; the gradient of a step under every knob is
tests/prorl/test_recipe_wiring.py's.
"""

import copy
import math

import pytest
import torch
from prorl.kernels import ppo_loss
from rollout_checkpoints import recompute_logprobs
from tiny_trainer import make_trainer

import prorl.update as update_module
from prorl.config import ConfigError, load_config
from prorl.config_runtime import check_world
from prorl.metrics import StepAccumulator, record_batch, record_loss, step_metrics
from prorl.packing import StepBatch
from prorl.sampling import Group, shape_rewards

BASE = [
    "trainer.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_response_tokens=24",
    "reward.length_penalty=false",
    "trainer.mini_batches=1",
    "trainer.micro_batch_tokens=0",
]


def make(setup, overrides=()):
    return make_trainer(setup, [*BASE, *overrides])


class LossSpy:
    """Records the arguments and results of every ppo_loss call the trainer makes."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(update_module, "ppo_loss", self)

    def __call__(self, *args, **kwargs):
        out = ppo_loss(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out


def update(trainer, groups, acc=None):
    batch = StepBatch.of(groups, trainer.cfg.rollout.n, trainer.device)
    return trainer.update(batch, 24, acc or StepAccumulator())


def sampled(trainer, k=3):
    groups = trainer.sampler.rollout(list(range(k)), seed=7, max_new=24)
    for g in groups:
        g.raw = [float(i % 2) for i in range(len(g.responses))]  # mixed: every group carries signal
        g.shaped = list(g.raw)
    return groups


def per_token_logprobs(model, groups, temperature=1.0):
    """[R] log-probs of every response token under `model`, one plain forward per prompt +
    response."""
    out = [
        recompute_logprobs(model, g.prompt_ids, t, temperature)
        for g in groups
        for t in g.responses
        if t  # an empty response has no token
    ]
    return torch.cat(out) if out else torch.zeros(0)


def test_carried_groups_are_trained_against_the_policy_that_sampled_them(tiny_setup, monkeypatch):
    trainer = make(tiny_setup, ["optim.lr=3e-3"])
    groups = sampled(trainer, k=3)
    # this step's surplus, sampled by the current policy
    trainer.sampler.carry = copy.deepcopy(groups[2:])
    behaviour = copy.deepcopy(trainer.policy)
    trainer.updater.store_old_logprobs(trainer.sampler.carry)
    update(trainer, groups[:2])  # the policy moves
    # the carry is used first, nothing sampled
    carried = trainer.sampler.collect(1, 24, 1, StepAccumulator())
    assert carried[0].old_logps is not None and carried[0].responses == groups[2].responses

    want_old = per_token_logprobs(behaviour, carried)
    now = per_token_logprobs(trainer.policy, carried)  # before this update moves the policy again
    spy = LossSpy(monkeypatch)
    update(trainer, carried)
    (logp, old, *_), _, _ = spy.calls[0]
    torch.testing.assert_close(old.float(), want_old, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp.detach().float(), now, rtol=0, atol=1e-5)
    assert (now - want_old).abs().max() > 1e-3, "the update did not move the policy"


def test_a_carried_group_is_never_carried_twice(tiny_setup):
    trainer = make(tiny_setup)
    groups = sampled(trainer, k=3)
    for g in groups[:2]:
        g.old_logps = [[0.0] * len(t) for t in g.responses]
    trainer.sampler.carry = groups[:2]  # more carried groups than this step needs
    kept = trainer.sampler.collect(1, 24, 0, acc := StepAccumulator())
    assert kept == groups[:1] and trainer.sampler.carry == []
    s, _, _ = acc.reduce()
    assert s["groups_dropped"] == 1 and s["groups_carried"] == 2


def test_the_sampler_keeps_the_groups_the_keep_rule_keeps(tiny_setup, monkeypatch):
    """docs/recipe.md §6 through GroupSampler.collect, the code the trainer runs: a group is kept
    iff its raw rewards are not all equal ([1,0,0,0] kept: one right answer is a signal; all right,
    all wrong dropped; [0.5,0.5,0.25,0.5] kept), and the pass-rate metrics count every sampled
    group."""
    trainer = make(
        tiny_setup,
        ["algorithm.dynamic_sampling=true", "algorithm.max_rounds=1", "scheduler.mode=none"],
    )
    patterns = [
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0],
        [0.0, 0.0, 0.0, 0.0],
        [0.5, 0.5, 0.25, 0.5],
    ]

    def verify(groups, acc):  # one round of 4 prompts, scored by the patterns
        assert len(groups) == len(patterns)
        for g, raw in zip(groups, patterns):
            g.raw = list(raw)
        acc.sum("samples_seen", sum(len(g.raw) for g in groups))

    monkeypatch.setattr(trainer.sampler, "verify", verify)
    kept = trainer.sampler.collect(4, 24, 0, acc := StepAccumulator())
    assert [g.raw for g in kept] == [patterns[0], patterns[3]]
    m = step_metrics(acc.reduce())
    assert m["dynamic_sampling/kept_groups"] == 2 and m["dynamic_sampling/sampled_groups"] == 4
    assert (
        m["dynamic_sampling/frac_all_correct"] == 0.25
        and m["dynamic_sampling/frac_all_wrong"] == 0.5
    )
    assert m["dynamic_sampling/pass_rate"] == pytest.approx(5 / 16)


@pytest.mark.parametrize(
    "mode, bounds, log_w, modified",
    [
        # 7 < is_high=10: not truncated (the old code capped at 5)
        ("tis", (0.5, 10.0), math.log(7.0), 0.0),
        ("tis", (0.5, 10.0), math.log(12.0), 1.0),
        # 0.35 in [0.2, 5]: kept (the old code zeroed it)
        ("icepop", (0.2, 5.0), math.log(0.35), 0.0),
        ("icepop", (0.2, 5.0), math.log(0.1), 1.0),
    ],
)
def test_importance_weights_are_bounded_once_at_the_configured_bounds(
    tiny_setup, monkeypatch, mode, bounds, log_w, modified
):
    trainer = make(
        tiny_setup,
        [
            f"algorithm.is_mode={mode}",
            f"algorithm.is_low={bounds[0]}",
            f"algorithm.is_high={bounds[1]}",
        ],
    )
    groups = sampled(trainer, k=2)
    true = per_token_logprobs(trainer.policy, groups).tolist()
    i = 0
    for g in groups:  # the sampler's log-probs differ from the trainer's by log_w on every token
        for j, t in enumerate(g.responses):
            g.sampler_logps[j] = [x - log_w for x in true[i : i + len(t)]]
            i += len(t)
    spy = LossSpy(monkeypatch)
    acc = StepAccumulator()
    update(trainer, groups, acc)
    metrics = step_metrics(acc.reduce())
    _, kwargs, _ = spy.calls[0]
    w = kwargs["is_weights"]
    torch.testing.assert_close(w, torch.full_like(w, math.exp(log_w)), rtol=1e-4, atol=0)
    assert kwargs["is_mode"] == mode and tuple(kwargs.get("is_bounds", (0.5, 5.0))) == bounds
    assert metrics["rollout/is_frac_modified"] == pytest.approx(modified)
    # the gradient under each mode, against the loss written out from docs/recipe.md rather than
    # from this call's arguments: tests/prorl/test_recipe_wiring.py (cases tis, icepop)


def test_clip_fraction_names_carry_verls_meanings():
    """docs/recipe.md §3 vectors: r=1.5, A=+1 clipped high; r=0.5, A=-1 clipped low; r=4, A=-1
    unclipped but capped by the dual clip c=3; r=1.1, A=+1 and r=0.7, A=+1 unclipped."""
    r = torch.tensor([1.5, 0.5, 4.0, 1.1, 0.7], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    logp = torch.log(r)
    _, m = ppo_loss(
        logp, torch.zeros_like(logp), adv, torch.ones(5, dtype=torch.bool), dual_clip=3.0
    )
    acc = StepAccumulator()
    record_loss(acc, m, torch.tensor(0.0), logp, logp)
    got = step_metrics(acc.reduce())
    assert got["actor/pg_clipfrac"] == pytest.approx(2 / 5)  # verl: clipped on either side
    assert got["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # verl: the dual-clip fraction
    assert got["actor/pg_clipfrac_high"] == pytest.approx(1 / 5)
    assert got["actor/pg_clipfrac_low"] == pytest.approx(1 / 5)
    assert got["actor/ppo_kl"] == pytest.approx(-float(logp.mean()))  # mean of old - new


def test_rewards_metric_is_the_shaped_reward(tiny_setup):
    """docs/recipe.md §5: raw [1, 1, 0, 0] with truncated [F, T, F, T] -> trained on [1, 0, 0,
    0]."""
    trainer = make(tiny_setup)
    g = Group(
        0,
        [1, 2],
        [[3], [4], [5], [6]],
        [[0.0]] * 4,
        [False, True, False, True],
        raw=[1.0, 1.0, 0.0, 0.0],
    )
    term = shape_rewards([g], trainer.cfg.reward, 0, 24)
    acc = StepAccumulator()
    record_batch(acc, [g], term)
    got = step_metrics(acc.reduce())
    assert g.shaped == [1.0, 0.0, 0.0, 0.0]
    assert got["critic/score/mean"] == pytest.approx(0.5) and got[
        "critic/rewards/mean"
    ] == pytest.approx(0.25)
    assert got["critic/rewards/max"] == 1.0 and got["critic/rewards/min"] == 0.0
    assert got["response_length/clip_ratio"] == pytest.approx(0.5)


def test_rollout_seeds_are_distinct_within_a_step(tiny_setup):
    sampler = make(tiny_setup).sampler
    seeds = set()
    for world in (1, 2, 64, 65, 300):
        sampler.world = world
        step_seeds = {0: set()}
        for rank in range(world):
            sampler.rank = rank
            step_seeds[0] |= {sampler.seed(5, r) for r in range(10)}
        assert len(step_seeds[0]) == 10 * world, world
        seeds |= step_seeds[0]
    assert all(0 <= s < 2**32 for s in seeds)


def test_prompts_per_step_must_split_evenly_over_ranks():
    cfg = load_config("default", ["trainer.prompts_per_step=3", "trainer.mini_batches=1"])
    check_world(cfg, 1)
    check_world(cfg, 3)
    with pytest.raises(ConfigError, match="prompts_per_step=3 is not a multiple of the 2 ranks"):
        check_world(cfg, 2)


def test_right_after_a_reset_the_kl_and_its_gradient_are_zero(tiny_setup, monkeypatch):
    """docs/recipe.md §7: after pi_ref <- policy the first mini-batch's KL term is exactly 0, and so
    is its gradient (one mini-batch: the reference pass and the update see the same passes)."""
    trainer = make(tiny_setup, ["optim.lr=3e-3", "algorithm.kl_coef=1.0"])
    update(trainer, sampled(trainer, k=2))  # the policy moves away from the reference
    trainer.reset_reference()
    spy = LossSpy(monkeypatch)
    update(trainer, sampled(trainer, k=2))
    for (logp, *_), kwargs, (_, metrics) in spy.calls:
        assert float(metrics["kl_mean"]) == 0.0 and float(metrics["kl_loss"]) == 0.0
        assert torch.equal(logp.detach().float(), kwargs["ref_logp"].float())
