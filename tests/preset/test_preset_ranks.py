"""The prorl_v2_1.5b preset in miniature, in-process on 2 gloo ranks (spawned): FSDP2 with bf16
mixed precision and activation checkpointing over a bf16 checkpoint with an untied LM head,
token-budget micro-batches, dynamic sampling that keeps different numbers of groups on different
ranks, reference resets. What a user running the preset on 8 GPUs relies on:

- the master weights are fp32 and move at the preset's learning rate (2e-6), although the checkpoint
  is bf16;
- ranks with less work run dummy passes that touch every parameter (the untied head too), so FSDP's
  collectives match;
- after a reset the reference equals the policy bit for bit, in the sharded state checkpoints save;
- every rank's sampler copy holds the same weights, the policy's in bf16;
- an update split over 2 ranks gives the gradients and metrics of the same update on 1 rank;
- with prompt scheduling on, the ranks keep one record and decide each refill round together.
"""

import copy

import pytest
import torch
from dist_helpers import run_ranks
from preset_helpers import preset_overrides, write_bf16_untied_checkpoint, write_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    d = tmp_path_factory.mktemp("preset")
    ckpt = write_bf16_untied_checkpoint(str(d / "ckpt"))
    train, val = write_data(str(d))
    return ckpt, train, val


def make_trainer(ckpt, train, val, extra, pool):
    import preset_rewards  # noqa: F401 - registers `preset_uneven` in this process
    from transformers import PreTrainedTokenizerFast

    from prorl import data
    from prorl.config import load_config
    from prorl.trainer import Trainer

    cfg = load_config("prorl_v2_1.5b", [*preset_overrides(ckpt, train, val), *extra])
    tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    return Trainer(cfg, ckpt, tok, data.load_file(train), data.load_file(val), pool)


def full(model) -> dict[str, torch.Tensor]:
    from prorl.engine.parallel import iter_full_tensors

    return {k: v.clone() for k, v in iter_full_tensors(model)}


def local_shards(model) -> dict[str, torch.Tensor]:
    from prorl.engine.parallel import clean_name, reshard

    reshard(model)
    return {clean_name(n): p.to_local().detach().clone() for n, p in model.named_parameters()}


def _preset_steps(rank, world, ckpt, train, val, steps):
    import os

    from prorl.rewards.pool import RewardPool

    # as torchrun sets it: the reward workers (preset_rewards) read it
    os.environ["RANK"] = str(rank)

    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = make_trainer(ckpt, train, val, [], pool)
        assert trainer.models.fsdp and trainer.models.sampler_model is not None
        out = {
            "master_dtypes": {p.dtype for p in trainer.policy.parameters()},
            "reference_dtypes": {p.dtype for p in trainer.reference.parameters()},
            "start": full(trainer.policy),
            "kept": [],
            "dummy": 0,
            "steps": [],
        }
        dummy = trainer.updater.dummy_pass

        def counting_dummy(model, grad):
            out["dummy"] += 1
            return dummy(model, grad)

        trainer.updater.dummy_pass = counting_dummy
        collect = trainer.sampler.collect

        def recording_collect(need, max_new, step, acc):
            kept = collect(need, max_new, step, acc)
            out["kept"].append(len(kept))
            return kept

        trainer.sampler.collect = recording_collect
        for _ in range(steps):
            m = trainer.step()
            row = {"metrics": m}
            if m["ref/reset_reason"]:
                row["policy_shards"] = local_shards(trainer.policy)
                row["reference_shards"] = local_shards(trainer.reference)
            if len(out["steps"]) == 0:
                row["after_first"] = full(trainer.policy)
            out["steps"].append(row)
        out["sampler"] = {
            k: v.clone() for k, v in trainer.models.sampler_model.state_dict().items()
        }
        out["policy"] = full(trainer.policy)
    return out


def test_preset_on_two_ranks(preset, tmp_path):
    ckpt, train, val = preset
    res = run_ranks(_preset_steps, tmp_path, ckpt, train, val, 3, world=2, timeout_s=600)
    r0, r1 = res[0], res[1]
    for r in (r0, r1):
        assert r["master_dtypes"] == {torch.float32}, (
            "master weights must be fp32 (the checkpoint is bf16)"
        )
        assert r["reference_dtypes"] == {torch.float32}
    # fp32 masters move at lr 2e-6: AdamW's first step moves every weight with a gradient by ~lr,
    # far below bf16's spacing (a bf16 master would keep nearly all of them)
    start, after = r0["start"], r0["steps"][0]["after_first"]
    moved = sum(int((after[k] != start[k]).sum()) for k in start)
    total = sum(v.numel() for v in start.values())
    assert moved > 0.5 * total, (moved, total)
    assert not torch.equal(after["lm_head.weight"], start["lm_head.weight"]), (
        "the untied head must train"
    )
    # uneven work: the ranks kept different numbers of groups in some step, and a rank ran dummy
    # passes
    assert r0["kept"] != r1["kept"], (r0["kept"], r1["kept"])
    assert r0["dummy"] + r1["dummy"] > 0
    # a reset (interval 2: after step 2): the reference equals the policy exactly, shard by shard
    resets = [i for i, row in enumerate(r0["steps"]) if row["metrics"]["ref/reset_reason"]]
    assert resets == [1], [row["metrics"]["ref/reset_reason"] for row in r0["steps"]]
    for r in (r0, r1):
        row = r["steps"][resets[0]]
        for name, shard in row["policy_shards"].items():
            assert torch.equal(row["reference_shards"][name], shard), name
    # the same metrics on every rank (they are global), and the same sampler weights: the policy's
    # in bf16
    for a, b in zip(r0["steps"], r1["steps"]):
        keys = [k for k in a["metrics"] if not k.startswith(("timing_s/", "perf/"))]
        assert {k: a["metrics"][k] for k in keys} == {k: b["metrics"][k] for k in keys}
        assert a["metrics"]["response_length/max"] <= 40
    for name, w in r0["sampler"].items():
        assert torch.equal(w, r1["sampler"][name]), name
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, r0["policy"][name].to(torch.bfloat16)), name


# -- one update split over 2 ranks == the same update on 1 rank ------------------------------------


def _update_on(rank, world, ckpt, train, val, groups_by_rank, extra=()):
    from prorl.metrics import StepAccumulator, step_metrics
    from prorl.packing import StepBatch
    from prorl.rewards.pool import RewardPool

    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = make_trainer(ckpt, train, val, list(extra), pool)
        grads = []
        # AdamW's sign-like first step would
        sgd = torch.optim.SGD(trainer.optimizer.params, lr=1.0)
        # turn round-off in tiny gradients into whole steps: compare under plain SGD
        step = sgd.step

        def recording_step(*args, **kwargs):
            grads.append(
                {n: p.grad.full_tensor().clone() for n, p in trainer.policy.named_parameters()}
            )
            return step(*args, **kwargs)

        sgd.step = recording_step
        trainer.optimizer.optimizer = sgd
        acc = StepAccumulator()
        groups = copy.deepcopy(groups_by_rank[rank])
        trainer.update(StepBatch.of(groups, trainer.cfg.rollout.n, trainer.device), 40, acc)
        return {
            "grads": grads,
            "metrics": step_metrics(acc.reduce()),
            "policy": full(trainer.policy),
        }


def _sample_groups(rank, world, ckpt, train, val):
    from prorl.rewards.pool import RewardPool
    from prorl.sampling import shape_rewards

    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = make_trainer(ckpt, train, val, [], pool)
        groups = trainer.sampler.rollout(list(range(16)), seed=3, max_new=40)
        for g in groups:
            g.raw = [float(i % 3 == 0) for i in range(len(g.responses))]
        shape_rewards(groups, trainer.cfg.reward, 0, 40)
        return groups


@pytest.fixture(scope="module")
def sampled(preset, tmp_path_factory):
    """16 groups the preset's trainer sampled on 1 rank, for the update tests (which only read
    them: each update works on a copy)."""
    ckpt, train, val = preset
    out = tmp_path_factory.mktemp("sample")
    return run_ranks(_sample_groups, out, ckpt, train, val, world=1)[0]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_an_update_on_two_ranks_equals_one_rank(preset, sampled, tmp_path):
    ckpt, train, val = preset
    groups = sampled
    # 4 mini-batches: rank r's m-th chunk of 2 groups; one rank's m-th chunk of 4 is the union of
    # both
    halves = [groups[0::2], groups[1::2]]
    one_rank = [g for m in range(4) for half in halves for g in half[2 * m : 2 * m + 2]]
    one = run_ranks(_update_on, tmp_path, ckpt, train, val, {0: one_rank}, world=1, timeout_s=600)[
        0
    ]
    two = run_ranks(
        _update_on, tmp_path, ckpt, train, val, dict(enumerate(halves)), world=2, timeout_s=600
    )
    assert len(one["grads"]) == len(two[0]["grads"]) == 4
    for step_one, step_two in zip(one["grads"], two[0]["grads"]):
        for name, g in step_one.items():
            torch.testing.assert_close(step_two[name], g, rtol=1e-4, atol=1e-7, msg=name)
    for name, w in one["policy"].items():
        torch.testing.assert_close(two[0]["policy"][name], w, rtol=1e-5, atol=1e-7, msg=name)
    for key, value in one["metrics"].items():
        assert two[0]["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def _replicated_update(rank, world, ckpt, train, val, groups_by_rank):
    from prorl.metrics import StepAccumulator, step_metrics
    from prorl.packing import StepBatch
    from prorl.rewards.pool import RewardPool

    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = make_trainer(
            ckpt, train, val, ["model.fsdp=false", "trainer.collective_timeout_s=120"], pool
        )
        assert not trainer.models.fsdp
        steps = []
        step = trainer.optimizer.step

        def counting_step(*args, **kwargs):
            steps.append(1)
            return step(*args, **kwargs)

        trainer.optimizer.step = counting_step
        acc = StepAccumulator()
        trainer.update(
            StepBatch.of(
                copy.deepcopy(groups_by_rank[rank]), trainer.cfg.rollout.n, trainer.device
            ),
            40,
            acc,
        )
        metrics = step_metrics(acc.reduce())
        return {
            "steps": len(steps),
            "metrics": metrics,
            "policy": dict(trainer.policy.state_dict()),
        }


def test_replicated_ranks_step_together_when_one_has_no_group_in_a_mini_batch(
    preset, sampled, tmp_path
):
    """Without FSDP each rank runs only its own passes, but every optimizer step is a collective
    (the gradient all-reduce): a rank whose share of a mini-batch is empty must still take part.
    Here rank 1 keeps 1 group, so its mini-batches 1-3 are empty while rank 0 has 2 groups in each
    (this deadlocked)."""
    ckpt, train, val = preset
    by_rank = {0: sampled[:8], 1: sampled[8:9]}
    res = run_ranks(_replicated_update, tmp_path, ckpt, train, val, by_rank, world=2, timeout_s=600)
    assert res[0]["steps"] == res[1]["steps"] == 4
    assert res[0]["metrics"]["actor/grad_norm"] == res[1]["metrics"]["actor/grad_norm"] > 0
    # replicas stay equal: the same summed gradient everywhere
    for name, w in res[0]["policy"].items():
        assert torch.equal(w, res[1]["policy"][name]), name


def _scheduled_steps(rank, world, ckpt, train, val, steps):
    import os

    from prorl.rewards.pool import RewardPool

    os.environ["RANK"] = str(rank)
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        scheduled = ["scheduler.mode=pass-rate", "scheduler.min_yield=0.7"]
        trainer = make_trainer(ckpt, train, val, scheduled, pool)
        metrics = [trainer.step() for _ in range(steps)]
        return {
            "record": trainer.sampler.scheduler.state_dict(),
            "metrics": metrics,
            "policy": full(trainer.policy),
            "sampler": {k: v.clone() for k, v in trainer.models.sampler_model.state_dict().items()},
        }


def test_prompt_scheduling_on_the_preset_keeps_the_ranks_together(preset, tmp_path):
    """The prompt scheduler on the preset (FSDP2, uneven dynamic sampling, resets): every rank holds
    the same record and weights, and refill rounds are run or skipped on every rank together."""
    ckpt, train, val = preset
    res = run_ranks(_scheduled_steps, tmp_path, ckpt, train, val, 3, world=2, timeout_s=600)
    r0, r1 = res[0], res[1]
    assert r0["record"] == r1["record"], "the ranks' prompt records differ"
    assert sum(r0["record"]["population"]) > 0
    for k in (
        "dynamic_sampling/rounds",
        "scheduler/rounds_skipped",
        "dynamic_sampling/sampled_groups",
    ):
        assert [m[k] for m in r0["metrics"]] == [m[k] for m in r1["metrics"]], k
    # min_yield 0.7: step 1 (no evidence, P(mixed) = 7/9) runs its refills, later steps skip them
    assert r0["metrics"][0]["dynamic_sampling/rounds"] > 1
    assert any(m["scheduler/rounds_skipped"] > 0 for m in r0["metrics"][1:])
    assert r0["metrics"][-1]["ref/num_resets"] >= 1
    for name in r0["policy"]:
        assert torch.equal(r0["policy"][name], r1["policy"][name]), name
    for name in r0["sampler"]:
        assert torch.equal(r0["sampler"][name], r1["sampler"][name]), name
