"""Benchmark of reward verification: verifications per second for math and code, RewardPool vs in-process.

    python -m benchmarks rewards [--quick] [--workers 2] [--domains math,code] [--providers prorl,naive]

Providers:
- `prorl`: `prorl.rewards.pool.RewardPool(num_workers=--workers)` scoring one batch per call
  (`score_batch`): worker processes, each item under the pool's hard timeout, the code verifier's
  sandbox inside. Workers are started, preloaded and warmed before timing (the trainer keeps its pool).
- `naive`: `prorl.rewards.score` in the calling process, one item after another: no isolation and no
  timeout, the floor of what scoring costs without a pool (for code, each item still starts its sandbox).
Workloads (fixed and deterministic; every score is checked against the known answer, and a batch with
a wrong score, a timeout or an error is reported as an error, not a number):
- math: boxed answers against LaTeX gold answers: integers, fraction vs decimal, equivalent radicals,
  a polynomial in two forms, sets, intervals, and wrong or unboxed answers (half right, half wrong),
  with numbers that change with the item index (`math_case`), so no parse cache is hit;
- code: Python programs against 5 stdin/stdout tests or 3 function-call tests: correct, wrong answer,
  syntax error.

Rows (harness.COLUMNS, mode `full` = the whole verification, shape = "<domain> batch=<B>"): `time` (ms
per batch) and `throughput` (verifications/s) with p50/p20/p80 over the timed batches; `versions` names
the worker count, the sandbox backend and math-verify's version. Measured one provider after another
in this process (the pool's own workers are separate processes); on a shared machine compare ratios
within one invocation (MACHINE-NOTES.md: timing on 2 busy cores varies severalfold).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import sys
import time
from types import SimpleNamespace

from benchmarks import harness

NAME = "rewards"
PROVIDERS = ("prorl", "naive")
DOMAINS = ("math", "code")
BATCH = {"math": 256, "code": 64}
QUICK_BATCH = {"math": 16, "code": 8}


def math_case(i: int) -> tuple[str, str, float]:
    """(response, ground truth, expected score) of math item i. Numbers change with i, so no two items
    of a batch are equal strings: math-verify keeps an LRU cache of 20 parsed LaTeX strings, which
    repeated items would hit."""
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
_STDIO = {"inputs": [f"{i} {2 * i}\n" for i in range(1, 6)], "outputs": [f"{3 * i}\n" for i in range(1, 6)]}
_CALL = {
    "inputs": [[[3, 1, 2]], [[5, 4]], [[]]],
    "outputs": [[[1, 2, 3]], [[4, 5]], [[]]],
    "fn_name": "sort_list",
}
CODE_CASES = [
    (_SUM, _STDIO, 1.0),
    (_SUM.replace("a + b", "a - b"), _STDIO, 0.0),
    ("```python\ndef sort_list(xs):\n    return sorted(xs)\n```", _CALL, 1.0),
    ("```python\ndef sort_list(xs)\n    return xs\n```", _CALL, 0.0),
]


def workload(domain: str, batch: int) -> tuple[list[str], list, list[float]]:
    """(responses, ground truths, expected scores) of `batch` items cycling through the domain's cases."""
    items = [math_case(i) if domain == "math" else CODE_CASES[i % len(CODE_CASES)] for i in range(batch)]
    return [r for r, _, _ in items], [g for _, g, _ in items], [e for _, _, e in items]


def _check(domain: str, scores: list[float], expected: list[float], timed_out=None, errored=None) -> None:
    timed_out, errored = timed_out or [False] * len(scores), errored or [False] * len(scores)
    wrong = [i for i, (s, e) in enumerate(zip(scores, expected)) if s != e]
    if wrong or any(timed_out) or any(errored):
        i = (wrong or [0])[0]
        raise RuntimeError(
            f"{domain}: {len(wrong)} wrong scores (first: item {i} scored {scores[i]}, expected "
            f"{expected[i]}), {sum(timed_out)} timeouts, {sum(errored)} errors: not a measure of verification"
        )


def measure(provider: str, domain: str, batch: int, workers: int, warmup: int, reps: int) -> list[float]:
    """Seconds per batch for `reps` timed batches, after `warmup` untimed ones (at least one for the pool)."""
    responses, truths, expected = workload(domain, batch)
    sources = [domain] * batch
    if provider == "prorl":
        from prorl.rewards.pool import RewardPool

        with RewardPool(num_workers=workers, timeout_s=10.0, preload=(domain,)) as pool:
            times = []
            for rep in range(max(warmup, 1) + reps):
                t0 = time.perf_counter()
                res = pool.score_batch(sources, responses, truths)
                elapsed = time.perf_counter() - t0
                _check(domain, res.scores, expected, res.timed_out, res.errored)
                if rep >= max(warmup, 1):
                    times.append(elapsed)
            return times
    if provider == "naive":
        from prorl.rewards import score

        score(domain, responses[0], truths[0])  # imports (math-verify ~1 s) outside the timing
        times = []
        for rep in range(warmup + reps):
            t0 = time.perf_counter()
            scores = [score(domain, r, g) for r, g in zip(responses, truths)]
            elapsed = time.perf_counter() - t0
            _check(domain, scores, expected)
            if rep >= warmup:
                times.append(elapsed)
        return times
    raise ValueError(f"unknown provider {provider!r}; one of {PROVIDERS}")


def versions_string(provider: str, workers: int) -> str:
    from prorl.rewards import sandbox

    parts = [f"python={platform.python_version()}"]
    try:
        parts.append(f"math-verify={importlib.metadata.version('math-verify')}")
    except importlib.metadata.PackageNotFoundError:
        parts.append("math-verify=absent")
    parts.append(f"sandbox={sandbox.backend()}")
    parts.append(f"workers={workers}" if provider == "prorl" else "workers=0 (in-process)")
    parts.append(f"cores={harness.default_threads()}")
    parts.append(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    return " ".join(parts)


def _rows(times: list[float], batch: int) -> list[dict]:
    def row(metric, unit, values):
        q = {f"p{p}": harness.quantile(values, p / 100) for p in (50, 20, 80)}
        return dict(metric=metric, unit=unit, **q)

    return [
        row("time", "ms", [t * 1e3 for t in times]),
        row("throughput", "verifications/s", [batch / t for t in times]),
    ]


def summary(rows: list[dict]) -> str:
    rate = {(r["shape"], r["provider"]): r for r in rows if r["metric"] == "throughput"}
    head = f"{'shape':<20} {'provider':<8} {'verif/s p50':>12} {'(p20-p80)':>18} {'x naive':>8}"
    lines = [head, "-" * len(head)]
    for (shape, provider), r in rate.items():
        base = rate.get((shape, "naive"))
        ratio = f"{r['p50'] / base['p50']:>8.2f}" if base else f"{'-':>8}"
        spread = f"({r['p20']:.1f}-{r['p80']:.1f})"
        lines.append(f"{shape:<20} {provider:<8} {r['p50']:>12.1f} {spread:>18} {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCH}, 2 reps (seconds)")
    p.add_argument("--workers", type=int, default=2, help="RewardPool worker processes")
    p.add_argument("--domains", default=",".join(DOMAINS), help="comma-separated subset of math,code")
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset of the providers")
    p.add_argument("--batch", type=int, default=None, help="items per batch for every domain")
    p.add_argument("--reps", type=int, default=None, help="timed batches (default 5, --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches before timing")
    p.add_argument("--out", default=None, help=f"CSV to append to (default benchmarks/results/{NAME}.csv)")
    args = p.parse_args(argv)

    domains, providers = args.domains.split(","), args.providers.split(",")
    for given, known in ((domains, DOMAINS), (providers, PROVIDERS)):
        if set(given) - set(known):
            p.error(f"unknown {sorted(set(given) - set(known))}; choose from {known}")
    reps = args.reps or (2 if args.quick else 5)
    out = args.out or harness.RESULTS_DIR / f"{NAME}.csv"
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    common = dict(name=NAME, mode="full", device=harness.device_name(SimpleNamespace(type="cpu")))
    common |= dict(git_rev=harness.git_rev(), timestamp=stamp)
    print(f"{NAME}: {providers} x {domains}, workers={args.workers}, reps={reps} -> {out}", flush=True)
    rows, errors = [], []
    for domain in domains:
        batch = args.batch or (QUICK_BATCH if args.quick else BATCH)[domain]
        for provider in providers:
            try:
                times = measure(provider, domain, batch, args.workers, args.warmup, reps)
            except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
                errors.append(f"{provider} {domain}: {type(exc).__name__}: {exc}")
                print(f"  {provider} {domain}: FAILED {errors[-1]}", flush=True)
                continue
            versions = versions_string(provider, args.workers)
            for r in _rows(times, batch):
                rows.append(
                    dict(r, provider=provider, shape=f"{domain} batch={batch}", versions=versions, **common)
                )
            rate = rows[-1]  # the throughput row
            print(f"  {provider} {domain}: {rate['p50']:.1f} verifications/s (p50)", flush=True)
    harness.append_csv(out, rows)
    print(summary(rows))
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
