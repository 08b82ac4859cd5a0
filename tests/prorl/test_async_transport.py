"""Asynchronous RL's weight transport (prorl/async_rl/transport.py, `RemoteRollouts.push`): the
weight checksum and its check, the push buckets, the push thread (newest version wins, a stuck push,
a root that left), heartbeats and lost peers, push headers. The other async pieces are
tests/prorl/test_async_units.py."""

import time

import pytest
import torch
from async_fakes import BlockingGroup, Store

from prorl.async_rl import transport
from prorl.async_rl.remote import RemoteRollouts
from prorl.config import load_config


def cfg(*overrides):
    return load_config("default", list(overrides))


def test_checksum_tells_versions_apart():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    same = [t.clone() for t in a]
    assert transport.same_checksum(transport.checksum(a), transport.checksum(same))
    # one small update of one tensor
    step = [a[0].clone(), a[1] + 1e-3 * torch.randn(7, generator=gen)]
    assert not transport.same_checksum(transport.checksum(a), transport.checksum(step))
    swapped = [a[0].flip(0), a[1]]  # the same values in other places
    assert not transport.same_checksum(transport.checksum(a), transport.checksum(swapped))
    bf16 = [t.bfloat16() for t in a]  # what travels in model.dtype=bfloat16
    assert transport.same_checksum(
        transport.checksum(bf16), transport.checksum([t.clone() for t in bf16])
    )


def test_bucket_layout_splits_at_the_bucket_size(monkeypatch):
    monkeypatch.setattr(transport, "BUCKET_BYTES", 64)
    named = [
        ("a", torch.zeros(8)),
        ("b", torch.zeros(8)),
        ("c", torch.zeros(40)),
        ("d", torch.zeros(2)),
    ]
    # fp32: 32 + 32 bytes fit one bucket; 160 bytes go alone
    layout = transport.bucket_layout(named)
    assert [[name for name, *_ in bucket] for bucket in layout] == [["a", "b"], ["c"], ["d"]]


def test_a_push_costs_the_trainer_the_copy_only_and_the_newest_version_wins():
    import time

    store, pg = Store(), BlockingGroup()
    pusher = transport.WeightPusher(store, pg)
    weights = {v: [("w", torch.full((4,), float(v)))] for v in range(4)}
    t0 = time.perf_counter()
    # the push thread blocks in its broadcast
    pusher.stage(0, weights[0], extra={0: "resume state"})
    for _ in range(100):  # until the thread has announced push 0
        if store.check(["push/0"]):
            break
        time.sleep(0.01)
    pusher.stage(1, weights[1])
    pusher.stage(2, weights[2])  # replaces version 1, not sent yet
    assert time.perf_counter() - t0 < 2.0  # stage returned while the rollout rank was not listening
    pg.release.set()
    for _ in range(200):
        if store.check(["push/1"]) and len(pg.sent) == 2:
            break
        time.sleep(0.01)
    pusher.close()
    headers = [transport.take(store, f"push/{i}", 1.0, "push") for i in range(3)]
    assert [h["version"] for h in headers] == [0, 2, -1] and headers[2]["stop"]
    assert headers[0]["extra"] == {0: "resume state"} and headers[1]["extra"] is None
    sent = [b.view(torch.float32) for b in pg.sent]
    torch.testing.assert_close(sent, [weights[0][0][1], weights[2][0][1]], rtol=0, atol=0)


# -- the reviewer's findings (issue 27) ----------------------------------------------------------


class _FailingGroup:
    """A push group whose broadcast fails (the root left); `before` runs first."""

    def __init__(self, before=None):
        self.before, self.calls = before, 0

    def broadcast(self, tensors, opts):
        self.calls += 1
        if self.before is not None:
            self.before()
        raise RuntimeError("Connection closed by peer")


def _receiver(store, pg=None, startup_s=5.0, stale_s=5.0):
    model = torch.nn.Linear(2, 1, bias=False)
    return transport.WeightReceiver(store, pg, model, startup_s=startup_s, stale_s=stale_s)


def _header(version, layout=(), stop=False):
    return {"version": version, "stop": stop, "extra": None, "layout": list(layout)}


def test_a_stop_while_a_push_is_stuck_ends_the_rollout_cleanly():
    """SIGTERM while the rollout is mid-step: the trainer gives up on the stuck push and exits; the
    rollout then joins the announced push, finds its root gone, and stops (exit 0), as it stops at
    once when no push is announced."""
    store, pg = Store(), BlockingGroup()  # the rollout is mid-step: the push thread blocks
    pusher = transport.WeightPusher(store, pg)
    pusher.stage(0, [("weight", torch.zeros(1, 2))])
    for _ in range(100):
        if store.check(["push/0"]):
            break
        time.sleep(0.01)
    pusher.close(timeout_s=0.05)  # gives up on the stuck thread
    assert store.check([transport.STOP_KEY])
    failing = _FailingGroup()  # the trainer has exited: the broadcast breaks
    receiver = _receiver(store, failing)
    receiver.receive()
    assert receiver.stopped and failing.calls == 1
    pg.release.set()
    store.delete_key("push/0")
    receiver = _receiver(store, failing)
    receiver.receive()  # nothing announced: the stop key alone
    assert receiver.stopped and failing.calls == 1


def test_a_broadcast_whose_root_left_is_a_stop_only_when_the_trainers_said_stop():
    layout = [[("weight", (1, 2), torch.float32)]]
    store = Store()
    transport.put(store, "push/0", _header(0, layout))
    with pytest.raises(RuntimeError, match="closed by peer"):
        _receiver(store, _FailingGroup()).receive()
    pg = _FailingGroup(before=lambda: transport.put(store, transport.STOP_KEY, True))
    receiver = _receiver(store, pg)
    receiver.receive()
    assert receiver.stopped and pg.calls == 1


def test_a_heartbeat_that_stops_moving_is_a_lost_peer(monkeypatch):
    monkeypatch.setattr(transport.Liveness, "look_s", 0.0)
    store = Store()
    never = transport.Liveness(
        store, "alive/rollout/0", "rollout rank 0", startup_s=0.2, stale_s=0.2
    )
    never.check("batch")  # still starting
    t0 = time.monotonic()
    with pytest.raises(
        transport.RolloutLost, match=r"rollout rank 0 sent no heartbeat .*\(never started\)"
    ):
        transport.take(store, "batch/0/0/0", 30.0, "batch", alive=[never])
    assert time.monotonic() - t0 < 5.0  # not the 30 s bound
    beat = transport.Heartbeat(store, "alive/trainer", every_s=0.02)
    live = transport.Liveness(store, "alive/trainer", "trainer rank 0", startup_s=0.2, stale_s=0.2)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:  # three times the staleness: the counter moves
        live.check("push")
        time.sleep(0.01)
    beat.stop()
    with pytest.raises(transport.RolloutLost, match=r"trainer rank 0 sent no heartbeat .*\(dead\)"):
        while time.monotonic() - t0 < 5.0:
            live.check("push")
            time.sleep(0.01)


def test_a_rollout_waits_for_a_push_as_long_as_the_trainer_beats(monkeypatch):
    """Validation, a checkpoint save or val_before_train before the next push: no timeout while
    trainer rank 0's heartbeat moves, however long (here 4 x the staleness and the start-up
    allowance)."""
    import threading

    monkeypatch.setattr(transport.Liveness, "look_s", 0.0)
    store = Store()
    beat = transport.Heartbeat(store, "alive/trainer", every_s=0.02)
    timer = threading.Timer(0.8, lambda: transport.put(store, "push/0", _header(4)))
    timer.start()
    receiver = _receiver(store, startup_s=0.2, stale_s=0.2)
    receiver.receive()
    beat.stop()
    timer.join()
    assert receiver.version == 4 and not receiver.stopped


def test_push_headers_are_deleted_once_every_rollout_rank_took_them():
    from types import SimpleNamespace

    from prorl.async_rl.worker import RolloutWorker

    store = Store()
    for i, header in enumerate([_header(0), _header(1), _header(-1, stop=True)]):
        transport.put(store, f"push/{i}", header)
    receiver = _receiver(store)
    receiver.receive()
    receiver.receive()
    receiver.release()
    assert not store.check(["push/0"]) and not store.check(["push/1"]) and store.check(["push/2"])
    # the rollout loop releases them (rollout index 0, after the all-reduce of the announced pushes)
    for i, header in enumerate([_header(0), _header(1), _header(-1, stop=True)]):
        transport.put(store, f"push/{i}", header)
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = cfg("rollout.async_rl.steps_ahead=1", "trainer.total_steps=3")
    w.roles = SimpleNamespace(index=0, rollouts=1, trainers=1, store=store)
    w.weights, w.generator = _receiver(store), object()
    w.produce = lambda step, waited: None
    assert w.run() == 0
    assert not store.check(["push/0"])


def test_checksum_is_the_position_weighted_float64_sum_in_chunks(monkeypatch):
    monkeypatch.setattr(transport, "CHECKSUM_CHUNK", 700)
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(50, 50, generator=gen), torch.randn(3, generator=gen).bfloat16()]
    expected = 0.0
    for i, t in enumerate(tensors):  # the rule, element by element position: p % 1009 + 1 + i
        flat = t.reshape(-1).double()
        expected += sum(float(x) * (p % 1009 + 1 + i) for p, x in enumerate(flat.tolist()))
    assert transport.same_checksum(transport.checksum(tensors), expected)


def test_a_push_holds_one_full_tensor_at_a_time(monkeypatch):
    """Every trainer records the checksum as the full tensors are gathered, none keeps a list of
    them; trainer 0's pusher receives them one at a time too."""
    import gc
    import weakref

    from prorl.async_rl import remote as remote_module

    alive, made = [], []

    def full_tensors(policy, dtype):
        for i in range(6):
            gc.collect()
            alive.append(sum(r() is not None for r in made))
            t = torch.full((4,), float(i))
            made.append(weakref.ref(t))
            yield f"w{i}", t

    monkeypatch.setattr(remote_module, "iter_full_tensors", full_tensors)
    r = RemoteRollouts.__new__(RemoteRollouts)
    r.k, r.checksums, r.pusher = 1, {}, None
    r.push(None, torch.float32, 3)
    assert max(alive) <= 1  # at most the previous tensor, still bound while the next is made
    reference = transport.checksum([torch.full((4,), float(i)) for i in range(6)])
    assert transport.same_checksum(r.checksums[3], reference)
    store, pg = Store(), BlockingGroup()
    pg.release.set()
    r.pusher, alive[:], made[:] = transport.WeightPusher(store, pg), [], []
    r.push(None, torch.float32, 4)
    assert max(alive) <= 1
    for _ in range(200):  # until the push thread has sent it
        if pg.sent:
            break
        time.sleep(0.01)
    r.pusher.close()
    sent = pg.sent[0].view(torch.float32)
    torch.testing.assert_close(sent, torch.arange(6.0).repeat_interleave(4), rtol=0, atol=0)
