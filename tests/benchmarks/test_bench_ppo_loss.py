"""Smoke test of the ppo_loss and linear_ppo_loss benchmarks: tiny shapes, temp CSV. Never asserts speed."""

from __future__ import annotations

import csv

from benchmarks import harness, linear_ppo_loss, ppo_loss


def _rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == harness.COLUMNS
        return list(reader)


def test_ppo_loss_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "ppo.csv"
    args = ["--sizes", "64", "--providers", "prorl,naive,trl-style", "--modes", "full", "--reps", "2"]
    assert ppo_loss.main(args + ["--warmup", "0", "--threads", "1", "--out", str(out)]) == 0
    assert "speed-up vs naive" in capsys.readouterr().out
    seen = {(r["provider"], r["metric"]) for r in _rows(out)}
    assert {("prorl", "time"), ("naive", "time"), ("trl-style", "time")} <= seen


def test_linear_ppo_loss_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "lpl.csv"
    args = ["--shape", "16,8,300", "--providers", "prorl,prorl-unfused,sgemm-floor", "--reps", "2"]
    assert linear_ppo_loss.main(args + ["--warmup", "0", "--threads", "1", "--out", str(out)]) == 0
    assert "÷ sgemm-floor" in capsys.readouterr().out
    rows = _rows(out)
    assert {r["provider"] for r in rows} == {"prorl", "prorl-unfused", "sgemm-floor"}
    assert all(r["mode"] == "full" for r in rows)
