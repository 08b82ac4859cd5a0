"""What a process outside an asynchronous run that reaches the job's store can write there
(tests/preset/test_async_attacks.py): a forged batch header (FORGED uids, scores 1.0), a pickle that
runs code when loaded, another key's genuine value (a replay)."""

import datetime
import pickle

import torch.distributed as dist

from prorl.async_rl import wire

GUESS = b"not the run's secret, 32 bytes!!"


class Payload:
    """Unpickled, it creates `path`: code run in the process that loads it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def connect(port: int):
    """The run's async keys (prorl/async_rl/roles.py's prefix), a client of the attempt's store,
    found as every rank finds it: posted in torchrun's store (engine.distributed.attempt_store)."""
    timeout = datetime.timedelta(seconds=30)
    agents = dist.TCPStore("127.0.0.1", port, None, False, timeout)
    own_port = int(agents.get("prorl/attempt_store").decode().split(" ", 1)[0])
    base = dist.TCPStore("127.0.0.1", own_port, None, False, timeout)
    return dist.PrefixStore("prorl/async/", base)


def forged(key: str) -> bytes:
    uids = [f"FORGED-{i}" for i in range(4)]
    return wire.sign(GUESS, {"key": key, "groups": uids, "raw": [1.0] * 4})


def pickled(marker: str) -> bytes:
    return pickle.dumps({"groups": [Payload(marker)], "version": 0})
