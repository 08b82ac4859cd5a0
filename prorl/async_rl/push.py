"""The weight push of an asynchronous run: trainer rank 0 -> every rollout rank over the `push`
process group (prorl/async_rl/roles.py).

Trainer rank 0 copies the full tensors into preallocated host buckets of at most `BUCKET_BYTES`
(page-locked on CUDA, non-blocking device-to-host copies, one synchronisation per push; no `cat`):
`WeightPusher.stage` is the only time the trainer spends on a push. Two sets of buckets alternate,
so staging the next version never waits for a broadcast under way. A thread of its own announces
push n in the store (a signed ticket, prorl/async_rl/wire.py), broadcasts its signed header (the
version, the bucket layout, the trainer's checksum of these weights, on resume the rollout ranks'
sampler states) and then the buckets. When the rollouts are still generating the thread waits, and
a newer staged version replaces an unsent older one (rollouts only ever want the newest).

The rollout ranks take pushes between two steps' sampling (`WeightReceiver`), all of them the same
pushes. The header over the push group is the authority: a store ticket that is not the run's is
named and ignored (a forged announcement makes a rollout wait for the next real push, no more).
Each bucket is checked against the signed layout before it is received, and the loaded weights
against the signed checksum before the rollout samples with them (Refused: exit 8). The checksum is
a position-weighted sum (transport.py), not a MAC: it catches a wrong or damaged payload, not one
crafted to collide by someone able to inject into the trainers' TCP streams.
"""

from __future__ import annotations

import threading
import time

import torch

from prorl.async_rl import wire
from prorl.async_rl.transport import (
    HEARTBEAT_STALE_S,
    POLL_S,
    STOP_KEY,
    Liveness,
    RolloutLost,
    broadcast,
    checksum,
    note_refused,
    ready,
    same_checksum,
    stopped,
    valid_ticket,
)

BUCKET_BYTES = 256 * 2**20
ALIGN = 64  # bytes: every tensor starts aligned in its bucket (a typed view of a uint8 bucket)


class BroadcastChannel:
    """wire's channel over a broadcast group whose root is rank 0 (the sender)."""

    def __init__(self, pg):
        self.pg = pg

    def send(self, t: torch.Tensor) -> None:
        broadcast(self.pg, t)

    recv = send


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_offsets(bucket) -> tuple[list[tuple[int, int]], int]:
    """[(offset, bytes)] of each (name, shape, dtype) of one bucket, and the bucket's size."""
    out, at = [], 0
    for _, shape, dtype in bucket:
        nbytes = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append((at, nbytes))
        at += _aligned(nbytes)
    return out, at


def _host_bucket(nbytes: int) -> torch.Tensor:
    """Host memory for one bucket: page-locked on CUDA (asynchronous copies, faster transfers)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class WeightPusher:
    """Trainer rank 0's side of the weight push (module docstring). `stage` raises RolloutLost once
    the push thread failed (a rollout rank died or timed out)."""

    def __init__(self, store, pg, secret: bytes):
        self.store, self.pg, self.secret, self.sent = store, pg, secret, 0
        self.slot, self.error, self.free = None, None, []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="prorl-weight-push", daemon=True)
        self.thread.start()

    def _buffers(self) -> tuple[list[torch.Tensor], object]:
        """(host buckets to stage into, the replaced push's resume states): an unsent older push's
        buckets (it is withdrawn: the newest wins), the set the thread returned, or none yet
        (allocated as the tensors arrive): two sets at most."""
        with self.cond:
            if self.slot is not None and not self.slot["header"]["stop"]:
                item, self.slot = self.slot, None
                return item["buckets"], item["header"]["extra"]
            return (self.free.pop() if self.free else []), None

    def stage(self, version: int, named, extra=None, checksum_of=None) -> None:
        """Copy (name, tensor) pairs, taken one at a time (an iterator: each tensor may be freed
        once copied), into host buckets and hand them to the push thread. `checksum_of()`: the
        trainers' checksum of these weights, read once `named` is consumed. `named` is consumed
        whole before a failed push raises: it may be a collective's iterator."""
        (buffers, replaced), layout, sizes, caps = self._buffers(), [], [], []
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            if not layout or (layout[-1] and sizes[-1] + _aligned(nbytes) > caps[-1]):
                layout.append([])
                sizes.append(0)
                need, i = _aligned(nbytes), len(layout) - 1
                if i == len(buffers) or buffers[i].numel() < need:
                    buffers[i : i + 1] = [_host_bucket(max(BUCKET_BYTES, need))]
                caps.append(min(buffers[i].numel(), max(BUCKET_BYTES, need)))
            host = buffers[len(layout) - 1][sizes[-1] : sizes[-1] + nbytes]
            host.view(t.dtype).copy_(t.detach().reshape(-1), non_blocking=True)
            layout[-1].append([name, list(t.shape), wire.NAMES[t.dtype]])
            sizes[-1] += _aligned(nbytes)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        if layout and buffers[len(layout) - 1].numel() > 2 * sizes[-1]:  # a small last bucket
            last = _host_bucket(sizes[-1])  # its own size: the next push fills it exactly
            buffers[len(layout) - 1] = last.copy_(buffers[len(layout) - 1][: sizes[-1]])
        if self.error is not None:
            raise RolloutLost(f"the weight push to the rollout ranks failed: {self.error}")
        value = checksum_of() if checksum_of is not None else None
        extra = extra if extra is not None else replaced  # a replaced push's resume states go too
        header = {"version": version, "stop": False, "extra": extra, "checksum": value}
        with self.cond:
            self.slot = {"header": {**header, "layout": layout}, "buckets": buffers}
            self.slot["sizes"] = sizes
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.slot is None:
                    self.cond.wait()
                item, self.slot = self.slot, None
            header, key = item["header"], f"push/{self.sent}"
            try:
                self.store.set(key, wire.ticket(self.secret, key, stop=header["stop"]))
                self.sent += 1
                if header["stop"]:
                    return
                wire.send(BroadcastChannel(self.pg), self.secret, key, header)
                for bucket, size in zip(item["buckets"], item["sizes"]):
                    broadcast(self.pg, bucket[:size])
            except Exception as exc:  # noqa: BLE001 - surfaced on the main thread by stage()
                self.error = str(exc).splitlines()[0][:300]
                return
            with self.cond:
                if not self.free:
                    self.free.append(item["buckets"])

    def close(self, timeout_s: float = 60.0) -> None:
        """Tell the rollout ranks to stop: STOP_KEY at once (seen even while a push is stuck), and a
        stop ticket after any push under way; wait for the thread."""
        self.store.set(STOP_KEY, wire.ticket(self.secret, STOP_KEY))
        if self.thread.is_alive():
            with self.cond:
                self.slot = {"header": {"stop": True, "extra": None}, "buckets": [], "sizes": []}
                self.cond.notify()
            self.thread.join(timeout_s)


class WeightReceiver:
    """A rollout rank's side of the weight push into `model` (module docstring). `version` and
    `checksum` describe the weights the model holds now; `stopped` once the trainers said stop. A
    push is waited for as long as trainer rank 0's heartbeat moves (validation, checkpoints,
    val_before_train take what they take)."""

    def __init__(
        self, store, pg, model, secret: bytes, startup_s: float, stale_s=HEARTBEAT_STALE_S
    ):
        self.store, self.pg, self.secret = store, pg, secret
        self.trainer = Liveness(store, "alive/trainer", "trainer rank 0", startup_s, stale_s)
        self.params = dict(model.state_dict())
        self.next, self.version, self.checksum, self.stopped = 0, None, None, False
        self.released = 0  # tickets below this index deleted from the store
        self.extra = None  # the first push's resume states
        self.buckets: list[torch.Tensor] = []  # host buffers, kept from push to push
        self.refused: set[str] = set()

    def release(self) -> None:
        """Delete the tickets of the pushes taken (once every rollout rank has taken them)."""
        for i in range(self.released, self.next):
            self.store.delete_key(f"push/{i}")
        self.released = self.next

    def _ticket(self):
        """The next push's ticket: its body, {} when the store's value is not the run's (named; the
        broadcast header decides), or None once the trainers set STOP_KEY and announced no further
        push. An announced push is joined even after a stop: its root waits for this rank (the
        trainer gives it up to `WeightPusher.close`'s timeout), and a root that left meanwhile is a
        clean stop (`receive`)."""
        key, what = f"push/{self.next}", "weight push from the trainers"
        while True:
            if ready(self.store, key):
                try:
                    return wire.verify(self.secret, self.store.get(key), key)
                except wire.Refused as exc:
                    note_refused(self.refused, exc)
                    return {}
            if stopped(self.store, self.secret, self.refused):
                return None
            self.trainer.check(what)
            time.sleep(POLL_S)

    def visible(self) -> int:
        """The index after the last push announced in the store now (non-blocking; a ticket that
        is not the run's announces nothing)."""
        n = self.next
        while valid_ticket(self.store, self.secret, f"push/{n}"):
            n += 1
        return n

    def receive(self) -> None:
        """Take the next push (waiting for its announcement) and load it into the model."""
        ticket = self._ticket()
        if ticket is None or ticket.get("stop") is True:
            self.stopped = True
            return
        key = f"push/{self.next}"
        try:
            header = wire.recv(BroadcastChannel(self.pg), self.secret, key)
        except wire.Refused:
            raise
        except Exception:  # the root left: a clean stop when it said so, else the error
            if stopped(self.store, self.secret, self.refused):
                self.stopped = True
                return
            raise
        self.next += 1
        layout, version, value = _check_header(header, self.params, key)
        if self.version is not None and version < self.version:
            raise wire.Refused(f"{key}: version {version} after version {self.version}")
        if header["extra"] is not None:
            self.extra = header["extra"]
        order = []
        for i, bucket in enumerate(layout):
            offsets, size = bucket_offsets(bucket)
            if i == len(self.buckets) or self.buckets[i].numel() < size:
                self.buckets[i : i + 1] = [_host_bucket(size)]
            buf = self.buckets[i][:size]
            broadcast(self.pg, buf)
            for (name, shape, dtype), (offset, nbytes) in zip(bucket, offsets):
                target = self.params[name]
                target.copy_(buf[offset : offset + nbytes].view(dtype).view(shape), True)
                order.append(target)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        self.version, self.checksum = version, checksum(order)
        if value is not None and not same_checksum(value, self.checksum):
            raise wire.Refused(
                f"{key}: the weights received (checksum {self.checksum!r}) are not the version "
                f"{version} the trainers signed (checksum {value!r})"
            )


def _check_header(header, params, key: str):
    """(layout as (name, shape, dtype), version, signed checksum) of a push header, each tensor
    checked against the rollout model's before a byte of the weights is received."""
    if not isinstance(header, dict) or not isinstance(header.get("layout"), list):
        raise wire.Refused(f"{key}: a push header without a layout")
    version, value = header.get("version"), header.get("checksum")
    if type(version) is not int or version < 0 or not isinstance(value, (float, int, type(None))):
        raise wire.Refused(f"{key}: version {version!r}, checksum {value!r}")
    if header.get("extra") is not None and not isinstance(header["extra"], dict):
        raise wire.Refused(f"{key}: resume states of type {type(header['extra']).__name__}")
    layout = []
    for bucket in header["layout"]:
        layout.append([])
        for entry in bucket if isinstance(bucket, list) else [None]:
            ok = isinstance(entry, list) and len(entry) == 3 and entry[2] in wire.DTYPES
            name, shape, dtype = entry if ok else (None, None, None)
            target = params.get(name) if isinstance(name, str) else None
            if target is None or [*target.shape] != shape or wire.NAMES[target.dtype] != dtype:
                raise RolloutLost(
                    f"weight push: the trainers send {str(entry)[:120]}, the rollout model holds "
                    f"{None if target is None else (tuple(target.shape), target.dtype)}"
                )
            layout[-1].append((name, tuple(shape), target.dtype))
    return layout, version, value


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
