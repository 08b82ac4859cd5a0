"""`python -m benchmarks embedded_default` on a hand-made run and control log: the rows it appends
(the shared columns, the command) and the figure. Never runs training."""

from __future__ import annotations

import json

import pytest

from benchmarks import embedded_default


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rows_from_a_run_and_its_control(tmp_path, run_main):
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib (the test extra)")
    run = tmp_path / "run"
    run.mkdir()
    # 4 steps of 30 s; held-out accuracy before training (step 0), after step 2 and after step 4
    steps = [{"step": 0, "val/accuracy": 0.2}] + [
        {"step": s, "timing_s/step": 30.0} for s in (1, 2, 3, 4)
    ]
    steps[2]["val/accuracy"], steps[4]["val/accuracy"] = 0.5, 0.4
    _jsonl(run / "metrics.jsonl", steps)
    control = tmp_path / "warmstart.jsonl"
    _jsonl(
        control,
        [
            {"elapsed_s": 50.0, "val_greedy_accuracy": 0.3},
            {"elapsed_s": 100.0, "val_greedy_accuracy": 0.6},
        ],
    )
    out = tmp_path / "embedded_default.csv"
    args = ["--run", str(run), "--control", str(control), "--out", str(out)]
    rows = run_main(embedded_default.main, args, out, "accuracy after (mean of last 3)")
    got = {(r["provider"], r["metric"]): float(r["p50"]) for r in rows}
    # RL: (0 s, 0.2), (60 s, 0.5), (120 s, 0.4); control: (0 s, 0.2: the run's start), (50, 0.3),
    # (100, 0.6)
    assert got == pytest.approx(
        {
            ("prorl-rl", "accuracy_before"): 0.2,
            ("prorl-rl", "accuracy_after_mean_last3"): (0.2 + 0.5 + 0.4) / 3,
            ("prorl-rl", "accuracy_max"): 0.5,
            ("prorl-rl", "wall_time"): 120.0,
            ("sft-control", "accuracy_before"): 0.2,
            ("sft-control", "accuracy_after_mean_last3"): (0.2 + 0.3 + 0.6) / 3,
            ("sft-control", "accuracy_max"): 0.6,
            ("sft-control", "wall_time"): 100.0,
        }
    )
    for r in rows:
        assert r["name"] == "embedded_default" and r["device"] and r["git_rev"] and r["timestamp"]
        assert r["command"] and r["p20"] == r["p50"] == r["p80"]
    assert {r["versions"] for r in rows} == {"OMP_NUM_THREADS=1 2 procs", "1 proc"}
    assert out.with_suffix(".png").stat().st_size > 0
