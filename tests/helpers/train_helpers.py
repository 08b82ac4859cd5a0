"""`prorl/train.py` as a subprocess in tests: launch it, watch its checkpoints, kill its tree."""

import contextlib
import os
import signal
import subprocess
import sys
import time

from prorl.engine.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
# a tiny deterministic run of the embedded default: about 0.6 s per step on 2 CPU processes
TINY = [
    "trainer.prompts_per_step=8",
    "trainer.mini_batches=2",
    "rollout.n=4",
    "data.val_size=20",
    "trainer.val_every=100",  # validation at step 0 and at the last step only
    "trainer.save_every=1",
    "trainer.keep_last=2",
    "trainer.deterministic=true",
    "optim.lr=1e-4",
]


def train_command(out, overrides, nproc: int | None = 2) -> list[str]:
    """torchrun with nproc processes, or plain `python prorl/train.py` when nproc is None."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else []
    )
    return [sys.executable, *launcher, "prorl/train.py", f"output_dir={out}", *overrides]


def run(cmd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def launch(cmd, log_path) -> subprocess.Popen:
    """Start cmd in a session of its own (a signal to its process group reaches it alone, as a
    terminal's Ctrl-C would), output to log_path."""
    log = open(log_path, "w")
    out = {"stdout": log, "stderr": subprocess.STDOUT}
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, start_new_session=True, **out)


def complete_steps(ckpt_dir) -> list[int]:
    if not os.path.isdir(ckpt_dir):
        return []
    return Checkpointer(ckpt_dir, keep_last=None).complete_steps()


def wait_for(condition, proc, timeout=180.0) -> bool:
    """Poll every 2 ms until condition() holds (True) or the run has exited (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise TimeoutError("the run made no progress")


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc). torchrun starts each worker in a session of its
    own, so a process-group kill of torchrun leaves the workers running."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout=60.0) -> list[int]:
    """Wait until none of pids runs; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def kill_tree(proc) -> None:
    """SIGKILL torchrun, its workers and their reward workers at one instant (as a node failure or a
    scheduler's cgroup kill would): all are frozen first, so none runs on while the rest are
    found."""
    frozen: set[int] = set()
    for _ in range(3):  # a process forked while freezing is found on the next pass
        for pid in set(process_tree(proc.pid)) - frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            frozen.add(pid)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
