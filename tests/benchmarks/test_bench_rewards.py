"""Smoke test of `python -m benchmarks rewards`: two items per domain, one worker, a temp CSV. Never
asserts speed; checks the plumbing (pool and in-process providers, score checks,
docs/architecture.md CSV columns)."""

from __future__ import annotations

import pytest

from benchmarks import rewards


def test_workloads_score_as_stated():
    pytest.importorskip(
        "math_verify", reason="the math verifier needs math-verify (a base dependency)"
    )
    from prorl.rewards import score

    for i in range(10):  # every math template once
        response, truth, expected = rewards.math_case(i)
        assert score("math", response, truth) == expected, response
    assert (
        len({rewards.math_case(i)[0] for i in range(40)}) == 40
    )  # no repeated strings (parse cache)


def test_rewards_benchmark_smoke(tmp_path, run_main):
    pytest.importorskip(
        "math_verify", reason="the math verifier needs math-verify (a base dependency)"
    )
    out = tmp_path / "rewards.csv"
    args = ["--batch", "2", "--reps", "1", "--warmup", "0", "--workers", "1", "--out", str(out)]
    rows = run_main(rewards.main, args, out, "speed-up vs naive")
    seen = {(r["provider"], r["shape"], r["metric"]) for r in rows}
    for provider in ("prorl", "naive"):
        for domain in ("math", "code"):
            for metric in ("time", "throughput"):
                assert (provider, f"{domain} batch=2", metric) in seen
    for r in rows:
        assert r["name"] == "rewards" and r["mode"] == "full" and float(r["p50"]) > 0
        assert "sandbox=" in r["versions"] and r["git_rev"] and r["timestamp"]
