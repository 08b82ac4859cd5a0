"""The wire format of an asynchronous run: signed JSON headers and tensors, no pickle.

Everything one side sends the other is a *message*: a header (JSON, signed with HMAC-SHA256 under
the run's secret) and payload tensors whose dtypes and sizes the header lists. Nothing that arrives
is unpickled; a header is checked (signature, key, sizes, dtypes) before any payload is received,
and the payload against the header's SHA-256 digest before it is decoded.

    secret = run_secret(store, directory, rank)        # every rank of the job, not the store
    send(channel, secret, "batch/5/0/1", obj)           # obj: JSON-like, its numbers as tensors
    obj = recv(channel, secret, "batch/5/0/1")          # Refused (named) when it is not ours
    ticket(secret, key) / check_ticket(...)             # the small signed value of a store key

The secret is 32 random bytes made by global rank 0 for each attempt of the job and written to a
0600 file under `output_dir` (or the system temp directory when output_dir is empty: one node), or
taken from PRORL_ASYNC_SECRET (hex) where the launcher hands every rank one. The store carries only
its SHA-256 fingerprint, so that a rank reads the current file. A process that can reach the store
but not the file (another user, another host) can neither forge nor replay a message: each header
names its key (`batch/<step>/<rollout>/<trainer>`, `push/<n>`), so a signed header moved to another
key is refused as a replay.

Encoding (`encode`/`decode`): dicts, lists, strings, numbers, booleans and None; a list of ints,
floats or booleans travels in one int64 / float64 / uint8 tensor (token ids, log-probs, the data
order), the rest as JSON with tagged nodes. Tuples come back as lists.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
import time

import torch

MAX_HEADER_BYTES = 64 * 2**20  # a header is a few KiB to a few MiB (a large run's data order)
SECRET_ENV = "PRORL_ASYNC_SECRET"
SECRET_FILE = "async_secret"
SECRET_WAIT_S = 300.0
DTYPES = {
    "int64": torch.int64,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
NAMES = {v: k for k, v in DTYPES.items()}


class RolloutLost(RuntimeError):
    """The rollout side stopped answering (died, hung past the timeout, or sent weights that are not
    the version it reports); train.py exits with lifecycle.EXIT_ROLLOUT_LOST."""


class Refused(RolloutLost):
    """A message that is not the run's own (forged, replayed, malformed): never used."""


# -- the run's secret ------------------------------------------------------------------------------
def run_secret(store, directory: str | None, rank: int, timeout_s: float = SECRET_WAIT_S) -> bytes:
    """The attempt's secret (module docstring): rank 0 makes and publishes it, the others read it
    once the store holds its fingerprint."""
    env = os.environ.get(SECRET_ENV)
    if env:
        try:
            key = bytes.fromhex(env)
        except ValueError:
            key = b""
        if len(key) < 16:
            raise Refused(f"{SECRET_ENV} must be at least 32 hex digits")
        return key
    path = os.path.join(directory or tempfile.gettempdir(), _secret_name(directory))
    if rank == 0:
        key = secrets.token_bytes(32)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        os.replace(tmp, path)
        store.set("secret", hashlib.sha256(key).hexdigest())
        return key
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check(["secret"]):
            want, key = store.get("secret").decode(errors="replace"), _read_secret(path)
            if key is not None and hmac.compare_digest(hashlib.sha256(key).hexdigest(), want):
                return key
        if time.monotonic() > deadline:
            raise Refused(
                f"no run secret at {path} matching the one rank 0 published within {timeout_s:.0f}"
                f" s: every rank must see output_dir (shared file system), or set {SECRET_ENV}"
            )
        time.sleep(0.05)


def _secret_name(directory: str | None) -> str:
    if directory:
        return SECRET_FILE
    # no output_dir: the temp directory of one node, one name per job
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"prorl-{os.getuid()}-{run}-{os.environ.get('MASTER_PORT', '0')}.{SECRET_FILE}"


def _read_secret(path: str) -> bytes | None:
    try:
        st = os.stat(path)
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise Refused(f"{path}: the run secret must be a 0600 file of this user")
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


# -- signed headers --------------------------------------------------------------------------------
def sign(secret: bytes, body: dict) -> bytes:
    """64 hex digits of HMAC-SHA256 over the canonical JSON of `body`, then that JSON."""
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, data, hashlib.sha256).hexdigest().encode() + data


def verify(secret: bytes, value, key: str) -> dict:
    """The body of a signed header meant for `key`; Refused (saying why) otherwise."""
    value = value.encode() if isinstance(value, str) else bytes(value)
    if len(value) < 66 or not hmac.compare_digest(
        hmac.new(secret, value[64:], hashlib.sha256).hexdigest().encode(), value[:64]
    ):
        kind = "a pickle" if value[:1] == b"\x80" else f"{len(value)} bytes"
        raise Refused(f"{key}: not signed with the run's secret ({kind}): forged")
    try:
        body = json.loads(value[64:])
    except ValueError:
        raise Refused(f"{key}: a signed header that is not JSON") from None
    if not isinstance(body, dict) or body.get("key") != key:
        named = body.get("key") if isinstance(body, dict) else None
        raise Refused(f"{key}: a replay of the run's own {named!r}")
    return body


def ticket(secret: bytes, key: str, **fields) -> bytes:
    """The signed value put under a store key (an announcement; the data travels elsewhere)."""
    return sign(secret, {"key": key, **fields})


# -- encoding --------------------------------------------------------------------------------------
def encode(obj) -> tuple[object, list[torch.Tensor]]:
    """(JSON-able tree, [int64, float64, uint8] tensors) of `obj` (module docstring)."""
    buffers: tuple[list, list, list] = ([], [], [])

    def walk(x):
        if x is None or isinstance(x, (bool, str, int, float)):
            return x
        if isinstance(x, dict):
            return {"D": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            for tag, kind, buf in (("B", bool, buffers[2]), ("I", int, buffers[0])):
                if x and all(type(v) is kind for v in x):
                    buf.extend(x)
                    return {tag: [len(buf) - len(x), len(x)]}
            if x and all(type(v) is float for v in x):
                buffers[1].extend(x)
                return {"F": [len(buffers[1]) - len(x), len(x)]}
            return {"L": [walk(v) for v in x]}
        raise TypeError(f"cannot send a {type(x).__name__}")

    tree = walk(obj)
    ints, floats, bools = buffers
    return tree, [
        torch.tensor(ints, dtype=torch.int64),
        torch.tensor(floats, dtype=torch.float64),
        torch.tensor(bools, dtype=torch.uint8),
    ]


def decode(tree, tensors: list[torch.Tensor]):
    """The object `encode` made; Refused on a malformed tree (unknown tag, range out of bounds)."""
    lists = [t.tolist() for t in tensors]

    def part(i, span):
        if (
            not isinstance(span, list)
            or len(span) != 2
            or not all(type(v) is int for v in span)
            or span[0] < 0
            or span[1] < 1
            or span[0] + span[1] > len(lists[i])
        ):
            raise Refused(f"a list out of the payload's bounds: {span!r}")
        return lists[i][span[0] : span[0] + span[1]]

    def walk(x, depth=0):
        if depth > 64:
            raise Refused("nested too deep")
        if x is None or isinstance(x, (bool, str, int, float)):
            return x
        if not isinstance(x, dict) or len(x) != 1:
            raise Refused(f"not a node: {str(x)[:80]}")
        ((tag, v),) = x.items()
        if tag in "IFB" and len(tag) == 1:
            values = part("IFB".index(tag), v)
            return [bool(b) for b in values] if tag == "B" else values
        if tag == "L" and isinstance(v, list):
            return [walk(e, depth + 1) for e in v]
        if tag == "D" and isinstance(v, list):
            if not all(isinstance(p, list) and len(p) == 2 for p in v):
                raise Refused("a malformed dict")
            return {_key(walk(k, depth + 1)): walk(val, depth + 1) for k, val in v}
        raise Refused(f"unknown node {tag!r}")

    return walk(tree)


def _key(k):
    if not isinstance(k, (str, int)):
        raise Refused(f"a dict key of type {type(k).__name__}")
    return k


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(memoryview(t.contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()


# -- messages over a channel -----------------------------------------------------------------------
def pack(secret: bytes, key: str, obj) -> tuple[bytes, list[torch.Tensor]]:
    """(signed header, payload tensors) of `obj` as the message under `key` (module docstring)."""
    tree, payload = encode(obj)
    specs = [[NAMES[t.dtype], t.numel()] for t in payload]
    body = {"key": key, "tree": tree, "specs": specs, "sha256": digest(payload)}
    return sign(secret, body), payload


def send_packed(channel, header: bytes, payload: list[torch.Tensor]) -> None:
    channel.send(torch.tensor([len(header)], dtype=torch.int64))
    channel.send(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for t in payload:
        channel.send(t)


def send(channel, secret: bytes, key: str, obj) -> None:
    """`obj` as one message under `key` over `channel` (its send(tensor) / recv(tensor))."""
    send_packed(channel, *pack(secret, key, obj))


def recv(channel, secret: bytes, key: str, max_bytes: int | None = None):
    """The object of the message under `key`; Refused before anything is used when its
    header is not the run's or its payload does not match it."""
    size = torch.zeros(1, dtype=torch.int64)
    channel.recv(size)
    n = int(size[0])
    if not 66 <= n <= MAX_HEADER_BYTES:
        raise Refused(f"{key}: a header of {n} bytes")
    raw = torch.empty(n, dtype=torch.uint8)
    channel.recv(raw)
    body = verify(secret, raw.numpy().tobytes(), key)
    specs = body.get("specs")
    if not isinstance(specs, list) or len(specs) != 3:
        raise Refused(f"{key}: no payload list")
    total, payload = 0, []
    for spec in specs:
        ok = isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES
        if not ok or type(spec[1]) is not int or spec[1] < 0:
            raise Refused(f"{key}: a malformed payload entry {str(spec)[:80]}")
        t = torch.empty(spec[1], dtype=DTYPES[spec[0]])
        total += t.numel() * t.element_size()
        if max_bytes is not None and total > max_bytes:
            raise Refused(f"{key}: a payload over {max_bytes} bytes")
        payload.append(t)
    for i, dtype in enumerate((torch.int64, torch.float64, torch.uint8)):
        if payload[i].dtype != dtype:
            raise Refused(f"{key}: payload {i} is {payload[i].dtype}, not {dtype}")
    for t in payload:
        channel.recv(t)
    if not hmac.compare_digest(digest(payload), str(body.get("sha256"))):
        raise Refused(f"{key}: the payload does not match its signed digest")
    return decode(body.get("tree"), payload)


class PairChannel:
    """Point-to-point sends and receives with one peer of a process group (gloo: CPU tensors)."""

    def __init__(self, pg, peer: int, tag: int = 0):
        self.pg, self.peer, self.tag = pg, peer, tag

    def send(self, t: torch.Tensor) -> None:
        self.pg.send([t], self.peer, self.tag).wait()

    def recv(self, t: torch.Tensor) -> None:
        self.pg.recv([t], self.peer, self.tag).wait()
