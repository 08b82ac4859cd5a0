"""prorl/prompt_schedule.py: the Beta posterior's P(mixed group) against its closed form, the
choice's guarantees (unseen first, no prompt twice in a step, disjoint identical slices on every
rank, every prompt re-probed within the bound, excluded prompts never chosen, the most likely mixed
first), the merge, its discount and the population prior, and the record being the same on every
rank of a real 2-rank trainer."""

from types import SimpleNamespace

import numpy as np
import pytest
from dist_helpers import run_ranks

from prorl.config import load_config
from prorl.prompt_schedule import PromptScheduler, mixed_probability


def cfg(**kw):
    base = dict(mode="pass-rate", prior_strength=2.0, discount=0.9, min_yield=0.0)
    return SimpleNamespace(**{**base, "reprobe_epochs": 2.0, "solved_threshold": 1.0, **kw})


def moment(a: float, b: float, n: int) -> float:
    """E[p^n] for p ~ Beta(a, b) = prod_{i<n} (a + i) / (a + b + i)."""
    out = 1.0
    for i in range(n):
        out *= (a + i) / (a + b + i)
    return out


def test_mixed_probability_matches_the_moments():
    for a, b, n in [(1, 1, 8), (3.5, 0.7, 16), (0.2, 9.0, 4), (40.0, 2.0, 8), (1e-3, 1e-3, 8)]:
        want = 1 - moment(a, b, n) - moment(b, a, n)  # E[(1-p)^n] = E[q^n], q ~ Beta(b, a)
        assert mixed_probability(np.array([a]), np.array([b]), n)[0] == pytest.approx(
            want, rel=1e-9, abs=1e-12
        )


def test_merge_discounts_evidence_and_the_prior_follows_the_population():
    s = PromptScheduler(cfg(discount=0.5), size=3, n=4, prompts_per_step=2, seed=0)
    assert s.prior(0) == (1.0, 1.0)  # no evidence: Beta(1, 1)
    s.merge(0, [[(1, 3.0, 4)]])
    # population 3 of 4: mean (3 + 1) / (4 + 2) = 2/3, strength 2
    a0, b0 = s.prior(0)
    assert (a0, b0) == pytest.approx((4 / 3, 2 / 3))
    alpha, beta = s.posterior(0)
    assert alpha.tolist() == pytest.approx([a0, a0 + 3, a0])
    assert beta.tolist() == pytest.approx([b0, b0 + 1, b0])
    s.merge(2, [[(1, 0.0, 4)], [(2, 4.0, 4)]])  # two steps later: old evidence is halved twice
    # population: 0.25 * (3, 1) + (0, 4) + (4, 0) = (4.75, 4.25); mean 5.75 / 11
    a0, b0 = s.prior(2)
    assert a0 == pytest.approx(2 * 5.75 / 11) and b0 == pytest.approx(2 * 5.25 / 11)
    alpha, beta = s.posterior(2)
    assert alpha[1] == pytest.approx(a0 + 0.25 * 3) and beta[1] == pytest.approx(b0 + 0.25 * 1 + 4)
    assert alpha[2] == pytest.approx(a0 + 4) and beta[2] == pytest.approx(b0)
    alpha, beta = s.posterior(3)  # read one step later: every prompt's evidence and the prior decay
    assert alpha[2] == pytest.approx(s.prior(3)[0] + 0.5 * 4)


def test_the_choice_takes_the_prompts_most_likely_to_give_a_mixed_group():
    s = PromptScheduler(cfg(discount=1.0), size=6, n=8, prompts_per_step=2, seed=0)
    s.probed[:] = 0
    # a mostly solved population; prompt 4 came back 4 of 8, prompt 1 0 of 8, the rest 8 of 8
    s.merge(0, [[(0, 8.0, 8), (1, 0.0, 8), (2, 8.0, 8), (3, 8.0, 8), (4, 4.0, 8), (5, 8.0, 8)]])
    alpha, beta = s.posterior(1)
    p = mixed_probability(alpha, beta, 8)
    want = [1 - moment(a, b, 8) - moment(b, a, 8) for a, b in zip(alpha, beta)]
    assert p == pytest.approx(want, rel=1e-9)
    assert p[4] > p[1] > max(p[[0, 2, 3, 5]])
    assert s.select(2, step=1, round_=0, rank=0, world=1) == [4, 1]


def test_choice_guarantees():
    size, k, world = 40, 3, 2
    ranks = [
        PromptScheduler(cfg(), size, 8, prompts_per_step=k * world, seed=1) for _ in range(world)
    ]
    # step 0: unseen prompts first; rounds never repeat a prompt; the ranks' slices are disjoint
    taken = []
    for round_ in range(3):
        parts = [
            s.select(k, step=0, round_=round_, rank=r, world=world) for r, s in enumerate(ranks)
        ]
        assert not set(parts[0]) & set(parts[1])
        taken += parts[0] + parts[1]
    assert len(taken) == len(set(taken)) == 18
    assert all(ranks[0].probed[i] == 0 for i in taken) and np.array_equal(
        ranks[0].probed, ranks[1].probed
    )
    # a record that calls every probed prompt hopeless still probes each one again within
    # (reprobe_epochs + 1) epochs: the stale ones first, oldest first, a step's worth at a time
    s = PromptScheduler(cfg(), size, 8, prompts_per_step=k, seed=2)
    s.probed[:] = 0
    s.failures[:] = 1e3  # every prompt hopeless, the population too
    s.population[:] = (0.0, 1e3 * size)
    bound = int((2.0 + 1) * s.epoch_steps)
    seen_at = {}
    for step in range(1, 4 * bound):
        s.new_step()
        for i in s.select(k, step=step, round_=0, rank=0, world=1):
            seen_at.setdefault(i, []).append(step)
    gaps = [b - a for steps in seen_at.values() for a, b in zip([0, *steps], steps)]
    assert len(seen_at) == size and max(gaps) <= bound, (bound, max(gaps))


def test_a_prompt_is_stale_exactly_reprobe_epochs_after_its_last_probe():
    """docs/recipe.md §10: a prompt not probed for `reprobe_epochs` epochs (here 2 x 12 / 4 = 6
    steps) is chosen before any other, however unlikely a mixed group: at step 6 for a probe at
    step 0, not at step 5."""
    s = PromptScheduler(cfg(discount=1.0), size=12, n=8, prompts_per_step=4, seed=0)
    s.probed[:4], s.probed[4:] = 0, 5
    # prompts 0-3 solved (P(mixed) ~ 0.02), the others mixed (P ~ 0.9)
    s.merge(0, [[(i, 8.0, 8) for i in range(4)] + [(i, 4.0, 8) for i in range(4, 12)]])
    s.new_step()
    early = s.select(4, step=5, round_=0, rank=0, world=1)
    assert not set(early) & {0, 1, 2, 3} and s.reprobes == 0
    s.probed[4:] = 5  # undo the probe of step 5
    s.new_step()
    assert sorted(s.select(4, step=6, round_=0, rank=0, world=1)) == [0, 1, 2, 3]
    assert s.reprobes == 4


def test_a_refill_round_runs_only_when_it_is_expected_to_keep_enough():
    def solved(min_yield):
        s = PromptScheduler(cfg(min_yield=min_yield), size=20, n=8, prompts_per_step=4, seed=0)
        s.probed[:] = 0
        s.merge(0, [[(i, 8.0, 8) for i in range(20)]])  # every prompt 8 of 8: P(mixed) ~ 0.02 each
        return s

    s = solved(0.1)
    assert s.expected_mixed(list(range(20)), 1) < 0.1
    first = s.select(4, step=1, round_=0, rank=0, world=1)
    assert len(first) == 4  # the first round always runs
    probed = s.probed.copy()
    assert s.select(4, step=1, round_=1, rank=0, world=1) == []
    # a skipped round marks nothing
    assert np.array_equal(s.probed, probed) and s.taken == set(first)
    assert len(solved(0.0).select(4, step=1, round_=1, rank=0, world=1)) == 4
    s = solved(0.1)
    s.merge(1, [[(i, 4.0, 8) for i in range(20)]])  # now mixed: refills run
    assert len(s.select(4, step=2, round_=1, rank=0, world=1)) == 4


def test_a_skipped_refill_counts_no_reprobe_and_each_step_starts_afresh():
    s = PromptScheduler(cfg(min_yield=0.5), size=12, n=8, prompts_per_step=2, seed=0)
    s.probed[:] = 0
    s.merge(0, [[(i, 8.0, 8) for i in range(12)]])  # all solved; every prompt stale by step 20
    s.new_step()
    assert len(s.select(2, step=20, round_=0, rank=0, world=1)) == 2 and s.reprobes == 2
    assert s.select(2, step=20, round_=1, rank=0, world=1) == [] and s.reprobes == 2
    s.new_step()
    assert s.reprobes == 0 and s.taken == set()


def test_a_record_saved_before_the_population_prior_loads_as_evidence():
    s = PromptScheduler(cfg(), size=3, n=4, prompts_per_step=2, seed=0)
    old = {"alpha": [1.0, 4.0, 1.0], "beta": [1.0, 2.0, 5.0], "updated": [0, 7, 9],
           "probed": [-1, 7, 9], "excluded": [False, False, False], "pending": []}  # fmt: skip
    s.load_state_dict(old)
    assert s.successes.tolist() == [0.0, 3.0, 0.0] and s.failures.tolist() == [0.0, 1.0, 4.0]
    assert s.population.tolist() == [3.0, 5.0] and s.population_updated == 9


def test_exclude_solved_never_chooses_a_solved_prompt_again():
    s = PromptScheduler(cfg(mode="exclude-solved"), size=6, n=4, prompts_per_step=2, seed=0)
    s.probed[:] = 0
    s.merge(0, [[(2, 4.0, 4), (3, 3.0, 4)]])
    assert s.excluded.tolist() == [False, False, True, False, False, False]
    chosen = []
    for step in range(1, 30):
        s.new_step()
        chosen += s.select(2, step=step, round_=0, rank=0, world=1)
    assert 2 not in chosen and set(chosen) == {0, 1, 3, 4, 5}


def _two_ranks(rank, world):
    import os

    from transformers import PreTrainedTokenizerFast

    from prorl.config import load_config
    from prorl.data import builtin
    from prorl.rewards.pool import RewardPool
    from prorl.trainer import Trainer

    os.environ["RANK"] = str(rank)
    path = os.path.join(os.path.dirname(__file__), "..", "..", "prorl", "assets", "tiny-reasoner")
    over = [
        "scheduler.mode=pass-rate",
        "trainer.prompts_per_step=8",
        "rollout.n=4",
        f"model.path={path}",
    ]
    cfg = load_config("default", over)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = Trainer(cfg, path, tok, builtin("digit_sums", n=40, split="train"), [], pool)
        chosen, observed = [], []
        scheduler = trainer.sampler.scheduler
        select, observe = scheduler.select, scheduler.observe

        def recording(k, **kw):
            out = select(k, **kw)
            chosen.append((kw["step"], out))
            return out

        def observing(prompt, rewards):  # this rank's own groups, with the step that saw them
            observed.append((trainer.step_count, prompt, float(sum(rewards)), len(rewards)))
            observe(prompt, rewards)

        scheduler.select, scheduler.observe = recording, observing
        for _ in range(3):
            trainer.step()
        return scheduler.state_dict(), chosen, observed


def test_the_record_is_global_under_torchrun(tmp_path):
    """Every rank's record is the one docs/recipe.md §10 defines from EVERY rank's groups: per
    prompt, sum over its groups of discount^(steps from the group to the prompt's last update) x
    (successes, failures); the population the same over all groups to the last step; a prompt's
    probe step the last step either rank chose it."""
    res = run_ranks(_two_ranks, tmp_path, world=2, timeout_s=600)
    for (_, a), (_, b) in zip(res[0][1], res[1][1]):  # every round: the ranks' prompts are disjoint
        assert not set(a) & set(b)
    observed = res[0][2] + res[1][2]
    assert {o[0] for o in res[0][2]} == {o[0] for o in res[1][2]} == {0, 1, 2}
    d = load_config("default").scheduler.discount
    size, last = 40, {}
    for step, prompt, _, _ in observed:
        last[prompt] = max(last.get(prompt, 0), step)
    want = {k: np.zeros(size) for k in ("successes", "failures")}
    population = np.zeros(2)
    for step, prompt, s, n in observed:
        want["successes"][prompt] += d ** (last[prompt] - step) * s
        want["failures"][prompt] += d ** (last[prompt] - step) * (n - s)
        population += d ** (2 - step) * np.array([s, n - s])
    probed = np.full(size, -1)
    for step, part in res[0][1] + res[1][1]:
        probed[part] = np.maximum(probed[part], step)
    for record in (res[0][0], res[1][0]):
        for k in ("successes", "failures"):
            assert record[k] == pytest.approx(want[k].tolist(), rel=1e-12, abs=1e-12), k
        assert record["population"] == pytest.approx(population.tolist(), rel=1e-12)
        assert record["probed"] == probed.tolist() and record["population_updated"] == 2
    assert population.sum() > 0, "no group was observed"
