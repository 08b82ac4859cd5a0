"""Chain sums: the built-in tasks of the prolonged benchmark (`python -m benchmarks prolonged`).

Two families (`Family`): `chain_sums` (3 to 6 single digits) and `long_sums` (2 to 6 two-digit
terms, the benchmark's task since the single-digit one saturated near 97% by step 300). A chain_sums
problem is a sum of single digits, "3+8+5+9+2="; its worked solution keeps a running total, "3+8=11,
11+5=16, 16+9=25, 25+2=27. \\boxed{27}". The number of terms is the difficulty level. Why this
family: each added term is one more chance to cross a decade (a carry), so the chance of a right
answer is a product over steps - a per-step accuracy of 0.95 gives ~0.8 on four steps and ~0.77 on
five - and held-out pass@1 keeps rising long after the short problems are solved (the embedded
default's three-term sums saturate in ~150 steps). In long_sums every addition may carry into the
tens and the hundreds and the model must copy the right two-digit term from a longer prompt, so each
step is less reliable. The warm start (`python -m prorl.warmstart --task chain_sums`) imitates
demonstrations that forget a carry with probability `slip` and, half of the time, restate the terms
first ("Terms: 3 8 5 9 2. "), so the length penalty and the context schedule have something to
remove.

Splits are disjoint by problem: per level the held-out problems are a fixed seeded draw
(`SPLIT_SEED`, never to change), and the training draw rejects them. Rewards: `data_source`
"math/<family>/<terms>" routes to the math verifier (the `/`-prefix rule of prorl.rewards) and gives
validation a per-level breakdown (`val-core/math/<family>/<terms>/pass@1`).
"""

from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass

from prorl.example import SPLITS, Example

SPLIT_SEED = 20261201  # fixed forever: changing it would leak held-out problems into training


@dataclass(frozen=True)
class Family:
    """A chain-sum task family: `levels` (terms per problem), terms drawn from `low`..`high`
    inclusive."""

    name: str  # the built-in task name (`data.builtin_task`) and the data_source's middle part
    levels: tuple[int, ...]
    low: int
    high: int
    val_per_level: int = 50
    train_size: int = 4000

    def space(self, terms: int) -> int:
        return (self.high - self.low + 1) ** terms

    def decode(self, index: int, terms: int) -> tuple[int, ...]:
        """Problem number `index` of the level: its base-(high-low+1) digits, most significant
        first."""
        base, out = self.high - self.low + 1, []
        for _ in range(terms):
            index, r = divmod(index, base)
            out.append(self.low + r)
        return tuple(reversed(out))

    def label(self, kind: str, terms: int, seed: int = 0) -> str:
        """The seed string of a level's draws (chain_sums keeps its original ones)."""
        if kind == "val":
            return (
                f"{SPLIT_SEED}:{terms}"
                if self.name == "chain_sums"
                else f"{SPLIT_SEED}:{self.name}:{terms}"
            )
        return f"{self.name}:{seed}:{terms}"


CHAIN_SUMS = Family("chain_sums", (3, 4, 5, 6), 0, 9)
# Two-digit terms: every addition can carry into the tens and the hundreds, so the per-step accuracy
# is lower and each extra term costs more; 2 to 6 terms (1 to 5 additions).
LONG_SUMS = Family("long_sums", (2, 3, 4, 5, 6), 10, 99, train_size=5000)
FAMILIES = {f.name: f for f in (CHAIN_SUMS, LONG_SUMS)}
LEVELS = CHAIN_SUMS.levels
VAL_PER_LEVEL = CHAIN_SUMS.val_per_level
TRAIN_SIZE = CHAIN_SUMS.train_size


def _family(terms: int, family: Family) -> Family:
    if terms not in family.levels:
        raise ValueError(f"{family.name}: terms must be one of {family.levels}, got {terms}")
    return family


def held_out(terms: int, family: Family = CHAIN_SUMS) -> list[tuple[int, ...]]:
    """The level's held-out problems: `val_per_level` distinct draws with `SPLIT_SEED`."""
    f = _family(terms, family)
    rng = random.Random(f.label("val", terms))
    return [f.decode(i, terms) for i in rng.sample(range(f.space(terms)), f.val_per_level)]


def _train_problems(terms: int, n: int, seed: int, family: Family) -> list[tuple[int, ...]]:
    """`n` distinct training problems of the level (all that are not held out when fewer exist)."""
    f = family
    excluded = set(held_out(terms, f))
    space = f.space(terms)
    rng = random.Random(f.label("train", terms, seed))
    if n >= space - len(excluded):
        pool = [i for i in range(space) if f.decode(i, terms) not in excluded]
        rng.shuffle(pool)
        return [f.decode(i, terms) for i in pool]
    picked: set[int] = set()
    while len(picked) < n:
        i = rng.randrange(space)
        if f.decode(i, terms) not in excluded:
            picked.add(i)
    order = sorted(picked)
    rng.shuffle(order)
    return [f.decode(i, terms) for i in order]


def solution(terms: tuple[int, ...], slip: float = 0.0, rng: random.Random | None = None) -> str:
    """The worked running-total solution; each step whose units carry (units of the total plus units
    of the term >= 10) forgets that carry with probability `slip` (needs `rng` when slip > 0), and
    the mistake flows into the boxed answer. For single-digit terms a units carry is a decade
    crossing."""
    total, steps = terms[0], []
    for d in terms[1:]:
        s = total + d
        if total % 10 + d % 10 >= 10 and slip > 0 and rng.random() < slip:
            s -= 10
        steps.append(f"{total}+{d}={s}")
        total = s
    return ", ".join(steps) + f". \\boxed{{{total}}}"


def restatement(terms: tuple[int, ...]) -> str:
    """The verbose opening some demonstrations have: it adds tokens and no information."""
    return "Terms: " + " ".join(map(str, terms)) + ". "


def example(terms: tuple[int, ...], split: str, family: Family = CHAIN_SUMS) -> Example:
    return Example(
        prompt=[{"role": "user", "content": "+".join(map(str, terms)) + "="}],
        data_source=f"math/{family.name}/{len(terms)}",
        ground_truth=str(sum(terms)),
        extra={
            "split": split,
            "task": family.name,
            "terms": len(terms),
            "solution": solution(terms),
        },
        ability="math",
    )


def parse_terms(prompt: str) -> tuple[int, ...]:
    """The terms of a prompt "3+8+5=" (the warm start rebuilds its demonstrations from them)."""
    return tuple(int(t) for t in prompt.rstrip("=").split("+"))


def chain_sums(
    n: int | None = None,
    seed: int = 0,
    split: str = "train",
    levels: tuple[int, ...] | None = None,
    family: Family | str = CHAIN_SUMS,
) -> list[Example]:
    """`n` problems of `split`, an equal share per level (the remainder to the longest levels),
    shuffled by `seed`. Train: n defaults to the family's `train_size`; distinct problems, none held
    out. Val: the held-out problems (`val_per_level` per level; n None or 0 takes all of them, a
    smaller n the first n of a level-balanced order, so a held-out subset is the same whatever the
    seed)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(family, str):
        if family not in FAMILIES:
            raise ValueError(f"unknown chain-sum family {family!r}; known: {sorted(FAMILIES)}")
        family = FAMILIES[family]
    levels = family.levels if levels is None else levels
    if split == "val":
        per_level = [held_out(t, family) for t in levels]
        interleaved = [p for row in zip(*per_level) for p in row]  # level-balanced at every prefix
        return [example(p, split, family) for p in interleaved[: n or None]]
    n = family.train_size if n is None else n
    shares = [n // len(levels) + (i >= len(levels) - n % len(levels)) for i in range(len(levels))]
    problems = [p for t, k in zip(levels, shares) for p in _train_problems(t, k, seed, family)]
    random.Random(seed).shuffle(problems)
    return [example(p, split, family) for p in problems]


_STEP = re.compile(r"(\d+)\+(\d+)=(\d+)")
_BOX = re.compile(r"\\boxed\{(-?\d+)\}")


def first_error(terms: tuple[int, ...], text: str) -> str:
    """Where a worked solution `text` of the sum of `terms` first goes wrong: "right" (the last
    boxed answer is the sum), "copied a term wrong" (a step adds another number than the next term),
    "wrong running total" (a step does not start from the previous result), "forgot the units carry"
    (exactly 10 short where the units carry), "other arithmetic", "extra step", "too few steps", "no
    answer" (nothing boxed), "box differs" (every step right, another number boxed)."""
    boxes = _BOX.findall(text)
    if boxes and int(boxes[-1]) == sum(terms):
        return "right"
    total, steps = terms[0], _STEP.findall(text)
    for i, (a, b, c) in enumerate(steps):
        a, b, c = int(a), int(b), int(c)
        if i + 1 >= len(terms):
            return "extra step"
        if a != total:
            return "wrong running total"
        if b != terms[i + 1]:
            return "copied a term wrong"
        if c == a + b - 10 and a % 10 + b % 10 >= 10:
            return "forgot the units carry"
        if c != a + b:
            return "other arithmetic"
        total = c
    if len(steps) < len(terms) - 1:
        return "too few steps"
    return "box differs" if boxes else "no answer"


def error_table(model_dir: str, family: str = "long_sums", temperature: float = 0.0) -> dict:
    """{terms: {first_error kind: count}} of the checkpoint's solutions of the family's held-out
    problems (one sample each; greedy at temperature 0)."""
    from collections import Counter

    from transformers import PreTrainedTokenizerFast

    from prorl.engine.model import load_hf
    from prorl.engine.rollout import NativeGenerator, SamplingParams

    tok, model = PreTrainedTokenizerFast.from_pretrained(model_dir), load_hf(model_dir)
    val = chain_sums(split="val", family=family)
    params = SamplingParams(
        temperature=temperature, max_new_tokens=128, stop_token_ids=[tok.eos_token_id]
    )
    chats = [
        tok.apply_chat_template(e.prompt, add_generation_prompt=True, tokenize=False) for e in val
    ]
    out = NativeGenerator(model).generate(
        [tok.encode(c, add_special_tokens=False) for c in chats], params
    )
    table: dict[int, Counter] = {}
    for s in out.samples:
        terms = parse_terms(val[s.prompt_index].prompt[0]["content"])
        kind = first_error(terms, tok.decode(s.token_ids, skip_special_tokens=True))
        table.setdefault(len(terms), Counter())[kind] += 1
    return {t: dict(c.most_common()) for t, c in sorted(table.items())}


__all__ = [
    "CHAIN_SUMS",
    "FAMILIES",
    "LEVELS",
    "LONG_SUMS",
    "Family",
    "chain_sums",
    "error_table",
    "first_error",
    "held_out",
    "parse_terms",
    "restatement",
    "solution",
]


if __name__ == "__main__":  # python -m prorl.chain_sums CHECKPOINT [FAMILY]: first errors per level
    for level, kinds in error_table(*sys.argv[1:3]).items():
        print(level, kinds)
