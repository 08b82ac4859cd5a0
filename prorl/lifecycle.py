"""What keeps a multi-rank run safe to stop, kill and restart: fatal errors raised on every rank,
signals as stop requests agreed on by every rank, the output directory's lock, seeding, and telling
a lost peer from a bug. Used by prorl/train.py; nothing here knows about RL.

Exit codes (prorl/exits.py): 0 done (or stopped cleanly by a signal), 2 config error (a damaged
model directory or data file included, named), 3 reward self-test failed, 4 checkpoint cannot be
resumed (incompatible settings or model, or every checkpoint damaged: the files are named), 5 output
directory unusable, 6 training stalled (steps without a group to train on, or non-finite gradients,
`trainer.max_consecutive_skips` times in a row), 7 another rank stopped answering (a collective
timed out or lost its peer), 8 asynchronous RL's rollout ranks stopped delivering groups or weights
(died, hung past the timeout, or hold weights other than the version they report), 9 a weight or
optimizer state became NaN or infinite (found before a save or the final export, which are refused;
the tensor and the step are named). In every case the last complete checkpoint is kept. Under
torchrun the shell sees 1 for any of them; `python -m prorl.launch` (prorl/launch.py) returns the
code itself.
"""

from __future__ import annotations

import os
import random
import signal
import time

import torch
import torch.distributed as dist

from prorl.engine import distributed
from prorl.engine.checkpoint import CheckpointError
from prorl.exits import (  # noqa: F401 - the exit codes and Fatal, re-exported
    EXIT_CONFIG,
    EXIT_NONFINITE,
    EXIT_OUTPUT_DIR,
    EXIT_PEER_LOST,
    EXIT_RESUME,
    EXIT_ROLLOUT_LOST,
    EXIT_SELF_TEST,
    EXIT_STALLED,
    Fatal,
)


def on_every_rank(code: int, fn, *args):
    """fn(*args) on every rank; if it fails with an OSError or CheckpointError anywhere, every rank
    raises Fatal (the failing rank with its own message) instead of the others waiting in the next
    collective."""
    error, result = None, None
    try:
        result = fn(*args)
    except (OSError, CheckpointError) as exc:
        error = str(exc)
    if (
        distributed.all_reduce_max(
            1.0 if error else 0.0, what="the check that every rank succeeded"
        )
        > 0
    ):
        raise Fatal(code, error or "")  # ranks that did not fail exit quietly
    return result


def peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that timed out or lost a peer (gloo and NCCL word it so)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        s in text
        for s in ("timed out", "timeout", "connection closed by peer", "connection reset by peer")
    )


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python, numpy and torch; with `deterministic`, also forbid nondeterministic kernels."""
    import numpy

    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(seed % 2**32)
    if deterministic:
        # cuBLAS needs it to be deterministic
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


class StopRequest:
    """SIGTERM / SIGINT set a flag; the training loop asks `requested()` after each step
    (collective, so that every rank stops after the same step). A second signal 2 s or more after
    the first raises KeyboardInterrupt (one request can arrive twice: a scheduler such as Slurm
    signals every process of the job, and torchrun forwards the signal to its workers as well).

    Under torchrun a worker whose agent has died (`kill -9` of torchrun: the workers run in sessions
    of their own and would train on, unseen) stops the same way once it notices its new parent."""

    def __init__(self):
        self.reason: str | None = None
        self.first_at = 0.0
        self.parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.reason is None:
            self.reason, self.first_at = signal.Signals(signum).name, time.monotonic()
        elif time.monotonic() - self.first_at >= 2.0:
            raise KeyboardInterrupt

    def requested(self) -> bool:
        if self.reason is None and self.parent is not None and os.getppid() != self.parent:
            self.reason = "the loss of torchrun (its agent process died)"
        return (
            distributed.all_reduce_max(
                1.0 if self.reason is not None else 0.0, what="the stop request"
            )
            > 0
        )

    @property
    def name(self) -> str:
        return self.reason or "a stop request on another rank"


def ignoring_stop_signals(fn, *args, **kwargs):
    """fn(...) with SIGINT / SIGTERM ignored, restored after: processes started inside (reward
    workers) inherit the ignore through exec, so a terminal's Ctrl-C or a scheduler's signal to the
    whole process group leaves them to finish the step; their owner stops them."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return fn(*args, **kwargs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def lock_output_dir(path: str):
    """An exclusive lock on `path` held for this process's lifetime (released by the kernel however
    it ends): a second run on the same directory, or workers left over from a killed torchrun, would
    interleave checkpoints and metrics with this one. Returns the open lock file; raises OSError."""
    import fcntl
    import socket

    f = open(os.path.join(path, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "an unknown process"
        f.close()
        msg = f"{path} is in use by another run ({owner}): stop it, or use another output_dir"
        raise OSError(msg) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f
