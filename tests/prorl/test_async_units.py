"""Asynchronous RL's pieces that need no launch (prorl/async_rl/): the settings' checks against the
world, the split of a step's groups between rollout and trainer ranks, the rollout worker's budget
and carry, the trainer's checks of what it takes, and the async metrics. The weight transport is
tests/prorl/test_async_transport.py; the multi-rank runs are tests/preset/test_async.py."""

import dataclasses
import time

import pytest
import torch
from async_fakes import SECRET, BlockingGroup, LoopChannel, Store
from prorl.kernels import ppo_loss

from prorl.algorithm import importance_weights
from prorl.async_rl import transport, wire
from prorl.async_rl.push import WeightPusher
from prorl.async_rl.remote import RemoteRollouts, check_batch
from prorl.async_rl.roles import check_async, slices
from prorl.config import ConfigError, load_config
from prorl.metrics import StepAccumulator, async_metrics
from prorl.sampling import Group


def cfg(*overrides):
    return load_config("default", list(overrides))


def test_the_async_keys_are_spelt_async_on_the_command_line():
    c = cfg("rollout.async_rl.steps_ahead=2", "rollout.async_rl.rollout_ranks=3")
    assert (c.rollout.async_rl.steps_ahead, c.rollout.async_rl.rollout_ranks) == (2, 3)
    assert cfg().rollout.async_rl.steps_ahead == 0  # the synchronous step by default


@pytest.mark.parametrize(
    "overrides, world, torchrun, words",
    [
        (["rollout.async_rl.steps_ahead=1"], 1, False, "launch with torchrun"),
        (["rollout.async_rl.steps_ahead=1"], 2, True, None),
        (["rollout.async_rl.steps_ahead=1", "rollout.async_rl.rollout_ranks=2"], 2, True,
         "no trainer rank"),
        (["rollout.async_rl.steps_ahead=1", "trainer.prompts_per_step=8"], 4, True,
         "3 trainer ranks"),
        (["rollout.async_rl.steps_ahead=1", "rollout.async_rl.rollout_ranks=3",
          "trainer.prompts_per_step=8"], 4, True, "3 rollout ranks"),
        (["rollout.async_rl.steps_ahead=1", "rollout.tensor_parallel_size=2"], 2, True,
         "parallel_size>1"),
        (["rollout.async_rl.steps_ahead=-1"], 2, True, "must be >= 0"),
        # steps_ahead=0: the setting is unused
        (["rollout.async_rl.rollout_ranks=5"], 2, True, None),
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
    # the rule: position p of the step's groups is sampled by rollout p // (pps / rollouts) and
    # trained by trainer p // (pps / trainers)
    expected: dict[tuple[int, int], list[int]] = {}
    for p in range(pps):
        j, t = p // (pps // rollouts), p // (pps // trainers)
        expected.setdefault((j, t), []).append(p - j * (pps // rollouts))
    got = {(j, t): list(range(lo, hi)) for j, t, lo, hi in slices(pps, trainers, rollouts)}
    assert got == expected


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


def test_icepop_with_pi_old_as_proximal_policy_is_areals_decoupled_objective():
    """AReaL's decoupled PPO loss (its `ppo_actor_loss_fn` with `use_decoupled_loss`), written out
    in float64: r = pi / pi_prox, loss_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) x w,
    with the behaviour weight w = pi_prox / pi_behav set to 0 where it exceeds the cap, averaged
    over the valid tokens. prorl's loss with pi_old as the proximal policy, the sampler as the
    behaviour policy and `is_mode=icepop`, `is_bounds=(0, cap)` must equal it, value and
    gradient."""
    gen = torch.Generator().manual_seed(3)
    n, cap, eps_low, eps_high = 64, 2.0, 0.2, 0.28
    prox = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    # some weights above the cap
    behav = prox + 0.8 * torch.randn(n, generator=gen, dtype=torch.float64)
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
    path.write_text(
        "model: {path: /m}\nrollout:\n  n: 4\n  async: {steps_ahead: 2, rollout_ranks: 2}\n"
    )
    c = load_config(str(path))
    assert (c.rollout.n, c.rollout.async_rl.steps_ahead, c.rollout.async_rl.rollout_ranks) == (
        4,
        2,
        2,
    )
    path.write_text("rollout:\n  async:\n    steps_ahead: 2\n  async_rl:\n    steps_ahead: 1\n")
    with pytest.raises(ConfigError, match="both rollout.async and rollout.async_rl"):
        load_config(str(path))


class _Sampler:
    """GroupSampler's surface that RolloutWorker.produce uses; records the budget it is given."""

    def __init__(self, carry):
        self.carry, self.reward_time, self.calls = carry, 0.0, []

    def collect(self, need, max_new, step, acc):
        self.calls.append((need, max_new, step))
        kept = [*self.carry, *[Group(100 + i, [1], [[2]], [[-0.5]], [False]) for i in range(need)]][
            :need
        ]
        self.carry = []
        return kept

    def state_dict(self):
        return {"data_order": [7]}


def _worker(step_version: int, carry, schedule):
    from types import SimpleNamespace

    from prorl.async_rl.worker import RolloutWorker

    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg = cfg(
        "rollout.async_rl.steps_ahead=1",
        "trainer.prompts_per_step=4",
        "rollout.max_response_tokens=40",
    )
    w.cfg.rollout.max_response_schedule = schedule
    w.roles = SimpleNamespace(index=0, rollouts=1, trainers=2, store=Store(), secret=SECRET)
    w.roles.pairs = {(0, t): LoopChannel() for t in range(2)}
    w.weights = SimpleNamespace(version=step_version, checksum=1.5)
    w.sampler, w.engine_check = _Sampler(carry), None
    w.slices = [s for s in slices(4, 2, 1) if s[0] == 0]
    w.senders = {
        t: transport.BatchSender(w.roles.store, w.roles.pairs[0, t], SECRET) for t in range(2)
    }
    return w


def _taken(w, key, t):
    """The message a trainer takes from the worker's slice to trainer t (once sent)."""
    for _ in range(500):
        if w.senders[t].queue.empty():
            break
        time.sleep(0.01)
    time.sleep(0.05)
    return transport.take(w.roles.store, w.roles.pairs[0, t], SECRET, key, 1.0, "batch")


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
    first, second = _taken(w, "batch/2/0/0", 0), _taken(w, "batch/2/0/1", 1)
    trained = check_batch(first, 2, 1, "b0") + check_batch(second, 2, 1, "b1")
    assert [g.uid for g in trained][:1] == ["1/0/9"] and "0/0/9" not in [g.uid for g in trained]
    assert first["sums"]["groups_dropped"] == 1 and "sums" not in second  # metrics travel once
    # the fresh carry's own, then this version's
    assert [g.version for g in trained] == [1, 1, 1, 1]
    assert first["version"] == 1 and first["checksum"] == 1.5 and first["waited"] == 0.25


# -- the reviewer's findings (issue 27) ----------------------------------------------------------


def test_each_side_times_out_on_its_own_world_and_the_push_on_every_round():
    """collective_timeout_s's documented rule: 600 s + 0.1 s per response token + ceil(round samples
    / reward workers) x reward.timeout_s, a round being ceil(prompts per rank x oversample) x
    rollout.n."""
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


def _remote(tmp_path, checksums, total_steps=10):
    from types import SimpleNamespace

    r = RemoteRollouts.__new__(RemoteRollouts)
    r.cfg = cfg(f"trainer.total_steps={total_steps}", "rollout.async_rl.steps_ahead=1")
    r.cfg.rollout.n = 1  # the stand-in groups hold one response
    r.roles = SimpleNamespace(store=Store(), pairs={(0, 0): LoopChannel()}, secret=SECRET)
    r.rank, r.k = 0, 1
    r.slices, r.timeout_s, r.alive = [(0, 0, 0, 2)], 1.0, []
    r.checksums, r.states, r.taken = checksums, {}, -1
    r.trace, r.pusher, r.heartbeat = str(tmp_path / "trace.jsonl"), None, None
    return r


def _batch(version, group_versions, checksum):
    groups = [
        dataclasses.asdict(Group(i, [1], [[2]], [[-0.5]], [False], version=v, uid=f"u{i}"))
        for i, v in enumerate(group_versions)
    ]
    return {"groups": groups, "version": version, "checksum": checksum, "engine_rms": None}


def _deliver(r, key, message):
    """What a rollout rank's BatchSender does: the ticket in the store, the message on the pair."""
    r.roles.store.set(key, wire.ticket(SECRET, key))
    wire.send(r.roles.pairs[0, 0], SECRET, key, message)


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
def test_take_refuses_a_batch_out_of_bound_or_with_other_weights(
    tmp_path, version, group_versions, words
):
    weights = {v: [torch.full((3,), float(v))] for v in (2, 3)}
    sums = {v: transport.checksum(w) for v, w in weights.items()}
    r = _remote(tmp_path, dict(sums))
    reported = sums[version] + (1.0 if words == "not version 3" else 0.0)
    _deliver(r, "batch/4/0/0", _batch(version, group_versions, reported))
    acc = StepAccumulator()
    if words is None:
        groups, _ = r.take(4, acc)
        assert [g.uid for g in groups] == ["u0", "u1"]
        return
    with pytest.raises(transport.RolloutLost, match=words):
        r.take(4, acc)


def test_the_rollouts_are_told_to_stop_once_the_last_batch_is_taken(tmp_path):
    store, pg = Store(), BlockingGroup()
    pg.release.set()
    r = _remote(tmp_path, {4: transport.checksum([])}, total_steps=6)
    r.roles.store, r.pusher = store, WeightPusher(store, pg, SECRET)
    _deliver(r, "batch/4/0/0", _batch(4, [4, 4], r.checksums[4]))
    r.take(4, StepAccumulator())
    assert not store.check([transport.STOP_KEY])  # step 5 of 6: more to come
    _deliver(r, "batch/5/0/0", _batch(4, [4, 4], r.checksums[4]))
    r.take(5, StepAccumulator())
    assert (
        store.check([transport.STOP_KEY])
        and wire.verify(SECRET, store.get("push/0"), "push/0")["stop"]
    )


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
    """A round's generation (or scoring) running past one round's timeout stops the rollout's
    heartbeat (the trainers then end the run within HEARTBEAT_STALE_S, not after every round's
    timeout); rounds each within it do not."""
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
    store, state = Store(), {"ok": True}
    beat = transport.Heartbeat(store, "alive/rollout/0", every_s=0.01, healthy=lambda: state["ok"])
    time.sleep(0.2)
    state["ok"] = False
    time.sleep(0.05)
    stalled = int(store.get("alive/rollout/0"))
    time.sleep(0.2)
    assert stalled > 0 and int(store.get("alive/rollout/0")) == stalled
    beat.stop()
