"""Smoke test of the benchmark harness: a tiny shape, two CPU providers, a temp CSV. Never asserts
speed.

Checks that `python -m benchmarks linear_logprob_entropy` plumbing works end to end (worker
processes, long-format CSV with the documented columns, the summary) and that the plot script reads
what it wrote.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import harness, linear_logprob_entropy


def test_linear_logprob_entropy_smoke(tmp_path, run_main):
    out = tmp_path / "llle.csv"
    args = [
        *"--shape 32,16,512 --providers prorl-torch,naive --modes forward,full".split(),
        *"--reps 2 --warmup 0 --threads 1 --out".split(),
        str(out),
    ]
    rows = run_main(linear_logprob_entropy.main, args, out, "speed-up vs naive")
    seen = {(r["provider"], r["mode"], r["metric"]) for r in rows}
    for provider in ("prorl-torch", "naive"):
        for mode in ("forward", "full"):
            assert (provider, mode, "time") in seen
            assert (provider, mode, "gflops") in seen
    for r in rows:
        assert r["name"] == "linear_logprob_entropy"
        assert r["shape"] == "N=32 D=16 V=512 float32"
        p20, p50, p80 = float(r["p20"]), float(r["p50"]), float(r["p80"])
        assert all(math.isfinite(x) for x in (p20, p50, p80)) and p20 <= p50 <= p80
        assert "torch=" in r["versions"] and "OMP_NUM_THREADS=1" in r["versions"]
        assert r["device"] and r["git_rev"] and r["timestamp"]

    # appending keeps one header
    harness.append_csv(out, rows[:1])
    with open(out) as f:
        assert sum(line.startswith("name,") for line in f) == 1

    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the test extra)")
    from benchmarks import plot

    pngs = plot.plot(out, tmp_path)
    assert [p.name for p in pngs][:1] == ["llle_time.png"] and all(
        p.stat().st_size > 0 for p in pngs
    )
