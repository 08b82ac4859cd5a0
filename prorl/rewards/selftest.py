"""Start-up self-test: a known-right and a known-wrong answer through every configured verifier.

A verifier that silently scores everything 0 (a missing dependency swallowed somewhere, a sandbox
that cannot start on this host, math-verify called from a thread) wastes a whole run, so the trainer
calls `self_test(data_sources, pool)` before step 0 and stops with this module's message if any
built-in verifier does not give the right answer 1 and the wrong answer 0, or times out, or errors.
The message carries the underlying error (a sandbox that cannot start names what failed) and, for a
wrong score, the verifier's own diagnostics (e.g. the code run's stderr).
"""

from __future__ import annotations

from prorl.rewards import lookup

_STDIO = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
_SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"

# built-in key -> (data_source, right response, wrong response, ground truth, extra)
SAMPLES: dict[str, tuple] = {
    "math": ("math", "<think>1/2</think> \\boxed{\\frac{1}{2}}", "\\boxed{0.6}", "0.5", None),
    "stem": ("stem", "The answer is (C).", "The answer is (B).", "C", None),
    "ifeval": (
        "ifeval",
        "all lower case and no commas here",
        "Has Capitals, and commas",
        {
            "instruction_id_list": ["change_case:english_lowercase", "punctuation:no_comma"],
            "kwargs": [{}, {}],
        },
        None,
    ),
    "reasoning_gym": (
        "reasoning_gym/basic_arithmetic",
        "<answer>12</answer>",
        "<answer>13</answer>",
        "12",
        None,
    ),
    "code": ("code", _SUM, _SUM.replace("a + b", "a - b"), _STDIO, None),
}


_DIAGNOSTICS = ("timed_out", "crashed", "compile_error", "stderr")


def _diagnostics(info: dict | None) -> str:
    """What a verifier reported about a wrong score (a code run's stderr, compile error,
    timeout)."""
    shown = [f"{k}: {str(info[k]).strip()[-500:]}" for k in _DIAGNOSTICS if (info or {}).get(k)]
    return f" ({'; '.join(shown)})" if shown else ""


def self_test(data_sources, pool=None) -> dict[str, str]:
    """Check the verifier behind each data source (once per verifier). Returns {key: "ok" |
    "skipped: no sample"}; raises RuntimeError naming every verifier that misbehaved and how."""
    keys = sorted({lookup(ds)[0] for ds in data_sources})
    status, failures = {}, []
    todo = [k for k in keys if k in SAMPLES]
    status.update({k: "skipped: no sample" for k in keys if k not in SAMPLES})
    if not todo:
        return status
    items = [
        (SAMPLES[k][0], SAMPLES[k][i], SAMPLES[k][3], SAMPLES[k][4]) for k in todo for i in (1, 2)
    ]
    sources, responses, truths, extras = (list(x) for x in zip(*items))
    if pool is not None:
        res = pool.score_batch(sources, responses, truths, extras)
        outcomes = [
            (s, "timeout" if t else f"error: {e}" if err else None, info)
            for s, t, err, e, info in zip(
                res.scores, res.timed_out, res.errored, res.errors, res.extras
            )
        ]
    else:
        from prorl.rewards import score_with_info

        outcomes = []
        for item in items:
            try:
                value, info = score_with_info(*item)
                outcomes.append((value, None, info))
            except Exception as exc:  # noqa: BLE001 - reported below
                outcomes.append((0.0, f"error: {type(exc).__name__}: {exc}", {}))
    for j, key in enumerate(todo):
        (right, right_problem, right_info), (wrong, wrong_problem, _) = (
            outcomes[2 * j],
            outcomes[2 * j + 1],
        )
        problems = list(dict.fromkeys(p for p in (right_problem, wrong_problem) if p))
        if right != 1.0:
            problems.append(f"known-right answer scored {right}{_diagnostics(right_info)}")
        if wrong != 0.0:
            problems.append(f"known-wrong answer scored {wrong}")
        if problems:
            failures.append(f"{key}: " + "; ".join(problems))
        status[key] = "ok" if not problems else "failed"
    if failures:
        raise RuntimeError("reward self-test failed:\n  " + "\n  ".join(failures))
    return status


def check_function(examples, pool) -> str:
    """A verl reward function (`reward.function`) on one example of each data source, its ground
    truth as the response: any finite score passes (its right answers are unknown here), an error or
    a timeout raises RuntimeError with the function's own message (which names its file and
    name)."""
    first = {}
    for ex in examples:
        first.setdefault(ex.data_source, ex)
    exs = list(first.values())
    if not exs:
        return "skipped: no data"
    res = pool.score_batch(
        [e.data_source for e in exs], [str(e.ground_truth) for e in exs],
        [e.ground_truth for e in exs], [e.extra for e in exs],
    )  # fmt: skip
    for ex, timed_out, errored, error in zip(exs, res.timed_out, res.errored, res.errors):
        if timed_out or errored:
            raise RuntimeError(
                f"reward self-test failed on data_source {ex.data_source!r}: {error}"
            )
    return "ok"
