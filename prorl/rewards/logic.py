"""Logic puzzles from Reasoning Gym, scored by each task's own `score_answer` (a float in [0, 1]).

The answer is the last `<answer>...</answer>` after `</think>` (Reasoning Gym's own convention); no
tag scores 0. The task comes from the data_source (`reasoning_gym/<task>`) or the entry's
`metadata.source_dataset`. What `score_answer` needs is found, in order of preference, in:

1. a generator reference `{"task", "seed", "size", "index", "config"?}` in `extra["reasoning_gym"]`
   or as the ground truth: the entry is regenerated exactly (Reasoning Gym is deterministic by
   seed and index). `prorl.data` writes this form. It is the only lossless one: a JSON round trip
   turns tuples into lists, which breaks e.g. `arc_agi` and `rearc` (seen with reasoning-gym
   0.1.25).
2. the entry dict itself (`question`, `answer`, `metadata`), or its JSON string, as the ground
   truth.
3. the answer string as the ground truth, with `extra["metadata"]` if the task needs it.

A `score_answer` that raises on a malformed answer (prime_factorization does on non-integers) scores
0 with the exception in the extras: the model's answer is at fault, not the verifier.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from prorl.rewards.extract import final_text, last_tag


def _reasoning_gym():
    """The optional reasoning-gym package (the `rewards` extra), imported on first use: prorl.data
    imports this module, and a run that never touches a Reasoning Gym task must not need it."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(
            "the reasoning_gym reward needs reasoning-gym: pip install 'prorl[rewards]' "
            "(or: pip install reasoning-gym)"
        ) from exc
    return reasoning_gym


PREFIX = "reasoning_gym/"


@functools.lru_cache(maxsize=256)
def dataset(task: str, seed: int, size: int, config_json: str = "{}"):
    """The Reasoning Gym dataset `task` (cached; generation is lazy and deterministic per index)."""
    return _reasoning_gym().create_dataset(task, seed=seed, size=size, **json.loads(config_json))


def generated_entry(ref: dict) -> dict:
    config = json.dumps(ref.get("config") or {}, sort_keys=True)
    return dataset(ref["task"], int(ref["seed"]), int(ref["size"]), config)[int(ref["index"])]


@functools.lru_cache(maxsize=256)
def score_fn(task: str):
    return _reasoning_gym().get_score_answer_fn(task)


def _entry_and_task(ground_truth: Any, extra: dict) -> tuple[dict, str | None]:
    data_source = extra.get("data_source", "")
    task = data_source[len(PREFIX) :] if data_source.startswith(PREFIX) else None
    ref = extra.get("reasoning_gym")
    if isinstance(ground_truth, str) and ground_truth.lstrip().startswith("{"):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            pass
    if (
        ref is None
        and isinstance(ground_truth, dict)
        and "index" in ground_truth
        and "task" in ground_truth
    ):
        ref = ground_truth
    if ref is not None:
        return generated_entry(ref), ref["task"]
    if isinstance(ground_truth, dict):
        entry = ground_truth
    else:
        entry = {"answer": ground_truth, "metadata": extra.get("metadata") or {}}
    task = task or (entry.get("metadata") or {}).get("source_dataset")
    return entry, task


def score(response: str, ground_truth: Any, extra: dict | None = None) -> dict:
    entry, task = _entry_and_task(ground_truth, extra or {})
    if not task:
        raise ValueError(
            "reasoning_gym: cannot tell the task; use data_source 'reasoning_gym/<task>' or an "
            "entry with metadata.source_dataset"
        )
    answer = last_tag(final_text(response), "answer")
    if answer is None:
        return {"score": 0.0, "format_ok": False}
    try:
        value = float(score_fn(task)(answer, entry))
    except Exception as exc:  # noqa: BLE001 - a malformed answer, see the module docstring
        return {
            "score": 0.0,
            "format_ok": True,
            "score_answer_error": f"{type(exc).__name__}: {exc}",
        }
    return {"score": min(max(value, 0.0), 1.0), "format_ok": True}
