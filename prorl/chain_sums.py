"""Chain sums: the built-in task of the prolonged benchmark (`python -m benchmarks prolonged`).

A problem is a sum of 3 to 6 single digits, "3+8+5+9+2="; its worked solution keeps a running total,
"3+8=11, 11+5=16, 16+9=25, 25+2=27. \\boxed{27}". The number of terms is the difficulty level. Why this
family: each added term is one more chance to cross a decade (a carry), so the chance of a right answer
is a product over steps - a per-step accuracy of 0.95 gives ~0.8 on four steps and ~0.77 on five - and
held-out pass@1 keeps rising long after the short problems are solved (the embedded default's three-term
sums saturate in ~150 steps). The warm start (`python -m prorl.warmstart --task chain_sums`) imitates
demonstrations that forget a carry with probability `slip` and, half of the time, restate the terms
first ("Terms: 3 8 5 9 2. "), so the length penalty and the context schedule have something to remove.

Splits are disjoint by problem: per level the held-out problems are a fixed seeded draw
(`SPLIT_SEED`, never to change), and the training draw rejects them. Rewards: `data_source`
"math/chain_sums/<terms>" routes to the math verifier (the `/`-prefix rule of prorl.rewards) and gives
validation a per-level breakdown (`val-core/math/chain_sums/<terms>/pass@1`).
"""

from __future__ import annotations

import random

from prorl.example import SPLITS, Example

LEVELS = (3, 4, 5, 6)  # terms per problem
SPLIT_SEED = 20261201  # fixed forever: changing it would leak held-out problems into training
VAL_PER_LEVEL = 50
TRAIN_SIZE = 4000  # default training set: 1000 problems per level (3 terms: all 950 not held out)


def _problem_space(terms: int) -> int:
    return 10**terms


def _decode(index: int, terms: int) -> tuple[int, ...]:
    return tuple(int(ch) for ch in str(index).zfill(terms))


def held_out(terms: int) -> list[tuple[int, ...]]:
    """The level's held-out problems: `VAL_PER_LEVEL` distinct draws with `SPLIT_SEED`."""
    if terms not in LEVELS:
        raise ValueError(f"chain_sums: terms must be one of {LEVELS}, got {terms}")
    rng = random.Random(f"{SPLIT_SEED}:{terms}")
    return [_decode(i, terms) for i in rng.sample(range(_problem_space(terms)), VAL_PER_LEVEL)]


def _train_problems(terms: int, n: int, seed: int) -> list[tuple[int, ...]]:
    """`n` distinct training problems of the level (all that are not held out when fewer exist)."""
    excluded = {int("".join(map(str, p))) for p in held_out(terms)}
    space = _problem_space(terms)
    rng = random.Random(f"chain_sums:{seed}:{terms}")
    if n >= space - len(excluded):
        pool = [i for i in range(space) if i not in excluded]
        rng.shuffle(pool)
        return [_decode(i, terms) for i in pool]
    picked: set[int] = set()
    while len(picked) < n:
        i = rng.randrange(space)
        if i not in excluded:
            picked.add(i)
    order = sorted(picked)
    rng.shuffle(order)
    return [_decode(i, terms) for i in order]


def solution(terms: tuple[int, ...], slip: float = 0.0, rng: random.Random | None = None) -> str:
    """The worked running-total solution; each step that crosses a multiple of ten forgets its carry with
    probability `slip` (needs `rng` when slip > 0), and the mistake flows into the boxed answer."""
    total, steps = terms[0], []
    for d in terms[1:]:
        s = total + d
        if s // 10 != total // 10 and slip > 0 and rng.random() < slip:
            s -= 10
        steps.append(f"{total}+{d}={s}")
        total = s
    return ", ".join(steps) + f". \\boxed{{{total}}}"


def restatement(terms: tuple[int, ...]) -> str:
    """The verbose opening some demonstrations have: it adds tokens and no information."""
    return "Terms: " + " ".join(map(str, terms)) + ". "


def example(terms: tuple[int, ...], split: str) -> Example:
    return Example(
        prompt=[{"role": "user", "content": "+".join(map(str, terms)) + "="}],
        data_source=f"math/chain_sums/{len(terms)}",
        ground_truth=str(sum(terms)),
        extra={"split": split, "task": "chain_sums", "terms": len(terms), "solution": solution(terms)},
        ability="math",
    )


def parse_terms(prompt: str) -> tuple[int, ...]:
    """The terms of a prompt "3+8+5=" (the warm start rebuilds its demonstrations from them)."""
    return tuple(int(t) for t in prompt.rstrip("=").split("+"))


def chain_sums(
    n: int | None = None, seed: int = 0, split: str = "train", levels: tuple[int, ...] = LEVELS
) -> list[Example]:
    """`n` problems of `split`, an equal share per level (the remainder to the longest levels), shuffled by
    `seed`. Train: n defaults to `TRAIN_SIZE`; distinct problems, none held out. Val: the held-out
    problems (`VAL_PER_LEVEL` per level; n None or 0 takes all of them, a smaller n the first n of a
    level-balanced order, so a held-out subset is the same whatever the seed)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "val":
        per_level = [held_out(t) for t in levels]
        interleaved = [p for row in zip(*per_level) for p in row]  # level-balanced at every prefix
        return [example(p, split) for p in interleaved[: n or None]]
    n = TRAIN_SIZE if n is None else n
    shares = [n // len(levels) + (i >= len(levels) - n % len(levels)) for i in range(len(levels))]
    problems = [p for t, k in zip(levels, shares) for p in _train_problems(t, k, seed)]
    random.Random(seed).shuffle(problems)
    return [example(p, split) for p in problems]


__all__ = ["LEVELS", "chain_sums", "held_out", "parse_terms", "restatement", "solution"]
