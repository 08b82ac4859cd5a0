"""RewardPool: score a batch of responses in worker processes, each call under a hard timeout.

A verifier that hangs (sympy on a pathological expression), crashes the interpreter (a segfault in a
C extension, `os._exit`) or raises must not stop or freeze training. Each item goes to one worker;
the parent keeps the clock. When an item outlives `timeout_s` its worker is SIGKILLed and replaced;
when a worker dies its item is an error and the worker is replaced; either way the batch completes,
the item scores 0 and is flagged, so the trainer logs `reward/timeout_frac` and `reward/error_frac`
(in training a flagged item then takes its group's mean score: prorl.sampling.impute_failed).

What counts as an error: only failures of the verifier itself (it raised: a bug, a ground truth it
cannot read, a sandbox that cannot start; or its worker died). What a response makes happen is never
an error: the code verifier scores a crash, a timeout inside its sandbox or a forged, malformed,
oversized or too-deep report 0 with the reason in the item's extras (`prorl.rewards.code_report`),
so a policy cannot raise `reward/error_frac` at will and the metric stays a signal of the harness's
health.

Workers are fresh interpreters started with subprocess (fork+exec, like multiprocessing's "spawn"),
never a bare fork of the trainer (which holds torch threads and CUDA state); unlike
multiprocessing's spawn they do not re-import the trainer's `__main__`. They start with the parent's
`sys.path`, import `prorl.rewards` (so the built-in keys are registered) and the modules of the keys
in `preload`, then say "ready"; an item's clock starts only when it is handed to a ready worker. The
verifier itself is sent with every item by reference (module + name, as pickle does), so
user-registered verifiers must be module-level functions of modules the workers can import; the pool
checks this when it scores.

Talk is over a socketpair with multiprocessing's Connection framing (pickle). Every request carries
an id that its reply must repeat. A verifier runs inside the worker and can break that protocol:
write to the worker's socket (the parent reads bytes that do not unpickle), or fork a child that
returns into the worker's loop (two replies to one request, or a reply to the next item's request:
matched by order, every later score of the batch would shift onto the next item). A reply that does
not unpickle, is not a reply, arrives while no request is out or repeats another request's id breaks
the worker's protocol: the worker is killed and replaced, its item sent again once and then scored 0
as an error ("protocol"), counted in `protocol_failures`. A forked child that returns into the loop
exits at once without replying. The parent's reads time out (REPLY_READ_TIMEOUT_S) so a partial
message cannot block it. A worker that dies is seen as EOF on its connection. A worker that dies
during start-up (or does not start in time) is started again; after MAX_START_FAILURES failures in a
row the pool raises, naming the last one.

Each worker runs in a process group of its own; killing a worker kills the group, so children a
verifier started (forked, or left behind by a timed-out call) go with it, and a worker whose pool
vanished kills its group as it exits (a child that leaves the group with setsid() escapes it:
verifiers are trusted code). A worker is recycled (replaced by a fresh one, counted in `recycled`)
after `max_calls` items or once its resident memory exceeds `max_rss_bytes`, so a verifier that
leaks (caches every call) bounds the worker's growth instead of the machine's. That check runs
between items; within one, the kernel bounds the worker: its RLIMIT_DATA soft limit is
`max_memory_bytes` (heap and private writable mappings, inherited by the processes it starts; the
code sandbox sets its own). An allocation past it fails (a MemoryError, or a C library's abort):
the item scores 0 as an error and the worker is replaced, counted in `memory_exceeded` (or, when it
died, in `replaced`).

Each worker has a private TMPDIR `prorl-reward-worker-*` (its code sandboxes' directories go there),
locked for as long as the worker lives (`sandbox.tempdirs`); the pool removes it when it kills the
worker, a worker whose pool vanished removes its own, and a new pool removes those that nobody holds
(left by a run SIGKILLed with its workers), never a live run's.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import prorl.rewards as rewards
from prorl.rewards.sandbox import tempdirs

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
REPLY_READ_TIMEOUT_S = 10.0  # a reply that started arriving but stalls this long breaks the worker
MAX_CALLS_PER_WORKER = 5000  # items before a worker is recycled
MAX_WORKER_RSS_BYTES = 2**30  # a worker whose resident memory passes this after an item is recycled
# RLIMIT_DATA of a worker: an allocation past it fails inside the item (a worker scoring math holds
# ~55 MB of data: VmData after `math` and `code` items)
MAX_WORKER_MEMORY_BYTES = 4 * 2**30
MAX_START_FAILURES = 3  # workers in a row that die or hang during start-up before the pool gives up
TMP_PREFIX = "prorl-reward-worker-"


@dataclass
class BatchResult:
    """Per-item outcome of `RewardPool.score_batch`; failed items score 0."""

    scores: list[float]
    timed_out: list[bool]
    errored: list[bool]
    errors: list[str | None]
    extras: list[dict] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        n = max(len(self.scores), 1)
        return {
            "reward/timeout_frac": sum(self.timed_out) / n,
            "reward/error_frac": sum(self.errored) / n,
        }


def _item_key(data_source, response, ground_truth, extra):
    """A hashable identity of one item (ground truths and extras may be lists / dicts); items that
    cannot be represented get a key of their own."""
    try:
        return (data_source, response, repr(ground_truth), repr(extra))
    except Exception:  # noqa: BLE001 - a failing __repr__: never merged with another item
        return (object(),)


class _Worker:
    def __init__(self, preload: tuple[str, ...], memory_bytes: int):
        parent_sock, child_sock = socket.socketpair()
        code = (
            "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
            "from prorl.rewards.pool import _worker_main; "
            "_worker_main(int(sys.argv[3]), int(sys.argv[2]))"
        )
        # a temporary directory of its own, removed when the worker is killed: a code sandbox killed
        # with its worker cannot clean up after itself. The worker inherits the directory's lock.
        self.tmpdir, lock = tempdirs.make_locked(TMP_PREFIX)
        # the sandbox's unprivileged uid must reach its directory inside
        os.chmod(self.tmpdir, 0o711)
        # a read of a reply that starts but stalls (a verifier wrote part of a frame) times out
        timeval = struct.pack("ll", int(REPLY_READ_TIMEOUT_S), 0)
        parent_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            TMPDIR=self.tmpdir,
        )
        try:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-c", code, json.dumps(sys.path)),
                    *(str(memory_bytes), str(child_sock.fileno())),
                ],
                pass_fds=(child_sock.fileno(), lock),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: killed with its children
            )
        except BaseException:
            parent_sock.close()
            child_sock.close()
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            raise
        finally:
            os.close(lock)
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send({"preload": list(preload)})
        self.ready = False
        self.started = time.monotonic()
        self.item: int | None = None  # index of the item it is working on
        self.request = 0  # id of the request out (ids are unique over the pool's life)
        self.calls = 0  # items it has scored
        self.deadline = 0.0

    def kill(self) -> None:
        try:  # the whole group: children of its verifiers too (before the wait: no pid reuse)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        self.conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _worker_main(fd: int, memory_bytes: int) -> None:
    """Worker: bound its memory, init, say ready, then score items until the pool closes the
    connection or vanishes."""
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if memory_bytes > 0 and (hard == resource.RLIM_INFINITY or memory_bytes < hard):  # 0: none
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, hard))
    # Ctrl-C / SIGTERM go to the whole process group: the trainer decides when to stop, and still
    # needs its verifiers to finish the step. A worker ends when its connection closes (or by
    # SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _serve(Connection(fd))
    except (EOFError, OSError):  # the pool is gone (a pool that closes kills its workers first)
        tmpdir = os.environ.get("TMPDIR", "")
        if os.path.basename(tmpdir).startswith(TMP_PREFIX):
            shutil.rmtree(tmpdir, ignore_errors=True)
        os.killpg(0, signal.SIGKILL)  # with the children its verifiers left


def _serve(conn: Connection) -> None:
    init = conn.recv()
    try:
        for key in init["preload"]:
            rewards.load(rewards.lookup(key)[1])
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready",))
    pid = os.getpid()
    while True:
        request, data_source, entry, response, ground_truth, extra = conn.recv()
        try:
            extra = dict(extra or {})
            extra.setdefault("data_source", data_source)
            result = rewards.load(entry)(response, ground_truth, extra)
            value, info = rewards.normalize_result(
                result, data_source, getattr(entry, "bounded", True)
            )
            try:
                pickle.dumps(info)
            except Exception:  # noqa: BLE001 - extras are best-effort
                info = {k: repr(v) for k, v in info.items()}
            reply = ("ok", request, value, info)
        except Exception as exc:  # noqa: BLE001 - any verifier error scores 0 and is counted
            reply = ("error", request, f"{type(exc).__name__}: {exc}", {})
        if os.getpid() != pid:  # a child the verifier forked, returned here: not a worker
            os._exit(0)
        conn.send(reply)


class RewardPool:
    """A pool of `num_workers` verifier processes; `score_batch` blocks, `score_batch_async` does
    not.

    timeout_s: hard limit per item (wall clock, from hand-off to a ready worker). The code verifier
        has its own 5 s budget inside, so keep this above that.
    preload: registry keys whose modules each worker imports at start (math-verify ~1 s,
        reasoning-gym ~5 s), so that import time never counts against an item.
    max_calls, max_rss_bytes: a worker is recycled after this many items, or when its resident
        memory exceeds this after an item.
    max_memory_bytes: each worker's RLIMIT_DATA (kernel-enforced, within an item); a verifier that
        allocates past it fails its item and the worker is replaced.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        preload: tuple[str, ...] = ("math",),
        max_calls: int = MAX_CALLS_PER_WORKER,
        max_rss_bytes: int = MAX_WORKER_RSS_BYTES,
        max_memory_bytes: int = MAX_WORKER_MEMORY_BYTES,
    ):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.timeout_s = float(timeout_s)
        self.preload = tuple(preload)
        self.max_calls, self.max_rss_bytes = max_calls, max_rss_bytes
        self.max_memory_bytes = max_memory_bytes
        self.replaced = 0  # workers killed or lost and started again, over the pool's life
        self.protocol_failures = 0  # workers replaced because their replies broke the protocol
        self.recycled = 0  # workers replaced after max_calls items or max_rss_bytes of memory
        self.memory_exceeded = 0  # workers replaced after a verifier hit max_memory_bytes
        self.process_groups: list[int] = []  # of every worker started (a worker's pid is its pgid)
        self._requests = 0  # the last request id handed out
        self._retried: set[int] = set()  # items of this batch sent again after a protocol failure
        self._start_failures = 0  # workers in a row that died or hung during start-up
        self._executor: ThreadPoolExecutor | None = None
        self.workers: list[_Worker] = []
        stale = tempdirs.remove_stale(TMP_PREFIX)
        if stale:
            log.info("removed %d reward-worker directories of runs that were killed", len(stale))
        for _ in range(num_workers):
            self.workers.append(self._start())

    # -- public API -------------------------------------------------------------------------------
    def score_batch(
        self,
        data_sources: list[str],
        responses: list[str],
        ground_truths: list[Any],
        extras: list[dict | None] | None = None,
    ) -> BatchResult:
        """Score every item; never raises for a verifier's failure (it scores 0 and is flagged).

        Identical items (same data_source, response, ground truth and extra) are verified once and
        share the outcome: a group's samples often repeat, and a verifier is a function of its
        inputs. Raises for caller bugs: unknown data_source, mismatched lengths, a verifier that
        cannot be sent to the workers (lambda, closure), a worker that cannot start.
        """
        n = len(responses)
        extras = list(extras) if extras is not None else [None] * n
        if not (len(data_sources) == len(ground_truths) == len(extras) == n):
            raise ValueError(
                "data_sources, responses, ground_truths and extras must have equal lengths"
            )
        first: dict = {}
        of = [
            first.setdefault(_item_key(*item), i)
            for i, item in enumerate(zip(data_sources, responses, ground_truths, extras))
        ]
        unique = sorted(set(of))
        if len(unique) == n:
            return self._score_unique(data_sources, responses, ground_truths, extras)
        got = self._score_unique(
            *([x[i] for i in unique] for x in (data_sources, responses, ground_truths, extras))
        )
        slot = {i: k for k, i in enumerate(unique)}
        return BatchResult(
            *(
                [getattr(got, f)[slot[of[i]]] for i in range(n)]
                for f in ("scores", "timed_out", "errored", "errors")
            ),
            [dict(got.extras[slot[of[i]]]) for i in range(n)],
        )

    def _score_unique(self, data_sources, responses, ground_truths, extras) -> BatchResult:
        n = len(responses)
        entries = {}
        for ds in set(data_sources):
            entry = rewards.lookup(ds)[1]
            try:
                pickle.dumps(entry)
            except Exception as exc:
                raise TypeError(
                    f"the verifier for {ds!r} cannot be sent to worker processes ({exc}); register "
                    "a module-level function of an importable module (not a lambda or closure)"
                ) from exc
            entries[ds] = entry
        result = BatchResult(
            [0.0] * n, [False] * n, [False] * n, [None] * n, [{} for _ in range(n)]
        )
        pending = deque(range(n))
        remaining = n
        self._retried = set()
        while remaining:
            self._hand_out(pending, (data_sources, responses, ground_truths, extras), entries)
            now = time.monotonic()
            deadlines = [w.deadline for w in self.workers if w.item is not None]
            deadlines += [w.started + STARTUP_TIMEOUT_S for w in self.workers if not w.ready]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            ready_conns = wait([w.conn for w in self.workers], timeout=timeout)
            for w in list(self.workers):
                if w.conn in ready_conns:
                    remaining -= self._receive(w, result, pending)
            now = time.monotonic()
            for w in list(self.workers):
                if w.item is not None and now >= w.deadline:
                    i = w.item
                    result.timed_out[i], result.errors[i] = (
                        True,
                        f"timeout after {self.timeout_s:g} s",
                    )
                    remaining -= 1
                    self._replace(w)
                elif not w.ready and now >= w.started + STARTUP_TIMEOUT_S:
                    self._start_failed(f"did not start within {STARTUP_TIMEOUT_S:g} s")
                    self._replace(w)
        return result

    def _hand_out(self, pending: deque, items: tuple, entries: dict) -> None:
        """Send the next pending items (indices into `items`' lists) to the idle ready workers."""
        data_sources, responses, ground_truths, extras = items
        for w in self.workers:
            if w.ready and w.item is None and pending:
                i = pending.popleft()
                self._requests += 1
                request = (self._requests, data_sources[i], entries[data_sources[i]])
                try:
                    w.conn.send((*request, responses[i], ground_truths[i], extras[i]))
                except OSError:  # died while idle: replace it and retry the item
                    pending.appendleft(i)
                    self._replace(w)
                    continue
                w.item, w.request = i, self._requests
                w.deadline = time.monotonic() + self.timeout_s

    def score_batch_async(self, *args, **kwargs) -> Future:
        """`score_batch` on a background thread; returns a Future of BatchResult. One batch at a
        time."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward-pool")
        return self._executor.submit(self.score_batch, *args, **kwargs)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for w in self.workers:
            w.kill()
        self.workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if getattr(self, "workers", None):
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- internals --------------------------------------------------------------------------------
    def _receive(self, w: _Worker, result: BatchResult, pending: deque) -> int:
        """Handle what `w` sent (or its death). Returns how many items finished (0 or 1)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError) as exc:
            if isinstance(exc, BlockingIOError):  # SO_RCVTIMEO: a reply that started, stalled
                return self._protocol_broken(w, result, pending, f"a reply stalled ({exc})")
            code = w.proc.wait()
            if w.item is None:
                if not w.ready:
                    self._start_failed(f"exited during start-up ({_exit_text(code)})")
                self._replace(w)
                return 0
            i = w.item
            result.errored[i], result.errors[i] = True, f"worker died ({_exit_text(code)})"
            self._replace(w)
            return 1
        except Exception as exc:  # noqa: BLE001 - bytes a verifier wrote to the worker's socket
            return self._protocol_broken(w, result, pending, f"{type(exc).__name__}: {exc}")
        if not w.ready and msg == ("ready",):
            w.ready = True
            self._start_failures = 0
            return 0
        if not w.ready and isinstance(msg, tuple) and msg[:1] == ("init_error",):
            raise RuntimeError(f"a reward worker failed to start:\n{msg[1]}")
        if not _is_reply(msg, w.request) or w.item is None:
            return self._protocol_broken(w, result, pending, f"unexpected message {msg!r:.200}")
        i, w.item = w.item, None
        status, _, payload, info = msg
        if status == "ok":
            result.scores[i], result.extras[i] = float(payload), info
        else:
            result.errored[i], result.errors[i] = True, payload
            log.debug("reward error on item %d: %s", i, payload)
            if payload.startswith("MemoryError"):  # its heap may be left half-built: a fresh one
                self.memory_exceeded += 1
                self._replace(w, lost=False)
                return 1
        w.calls += 1
        if w.calls >= self.max_calls or _rss_bytes(w.proc.pid) > self.max_rss_bytes:
            self.recycled += 1
            self._replace(w, lost=False)
        return 1

    def _protocol_broken(self, w: _Worker, result: BatchResult, pending: deque, why: str) -> int:
        """Replace `w`, whose replies can no longer be trusted; its item goes out once more, then
        scores 0 as an error. Returns how many items finished (0 or 1)."""
        self.protocol_failures += 1
        log.warning("a reward worker broke the reply protocol (%s); replacing it", why)
        i, w.item = w.item, None
        self._replace(w)
        if i is None:
            return 0
        if i not in self._retried:
            self._retried.add(i)
            pending.appendleft(i)
            return 0
        result.errored[i], result.errors[i] = (
            True,
            f"protocol: the verifier broke the reply ({why})",
        )
        return 1

    def _replace(self, w: _Worker, lost: bool = True) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = self._start()
        self.replaced += lost

    def _start(self) -> _Worker:
        while True:
            try:
                w = _Worker(self.preload, self.max_memory_bytes)
                self.process_groups.append(w.proc.pid)
                return w
            # fork/exec failed (no memory, process limit): retried like a death
            except OSError as exc:
                self._start_failed(f"could not be spawned ({exc})")
                time.sleep(0.1 * self._start_failures)

    def _start_failed(self, why: str) -> None:
        """Count a worker that failed to start; raise once MAX_START_FAILURES happened in a row."""
        self._start_failures += 1
        n = self._start_failures
        if n >= MAX_START_FAILURES:
            raise RuntimeError(
                f"reward workers failed to start {n} times in a row; the last one {why} "
                "(its own output, if any, is above)"
            )
        log.warning(
            "a reward worker %s; starting another (failure %d of %d)", why, n, MAX_START_FAILURES
        )


# the pool's counters of replaced workers, by cause (cumulative over its life; the trainer logs
# each step's increase: reward/workers_replaced, reward/protocol_failures, ...)
COUNTERS = ("replaced", "protocol_failures", "recycled", "memory_exceeded")


def pool_counts(pool) -> dict[str, int]:
    """The counters of `pool` (0 for a scorer without them)."""
    return {key: int(getattr(pool, key, 0)) for key in COUNTERS}


def _is_reply(msg: Any, request: int) -> bool:
    """Whether `msg` is a worker's reply to request id `request`."""
    return (
        isinstance(msg, tuple)
        and len(msg) == 4
        and msg[0] in ("ok", "error")
        and msg[1] == request
        and isinstance(msg[3], dict)
        and (msg[0] == "error" or isinstance(msg[2], (int, float)))
    )


def _rss_bytes(pid: int) -> int:
    """The resident memory of process `pid` (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
