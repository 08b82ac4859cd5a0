"""A failed verification (the verifier raised, died or timed out) takes its group's mean score in
training, so it moves neither the group's baseline nor any other sample's advantage (a fixed 0 would
sit above a verl-style -1 wrong answer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prorl.metrics import StepAccumulator, step_metrics
from prorl.rewards.pool import BatchResult, pool_counts
from prorl.sampling import Group, GroupSampler, impute_failed


def _baseline_advantages(scores: list[float]) -> list[float]:
    """REINFORCE++-baseline's group step in float64: reward minus the group mean."""
    r = torch.tensor(scores, dtype=torch.float64)
    return (r - r.mean()).tolist()


def test_failed_items_leave_the_other_advantages_unchanged():
    scores = [-1.0, 1.0, 0.0, 1.0]  # item 2 errored: the pool scored it 0
    failed = [False, False, True, False]
    imputed = impute_failed(scores, failed)
    assert imputed[2] == pytest.approx(1 / 3)  # mean of -1, 1, 1
    assert imputed[2] > -1.0  # never below a real wrong answer, never above a right one
    with_fail = _baseline_advantages(imputed)
    without = _baseline_advantages([-1.0, 1.0, 1.0])
    assert [with_fail[i] for i in (0, 1, 3)] == pytest.approx(without)
    assert with_fail[2] == pytest.approx(0.0)
    assert impute_failed([0.0, 0.0], [True, True]) == [0.0, 0.0]  # nothing verified: no signal
    assert impute_failed([0.5, 1.0], [False, False]) == [0.5, 1.0]


class _Pool:
    """A reward pool whose second response of each group fails (one error, one timeout)."""

    def score_batch(self, sources, texts, truths, extras):
        n = len(texts)
        return BatchResult(
            scores=[-1.0, 0.0, 1.0, 0.0][:n],
            timed_out=[False, False, False, True][:n],
            errored=[False, True, False, False][:n],
            errors=[None] * n,
            extras=[{} for _ in range(n)],
        )


def test_verify_imputes_errored_and_timed_out_items():
    sampler = GroupSampler.__new__(GroupSampler)  # only verify's collaborators
    ex = SimpleNamespace(data_source="math", ground_truth="1", extra={})
    sampler.examples, sampler.kept, sampler.pool = [ex, ex], [0, 1], _Pool()
    sampler.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "x")
    sampler.reward_time, sampler.pool_seen = 0.0, pool_counts(sampler.pool)
    groups = [Group(i, [1], [[2], [3]], [[0.0], [0.0]], [False, False]) for i in range(2)]
    acc = StepAccumulator()
    sampler.verify(groups, acc)
    assert groups[0].raw == [-1.0, -1.0]  # the error takes the group's mean (-1), not 0
    assert groups[1].raw == [1.0, 1.0]  # so does the timeout (1)
    sums = acc.reduce()[0]
    assert sums["samples_error"] == 1 and sums["samples_timeout"] == 1


class _Scheduler:
    def __init__(self):
        self.seen = []

    def observe(self, prompt, rewards):
        self.seen.append((prompt, list(rewards)))


@pytest.mark.tally("faults")
def test_the_prompt_scheduler_sees_only_verified_scores():
    """A failed verification is no evidence about a prompt: before, its imputed (or, with every
    call failed, 0) score went into the scheduler's pass rate, and a prompt whose verifier always
    failed was recorded as unsolved."""
    sampler = GroupSampler.__new__(GroupSampler)
    sampler.scheduler = _Scheduler()
    sampler.cfg = SimpleNamespace(algorithm=SimpleNamespace(dynamic_sampling=True))
    groups = [Group(i, [1], [[2], [3]], [[0.0], [0.0]], [False, False]) for i in range(3)]
    groups[0].raw, groups[0].verified = [1.0, 1.0], [True, False]
    groups[1].raw, groups[1].verified = [0.0, 0.0], [False, False]
    groups[2].raw, groups[2].verified = [0.0, 1.0], [True, True]
    sampler._keep(groups, StepAccumulator())
    assert sampler.scheduler.seen == [(0, [1.0]), (2, [0.0, 1.0])]


@pytest.mark.tally("bad_inputs")
def test_a_mean_score_is_not_printed_as_an_accuracy_and_failed_validation_warns():
    from prorl.report import accuracy_line, validation_warning

    # a verl function scoring -1 / +1: a mean of -0.5 is no "-50.0%" accuracy
    line = accuracy_line([(0, -0.5), (5, 0.25)], unit=False)
    assert line == "held-out mean score -0.5 -> 0.25 (mean of the last 1 evaluations)"
    assert accuracy_line([(0, 0.25), (5, 0.5)]).startswith("held-out accuracy 25.0% -> 50.0%")
    assert validation_warning({"val/accuracy": 0.0, "val/verify_failed_frac": 1.0})
    assert validation_warning({"val/accuracy": 0.4, "val/verify_failed_frac": 0.1}) is None


class _CountingPool(_Pool):
    """A pool whose counters (cumulative over its life, as RewardPool's) already hold earlier
    steps' replacements and grow during each batch."""

    def __init__(self):
        self.replaced, self.protocol_failures, self.recycled, self.memory_exceeded = 5, 4, 3, 2

    def score_batch(self, sources, texts, truths, extras):
        self.replaced += 1
        self.protocol_failures += 2
        self.recycled += 3
        self.memory_exceeded += 4
        return super().score_batch(sources, texts, truths, extras)


@pytest.mark.tally("faults")
def test_the_step_row_counts_the_reward_workers_replaced_this_step():
    """Replaced reward workers (protocol broken, recycled, over their memory bound) were counted
    only inside the pool, never in metrics.jsonl."""
    sampler = GroupSampler.__new__(GroupSampler)
    ex = SimpleNamespace(data_source="math", ground_truth="1", extra={})
    sampler.examples, sampler.kept, sampler.pool = [ex], [0], _CountingPool()
    sampler.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "x")
    sampler.reward_time = 0.0
    sampler.pool_seen = {"replaced": 5, "protocol_failures": 4, "recycled": 3, "memory_exceeded": 2}
    acc = StepAccumulator()
    for _ in range(2):  # two verify rounds in one step
        sampler.verify([Group(0, [1], [[2], [3]], [[0.0], [0.0]], [False, False])], acc)
    row = step_metrics(acc.reduce())
    got = {k: row[k] for k in row if k.startswith("reward/") and "frac" not in k}
    assert got == {
        "reward/length_penalty/mean": 0.0,
        "reward/workers_replaced": 2.0,
        "reward/protocol_failures": 4.0,
        "reward/workers_recycled": 6.0,
        "reward/workers_over_memory": 8.0,
    }
    # a worker replaced between steps (validation shares the pool) counts in the next step's row
    sampler.pool.replaced += 10
    acc = StepAccumulator()
    sampler.verify([Group(0, [1], [[2], [3]], [[0.0], [0.0]], [False, False])], acc)
    assert step_metrics(acc.reduce())["reward/workers_replaced"] == 11.0
    # a step without reward-pool trouble still carries the keys (uniform rows), at 0
    quiet = step_metrics(StepAccumulator().reduce())
    assert quiet["reward/protocol_failures"] == 0.0 and quiet["reward/workers_over_memory"] == 0.0
