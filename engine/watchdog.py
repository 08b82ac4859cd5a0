"""Say what a rank is waiting for: a frozen or slow peer shows up as the others' long waits, long
before a collective times out.

    watch = Watchdog(warn_after_s=300)                 # one per process; a daemon thread
    with watch.phase("sampling round 2"):             # what this rank is doing
        ...
        with watch.waiting("the round's shortfall"):  # a collective: every rank must join
            dist.all_reduce(x)

When this rank has been inside one `waiting` block for `warn_after_s` (and again every
`warn_after_s` after that), the thread prints one line naming the rank, the collective, the phase
and the time waited, e.g. "prorl: rank 0 has waited 600 s for the other ranks (all-reduce of the
metrics, in phase 'update'): a rank may be stopped, stuck or much slower". Outside `waiting` it says
nothing: long local work (a sampling round, a checkpoint write) is not a hang. The timeout itself is
the process group's.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time


class Watchdog:
    def __init__(self, warn_after_s: float, rank: int = 0, log=None, poll_s: float | None = None):
        self.warn_after_s, self.rank = warn_after_s, rank
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.poll_s = poll_s if poll_s is not None else min(max(warn_after_s / 10, 0.05), 10.0)
        self._phase = "start-up"
        self._wait: tuple[str, float] | None = None
        self._warned = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if warn_after_s > 0:
            self._thread = threading.Thread(target=self._run, name="prorl-watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def phase(self, name: str):
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @contextlib.contextmanager
    def waiting(self, what: str):
        with self._lock:
            self._wait, self._warned = (what, time.monotonic()), 0
        try:
            yield
        finally:
            with self._lock:
                self._wait = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if self._wait is None:
                    continue
                what, since = self._wait
                waited = time.monotonic() - since
                if waited < (self._warned + 1) * self.warn_after_s:
                    continue
                self._warned += 1
                phase = self._phase
            self.log(
                f"prorl: rank {self.rank} has waited {waited:.0f} s for the other ranks ({what}, "
                f"in phase {phase!r}): a rank may be stopped, stuck or much slower"
            )


_NULL = Watchdog(0.0)


def null_watchdog() -> Watchdog:
    """A watchdog that never speaks (no thread): the default of code run outside the trainer."""
    return _NULL
