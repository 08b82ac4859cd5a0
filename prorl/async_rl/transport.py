"""What travels between the two sides of an asynchronous run (prorl/async_rl/roles.py), and how
each side sees the other alive.

Nothing is unpickled: every message is a signed header and tensors (prorl/async_rl/wire.py). The
job's store (torchrun's TCPStore) carries only small control keys: the signed tickets announcing a
batch or a push, the stop key, heartbeats and the run secret's fingerprint. The data travel over
process groups: a step's groups from rollout rank j to trainer t over their gloo pair group
(`BatchSender` / `take`; any size, no store limit), weights over the push group (push.py).

A batch: the rollout rank puts the signed ticket under `batch/<step>/<j>/<t>` and its sender thread
sends the message over the pair group (it waits there until the trainer takes it: steps_ahead
batches queue on the rollout rank, not in the store). The trainer waits for the ticket, receives the
message (whose signed header names the key: a message out of order is refused), then checks the
ticket: one that is not the run's (forged, replayed, a pickle) is named and the run goes on with the
message from the pair group.

Liveness: trainer rank 0 and every rollout rank run a `Heartbeat` thread that bumps a counter under
`alive/...` in the store; a side waiting for the other (`wait_ready` with a `Liveness`) fails once
the counter it watches has not moved for `HEARTBEAT_STALE_S` (its own clock: no clock is compared
across nodes), so a long validation or checkpoint save of a live trainer is no timeout and a dead
peer is seen within minutes. The trainers' `close` also sets `STOP_KEY` (signed), which a rollout
rank checks while waiting for a push, and a broadcast that fails once it is set is a clean stop: a
trainer that gave up on a push stuck behind a rollout still mid-step (SIGTERM: save, then exit)
stops that rollout cleanly. A forged heartbeat can only make a dead peer look alive: the pair
group's timeout still ends the wait.

`checksum` is the yardstick of "the rollout's weights are the version it reports": the trainer
records it per version over its own full tensors, the rollout computes it over its model after
loading a push, and every received batch is checked against the record (`RemoteRollouts.take`).
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from prorl.async_rl import wire
from prorl.async_rl.wire import RolloutLost

POLL_S = 0.005  # how often a waiting side looks for its key in the store
HEARTBEAT_S = 5.0  # how often each side's heartbeat thread bumps its counter
HEARTBEAT_STALE_S = 120.0  # a counter that has not moved this long: its side is dead
CHECKSUM_CHUNK = 1 << 22  # elements per float64 pass of `checksum` (bounds its scratch memory)
STOP_KEY = "stop"

__all__ = ["RolloutLost"]


def ready(store, key: str) -> bool:
    return store.check([key])


def wait_ready(store, key: str, timeout_s: float, what: str, alive=()) -> None:
    """Wait until the store holds `key`, at most timeout_s and while every Liveness of `alive`
    holds."""
    # polled, not store.wait: a waiting client holds its connection's lock, and the push thread
    # shares it
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise RolloutLost(f"no {what} within {timeout_s:.0f} s")
        for peer in alive:
            peer.check(what)
        time.sleep(POLL_S)


def note_refused(seen: set, exc: Exception) -> None:
    """Name a refused store value once (the run goes on: the genuine data travel elsewhere)."""
    if str(exc) not in seen:
        seen.add(str(exc))
        print(f"prorl: async: refused a value in the job's store: {exc}", flush=True)


def stopped(store, secret: bytes, seen: set) -> bool:
    """True once the store holds the trainers' signed stop (a forged one is named and ignored)."""
    if not ready(store, STOP_KEY):
        return False
    try:
        wire.verify(secret, store.get(STOP_KEY), STOP_KEY)
        return True
    except wire.Refused as exc:
        note_refused(seen, exc)
        return False


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def broadcast(pg, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([tensor], opts).wait()


# -- batches ---------------------------------------------------------------------------------------
class BatchSender:
    """A rollout rank's sends to one trainer, in order, on a thread of their own (a send waits
    until the trainer takes the batch). `send` raises RolloutLost once a send failed."""

    def __init__(self, store, channel, secret: bytes):
        self.store, self.channel, self.secret = store, channel, secret
        self.queue: queue.Queue = queue.Queue()
        self.error = None
        self.thread = threading.Thread(target=self._loop, name="prorl-batch-send", daemon=True)
        self.thread.start()

    def send(self, key: str, message: dict) -> None:
        if self.error is not None:
            raise RolloutLost(f"sending {key} to its trainer failed: {self.error}")
        packed = wire.pack(self.secret, key, message)
        self.store.set(key, wire.ticket(self.secret, key))
        self.queue.put(packed)

    def _loop(self) -> None:
        while True:
            packed = self.queue.get()
            try:
                wire.send_packed(self.channel, *packed)
            except Exception as exc:  # noqa: BLE001 - surfaced on the main thread by send()
                self.error = str(exc).splitlines()[0][:300]
                return
            finally:
                self.queue.task_done()


def take(store, channel, secret: bytes, key: str, timeout_s: float, what: str, alive=()):
    """The message under `key` from the pair group `channel`, once its ticket is in the store
    (module docstring); the ticket is then checked (named when not the run's) and deleted."""
    wait_ready(store, key, timeout_s, what, alive)
    try:
        message = wire.recv(channel, secret, key)
    except wire.Refused:
        raise
    except RuntimeError as exc:  # the pair group timed out or its peer left
        raise RolloutLost(f"receiving the {what}: {str(exc).splitlines()[0][:300]}") from exc
    try:
        wire.verify(secret, store.get(key), key)
    except wire.Refused as exc:
        note_refused(set(), exc)
    store.delete_key(key)
    return message


def valid_ticket(store, secret: bytes, key: str) -> bool:
    """The store holds the run's own ticket under `key` (non-blocking; for counts)."""
    if not ready(store, key):
        return False
    try:
        wire.verify(secret, store.get(key), key)
        return True
    except (wire.Refused, KeyError, ValueError):
        return False


class Heartbeat:
    """A thread bumping a counter under `key` every HEARTBEAT_S until `stop` (module docstring),
    while `healthy()` (None: always) says the process makes progress."""

    def __init__(self, store, key: str, every_s: float = HEARTBEAT_S, healthy=None):
        self.store, self.key, self.every_s, self.done = store, key, every_s, threading.Event()
        self.healthy = healthy
        store.set(key, "0")
        self.thread = threading.Thread(target=self._loop, name=f"prorl-{key}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        beat = 0
        while not self.done.wait(self.every_s):
            if self.healthy is not None and not self.healthy():
                continue  # a hung main thread: the other side sees the counter stop
            beat += 1
            try:
                self.store.set(self.key, str(beat))
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def stop(self) -> None:
        self.done.set()


class Liveness:
    """The other side's heartbeat under `key`, seen from here: `check` raises RolloutLost once it
    has not moved for `stale_s` of this process's clock; before its first beat (the other side still
    starting: model load, engine start), once `startup_s` have passed since construction."""

    look_s = 1.0  # at most one store read per this many seconds

    def __init__(
        self, store, key: str, who: str, startup_s: float, stale_s: float = HEARTBEAT_STALE_S
    ):
        self.store, self.key, self.who, self.stale_s = store, key, who, stale_s
        self.startup_s = startup_s
        self.beat, self.seen, self.looked = None, time.monotonic(), 0.0

    def check(self, what: str) -> None:
        now = time.monotonic()
        if now - self.looked < self.look_s:
            return
        self.looked = now
        value = _bytes(self.store.get(self.key))[:32] if ready(self.store, self.key) else None
        beat = int(value) if value is not None and value.isdigit() else self.beat
        if beat != self.beat:
            self.beat, self.seen = beat, now
        elif now - self.seen > (self.startup_s if beat is None else self.stale_s):
            raise RolloutLost(
                f"waiting for the {what}: {self.who} sent no heartbeat for {now - self.seen:.0f} s "
                f"({'never started' if beat is None else 'dead'})"
            )


class Checksum:
    """A position-weighted float64 sum of every element of the tensors added (in order), computed
    CHECKSUM_CHUNK elements at a time: equal weights give equal sums (to rounding of the summation
    order, hence `same_checksum`), a different version does not."""

    def __init__(self):
        self.value, self.count = 0.0, 0
        self.weights: dict = {}  # device -> p % 1009 + 1 for p in one chunk, float64

    def add(self, t: torch.Tensor) -> None:
        flat, i = t.detach().reshape(-1), self.count
        self.count += 1
        # a chunk is a whole number of 1009-periods: every chunk has the same weights, made once
        chunk = max(CHECKSUM_CHUNK // 1009, 1) * 1009
        w = self.weights.get(flat.device)
        if w is None:
            w = torch.arange(chunk, dtype=torch.float64, device=flat.device) % 1009 + 1
            self.weights[flat.device] = w
        for lo in range(0, flat.numel(), chunk):
            part = flat[lo : lo + chunk].double()
            # sum(x * (p % 1009 + 1 + i)) = x . (p % 1009 + 1) + i * sum(x)
            self.value += float(torch.dot(part, w[: part.numel()]) + i * part.sum())


def checksum(tensors) -> float:
    """`Checksum` of `tensors`."""
    total = Checksum()
    for t in tensors:
        total.add(t)
    return total.value


def same_checksum(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)
