"""Smoke test of the ppo_loss and linear_ppo_loss benchmarks: tiny shapes, temp CSV. Never asserts
speed."""

from __future__ import annotations

from benchmarks import linear_ppo_loss, ppo_loss


def test_ppo_loss_benchmark_smoke(tmp_path, run_main):
    out = tmp_path / "ppo.csv"
    args = "--sizes 64 --providers prorl,naive,trl-style --modes full --reps 2".split()
    args += ["--warmup", "0", "--threads", "1", "--out", str(out)]
    rows = run_main(ppo_loss.main, args, out, "speed-up vs naive")
    seen = {(r["provider"], r["metric"]) for r in rows}
    assert {("prorl", "time"), ("naive", "time"), ("trl-style", "time")} <= seen


def test_linear_ppo_loss_benchmark_smoke(tmp_path, run_main):
    out = tmp_path / "lpl.csv"
    args = ["--shape", "16,8,300", "--providers", "prorl,prorl-unfused,sgemm-floor", "--reps", "2"]
    args += ["--warmup", "0", "--threads", "1", "--out", str(out)]
    rows = run_main(linear_ppo_loss.main, args, out, "÷ sgemm-floor")
    assert {r["provider"] for r in rows} == {"prorl", "prorl-unfused", "sgemm-floor"}
    assert all(r["mode"] == "full" for r in rows)
