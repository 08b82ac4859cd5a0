"""Asynchronous RL's pieces that need no launch (prorl/async_rl/): the settings' checks against the world,
the split of a step's groups between rollout and trainer ranks, the weight checksum and its check, and the
async metrics. The multi-rank runs are tests/preset/test_async.py."""

import time

import pytest
import torch
from prorl.kernels import ppo_loss

from prorl.algorithm import importance_weights
from prorl.async_rl import transport
from prorl.async_rl.remote import RemoteRollouts
from prorl.async_rl.roles import check_async
from prorl.async_rl.worker import slices
from prorl.config import ConfigError, load_config
from prorl.metrics import StepAccumulator, async_metrics
from prorl.sampling import Group


def cfg(*overrides):
    return load_config("default", list(overrides))


def test_the_async_keys_are_spelt_async_on_the_command_line():
    c = cfg("rollout.async.steps_ahead=2", "rollout.async.rollout_ranks=3")
    assert (c.rollout.async_rl.steps_ahead, c.rollout.async_rl.rollout_ranks) == (2, 3)
    assert cfg().rollout.async_rl.steps_ahead == 0  # the synchronous step by default


@pytest.mark.parametrize(
    "overrides, world, torchrun, words",
    [
        (["rollout.async.steps_ahead=1"], 1, False, "launch with torchrun"),
        (["rollout.async.steps_ahead=1"], 2, True, None),
        (["rollout.async.steps_ahead=1", "rollout.async.rollout_ranks=2"], 2, True, "no trainer rank"),
        (["rollout.async.steps_ahead=1", "trainer.prompts_per_step=8"], 4, True, "3 trainer ranks"),
        (["rollout.async.steps_ahead=1", "rollout.async.rollout_ranks=3", "trainer.prompts_per_step=8"],
         4, True, "3 rollout ranks"),
        (["rollout.async.steps_ahead=1", "rollout.tensor_parallel_size=2"], 2, True, "parallel_size>1"),
        (["rollout.async.steps_ahead=-1"], 2, True, "must be >= 0"),
        (["rollout.async.rollout_ranks=5"], 2, True, None),  # steps_ahead=0: the setting is unused
    ],
)  # fmt: skip
def test_settings_checked_against_the_world(overrides, world, torchrun, words):
    c = cfg(*overrides)
    if words is None:
        check_async(c, world, torchrun)
        return
    with pytest.raises(ConfigError, match=words):
        check_async(c, world, torchrun)


@pytest.mark.parametrize(
    "pps, trainers, rollouts", [(8, 1, 1), (8, 2, 1), (8, 1, 2), (8, 2, 2), (12, 3, 2), (12, 2, 3)]
)
def test_slices_give_every_position_to_one_trainer(pps, trainers, rollouts):
    # the rule: position p of the step's groups is sampled by rollout p // (pps / rollouts) and trained
    # by trainer p // (pps / trainers)
    expected: dict[tuple[int, int], list[int]] = {}
    for p in range(pps):
        j, t = p // (pps // rollouts), p // (pps // trainers)
        expected.setdefault((j, t), []).append(p - j * (pps // rollouts))
    got = {(j, t): list(range(lo, hi)) for j, t, lo, hi in slices(pps, trainers, rollouts)}
    assert got == expected


def test_checksum_tells_versions_apart():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    same = [t.clone() for t in a]
    assert transport.same_checksum(transport.checksum(a), transport.checksum(same))
    step = [a[0].clone(), a[1] + 1e-3 * torch.randn(7, generator=gen)]  # one small update of one tensor
    assert not transport.same_checksum(transport.checksum(a), transport.checksum(step))
    swapped = [a[0].flip(0), a[1]]  # the same values in other places
    assert not transport.same_checksum(transport.checksum(a), transport.checksum(swapped))
    bf16 = [t.bfloat16() for t in a]  # what travels in model.dtype=bfloat16
    assert transport.same_checksum(transport.checksum(bf16), transport.checksum([t.clone() for t in bf16]))


def test_a_batch_sampled_with_other_weights_than_it_reports_is_refused():
    remote = RemoteRollouts.__new__(RemoteRollouts)  # only the record of checksums is needed
    weights = [torch.arange(6.0)]
    remote.checksums = {3: transport.checksum(weights)}
    remote._check_weights(3, transport.checksum(weights), "groups of step 4")
    with pytest.raises(transport.RolloutLost, match="not version 3"):
        remote._check_weights(3, transport.checksum([weights[0] + 1]), "groups of step 4")
    with pytest.raises(transport.RolloutLost, match="not version 2"):  # a version never pushed
        remote._check_weights(2, transport.checksum(weights), "groups of step 4")


def test_async_metrics_from_the_sums():
    sums = {"async_staleness": 5.0, "async_groups": 4.0, "async_queue_groups": 8.0}
    extrema = {"async_staleness": 2.0, "async_wait_trainer": 0.25}
    out = async_metrics((sums, extrema, {}))
    assert out == {
        "async/staleness/mean": 5.0 / 4.0,
        "async/staleness/max": 2.0,
        "async/queue_groups": 8.0,
        "timing_s/wait_trainer": 0.25,
    }


def test_bucket_layout_splits_at_the_bucket_size(monkeypatch):
    monkeypatch.setattr(transport, "BUCKET_BYTES", 64)
    named = [("a", torch.zeros(8)), ("b", torch.zeros(8)), ("c", torch.zeros(40)), ("d", torch.zeros(2))]
    layout = transport.bucket_layout(named)  # fp32: 32 + 32 bytes fit one bucket; 160 bytes go alone
    assert [[name for name, *_ in bucket] for bucket in layout] == [["a", "b"], ["c"], ["d"]]


def test_icepop_with_pi_old_as_proximal_policy_is_areals_decoupled_objective():
    """AReaL's decoupled PPO loss (its `ppo_actor_loss_fn` with `use_decoupled_loss`), written out in
    float64: r = pi / pi_prox, loss_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) x w, with the
    behaviour weight w = pi_prox / pi_behav set to 0 where it exceeds the cap, averaged over the valid
    tokens. prorl's loss with pi_old as the proximal policy, the sampler as the behaviour policy and
    `is_mode=icepop`, `is_bounds=(0, cap)` must equal it, value and gradient."""
    gen = torch.Generator().manual_seed(3)
    n, cap, eps_low, eps_high = 64, 2.0, 0.2, 0.28
    prox = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    behav = prox + 0.8 * torch.randn(n, generator=gen, dtype=torch.float64)  # some weights above the cap
    logp = (prox + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = torch.rand(n, generator=gen) > 0.2

    w = torch.exp(prox - behav)
    assert (w > cap).any() and (w <= cap).any()
    r = torch.exp(logp - prox)
    per_token = torch.maximum(-adv * r, -adv * r.clamp(1 - eps_low, 1 + eps_high))
    expected = (per_token * torch.where(w <= cap, w, 0.0))[mask].sum() / mask.sum()
    (grad_expected,) = torch.autograd.grad(expected, logp)

    loss, _ = ppo_loss(
        logp, prox, adv, mask, eps_low=eps_low, eps_high=eps_high,
        is_weights=importance_weights(prox, behav), is_mode="icepop", is_bounds=(0.0, cap),
        agg="token-mean", backend="torch",
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-12, atol=1e-12)


def test_a_config_file_may_spell_the_section_async(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: /m}\nrollout:\n  n: 4\n  async: {steps_ahead: 2, rollout_ranks: 2}\n")
    c = load_config(str(path))
    assert (c.rollout.n, c.rollout.async_rl.steps_ahead, c.rollout.async_rl.rollout_ranks) == (4, 2, 2)
    path.write_text("rollout:\n  async:\n    steps_ahead: 2\n  async_rl:\n    steps_ahead: 1\n")
    with pytest.raises(ConfigError, match="both rollout.async and rollout.async_rl"):
        load_config(str(path))


class _Store:
    """The store's set/check/get as a dict (transport.put / take)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        del self.data[key]


class _Sampler:
    """GroupSampler's surface that RolloutWorker.produce uses; records the budget it is given."""

    def __init__(self, carry):
        self.carry, self.reward_time, self.calls = carry, 0.0, []

    def collect(self, need, max_new, step, acc):
        self.calls.append((need, max_new, step))
        kept = [*self.carry, *[Group(100 + i, [1], [[2]], [[-0.5]], [False]) for i in range(need)]][:need]
        self.carry = []
        return kept

    def state_dict(self):
        return {"data_order": [7]}


def _worker(step_version: int, carry, schedule):
    from types import SimpleNamespace

    from prorl.async_rl.worker import RolloutWorker

    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = cfg("rollout.async.steps_ahead=1", "trainer.prompts_per_step=4", "rollout.max_response_tokens=40")
    w.cfg.rollout.max_response_schedule = schedule
    w.roles = SimpleNamespace(index=0, rollouts=1, trainers=2, store=_Store())
    w.weights = SimpleNamespace(version=step_version, checksum=1.5)
    w.sampler, w.engine_check = _Sampler(carry), None
    w.slices = [s for s in slices(4, 2, 1) if s[0] == 0]
    return w


def test_a_rollout_samples_with_the_budget_of_the_step_that_trains_the_batch():
    w = _worker(2, [], {3: 20})
    w.produce(3, waited=0.0)  # sampled with version 2, trained at step 3: step 3's budget
    w.produce(4, waited=0.0)
    assert [c[1] for c in w.sampler.calls] == [20, 20]
    w = _worker(2, [], {4: 20})
    w.produce(3, waited=0.0)
    assert w.sampler.calls[0][1] == 40


def test_a_carried_group_older_than_the_bound_is_dropped_and_counted():
    old = Group(5, [1], [[2]], [[-0.5]], [False], version=0, uid="0/0/9")
    fresh = Group(6, [1], [[2]], [[-0.5]], [False], version=1, uid="1/0/9")
    w = _worker(1, [old, fresh], {})
    w.produce(2, waited=0.25)  # k = 1: version 0 would be 2 updates old at step 2, version 1 is 1
    first = transport.take(w.roles.store, "batch/2/0/0", 1.0, "batch")
    second = transport.take(w.roles.store, "batch/2/0/1", 1.0, "batch")
    trained = first["groups"] + second["groups"]
    assert [g.uid for g in trained][:1] == ["1/0/9"] and "0/0/9" not in [g.uid for g in trained]
    assert first["sums"]["groups_dropped"] == 1 and "sums" not in second  # metrics travel once
    assert [g.version for g in trained] == [1, 1, 1, 1]  # the fresh carry's own, then this version's
    assert first["version"] == 1 and first["checksum"] == 1.5 and first["waited"] == 0.25


class _BlockingGroup:
    """A push group whose broadcasts wait until `release` is set (a rollout rank still generating)."""

    def __init__(self):
        import threading

        self.release, self.sent = threading.Event(), []

    def broadcast(self, tensors, opts):
        group = self

        class Work:
            def wait(self):
                group.release.wait(10)
                group.sent.append(tensors[0].clone())

        return Work()


def test_a_push_costs_the_trainer_the_copy_only_and_the_newest_version_wins():
    import time

    store, pg = _Store(), _BlockingGroup()
    pusher = transport.WeightPusher(store, pg)
    weights = {v: [("w", torch.full((4,), float(v)))] for v in range(4)}
    t0 = time.perf_counter()
    pusher.stage(0, weights[0], extra={0: "resume state"})  # the push thread blocks in its broadcast
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


def test_each_side_times_out_on_its_own_world_and_the_push_on_every_round():
    """collective_timeout_s's documented rule: 600 s + 0.1 s per response token + ceil(round samples /
    reward workers) x reward.timeout_s, a round being ceil(prompts per rank x oversample) x rollout.n."""
    import math

    from prorl.async_rl.roles import timeouts

    c = cfg(
        "trainer.prompts_per_step=48", "rollout.n=4", "rollout.max_response_tokens=1000",
        "reward.num_workers=2", "reward.timeout_s=10", "algorithm.dynamic_sampling=true",
        "algorithm.oversample=1.5", "algorithm.max_rounds=5",
    )  # fmt: skip

    def rule(world):
        return 600 + 0.1 * 1000 + math.ceil(math.ceil(48 // world * 1.5) * 4 / 2) * 10

    got = timeouts(c, trainers=6, rollouts=2)
    assert got == {"train": rule(6), "rollout": rule(2), "step": 5 * rule(2)}
    assert rule(6) != rule(2)


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
    store, pg = _Store(), _BlockingGroup()  # the rollout is mid-step: the push thread blocks
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
    store = _Store()
    transport.put(store, "push/0", _header(0, layout))
    with pytest.raises(RuntimeError, match="closed by peer"):
        _receiver(store, _FailingGroup()).receive()
    pg = _FailingGroup(before=lambda: transport.put(store, transport.STOP_KEY, True))
    receiver = _receiver(store, pg)
    receiver.receive()
    assert receiver.stopped and pg.calls == 1


def test_a_heartbeat_that_stops_moving_is_a_lost_peer(monkeypatch):
    monkeypatch.setattr(transport.Liveness, "look_s", 0.0)
    store = _Store()
    never = transport.Liveness(store, "alive/rollout/0", "rollout rank 0", startup_s=0.2, stale_s=0.2)
    never.check("batch")  # still starting
    t0 = time.monotonic()
    with pytest.raises(transport.RolloutLost, match=r"rollout rank 0 sent no heartbeat .*\(never started\)"):
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
    """Validation, a checkpoint save or val_before_train before the next push: no timeout while trainer
    rank 0's heartbeat moves, however long (here 4 x the staleness and the start-up allowance)."""
    import threading

    monkeypatch.setattr(transport.Liveness, "look_s", 0.0)
    store = _Store()
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

    store = _Store()
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
    w.cfg = cfg("rollout.async.steps_ahead=1", "trainer.total_steps=3")
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
    """Every trainer records the checksum as the full tensors are gathered, none keeps a list of them;
    trainer 0's pusher receives them one at a time too."""
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
    store, pg = _Store(), _BlockingGroup()
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


def _remote(tmp_path, checksums, total_steps=10):
    from types import SimpleNamespace

    r = RemoteRollouts.__new__(RemoteRollouts)
    r.cfg = cfg(f"trainer.total_steps={total_steps}", "rollout.async.steps_ahead=1")
    r.roles, r.rank, r.k = SimpleNamespace(store=_Store()), 0, 1
    r.slices, r.timeout_s, r.alive = [(0, 0, 0, 2)], 1.0, []
    r.checksums, r.states, r.taken = checksums, {}, -1
    r.trace, r.pusher, r.heartbeat = str(tmp_path / "trace.jsonl"), None, None
    return r


def _batch(version, group_versions, checksum):
    groups = [
        Group(i, [1], [[2]], [[-0.5]], [False], version=v, uid=f"u{i}") for i, v in enumerate(group_versions)
    ]
    return {"groups": groups, "version": version, "checksum": checksum, "engine_rms": None}


@pytest.mark.parametrize(
    "version, group_versions, words",
    [
        (3, [3, 3], None),
        (3, [3, 2], "version 2"),  # a carried group 2 updates old at step 4 (k = 1)
        (3, [3, 5], "version 5"),  # a group from the future
        (2, [2, 2], "version 2"),  # the batch itself out of bound
        (3, [3, 3], "not version 3"),  # weights that are not the version reported
    ],
)
def test_take_refuses_a_batch_out_of_bound_or_with_other_weights(tmp_path, version, group_versions, words):
    weights = {v: [torch.full((3,), float(v))] for v in (2, 3)}
    sums = {v: transport.checksum(w) for v, w in weights.items()}
    r = _remote(tmp_path, dict(sums))
    reported = sums[version] + (1.0 if words == "not version 3" else 0.0)
    transport.put(r.roles.store, "batch/4/0/0", _batch(version, group_versions, reported))
    acc = StepAccumulator()
    if words is None:
        groups, _ = r.take(4, acc)
        assert [g.uid for g in groups] == ["u0", "u1"]
        return
    with pytest.raises(transport.RolloutLost, match=words):
        r.take(4, acc)


def test_the_rollouts_are_told_to_stop_once_the_last_batch_is_taken(tmp_path):
    store, pg = _Store(), _BlockingGroup()
    pg.release.set()
    r = _remote(tmp_path, {4: transport.checksum([])}, total_steps=6)
    r.roles.store, r.pusher = store, transport.WeightPusher(store, pg)
    transport.put(store, "batch/4/0/0", _batch(4, [4, 4], r.checksums[4]))
    r.take(4, StepAccumulator())
    assert not store.check([transport.STOP_KEY])  # step 5 of 6: more to come
    transport.put(store, "batch/5/0/0", _batch(4, [4, 4], r.checksums[4]))
    r.take(5, StepAccumulator())
    assert store.check([transport.STOP_KEY]) and transport.take(store, "push/0", 1.0, "stop")["stop"]


def test_a_vllm_engine_that_does_not_follow_the_push_is_a_lost_rollout():
    from types import SimpleNamespace

    from prorl.engine.rollout import StaleWeightsError

    from prorl.async_rl.worker import RolloutWorker

    class Engine:
        def calibrate(self, model):
            pass

        def update_weights(self, params, reference):
            raise StaleWeightsError("rms gap 0.3 after the sync")

    w = RolloutWorker.__new__(RolloutWorker)
    w.roles, w.generator, w.model = SimpleNamespace(index=1), Engine(), None
    w.weights = SimpleNamespace(receive=lambda: None, stopped=False, params={}, version=3)
    with pytest.raises(transport.RolloutLost, match="version 3: rms gap 0.3"):
        w.receive()


def test_a_rollout_hung_in_one_round_stops_its_heartbeat():
    """A round's generation (or scoring) running past one round's timeout stops the rollout's heartbeat
    (the trainers then end the run within HEARTBEAT_STALE_S, not after every round's timeout); rounds
    each within it do not."""
    seen = []

    class Sampler(_Sampler):
        def rollout(self, seconds):
            time.sleep(seconds)
            seen.append(w.healthy())

        def verify(self, groups, acc):
            pass

        def collect(self, need, max_new, step, acc):
            time.sleep(0.4)  # choosing prompts, a collective: the bound is timed from each call
            self.rollout(0.3)  # two rounds of 0.3 s each: within the 0.6 s bound
            self.rollout(0.3)
            self.rollout(1.2)  # a hung round
            return super().collect(need, max_new, step, acc)

    w = _worker(2, [], {})
    w.roles.timeout_s, w.sampler = 0.6, Sampler([])
    w.watch_sampler()
    w.produce(3, waited=0.0)
    assert seen == [True, True, False]
    time.sleep(0.7)
    assert w.healthy()  # between steps (waiting for a push): no round to time
    store, state = _Store(), {"ok": True}
    beat = transport.Heartbeat(store, "alive/rollout/0", every_s=0.01, healthy=lambda: state["ok"])
    time.sleep(0.2)
    state["ok"] = False
    time.sleep(0.05)
    stalled = transport.take(store, "alive/rollout/0", 1.0, "beat", delete=False)
    time.sleep(0.2)
    assert stalled > 0 and transport.take(store, "alive/rollout/0", 1.0, "beat") == stalled
    beat.stop()
