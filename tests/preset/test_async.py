"""Asynchronous RL (`rollout.async_rl.steps_ahead`, prorl/async_rl/) in miniature: the embedded
default's tiny reasoner under `python -m prorl.launch` on gloo, the native sampler on the rollout
ranks.

- 1 rollout + 1 trainer rank, k = 1, stopped by SIGTERM after a few checkpoints and resumed: every
  step of 0..total-1 is trained exactly once, no group (by its id) is trained twice, and no prompt
  twice within the epoch (scheduler off: the rollout rank's data position travels with the
  checkpoint);
- 2 rollout + 2 trainer ranks of the prorl_v2_1.5b preset in miniature (FSDP2, bf16, untied head),
  k = 2: every group's staleness (step trained - version that sampled it) is <= k, the async metrics
  are in metrics.jsonl, and the trainers checked every batch's weight checksum against their own
  record of that version (a mismatch stops the run: exit 8);
- a rollout rank that hangs (SIGSTOP) ends the run with exit code 8 after the timeout; one that is
  killed (SIGKILL) stops it as well.

Each run costs 15-25 s (engine start included); the checks share launches.
"""

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from preset_helpers import preset_env, preset_overrides, write_bf16_untied_checkpoint, write_data
from train_helpers import ENV, ROOT, TINY, complete_steps, process_tree, wait_for

pytestmark = pytest.mark.slow

TOTAL = 10


def command(out, nproc: int, extra=()) -> list[str]:
    launcher = [sys.executable, "-m", "prorl.launch", "--standalone", f"--nproc_per_node={nproc}"]
    overrides = [
        *TINY,
        f"trainer.total_steps={TOTAL}",
        "algorithm.is_mode=tis",
        "scheduler.mode=none",
    ]
    return [*launcher, "prorl/train.py", f"output_dir={out}", *overrides, *extra]


def start(cmd, log_path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(proc, log_path, timeout=240) -> tuple[int, str]:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, open(log_path).read()


def rows(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def trained(out, trainers: int) -> list[dict]:
    """Every trainer's trace rows (prorl/async_rl/remote.py: one per step, the groups trained)."""
    out_rows = []
    for t in range(trainers):
        with open(os.path.join(out, f"async_trained.rank{t}.jsonl")) as f:
            out_rows += [dict(json.loads(line), trainer=t) for line in f]
    return out_rows


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's worker of global rank `rank` (a direct child: prorl.launch runs
    torchrun's agent in its own process)."""
    for pid in process_tree(launcher_pid):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} under {launcher_pid}")


def test_one_plus_one_sigterm_resume_trains_every_step_once(tmp_path):
    out, log = tmp_path / "run", tmp_path / "a.log"
    cmd = command(out, 2, ["rollout.async_rl.steps_ahead=1"])
    proc = start(cmd, log)
    ckpt = os.path.join(out, "checkpoints")
    assert wait_for(
        lambda: len(complete_steps(ckpt)) >= 1 and max(complete_steps(ckpt)) >= 3, proc
    ), open(log).read()[-3000:]
    # the launcher forwards it to its workers, as a scheduler's would
    proc.send_signal(signal.SIGTERM)
    code, text = finish(proc, log)
    stopped = max(complete_steps(ckpt))
    assert stopped < TOTAL and f"stopped by SIGTERM after step {stopped}" in text, text[-3000:]
    assert code in (0, 128 + signal.SIGTERM), text[-3000:]
    code, text = finish(start(cmd, tmp_path / "b.log"), tmp_path / "b.log")
    assert code == 0, text[-3000:]
    assert f"resumed from {ckpt}" in text

    trace = trained(out, 1)
    steps = [r["step"] for r in trace]
    assert steps == list(range(TOTAL)), steps  # the killed run's untaken batches were never trained
    uids = collections.Counter(g[0] for r in trace for g in r["groups"])
    assert [u for u, n in uids.items() if n > 1] == []
    prompts = collections.Counter(g[2] for r in trace for g in r["groups"])
    assert [p for p, n in prompts.items() if n > 1] == []  # 80 of the 800 prompts: one epoch
    for r in trace:
        assert all(0 <= r["step"] - g[1] <= 1 for g in r["groups"]), r
    assert [r["step"] for r in rows(out)] == list(range(TOTAL + 1))


def test_two_plus_two_preset_staleness_bounded_and_weights_checked(tmp_path):
    """The prorl_v2_1.5b preset in miniature (tests/helpers/preset_helpers.py: FSDP2 over the 2
    trainer ranks with fp32 masters and bf16 compute, an untied head, reference resets, uneven
    dynamic sampling) with 2 rollout ranks and k = 2."""
    ckpt = write_bf16_untied_checkpoint(str(tmp_path / "ckpt"))
    train, val = write_data(str(tmp_path))
    out, steps = tmp_path / "run", 6
    cmd = [
        *(
            sys.executable,
            "-m",
            "prorl.launch",
            "--standalone",
            "--nproc_per_node=4",
            "prorl/train.py",
        ),
        *("--config", "prorl_v2_1.5b", *preset_overrides(ckpt, train, val), f"output_dir={out}"),
        *(f"trainer.total_steps={steps}", "trainer.save_every=0", "algorithm.is_mode=tis"),
        *("rollout.async_rl.steps_ahead=2", "rollout.async_rl.rollout_ranks=2"),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=preset_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [r for r in rows(out) if r["step"] > 0]
    assert len(metrics) == steps
    names = (
        "async/staleness/mean",
        "async/queue_groups",
        "timing_s/wait_rollout",
        "timing_s/wait_trainer",
    )
    for r in metrics:
        assert all(key in r for key in names), r
        assert 0 <= r["async/staleness/mean"] <= r["async/staleness/max"] <= 2, r
        assert r["dynamic_sampling/kept_groups"] <= 16
    # resets on the trainers, rollouts unaffected
    assert any(r["ref/reset_reason"] for r in metrics)
    trace = trained(out, 2)
    for t in (0, 1):
        assert [r["step"] for r in trace if r["trainer"] == t] == list(range(steps))
    staleness = [r["step"] - g[1] for r in trace for g in r["groups"]]
    assert min(staleness) >= 0 and max(staleness) <= 2, staleness
    # the rollout ranks sampled ahead: some group was trained with older weights than the current
    # ones
    assert max(staleness) >= 1
    # trainer t trains rollout t's batch (prompts_per_step / 2 each side): ids name the sampling
    # rank
    for r in trace:
        assert {g[0].split("/")[1] for g in r["groups"]} <= {str(r["trainer"])}, r


def start_and_save_once(tmp_path):
    """A 1 + 1 run with short timeouts, once it has saved a checkpoint: (launcher, log,
    checkpoints)."""
    out, log = tmp_path / "run", tmp_path / "a.log"
    extra = [
        "rollout.async_rl.steps_ahead=1",
        "trainer.collective_timeout_s=8",
        "algorithm.max_rounds=1",
    ]
    proc = start(command(out, 2, extra), log)
    ckpt = os.path.join(out, "checkpoints")
    assert wait_for(lambda: len(complete_steps(ckpt)) >= 1, proc), open(log).read()[-3000:]
    return proc, log, ckpt


@pytest.mark.tally("faults")
def test_hung_rollout_rank_ends_the_run_with_exit_code_8(tmp_path):
    proc, log, _ = start_and_save_once(tmp_path)
    pid, trainer = worker_pid(proc.pid, 1), worker_pid(proc.pid, 0)  # rank 1 of 2: the rollout rank
    os.kill(pid, signal.SIGSTOP)
    try:
        # once the trainer has exited, the stopped rank is killed: torchrun would otherwise wait its
        # 30 s shutdown grace for a process that cannot act on SIGTERM
        wait_for(lambda: not os.path.exists(f"/proc/{trainer}"), proc, timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        code, text = finish(proc, log, timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert code == 8, text[-3000:]
    assert "asynchronous RL" in text and "rollout rank 0" in text, text[-3000:]


@pytest.mark.tally("faults")
def test_killed_rollout_rank_stops_the_run(tmp_path):
    proc, log, ckpt = start_and_save_once(tmp_path)
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)  # as the OOM killer would
    code, text = finish(proc, log, timeout=120)
    # torchrun stops the trainer; it reports the lost rollout rank (8) unless it is killed first
    # (137)
    assert code in (8, 128 + signal.SIGKILL), text[-3000:]
    assert max(complete_steps(ckpt)) < TOTAL


@pytest.mark.tally("faults")
def test_a_killed_rollout_rank_under_max_restarts_resumes_and_trains_every_step_once(tmp_path):
    """`--max-restarts=1` (torchrun's): once a rank dies, torchrun stops the others (the trainer
    finishes its step and saves on the SIGTERM) and restarts every rank, which resume from the last
    checkpoint: every step trained once, no group twice, metrics.jsonl one row per step."""
    out, log = tmp_path / "run", tmp_path / "a.log"
    cmd = command(out, 2, ["rollout.async_rl.steps_ahead=1"])
    cmd.insert(cmd.index("--nproc_per_node=2") + 1, "--max-restarts=1")
    proc = start(cmd, log)
    ckpt = os.path.join(out, "checkpoints")
    saved = wait_for(lambda: max(complete_steps(ckpt), default=0) >= 2, proc)
    assert saved, open(log).read()[-3000:]
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)  # the rollout rank, as the OOM killer would
    code, text = finish(proc, log)
    assert code == 0, text[-3000:]
    assert text.count("prorl: resumed from") == 1, text[-3000:]
    trace = trained(out, 1)
    assert [r["step"] for r in trace] == list(range(TOTAL))
    uids = collections.Counter(g[0] for r in trace for g in r["groups"])
    assert [u for u, n in uids.items() if n > 1] == []
    assert [r["step"] for r in rows(out)] == list(range(TOTAL + 1))
