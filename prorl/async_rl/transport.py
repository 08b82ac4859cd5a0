"""What travels between the two sides of an asynchronous run (prorl/async_rl/roles.py).

Objects (a step's groups, push headers) go through the job's store: `put` pickles under a key,
`take` waits for it (with a timeout), reads and deletes it, `ready` probes without blocking. The
store is the rendezvous TCPStore torchrun already runs; a step's groups are token ids and log-probs,
about 8 bytes per response token.

Weights go from trainer rank 0 to every rollout rank over the gloo `push` group, in buckets of at
most `BUCKET_BYTES` (bytes of the sampler's dtype, so bf16 travels as bf16). Trainer rank 0 copies
them into host buckets (`WeightPusher.stage`: the only time the trainer spends on a push) and a
thread of its own announces the push in the store and broadcasts the buckets; when the rollouts are
still generating, the thread waits, and a newer staged version replaces an unsent older one
(rollouts only ever want the newest). The rollout ranks take pushes only between two steps' sampling
(`WeightReceiver`), all of them the same pushes.

Liveness: trainer rank 0 and every rollout rank run a `Heartbeat` thread that bumps a counter under
`alive/...` in the store; a side waiting for the other (`take` with a `Liveness`) fails once the
counter it watches has not moved for `HEARTBEAT_STALE_S` (its own clock: no clock is compared across
nodes), so a long validation or checkpoint save of a live trainer is no timeout and a dead peer is
seen within minutes. The trainers' `close` also sets `STOP_KEY`, which a rollout rank checks while
waiting for a push, and a broadcast that fails once it is set is a clean stop: a trainer that gave
up on a push stuck behind a rollout still mid-step (SIGTERM: save, then exit) stops that rollout
cleanly.

`checksum` is the yardstick of "the rollout's weights are the version it reports": the trainer
records it per version over its own full tensors, the rollout computes it over its model after
loading a push, and every received batch is checked against the record (`RemoteRollouts.take`).
"""

from __future__ import annotations

import pickle
import threading
import time

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20
POLL_S = 0.005  # how often a waiting side looks for its key in the store
HEARTBEAT_S = 5.0  # how often each side's heartbeat thread bumps its counter
HEARTBEAT_STALE_S = 120.0  # a counter that has not moved this long: its side is dead
CHECKSUM_CHUNK = 1 << 22  # elements per float64 pass of `checksum` (bounds its scratch memory)
STOP_KEY = "stop"


class RolloutLost(RuntimeError):
    """The rollout side stopped answering (died, hung past the timeout, or sent weights that are not
    the version it reports); train.py exits with lifecycle.EXIT_ROLLOUT_LOST."""


def put(store, key: str, obj) -> None:
    store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def ready(store, key: str) -> bool:
    return store.check([key])


def take(store, key: str, timeout_s: float, what: str, delete: bool = True, alive=()):
    """The object under `key`, waited for at most timeout_s (and while every Liveness of `alive`
    holds), then deleted from the store (`delete`: a push header stays, every rollout rank reads
    it)."""
    # polled, not store.wait: a waiting client holds its connection's lock, and the push thread
    # shares it
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise RolloutLost(f"no {what} within {timeout_s:.0f} s")
        for peer in alive:
            peer.check(what)
        time.sleep(POLL_S)
    obj = pickle.loads(store.get(key))
    if delete:
        store.delete_key(key)
    return obj


class Heartbeat:
    """A thread bumping a counter under `key` every HEARTBEAT_S until `stop` (module docstring),
    while `healthy()` (None: always) says the process makes progress."""

    def __init__(self, store, key: str, every_s: float = HEARTBEAT_S, healthy=None):
        self.store, self.key, self.every_s, self.done = store, key, every_s, threading.Event()
        self.healthy = healthy
        put(store, key, 0)
        self.thread = threading.Thread(target=self._loop, name=f"prorl-{key}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        beat = 0
        while not self.done.wait(self.every_s):
            if self.healthy is not None and not self.healthy():
                continue  # a hung main thread: the other side sees the counter stop
            beat += 1
            try:
                put(self.store, self.key, beat)
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
        beat = pickle.loads(self.store.get(self.key)) if ready(self.store, self.key) else None
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

    def add(self, t: torch.Tensor) -> None:
        flat, i = t.detach().reshape(-1), self.count
        self.count += 1
        for lo in range(0, flat.numel(), CHECKSUM_CHUNK):
            part = flat[lo : lo + CHECKSUM_CHUNK].double()
            at = torch.arange(lo, lo + part.numel(), dtype=torch.float64, device=part.device)
            self.value += float((part * (at % 1009 + 1 + i)).sum())


def checksum(tensors) -> float:
    """`Checksum` of `tensors`."""
    total = Checksum()
    for t in tensors:
        total.add(t)
    return total.value


def same_checksum(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def _broadcast(pg, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([tensor], opts).wait()


def bucket_layout(named) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """(name, shape, dtype) of each tensor, in buckets of at most BUCKET_BYTES (a larger tensor
    alone)."""
    return pack(named, copy=False)[0]


def pack(named, copy: bool = True) -> tuple[list, list[torch.Tensor]]:
    """`bucket_layout` of the (name, tensor) pairs, taken one at a time (an iterator: each tensor
    may be freed once copied), and with `copy` the host buckets of their bytes."""
    layout, buckets, parts, size = [], [], [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if layout and size + nbytes > BUCKET_BYTES:
            buckets.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))
            layout, parts, size = [*layout, []], [], 0
        if not layout:
            layout = [[]]
        layout[-1].append((name, tuple(t.shape), t.dtype))
        size += nbytes
        if copy:
            parts.append(t.detach().reshape(-1).cpu().view(torch.uint8))
    if layout:
        buckets.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))
    return layout, buckets if copy else []


class WeightPusher:
    """Trainer rank 0's side of the weight push (module docstring). `stage` raises RolloutLost once
    the push thread failed (a rollout rank died or timed out)."""

    def __init__(self, store, pg):
        self.store, self.pg, self.sent = store, pg, 0
        self.slot, self.error = None, None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="prorl-weight-push", daemon=True)
        self.thread.start()

    def stage(self, version: int, named, extra=None, stop: bool = False) -> None:
        """Copy (name, tensor) pairs, one at a time, into host buckets and hand them to the push
        thread. `named` is consumed whole before a failed push raises: it may be a collective's
        iterator."""
        layout, buckets = pack(named)
        if self.error is not None:
            raise RolloutLost(f"the weight push to the rollout ranks failed: {self.error}")
        with self.cond:
            if self.slot is not None and extra is None:
                extra = self.slot["extra"]  # a replaced push's resume states still go out
            header = {"version": version, "stop": stop, "extra": extra, "layout": layout}
            self.slot = {"header": header, "buckets": buckets, "extra": extra}
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.slot is None:
                    self.cond.wait()
                item, self.slot = self.slot, None
            try:
                put(self.store, f"push/{self.sent}", item["header"])
                self.sent += 1
                if item["header"]["stop"]:
                    return
                for bucket in item["buckets"]:
                    _broadcast(self.pg, bucket)
            except Exception as exc:  # noqa: BLE001 - surfaced on the main thread by stage()
                self.error = str(exc).splitlines()[0][:300]
                return

    def close(self, timeout_s: float = 60.0) -> None:
        """Tell the rollout ranks to stop: STOP_KEY at once (seen even while a push is stuck), and a
        stop header after any push under way; wait for the thread."""
        put(self.store, STOP_KEY, True)
        if self.thread.is_alive():
            with self.cond:
                self.slot = {"header": {"version": -1, "stop": True, "extra": None, "layout": []}}
                self.slot["buckets"], self.slot["extra"] = [], None
                self.cond.notify()
            self.thread.join(timeout_s)


class WeightReceiver:
    """A rollout rank's side of the weight push into `model` (module docstring). `version` and
    `checksum` describe the weights the model holds now; `stopped` once the trainers said stop. A
    push is waited for as long as trainer rank 0's heartbeat moves (validation, checkpoints,
    val_before_train take what they take)."""

    def __init__(self, store, pg, model, startup_s: float, stale_s: float = HEARTBEAT_STALE_S):
        self.store, self.pg = store, pg
        self.trainer = Liveness(store, "alive/trainer", "trainer rank 0", startup_s, stale_s)
        self.params = dict(model.state_dict())
        self.next, self.version, self.checksum, self.stopped = 0, None, None, False
        self.released = 0  # headers below this index deleted from the store
        self.extra = None  # the first push's resume states

    def release(self) -> None:
        """Delete the headers of the pushes taken (once every rollout rank has taken them)."""
        for i in range(self.released, self.next):
            self.store.delete_key(f"push/{i}")
        self.released = self.next

    def _header(self):
        """The next push's header, or None once the trainers set STOP_KEY and announced no further
        push. An announced push is joined even after a stop: its root waits for this rank (the
        trainer gives it up to `WeightPusher.close`'s timeout), and a root that left meanwhile is a
        clean stop (`receive`)."""
        key, what = f"push/{self.next}", "weight push from the trainers"
        while True:
            if ready(self.store, key):
                return pickle.loads(self.store.get(key))
            if ready(self.store, STOP_KEY):
                return None
            self.trainer.check(what)
            time.sleep(POLL_S)

    def visible(self) -> int:
        """The index after the last push announced in the store now (non-blocking)."""
        n = self.next
        while ready(self.store, f"push/{n}"):
            n += 1
        return n

    def receive(self) -> None:
        """Take the next push (waiting for its announcement) and load it into the model."""
        header = self._header()
        if header is None or header["stop"]:
            self.stopped = True
            return
        self.next += 1
        if header["extra"] is not None:
            self.extra = header["extra"]
        order = []
        for bucket in header["layout"]:
            nbytes = [
                _numel(shape) * torch.empty(0, dtype=dt).element_size() for _, shape, dt in bucket
            ]
            buf = torch.empty(sum(nbytes), dtype=torch.uint8)
            try:
                _broadcast(self.pg, buf)
            except Exception:  # the root left: a clean stop when it said so, else the error
                if ready(self.store, STOP_KEY):
                    self.stopped = True
                    return
                raise
            offset = 0
            for (name, shape, dtype), nb in zip(bucket, nbytes):
                target = self.params.get(name)
                if target is None or tuple(target.shape) != shape or target.dtype != dtype:
                    raise RolloutLost(
                        f"weight push: the trainers send {name} {shape} {dtype}, the rollout model "
                        f"holds {None if target is None else (tuple(target.shape), target.dtype)}"
                    )
                target.copy_(buf[offset : offset + nb].view(dtype).view(shape))
                order.append(target)
                offset += nb
        self.version, self.checksum = header["version"], checksum(order)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
