"""What travels between the two sides of an asynchronous run (prorl/async_rl/roles.py).

Objects (a step's groups, push headers) go through the job's store: `put` pickles under a key, `take`
waits for it (with a timeout), reads and deletes it, `ready` probes without blocking. The store is the
rendezvous TCPStore torchrun already runs; a step's groups are token ids and log-probs, about 8 bytes
per response token.

Weights go from trainer rank 0 to every rollout rank over the gloo `push` group, in buckets of at most
`BUCKET_BYTES` (bytes of the sampler's dtype, so bf16 travels as bf16). Trainer rank 0 copies them into
host buckets (`WeightPusher.stage`: the only time the trainer spends on a push) and a thread of its own
announces the push in the store and broadcasts the buckets; when the rollouts are still generating, the
thread waits, and a newer staged version replaces an unsent older one (rollouts only ever want the
newest). The rollout ranks take pushes only between two steps' sampling (`WeightReceiver`), all of them
the same pushes.

`checksum` is the yardstick of "the rollout's weights are the version it reports": the trainer records it
per version over its own full tensors, the rollout computes it over its model after loading a push, and
every received batch is checked against the record (`RemoteRollouts.take`).
"""

from __future__ import annotations

import pickle
import threading
import time

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20
POLL_S = 0.005  # how often a waiting side looks for its key in the store


class RolloutLost(RuntimeError):
    """The rollout side stopped answering (died, hung past the timeout, or sent weights that are not the
    version it reports); train.py exits with lifecycle.EXIT_ROLLOUT_LOST."""


def put(store, key: str, obj) -> None:
    store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def ready(store, key: str) -> bool:
    return store.check([key])


def take(store, key: str, timeout_s: float, what: str, delete: bool = True):
    """The object under `key`, waited for at most timeout_s, then deleted from the store (`delete`: a
    push header stays, every rollout rank reads it)."""
    # polled, not store.wait: a waiting client holds its connection's lock, and the push thread shares it
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise RolloutLost(f"no {what} within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    obj = pickle.loads(store.get(key))
    if delete:
        store.delete_key(key)
    return obj


def checksum(tensors) -> float:
    """A position-weighted float64 sum of every element of `tensors` (in order): equal weights give equal
    sums (to rounding of the summation order, hence `same_checksum`), a different version does not."""
    total = 0.0
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1).double()
        weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 1009 + 1 + i
        total += float((flat * weights).sum())
    return total


def same_checksum(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def _broadcast(pg, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([tensor], opts).wait()


def bucket_layout(named: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """(name, shape, dtype) of each tensor, in buckets of at most BUCKET_BYTES (a larger tensor alone)."""
    buckets, size = [[]], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > BUCKET_BYTES:
            buckets, size = [*buckets, []], 0
        buckets[-1].append((name, tuple(t.shape), t.dtype))
        size += nbytes
    return buckets if buckets[0] else []


class WeightPusher:
    """Trainer rank 0's side of the weight push (module docstring). `stage` raises RolloutLost once the
    push thread failed (a rollout rank died or timed out)."""

    def __init__(self, store, pg):
        self.store, self.pg, self.sent = store, pg, 0
        self.slot, self.error = None, None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="prorl-weight-push", daemon=True)
        self.thread.start()

    def stage(self, version: int, named, extra=None, stop: bool = False) -> None:
        """Copy (name, tensor) pairs into host buckets and hand them to the push thread."""
        if self.error is not None:
            raise RolloutLost(f"the weight push to the rollout ranks failed: {self.error}")
        named = list(named)
        layout = bucket_layout(named)
        tensors, buckets, i = [t for _, t in named], [], 0
        for bucket in layout:
            parts = [tensors[i + j].detach().reshape(-1).cpu().view(torch.uint8) for j in range(len(bucket))]
            buckets.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))
            i += len(bucket)
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
        """Tell the rollout ranks to stop (after any push under way) and wait for the thread."""
        if self.thread.is_alive():
            with self.cond:
                self.slot = {"header": {"version": -1, "stop": True, "extra": None, "layout": []}}
                self.slot["buckets"], self.slot["extra"] = [], None
                self.cond.notify()
            self.thread.join(timeout_s)


class WeightReceiver:
    """A rollout rank's side of the weight push into `model` (module docstring). `version` and
    `checksum` describe the weights the model holds now; `stopped` once the trainers said stop."""

    def __init__(self, store, pg, model, timeout_s: float):
        self.store, self.pg, self.timeout_s = store, pg, timeout_s
        self.params = dict(model.state_dict())
        self.next, self.version, self.checksum, self.stopped = 0, None, None, False
        self.extra = None  # the first push's resume states

    def visible(self) -> int:
        """The index after the last push announced in the store now (non-blocking)."""
        n = self.next
        while ready(self.store, f"push/{n}"):
            n += 1
        return n

    def receive(self) -> None:
        """Take the next push (waiting for its announcement) and load it into the model."""
        what = "weight push from the trainers"
        header = take(self.store, f"push/{self.next}", self.timeout_s, what, delete=False)
        self.next += 1
        if header["extra"] is not None:
            self.extra = header["extra"]
        if header["stop"]:
            self.stopped = True
            return
        order = []
        for bucket in header["layout"]:
            nbytes = [_numel(shape) * torch.empty(0, dtype=dt).element_size() for _, shape, dt in bucket]
            buf = torch.empty(sum(nbytes), dtype=torch.uint8)
            _broadcast(self.pg, buf)
            offset = 0
            for (name, shape, dtype), nb in zip(bucket, nbytes):
                target = self.params.get(name)
                if target is None or tuple(target.shape) != shape or target.dtype != dtype:
                    raise RolloutLost(
                        f"weight push: the trainers send {name} {shape} {dtype}, the rollout model holds "
                        f"{None if target is None else (tuple(target.shape), target.dtype)}"
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
