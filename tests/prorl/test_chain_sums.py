"""The chain-sums task (prorl/chain_sums.py): disjoint splits, balanced levels, worked solutions
that follow the documented slip rule, routing to the math verifier, and the warm start's
demonstrations."""

from __future__ import annotations

import random
import re

import pytest

from prorl import chain_sums, data
from prorl.warmstart import demonstration


def _terms(ex):
    return tuple(int(t) for t in ex.prompt[-1]["content"].rstrip("=").split("+"))


def test_splits_are_disjoint_balanced_and_fixed():
    train = data.builtin("chain_sums", split="train")
    val = data.builtin("chain_sums", split="val")
    assert len(val) == 200 and {len(_terms(e)) for e in val} == {3, 4, 5, 6}
    assert {k: sum(len(_terms(e)) == k for e in val) for k in (3, 4, 5, 6)} == {
        3: 50,
        4: 50,
        5: 50,
        6: 50,
    }
    # 3 terms: 1000 problems, 50 held out, so 950 train; the longer levels 1000 each
    assert {k: sum(len(_terms(e)) == k for e in train) for k in (3, 4, 5, 6)} == {
        3: 950,
        4: 1000,
        5: 1000,
        6: 1000,
    }
    assert not {_terms(e) for e in train} & {_terms(e) for e in val}
    assert len({_terms(e) for e in train}) == len(train)  # distinct problems
    # the held-out set does not move with the run seed; a prefix stays level-balanced
    assert [_terms(e) for e in data.builtin("chain_sums", seed=7, split="val")] == [
        _terms(e) for e in val
    ]
    assert sorted(len(_terms(e)) for e in chain_sums.chain_sums(8, split="val")) == [
        3,
        3,
        4,
        4,
        5,
        5,
        6,
        6,
    ]
    for e in val + train[:50]:
        assert e.ground_truth == str(sum(_terms(e)))
        assert e.data_source == f"math/chain_sums/{len(_terms(e))}"


def test_worked_solution_and_slip_rule():
    assert chain_sums.solution((3, 8, 5, 9, 2)) == "3+8=11, 11+5=16, 16+9=25, 25+2=27. \\boxed{27}"
    # slip 1 forgets every carry: 9+9=8 (18 - 10), 8+9=7 (17 - 10); 1+2 crosses no decade
    assert chain_sums.solution((9, 9, 9), 1.0, random.Random(0)) == "9+9=8, 8+9=7. \\boxed{7}"
    assert chain_sums.solution((1, 2, 3), 1.0, random.Random(0)) == "1+2=3, 3+3=6. \\boxed{6}"
    rng = random.Random(0)
    for e in data.builtin("chain_sums", n=200, split="train"):
        text = chain_sums.solution(_terms(e))
        steps = re.findall(r"(\d+)\+(\d)=(\d+)", text)
        assert [int(d) for _, d, _ in steps] == list(_terms(e)[1:])
        assert all(int(x) + int(d) == int(s) for x, d, s in steps)
        # slipped: every step is right or exactly 10 short at a decade crossing
        for x, d, s in re.findall(
            r"(\d+)\+(\d)=(\d+)", demonstration(e.prompt[-1]["content"], 0.6, 0.0, rng)
        ):
            x, d, s = int(x), int(d), int(s)
            assert s == x + d or (s == x + d - 10 and (x + d) // 10 != x // 10)


def test_demonstrations_restate_at_the_given_rate_and_digit_sums_are_unchanged():
    rng = random.Random(1)
    texts = [demonstration("3+8+5=", 0.0, 0.5, rng) for _ in range(2000)]
    share = sum(t.startswith("Terms: 3 8 5. 3+8=11") for t in texts) / len(texts)
    assert 0.45 < share < 0.55
    # the embedded default's demonstrations at slip 0 are data.digit_sums' own worked solutions
    for ex in data.digit_sums(50):
        assert demonstration(ex.prompt[-1]["content"], 0.0, 0.0, rng) == ex.extra["solution"]


def test_routes_to_the_math_verifier():
    pytest.importorskip(
        "math_verify", reason="the math verifier needs math-verify (a core dependency)"
    )
    from prorl.rewards import score

    ex = chain_sums.chain_sums(1, split="val")[0]
    right = chain_sums.solution(_terms(ex))
    assert score(ex.data_source, right, ex.ground_truth) == 1.0
    assert (
        score(ex.data_source, right.replace(f"{{{ex.ground_truth}}}", "{100}"), ex.ground_truth)
        == 0.0
    )


def test_long_sums_splits_levels_and_two_digit_slip():
    """The two-digit family: 50 held-out problems per level (2-6 terms of 10..99), training disjoint
    from them by problem, every step of a slipped demonstration right or exactly 10 short where the
    units carry (units of the total + units of the term >= 10)."""
    val = data.builtin("long_sums", split="val")
    train = data.builtin("long_sums", split="train")
    assert {k: sum(len(_terms(e)) == k for e in val) for k in range(2, 7)} == dict.fromkeys(
        range(2, 7), 50
    )
    assert {k: sum(len(_terms(e)) == k for e in train) for k in range(2, 7)} == dict.fromkeys(
        range(2, 7), 1000
    )
    assert not {_terms(e) for e in train} & {_terms(e) for e in val}
    assert len({_terms(e) for e in train}) == len(train)
    assert all(10 <= t <= 99 for e in val + train for t in _terms(e))
    assert [_terms(e) for e in data.builtin("long_sums", seed=3, split="val")] == [
        _terms(e) for e in val
    ]
    # the chain_sums held-out problems are not moved by the family machinery (the split seed's
    # draws)
    assert chain_sums.held_out(3)[0] == chain_sums.CHAIN_SUMS.decode(
        random.Random(f"{chain_sums.SPLIT_SEED}:3").sample(range(1000), 50)[0], 3
    )
    for e in val:
        assert (
            e.ground_truth == str(sum(_terms(e)))
            and e.data_source == f"math/long_sums/{len(_terms(e))}"
        )
    assert chain_sums.solution((47, 85, 12)) == "47+85=132, 132+12=144. \\boxed{144}"
    # slip 1: 47+85 carries in the units (7+5): 122; 122+12 does not (2+2)
    assert (
        chain_sums.solution((47, 85, 12), 1.0, random.Random(0))
        == "47+85=122, 122+12=134. \\boxed{134}"
    )
    rng, slipped = random.Random(0), 0
    for e in train[:300]:
        for x, d, s in re.findall(
            r"(\d+)\+(\d+)=(\d+)", demonstration(e.prompt[-1]["content"], 0.6, 0.0, rng)
        ):
            x, d, s = int(x), int(d), int(s)
            assert s == x + d or (s == x + d - 10 and x % 10 + d % 10 >= 10)
            slipped += s != x + d
    assert slipped > 100
    with pytest.raises(ValueError, match="long_sums: terms must be one of"):
        chain_sums.held_out(7, chain_sums.LONG_SUMS)


def test_first_error_names_the_first_wrong_step():
    """The classes of chain_sums.first_error, each on a hand-written solution of 47+85+12 (=
    144)."""
    t = (47, 85, 12)
    cases = {
        "47+85=132, 132+12=144. \\boxed{144}": "right",
        "Terms: 47 85 12. 47+85=132, 132+12=144. \\boxed{144}": "right",
        "47+85=122, 122+12=134. \\boxed{134}": "forgot the units carry",  # 7+5 carries
        "47+58=105, 105+12=117. \\boxed{117}": "copied a term wrong",
        "47+85=132, 123+12=135. \\boxed{135}": "wrong running total",
        "47+85=131, 131+12=143. \\boxed{143}": "other arithmetic",
        "47+85=132. \\boxed{132}": "too few steps",
        "47+85=132, 132+12=144, 144+1=145. \\boxed{145}": "extra step",
        "47+85=132, 132+12=144. \\boxed{145}": "box differs",
        "47+85=132, 132+12=144.": "no answer",
    }
    assert {text: chain_sums.first_error(t, text) for text in cases} == cases
    # 2+8 carries in the units of single digits too: a chain_sums slip is this class
    assert chain_sums.first_error((2, 8), "2+8=0. \\boxed{0}") == "forgot the units carry"
