"""Exact resume and clean stops of `torchrun prorl/train.py` (issue 8), on 2 CPU processes.

One tiny deterministic run goes uninterrupted into A. The same command goes into B, where it is
killed with SIGKILL (the whole process tree: torchrun, both ranks, their reward workers) mid-save
and mid-step, stopped once with Ctrl-C (SIGINT, as a terminal sends it), and re-run each time until
it completes. B's final weights must equal A's bit for bit and every per-step metric (all but timing
and throughput) must be equal, each step logged exactly once; after every kill, nothing that is not
a whole checkpoint may look complete to `Checkpointer`. Kill times are random: the seed is printed
on failure (set PRORL_TEST_SEED to replay it).
"""

import json
import os
import random
import signal
import time

import pytest
import torch
from prorl.engine.checkpoint import MARKER, Checkpointer
from safetensors.torch import load_file
from train_helpers import (
    TINY,
    complete_steps,
    kill_tree,
    launch,
    process_tree,
    run,
    train_command,
    wait_for,
    wait_gone,
)

TOTAL = 6
OVERRIDES = [
    *TINY,
    f"trainer.total_steps={TOTAL}",
    "optim.schedule=cosine",  # the schedule's position must survive too
    "optim.warmup_steps=2",
    "algorithm.reset.interval=2",  # reference resets after steps 2 and 4: pi_ref must be restored
    # ProRL v1's optimizer reset with them: the checkpoints of steps 2 and 4 hold an AdamW without
    # state, those of steps 1, 3 and 5 its moments
    "algorithm.reset.reset_optimizer=true",
    "reward.length_k_on=2",  # the length penalty switches on and off within the run
    "reward.length_k_off=2",
    "scheduler.mode=pass-rate",  # the per-prompt record must survive too
]
SAVED_FILES = (
    MARKER,
    "meta.json",
    "objects.pt",
    ".metadata",
    "rng/rank_00000.pt",
    "rng/rank_00001.pt",
)


def check_nothing_looks_complete_that_is_not(ckpt_dir) -> None:
    ckpt = Checkpointer(ckpt_dir, keep_last=None)
    latest = ckpt.latest()
    assert latest is None or not latest.endswith(".tmp")
    for step in ckpt.complete_steps():
        path = ckpt.step_dir(step)
        missing = [f for f in SAVED_FILES if not os.path.isfile(os.path.join(path, f))]
        assert not missing, f"{path} has {MARKER} but lacks {missing}"
    # interrupted saves stay .tmp (never renamed without all files)
    for name in os.listdir(ckpt_dir):
        if name.endswith(".tmp"):
            assert not os.path.exists(os.path.join(ckpt_dir, name, MARKER))


def step_rows(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r["step"] for r in rows]
    assert steps == list(range(TOTAL + 1)), f"each step logged once, in order: {steps}"
    return {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))}
        for r in rows
    }


@pytest.mark.tally("faults")
@pytest.mark.slow
def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path):
    seed = int(os.environ.get("PRORL_TEST_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    a, b = tmp_path / "A", tmp_path / "B"
    proc = run(train_command(a, OVERRIDES))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows_a = step_rows(a)
    timed = [json.loads(line) for line in open(a / "metrics.jsonl")]
    step_s = sum(r.get("timing_s/step", 0.0) for r in timed) / TOTAL

    ckpt_dir = b / "checkpoints"
    events = []  # what each interrupted attempt saw, for the failure message
    attempt = 0

    def start():
        nonlocal attempt
        attempt += 1
        return launch(train_command(b, OVERRIDES), tmp_path / f"B{attempt}.log")

    def progress_after(proc, known):
        return wait_for(lambda: max(complete_steps(ckpt_dir), default=0) > known, proc)

    def saving():
        return os.path.isdir(ckpt_dir) and any(n.endswith(".tmp") for n in os.listdir(ckpt_dir))

    def log_text():
        return open(tmp_path / f"B{attempt}.log").read()

    def log_tail():
        return log_text()[-3000:]

    def mid_save():  # a save in progress, an earlier checkpoint complete
        return saving() and complete_steps(ckpt_dir)

    # 1. mid-step, in the first step (no checkpoint yet: the re-run starts afresh, its metrics with
    #    it)
    proc = start()
    assert wait_for(lambda: "held-out accuracy before RL" in log_text(), proc), log_tail()
    time.sleep(rng.uniform(0.1, 0.9) * step_s)
    kill_tree(proc)
    events.append(f"kill in step 1: complete {complete_steps(ckpt_dir)}")
    check_nothing_looks_complete_that_is_not(ckpt_dir)

    # 2. mid-save, with an earlier checkpoint in place: as soon as a save's step_X.tmp directory
    #    appears (should the polling miss the saves, this becomes a kill right after a checkpoint)
    proc = start()
    assert wait_for(lambda: mid_save() or len(complete_steps(ckpt_dir)) >= 3, proc), log_tail()
    kill_tree(proc)
    events.append(f"mid-save kill: .tmp left {saving()}, complete {complete_steps(ckpt_dir)}")
    check_nothing_looks_complete_that_is_not(ckpt_dir)

    # 3. Ctrl-C (SIGINT to torchrun's process group, as a terminal sends it; torchrun forwards it to
    #    the workers): the step is finished and saved, and every rank exits 0
    known = max(complete_steps(ckpt_dir), default=0)
    proc = start()
    assert progress_after(proc, known), log_tail()
    time.sleep(rng.uniform(0.0, 0.9) * step_s)
    tree = process_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    stopped = [
        line for line in log_tail().splitlines() if "prorl: stopped by SIGINT after step" in line
    ]
    assert stopped, log_tail()
    at = int(stopped[0].split("after step ")[1].split()[0])
    assert max(complete_steps(ckpt_dir)) == at, (at, complete_steps(ckpt_dir))
    assert "KeyboardInterrupt" not in log_tail(), log_tail()
    assert not wait_gone(tree, timeout=10), "a worker is left behind"
    events.append(f"Ctrl-C at step {at}")
    check_nothing_looks_complete_that_is_not(ckpt_dir)

    # 4. to the end
    proc = run(train_command(b, OVERRIDES))
    info = f"seed {seed}; {events}; " + proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, info
    assert "prorl: resumed from" in proc.stdout, info
    check_nothing_looks_complete_that_is_not(ckpt_dir)

    rows_b = step_rows(b)
    for step in rows_a:
        assert rows_b[step] == rows_a[step], f"step {step}: {info}"
    final_a = load_file(a / "checkpoints" / "final" / "model.safetensors")
    final_b = load_file(b / "checkpoints" / "final" / "model.safetensors")
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), f"{name}: {info}"
