"""Asynchronous RL's weight transport (prorl/async_rl/transport.py, `RemoteRollouts.push`): the
weight checksum and its check, the push buckets, the push thread (newest version wins, a stuck push,
a root that left), heartbeats and lost peers, push headers. The other async pieces are
tests/prorl/test_async_units.py."""

import time

import pytest
import torch
from async_fakes import SECRET, BlockingGroup, ReplayGroup, Store

from prorl.async_rl import push, transport, wire
from prorl.async_rl.push import WeightPusher, WeightReceiver
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


def _wait(cond, seconds=5.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < seconds:
        time.sleep(0.01)


def _pushed(pushes, close=True):
    """(store, what the root broadcast) of trainer rank 0's pushes [(version, named, extra)]."""
    store, pg = Store(), BlockingGroup()
    pg.release.set()
    pusher = WeightPusher(store, pg, SECRET)
    for version, named, extra in pushes:
        n = pusher.sent
        pusher.stage(version, named, extra=extra, checksum_of=lambda n=named: _sum(n))
        _wait(lambda n=n: pusher.sent > n and pusher.slot is None)
        _wait(lambda: pusher.free)  # its broadcasts done
        pusher.free.clear()
    if close:
        pusher.close()
    return store, pg.sent


def _sum(named):
    return transport.checksum([t for _, t in named])


def test_a_push_travels_in_aligned_buckets_and_loads_into_the_model(monkeypatch):
    monkeypatch.setattr(push, "BUCKET_BYTES", 128)
    gen = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(8, generator=gen)),
        ("b", torch.randn(2, 4, generator=gen)),
        ("c", torch.randn(40, generator=gen)),
        ("d", torch.randn(2, generator=gen)),
    ]
    store, sent = _pushed([(3, named, {0: {"data_order": [5, 1]}})])
    # fp32, 64-byte aligned: 32 + 32 bytes fit one 128-byte bucket; 160 bytes go alone
    assert [t.numel() for t in sent[5:]] == [128, 192, 64]
    model = torch.nn.Module()
    for name, t in named:
        model.register_buffer(name, torch.zeros_like(t))
    receiver = WeightReceiver(store, ReplayGroup(sent), model, SECRET, startup_s=5.0)
    receiver.receive()
    for name, t in named:
        torch.testing.assert_close(getattr(model, name), t, rtol=0, atol=0)
    assert receiver.version == 3 and receiver.extra == {0: {"data_order": [5, 1]}}
    receiver.receive()
    assert receiver.stopped


def test_a_push_costs_the_trainer_the_copy_only_and_the_newest_version_wins():
    store, pg = Store(), BlockingGroup()
    pusher = WeightPusher(store, pg, SECRET)
    weights = {v: [("w", torch.full((4,), float(v)))] for v in range(4)}
    t0 = time.perf_counter()
    # the push thread blocks in its broadcast
    pusher.stage(0, weights[0], extra={0: {"resume": 1}})
    _wait(lambda: store.check(["push/0"]))
    pusher.stage(1, weights[1])
    pusher.stage(2, weights[2])  # replaces version 1, not sent yet
    assert time.perf_counter() - t0 < 2.0  # stage returned while the rollout rank was not listening
    pg.release.set()
    _wait(lambda: store.check(["push/1"]) and len(pg.sent) == 12)
    pusher.close()
    model = torch.nn.Module()
    model.register_buffer("w", torch.zeros(4))
    receiver = WeightReceiver(store, ReplayGroup(pg.sent), model, SECRET, startup_s=5.0)
    receiver.receive()
    assert receiver.version == 0 and receiver.extra == {0: {"resume": 1}}
    torch.testing.assert_close(model.w, weights[0][0][1], rtol=0, atol=0)
    receiver.receive()
    assert receiver.version == 2 and receiver.extra == {0: {"resume": 1}}  # from push 0
    torch.testing.assert_close(model.w, weights[2][0][1], rtol=0, atol=0)
    receiver.receive()
    assert receiver.stopped


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
    return WeightReceiver(store, pg, model, SECRET, startup_s=startup_s, stale_s=stale_s)


def _ticket(store, n, stop=False):
    store.set(f"push/{n}", wire.ticket(SECRET, f"push/{n}", stop=stop))


def test_a_stop_while_a_push_is_stuck_ends_the_rollout_cleanly():
    """SIGTERM while the rollout is mid-step: the trainer gives up on the stuck push and exits; the
    rollout then joins the announced push, finds its root gone, and stops (exit 0), as it stops at
    once when no push is announced."""
    store, pg = Store(), BlockingGroup()  # the rollout is mid-step: the push thread blocks
    pusher = WeightPusher(store, pg, SECRET)
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
    store = Store()
    _ticket(store, 0)
    with pytest.raises(RuntimeError, match="closed by peer"):
        _receiver(store, _FailingGroup()).receive()
    stop = wire.ticket(SECRET, transport.STOP_KEY)
    pg = _FailingGroup(before=lambda: store.set(transport.STOP_KEY, stop))
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
        transport.wait_ready(store, "batch/0/0/0", 30.0, "batch", alive=[never])
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
    pushed, sent = _pushed([(4, [("weight", torch.ones(1, 2))], None)], close=False)
    store = Store()
    beat = transport.Heartbeat(store, "alive/trainer", every_s=0.02)
    timer = threading.Timer(0.8, lambda: store.set("push/0", pushed.get("push/0")))
    timer.start()
    receiver = _receiver(store, ReplayGroup(sent), startup_s=0.2, stale_s=0.2)
    receiver.receive()
    beat.stop()
    timer.join()
    assert receiver.version == 4 and not receiver.stopped


def test_push_headers_are_deleted_once_every_rollout_rank_took_them():
    from types import SimpleNamespace

    from prorl.async_rl.worker import RolloutWorker

    one = [("weight", torch.ones(1, 2))]
    store, sent = _pushed([(0, one, None), (1, one, None)])
    receiver = _receiver(store, ReplayGroup(sent))
    receiver.receive()
    receiver.receive()
    receiver.release()
    assert not store.check(["push/0"]) and not store.check(["push/1"]) and store.check(["push/2"])
    # the rollout loop releases them (rollout index 0, after the all-reduce of the announced pushes)
    store, sent = _pushed([(0, one, None), (1, one, None)])
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = cfg("rollout.async_rl.steps_ahead=1", "trainer.total_steps=3")
    w.roles = SimpleNamespace(index=0, rollouts=1, trainers=1, store=store)
    w.weights, w.generator = _receiver(store, ReplayGroup(sent)), object()
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
    r.pusher, alive[:], made[:] = WeightPusher(store, pg, SECRET), [], []
    r.push(None, torch.float32, 4)
    assert max(alive) <= 1
    _wait(lambda: len(pg.sent) == 6)  # until the push thread has sent it
    r.pusher.close()
    sent = (
        pg.sent[5][: 6 * 64].view(torch.float32).view(6, 16)[:, :4].reshape(-1)
    )  # 64-byte aligned
    torch.testing.assert_close(sent, torch.arange(6.0).repeat_interleave(4), rtol=0, atol=0)


@pytest.mark.tally("attacks")
def test_weights_changed_on_the_way_are_refused_before_sampling():
    """The push's buckets are checked against the trainers' signed checksum once loaded: a bucket
    altered after the header was signed stops the rollout (Refused: exit 8)."""
    named = [("weight", torch.ones(1, 2))]
    store, sent = _pushed([(0, named, None)])
    sent[5] = sent[5].clone()
    sent[5][:8].view(torch.float32)[1] = 3.0  # the second weight, 1.0 -> 3.0
    receiver = _receiver(store, ReplayGroup(sent))
    with pytest.raises(wire.Refused, match="push/0: the weights received .* not the version 0"):
        receiver.receive()


def test_host_buckets_are_allocated_once_and_the_last_one_at_its_size(monkeypatch):
    monkeypatch.setattr(push, "BUCKET_BYTES", 1024)
    made, host_bucket = [], push._host_bucket
    monkeypatch.setattr(push, "_host_bucket", lambda n: made.append(n) or host_bucket(n))
    store, pg = Store(), BlockingGroup()
    pg.release.set()
    pusher = WeightPusher(store, pg, SECRET)
    named = [("a", torch.zeros(200)), ("b", torch.zeros(50)), ("c", torch.zeros(3))]
    for v in range(3):
        pusher.stage(v, [(n, t + v) for n, t in named])
        _wait(lambda v=v: pusher.sent > v and pusher.free)
    pusher.close()
    # fp32, 64-byte aligned: a (800 -> 832 bytes) alone in a 1024-byte bucket; b (200 -> 256) and
    # c (12 -> 64) in a second, then trimmed to its 320 bytes; nothing allocated after push 0
    assert made == [1024, 1024, 320]
    assert [b.numel() for b in pusher.free[0]] == [1024, 320]


@pytest.mark.tally("attacks")
def test_a_push_of_an_older_version_than_the_rollout_holds_is_refused():
    named = [("weight", torch.ones(1, 2))]
    store, sent = _pushed([(3, named, None), (2, named, None)])
    receiver = _receiver(store, ReplayGroup(sent))
    receiver.receive()
    with pytest.raises(wire.Refused, match="push/1: version 2 after version 3"):
        receiver.receive()
