"""Attacks on a real asynchronous run (1 rollout + 1 trainer rank under `python -m prorl.launch`,
the embedded default in miniature) from a process outside the run that reaches the job's store
(this test process; tests/helpers/async_attacker.py): a step's batch ticket rewritten, before the
trainer checks it, with a forged header, with a pickle that would run code, and with another step's
genuine ticket (a replay); a forged stop. Each one is refused and named, nothing is unpickled, only
the rollout rank's own groups are trained, and the run completes (exit 0). (A pickle under a weight
push's key: tests/prorl/test_async_wire.py.)

The rollout rank is held (SIGSTOP) while a ticket is rewritten: the trainer checks a ticket once it
has received the batch, which the held rank's sender does not finish sending. The trainer itself
cannot be held: its rank 0 hosts the attempt's store (engine.distributed.attempt_store). A batch
the trainer had already received is missed; each attack then takes the next ticket."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from async_attacker import connect, forged, pickled
from test_async import worker_pid
from train_helpers import ENV, ROOT, TINY, wait_for

pytestmark = pytest.mark.slow

TOTAL = 14


def _port(launcher_pid: int) -> int:
    env = open(f"/proc/{worker_pid(launcher_pid, 0)}/environ", "rb").read().split(b"\0")
    return int(next(e[12:] for e in env if e.startswith(b"MASTER_PORT=")))


def _hold_at_a_batch(store, ours, rollout: int) -> str:
    """Stop the rollout rank at a moment the store holds one of its batch tickets that the trainer
    has not checked; the ticket's key."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for s in range(TOTAL):
            key = f"batch/{s}/0/0"
            if store.check([key]) and store.get(key) not in ours:
                os.kill(rollout, signal.SIGSTOP)
                if store.check([key]):  # not taken meanwhile
                    return key
                os.kill(rollout, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError("no batch ticket of the rollout rank's in the store")


def _log_has(path, pattern, seconds=20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if re.search(pattern, open(path).read()):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.tally("attacks")
def test_forged_replayed_and_pickled_store_values_are_refused_in_a_real_run(tmp_path):
    out, marker, log_path = tmp_path / "run", tmp_path / "code-ran", tmp_path / "run.log"
    cmd = [
        *(sys.executable, "-m", "prorl.launch", "--standalone", "--nproc_per_node=2"),
        *("prorl/train.py", f"output_dir={out}", *TINY, f"trainer.total_steps={TOTAL}"),
        *("algorithm.is_mode=tis", "scheduler.mode=none", "rollout.async.steps_ahead=1"),
        "trainer.save_every=0",
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    rollout = None
    try:
        assert wait_for(lambda: _workers(proc.pid), proc, timeout=120), open(log_path).read()
        rollout = worker_pid(proc.pid, 1)
        store = connect(_port(proc.pid))
        store.set("stop", forged("stop"))  # would stop the rollout rank if it were believed
        evil, seen = pickled(str(marker)), []
        ours = {evil}
        trace = out / "async_trained.rank0.jsonl"
        assert wait_for(lambda: os.path.exists(trace), proc), open(log_path).read()[-3000:]
        for kind in ("forge", "pickle", "replay"):
            expect = {
                "forge": r"not signed .*\(\d+ bytes\): forged",
                "pickle": r"not signed .*\(a pickle\): forged",
                "replay": r"a replay of the run's own 'batch/\d+/0/0'",
            }[kind]
            for _ in range(3):  # a ticket the trainer checked before the hold: take the next
                key = _hold_at_a_batch(store, ours, rollout)
                try:
                    value = {"forge": forged(key), "pickle": evil, "replay": seen and seen[0]}[kind]
                    seen.append(store.get(key))
                    ours.add(value)
                    store.set(key, value)
                finally:
                    os.kill(rollout, signal.SIGCONT)
                if _log_has(log_path, rf"{key}: {expect}", seconds=10):
                    break
            else:
                raise AssertionError(f"{kind}: never refused\n" + open(log_path).read()[-3000:])
        code = proc.wait(300)
    finally:
        if rollout is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rollout, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = open(log_path).read()
    assert code == 0, text[-3000:]
    assert not marker.exists()  # no pickle was loaded, in either rank
    with open(out / "async_trained.rank0.jsonl") as f:
        trace = [json.loads(line) for line in f]
    assert [r["step"] for r in trace] == list(range(TOTAL))  # the forged stop stopped nothing
    uids = [g[0] for r in trace for g in r["groups"]]
    assert uids and all(re.fullmatch(r"\d+/0/\d+", u) for u in uids), uids


def _workers(launcher_pid: int) -> bool:
    try:
        return _port(launcher_pid) > 0 and worker_pid(launcher_pid, 1) > 0
    except (AssertionError, OSError, StopIteration):
        return False
