"""Asynchronous RL's pieces that need no launch (prorl/async_rl/): the settings' checks against the world,
the split of a step's groups between rollout and trainer ranks, the weight checksum and its check, and the
async metrics. The multi-rank runs are tests/preset/test_async.py."""

import pytest
import torch
from prorl.kernels import ppo_loss

from prorl.algorithm import importance_weights
from prorl.async_rl import transport
from prorl.async_rl.remote import RemoteRollouts
from prorl.async_rl.roles import check_async
from prorl.async_rl.worker import slices
from prorl.config import ConfigError, load_config
from prorl.metrics import async_metrics
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
