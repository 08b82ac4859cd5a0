"""Benchmark of reward verification: verifications/s for math and code, RewardPool vs in-process.

    python -m benchmarks rewards [--quick] [--workers 2] [--domains math,code]
        [--providers prorl,naive]

`prorl` (RewardPool) against `naive` (`score` in-process) on fixed workloads, every score checked
against the known answer. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import platform
import time

from benchmarks import harness

NAME = "rewards"
PROVIDERS = ("prorl", "naive")
DOMAINS = ("math", "code")
BATCH = {"math": 256, "code": 64}
QUICK_BATCH = {"math": 16, "code": 8}


def math_case(i: int) -> tuple[str, str, float]:
    """(response, ground truth, expected score) of math item i. Numbers change with i, so no two
    items of a batch are equal strings: math-verify keeps an LRU cache of 20 parsed LaTeX strings,
    which repeated items would hit."""
    a, b = i + 1, i + 4
    cases = [
        (f"<think>{b}?</think> The answer is \\boxed{{{b}}}.", f"{b}", 1.0),
        (f"\\boxed{{{b + 1}}}", f"{b}", 0.0),
        (f"\\boxed{{\\frac{{{2 * i + 1}}}{{2}}}}", f"{i}.5", 1.0),
        (f"\\boxed{{{i}.6}}", f"\\frac{{{2 * i + 1}}}{{2}}", 0.0),
        (f"\\boxed{{\\frac{{\\sqrt{{2}}}}{{{2 * a}}}}}", f"\\frac{{1}}{{{a}\\sqrt{{2}}}}", 1.0),
        (f"\\boxed{{{a + 2}\\sqrt{{2}}}}", f"\\sqrt{{{2 * (a + 1) ** 2}}}", 0.0),
        (f"\\boxed{{x^2+{2 * a}x+{a * a}}}", f"(x+{a})^2", 1.0),
        (f"\\boxed{{\\{{1, 2, {b}\\}}}}", f"\\{{{b - 1},2,1\\}}", 0.0),
        (f"\\boxed{{(0, {a}]}}", f"(0,{a}]", 1.0),
        (f"The answer is {b}.", f"{b}", 0.0),
    ]
    return cases[i % len(cases)]


_SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
_STDIO = dict(
    inputs=[f"{i} {2 * i}\n" for i in range(1, 6)], outputs=[f"{3 * i}\n" for i in range(1, 6)]
)
_CALL = dict(
    inputs=[[[3, 1, 2]], [[5, 4]], [[]]], outputs=[[[1, 2, 3]], [[4, 5]], [[]]], fn_name="sort_list"
)
CODE_CASES = [
    (_SUM, _STDIO, 1.0),
    (_SUM.replace("a + b", "a - b"), _STDIO, 0.0),
    ("```python\ndef sort_list(xs):\n    return sorted(xs)\n```", _CALL, 1.0),
    ("```python\ndef sort_list(xs)\n    return xs\n```", _CALL, 0.0),
]


def workload(domain: str, batch: int) -> tuple[list[str], list, list[float]]:
    """(responses, ground truths, expected scores) of `batch` items cycling through its cases."""
    case = math_case if domain == "math" else lambda i: CODE_CASES[i % len(CODE_CASES)]
    items = [case(i) for i in range(batch)]
    return [r for r, _, _ in items], [g for _, g, _ in items], [e for _, _, e in items]


def _check(domain: str, scores: list[float], expected: list[float], timed_out=(), errored=()):
    wrong = [i for i, (s, e) in enumerate(zip(scores, expected)) if s != e]
    if wrong or any(timed_out) or any(errored):
        i = (wrong or [0])[0]
        raise RuntimeError(
            f"{domain}: {len(wrong)} wrong scores (first: item {i} scored {scores[i]}, expected "
            f"{expected[i]}), {sum(timed_out)} timeouts, {sum(errored)} errors: "
            "not a measure of verification"
        )


def _timed(score_batch, warmup: int, reps: int, check) -> list[float]:
    """Seconds of the `reps` calls of `score_batch` after `warmup` untimed ones, each checked."""
    times = []
    for _ in range(warmup + reps):
        t0 = time.perf_counter()
        result = score_batch()
        times.append(time.perf_counter() - t0)
        check(result)
    return times[warmup:]


def timed_batches(provider: str, domain: str, batch: int, workers: int, warmup: int, reps: int):
    """Seconds per batch for `reps` timed batches, after `warmup` untimed ones (the pool: >= 1)."""
    responses, truths, expected = workload(domain, batch)
    if provider == "prorl":
        from prorl.rewards.pool import RewardPool

        check = lambda res: _check(domain, res.scores, expected, res.timed_out, res.errored)
        with RewardPool(num_workers=workers, timeout_s=10.0, preload=(domain,)) as pool:
            score_batch = lambda: pool.score_batch([domain] * batch, responses, truths)
            return _timed(score_batch, max(warmup, 1), reps, check)
    if provider == "naive":
        from prorl.rewards import score

        score(domain, responses[0], truths[0])  # imports (math-verify ~1 s) outside the timing
        score_batch = lambda: [score(domain, r, g) for r, g in zip(responses, truths)]
        return _timed(score_batch, warmup, reps, lambda scores: _check(domain, scores, expected))
    raise ValueError(f"unknown provider {provider!r}; one of {PROVIDERS}")


def measure(spec: dict, provider: str, mode: str, shape: dict, device) -> list[dict]:
    """harness.worker_main's measure: the time and throughput rows of a provider on a workload."""
    from prorl.rewards import sandbox

    workers, batch = spec["options"]["workers"], shape["batch"]
    times = timed_batches(provider, shape["domain"], batch, workers, spec["warmup"], spec["reps"])
    note = f"python={platform.python_version()} math-verify={harness.dist_version('math-verify')}"
    note += f" sandbox={sandbox.backend()}"
    note += f" workers={workers}" if provider == "prorl" else " workers=0 (in-process)"
    rows = [harness.row("time", "ms", [t * 1e3 for t in times])]
    rows.append(harness.row("throughput", "verifications/s", [batch / t for t in times]))
    return [dict(r, mode=mode, note=note) for r in rows]


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCH}, 2 reps (seconds)")
    p.add_argument("--workers", type=int, default=2, help="RewardPool worker processes")
    p.add_argument("--domains", type=harness.subset_of(DOMAINS), default=",".join(DOMAINS))
    p.add_argument("--batch", type=int, help="items per batch for every domain")


def _shapes(args) -> list[dict]:
    batches = {d: args.batch or (QUICK_BATCH if args.quick else BATCH)[d] for d in args.domains}
    return [dict(domain=d, batch=b, label=f"{d} batch={b}") for d, b in batches.items()]


BENCHMARK = harness.Benchmark(
    NAME, PROVIDERS, _shapes, _options, measure="benchmarks.rewards:measure"
)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
