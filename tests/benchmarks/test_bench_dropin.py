"""Smoke test of `python -m benchmarks dropin` (TRL's providers: verl and OpenRLHF live in the peers
venv). Never asserts speed."""

from __future__ import annotations

import pytest

from benchmarks import dropin

pytest.importorskip("trl", reason="TRL is not installed (pip install trl); CI installs it")


@pytest.mark.slow
def test_dropin_benchmark_smoke(tmp_path, run_main, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "dropin.csv"
    args = ["--vocab", "512", "--providers", "trl,trl-fused", "--reps", "1", "--warmup", "0"]
    args += ["--threads", "1", "--out", str(out), "--no-plot"]
    rows = run_main(dropin.main, args, out, "trl-fused")
    assert {(r["provider"], r["metric"]) for r in rows} >= {("trl", "time"), ("trl-fused", "time")}
