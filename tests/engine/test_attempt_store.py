"""`attempt_store`: under torchrun the workers share the agents' store, which keeps a dead
attempt's keys after a `--max-restarts` restart. Rank 0 of each attempt starts a store of its own
and posts it; the other ranks must end up in that one, not in what a dead attempt posted (its port
refused, or a store still up that holds another nonce). The restart itself, two torchrun agents with
a killed worker: tests/prorl/test_train_faults.py."""

import datetime
import socket
import threading
import time

import torch.distributed as dist
from prorl.engine import distributed

TIMEOUT = datetime.timedelta(seconds=20)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_ranks_meet_in_the_store_rank_0_posted_this_attempt(monkeypatch):
    agents = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    # what the dead attempt left: first a port nothing listens on, then a live store of another
    # attempt (its rank 0 still shutting down)
    agents.set("prorl/attempt_store", f"{_dead_port()} dead-attempt")
    old = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    old.set("prorl/nonce", "old-attempt")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")

    def rendezvous(url, timeout):
        rank = 0 if threading.current_thread() is threading.main_thread() else 1
        client = dist.TCPStore("127.0.0.1", agents.port, 2, is_master=False, timeout=timeout)
        yield client, rank, 2

    monkeypatch.setattr(distributed.dist, "rendezvous", rendezvous)
    got = {}
    rank1 = threading.Thread(target=lambda: got.update(one=distributed.attempt_store(TIMEOUT)))
    rank1.start()
    time.sleep(4)  # rank 1 has met the refused port
    agents.set("prorl/attempt_store", f"{old.port} old-attempt-2")  # and now a live wrong one
    time.sleep(2)
    store0, rank0, world = distributed.attempt_store(TIMEOUT)
    rank1.join(timeout=30)
    store1, rank, _ = got["one"]
    assert (rank0, rank, world) == (0, 1, 2)
    assert store0.port == store1.port != old.port
    store0.set("this attempt", "here")
    assert store1.get("this attempt") == b"here"
    assert not old.check(["this attempt"])


def test_without_the_agents_store_the_env_store_is_used(monkeypatch):
    """Not under torchrun's shared store: rank 0 hosts the env:// store, fresh per process."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    mine = object()
    monkeypatch.setattr(distributed.dist, "rendezvous", lambda url, timeout: iter([(mine, 0, 1)]))
    assert distributed.attempt_store(TIMEOUT) == (mine, 0, 1)
