"""benchmarks/prolonged.py: the `--quick` smoke run (two variants, one seed, four tiny steps, real
trainer processes) and the summary table's arithmetic on hand-made rows."""

from __future__ import annotations

import csv

from benchmarks import prolonged


def test_quick_run_writes_rows_table_and_figures(tmp_path):
    results = tmp_path / "results"
    assert (
        prolonged.main(["--quick", "--work", str(tmp_path / "runs"), "--results", str(results)])
        == 0
    )
    with open(results / "prolonged.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["variant", "seed", "step", "metric", "value"]
        rows = list(reader)
    for variant in ("full", "fixed-context"):
        val = sorted(
            int(r["step"]) for r in rows if r["variant"] == variant and r["metric"] == "val_pass@1"
        )
        assert val == [0, 2, 4], variant  # before training, every val_every=2 steps, at the end
        steps = sorted(
            int(r["step"]) for r in rows if r["variant"] == variant and r["metric"] == "entropy"
        )
        assert steps == [1, 2, 3, 4]
        for metric in ("val_pass@4", "response_length", "kl", "val_pass@1/3", "val_pass@4/3"):
            assert any(r["variant"] == variant and r["metric"] == metric for r in rows), (
                variant,
                metric,
            )
        assert all(r["seed"] == "1" for r in rows)
    table = (results / "prolonged.md").read_text()
    assert "| full | 1 |" in table and "| fixed-context | 1 |" in table
    assert (results / "prolonged.png").stat().st_size > 0 and (
        results / "prolonged_levels.png"
    ).exists()
    # a second call finds both runs complete and trains nothing
    assert (
        prolonged.main(["--quick", "--work", str(tmp_path / "runs"), "--results", str(results)])
        == 0
    )


def _val(variant, seed, step, value):
    return dict(variant=variant, seed=seed, step=step, metric="val_pass@1", value=value)


def test_summary_final_best_and_spread_over_seeds():
    rows = [_val("full", 1, 0, 0.1), _val("full", 1, 50, 0.6), _val("full", 1, 100, 0.5)]
    rows += [_val("full", 2, 0, 0.1), _val("full", 2, 50, 0.4), _val("full", 2, 100, 0.7)]
    rows += [
        dict(variant="full", seed=s, step=100, metric="val_pass@4", value=v)
        for s, v in ((1, 0.8), (2, 0.9))
    ]
    rows += [
        dict(variant="full", seed=1, step=t, metric="entropy", value=float(t))
        for t in range(1, 101)
    ]
    rows += [
        dict(variant="full", seed=s, step=t, metric="step_time", value=0.5)
        for s in (1, 2)
        for t in range(100)
    ]
    rows += [
        dict(variant="full", seed=1, step=t, metric="response_length", value=float(t))
        for t in range(1, 201)
    ]
    (t,) = prolonged.summary(rows, ["full", "no-kl"], (50, 150))  # no rows of no-kl: no line
    # the length penalty is on for steps 1-50 of every 200: mean of 1..50 and of 51..200
    assert (t["length_on"], t["length_off"]) == (25.5, 125.5)
    assert t["seeds"] == 2 and t["steps"] == 100 and t["start"] == [0.1, 0.1]
    assert sorted(t["final"]) == [0.5, 0.7] and sorted(t["best"]) == [0.6, 0.7]
    assert abs(t["final_pass4"] - 0.85) < 1e-12
    assert abs(t["entropy"] - sum(range(51, 101)) / 50) < 1e-12  # the last 50 steps only
    assert (
        abs(t["train_s"] - 50.0) < 1e-9
    )  # per run: the sum of its step times, averaged over seeds
    line = prolonged.markdown([t]).splitlines()[-1]
    assert line.startswith("| full | 2 | 60.0 (50.0-70.0) | 65.0 (60.0-70.0) | 85.0 |")


def test_equal_compute_interpolates_pass_at1_at_a_token_budget():
    """pass@1 once a run had generated the budget's tokens: linear between the evaluations on either
    side (cumulative generated tokens at each evaluation), per seed; a seed short of the budget is
    left out."""
    rows = [_val("ds", 1, 0, 0.2), _val("ds", 1, 2, 0.6), _val("ds", 1, 4, 0.8)]
    rows += [
        dict(variant="ds", seed=1, step=t, metric="generated_tokens", value=100.0)
        for t in (1, 2, 3, 4)
    ]
    rows += [_val("ds", 2, 0, 0.2), _val("ds", 2, 2, 0.4)]
    rows += [
        dict(variant="ds", seed=2, step=t, metric="generated_tokens", value=50.0) for t in (1, 2)
    ]
    # seed 1: 200 tokens at step 2 (0.6), 400 at step 4 (0.8): 300 tokens -> 0.7; seed 2 ends at 100
    assert prolonged.pass_at_tokens(rows, "ds", 300.0) == [0.7]
    # 50 tokens: seed 1 a quarter of the way to step 2 (0.3), seed 2 half way (0.3)
    assert [round(x, 12) for x in prolonged.pass_at_tokens(rows, "ds", 50.0)] == [0.3, 0.3]
    # the budget is the cheapest run's total (seed 2: 100 tokens), which every run reached: 0.4 and
    # 0.4
    text = prolonged.equal_compute(rows, ["ds"])
    assert "at 0 K generated" in text and "- ds: 40.0 (40.0-40.0)" in text


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not all(isinstance(x, int) for x in v):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_each_variant_changes_only_its_piece():
    from dataclasses import asdict

    from prorl.algorithm import scheduled_value
    from prorl.config import load_config

    full = _flat(asdict(load_config("prolonged", [])))
    # the full recipe: clip-higher, dynamic sampling, KL with interval resets, length penalty, 80
    # then 128
    assert (full["algorithm.eps_low"], full["algorithm.eps_high"]) == (0.2, 0.28)
    assert full["algorithm.dynamic_sampling"] and full["reward.length_penalty"]
    assert full["algorithm.kl_coef"] > 0 and full["algorithm.reset.interval"] == 100
    assert full["scheduler.mode"] == "none"
    sched = full["rollout.max_response_schedule"]
    budgets = [
        scheduled_value(s, sched, full["rollout.max_response_tokens"]) for s in (0, 149, 150, 499)
    ]
    assert budgets == [80, 80, 128, 128]
    expected = {
        "no-clip-higher": {"algorithm.eps_high": 0.2},
        "no-dynamic-sampling": {"algorithm.dynamic_sampling": False},
        "no-kl": {"algorithm.kl_coef": 0.0},
        "kl-no-reset": {"algorithm.reset.interval": 0, "algorithm.reset.kl_spike_factor": 0.0},
        "no-length-penalty": {"reward.length_penalty": False},
        "fixed-context": {"rollout.max_response_schedule": {0: 128, 150: 128}},
    }
    assert set(expected) | {"full"} == set(prolonged.VARIANTS)
    for variant, changed in expected.items():
        cfg = _flat(asdict(load_config("prolonged", prolonged.VARIANTS[variant])))
        diff = {k: v for k, v in cfg.items() if v != full[k]}
        if variant == "kl-no-reset":  # the preset already has the spike rule off
            changed = {k: v for k, v in changed.items() if full[k] != v}
        assert diff == changed, variant
