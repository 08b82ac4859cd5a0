"""benchmarks/async_rl.py: the `--quick` smoke run (real torchrun jobs: sync and 1 + 1 async), and
its arithmetic (time base, idle fractions, overlap, accuracy delta, the GPU projection) on hand-made
numbers worked out in the comments."""

from __future__ import annotations

import csv

import pytest

from benchmarks import async_rl
from benchmarks.gpu import plan


@pytest.mark.slow
def test_quick_run_writes_rows_plot_and_projection(tmp_path):
    out, work = tmp_path / "async_rl.csv", tmp_path / "runs"
    argv = ["--quick", "--variants", "sync,async-k1", "--work", str(work), "--out", str(out)]
    assert async_rl.main(argv) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    got = {(r["provider"], r["mode"], r["shape"], r["metric"]): float(r["p50"]) for r in rows}
    measured = lambda v, m: got[(v, "measured", "embedded default, 4 steps (quick)", m)]
    for variant in ("sync", "async-k1"):
        assert measured(variant, "steps_per_min") > 0 and measured(variant, "gen_tokens_per_s") > 0
        assert 0 < measured(variant, "train_time") < measured(variant, "wall_time")
        for side in ("rollout_idle", "trainer_idle"):
            assert 0 <= measured(variant, side) < 1, (variant, side)
        assert measured(variant, "overlap_efficiency") >= 1
        assert 0 <= measured(variant, "final_val_accuracy") <= 1
    assert measured("sync", "val_accuracy_delta") == 0 and measured("sync", "staleness_max") == 0
    assert measured("async-k1", "staleness_max") <= 1  # never more than k updates old
    # sync idles each side for the other's phases: the two fractions cover the step
    assert abs(measured("sync", "rollout_idle") + measured("sync", "trainer_idle") - 1) < 1e-3
    # the async run really was 1 rollout + 1 trainer rank with k = 1
    config = (work / "async-k1" / "config.yaml").read_text()
    assert "steps_ahead: 1" in config and "rollout_ranks: 1" in config and "is_mode: tis" in config
    assert (work / "async-k1" / "timing.json").exists()
    projected = [r for r in rows if r["provider"] == "projection"]
    assert {(r["mode"], r["shape"]) for r in projected} == {
        (m, s) for m in ("linear", "tail") for s in ("8 gpus", "2x8 gpus")
    }
    assert all(r["versions"].startswith("projection, not measured") for r in projected)
    assert out.with_suffix(".png").stat().st_size > 0


def _sync_rows(async_waits=None):
    """A validation before RL, then two steps of 1 s (gen 0.3 + verify 0.1), step 2 validated."""
    step = {"timing_s/step": 1.0, "timing_s/gen": 0.3, "timing_s/reward": 0.1}
    step |= {"timing_s/old_log_prob": 0.2, "timing_s/ref": 0.05, "timing_s/update_actor": 0.3}
    step |= {"response_length/mean": 30.0, "response_length/max": 40.0}
    step |= {"dynamic_sampling/generated_tokens": 1100.0}
    step |= async_waits or {}
    val = {"val/accuracy": 0.5, "timing_s/testing": 0.5}
    return [{"step": 0, "val/accuracy": 0.2, "timing_s/testing": 2.0}, dict(step, step=1)] + [
        dict(step, step=2, **val)
    ]


ARRIVALS = [3.0, 4.2, 5.9]  # seconds after launch at which each row appeared


def test_training_time_from_row_arrivals_leaves_validations_out():
    rows = _sync_rows()
    # step 1 began at 4.2 - 1.0 = 3.2; step 2's row appeared at 5.9 after its 0.5 s validation
    assert async_rl.training_time(rows, ARRIVALS) == pytest.approx(5.9 - 3.2 - 0.5)
    assert async_rl.training_time(rows, None) == 2.0  # not watched: the steps' own times
    assert async_rl.training_time(rows, ARRIVALS[:2]) == 2.0  # arrivals that do not match the rows


def test_sync_and_async_idle_overlap_and_throughput():
    s = async_rl.summarise(_sync_rows(), {"wall_s": 9.0, "arrivals": ARRIVALS})
    train = 2.2  # training_time above
    assert s["train_time"] == pytest.approx(train) and s["wall_time"] == 9.0
    assert s["steps_per_min"] == pytest.approx(60 * 2 / train)
    assert s["gen_tokens_per_s"] == pytest.approx(2200 / train)
    # sync: the rollout side works 2 x (0.3 + 0.1) = 0.8 s, the trainer side the other 1.4 s
    assert s["trainer_idle"] == pytest.approx(0.8 / train)
    assert s["rollout_idle"] == pytest.approx(1.4 / train)
    assert s["overlap_efficiency"] == pytest.approx(train / 1.4)
    assert s["phases"]["logprob"] == pytest.approx(0.25) and s["phases"]["verify"] == 0.1
    assert s["phases"]["push"] == pytest.approx(0.1)  # 0.2 s between the steps, over 2 steps
    assert s["tail"] == pytest.approx(0.25) and s["accuracy"] == {0: 0.2, 2: 0.5}
    waits = {"timing_s/wait_rollout": 0.2, "timing_s/wait_trainer": 0.1, "async/staleness/max": 1.0}
    a = async_rl.summarise(_sync_rows(waits), {"arrivals": ARRIVALS})
    # async: the trainer waited 0.4 s in all, the rollout rank 0.2 s: the rollout side is the busier
    assert a["trainer_idle"] == pytest.approx(0.4 / train)
    assert a["rollout_idle"] == pytest.approx(0.2 / train)
    assert a["overlap_efficiency"] == pytest.approx(train / 2.0) and a["staleness_max"] == 1.0


def test_accuracy_delta_is_in_points_against_sync_at_the_last_common_step():
    sync = async_rl.summarise(_sync_rows(), {})
    other = dict(sync, accuracy={0: 0.2, 2: 0.52})
    rows = async_rl.csv_rows({"sync": sync, "async-k1": other}, "shape", "note")
    delta = {r["provider"]: r["p50"] for r in rows if r["metric"] == "val_accuracy_delta"}
    assert delta["sync"] == 0 and delta["async-k1"] == pytest.approx(2.0)


# G = gen + verify = 3 s, T = logprob + update = 1 s per step on 2 devices: 6 and 2 device-seconds
PHASES = dict(gen=2.5, verify=0.5, logprob=0.4, update=0.6, push=0.0)


def test_projection_linear_scaling_can_only_tie():
    # sync on 8: 6/8 + 2/8 = 1.0 s; async: max(6/r, 2/(8 - r)) is 1.0 at r = 6, more elsewhere
    p = async_rl.project(PHASES, 2, 8, None, 0.0)
    assert p == pytest.approx(dict(sync_s=1.0, async_s=1.0, rollout=6, speedup=1.0))
    # with pushes: sync pays 0.1 s, async 0.05 s per step
    p = async_rl.project(dict(PHASES, push=0.1, async_push=0.05), 2, 8, None, 0.0)
    assert (p["sync_s"], p["async_s"], p["speedup"]) == pytest.approx((1.1, 1.05, 1.1 / 1.05))


def test_projection_with_a_serial_tail():
    # half of G does not shrink: gen(d) = 0.5 * 6 / 2 + 0.5 * 6 / d = 1.5 + 3 / d
    # sync on 8: 1.5 + 3/8 + 2/8 = 2.125; async: r = 6 gives max(2.0, 1.0) = 2.0 (r = 7 ties, later)
    p = async_rl.project(PHASES, 2, 8, None, 0.5)
    assert p == pytest.approx(dict(sync_s=2.125, async_s=2.0, rollout=6, speedup=1.0625))
    # 2 x 8, one node each: sync 1.5 + 3/16 + 2/16 = 1.8125; async max(1.5 + 3/8, 2/8) = 1.875
    p = async_rl.project(PHASES, 2, 16, 8, 0.5)
    assert p == pytest.approx(dict(sync_s=1.8125, async_s=1.875, rollout=8, speedup=1.8125 / 1.875))


def test_the_gpu_check_runs_async_first_on_its_own(tmp_path):
    # asynchronous RL on CUDA has never run: first in the plan, k = 1 only (no sync run to read)
    full = {"cuda": True, "torchao": "0.18.0", "omegaconf": "2.4.0", "math_verify": "0.9.0"}
    steps = plan.plan("python", full, str(tmp_path))
    assert steps[0].name == "async_rl" and steps[0].skip is None
    cmd = steps[0].cmd
    assert cmd[cmd.index("--variants") + 1] == "async-k1" and "--sync-run" not in cmd
    bare = {s.name: s.skip for s in plan.plan("python", {"cuda": True}, str(tmp_path))}
    assert "omegaconf, math_verify not importable" in bare["async_rl"]
