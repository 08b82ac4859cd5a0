"""A failed verification (the verifier raised, died or timed out) takes its group's mean score in
training, so it moves neither the group's baseline nor any other sample's advantage (a fixed 0 would
sit above a verl-style -1 wrong answer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prorl.metrics import StepAccumulator
from prorl.rewards.pool import BatchResult
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
    sampler.reward_time = 0.0
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
