"""prorl.algorithm against the worked numbers of docs/recipe.md §5-§7."""

import math

import pytest
import torch

from prorl.algorithm import (
    ReferenceResetPolicy,
    cosine_length_eta,
    cosine_length_shaping,
    group_pass_counts,
    importance_weights,
    keep_groups,
    length_penalty_on,
    overlong_buffer_penalty,
    scheduled_value,
    stop_properly,
)
from prorl.metrics import StepAccumulator, step_metrics


def test_stop_properly_vector():
    raw = torch.tensor([1.0, 1.0, 0.0, 0.0])
    trunc = torch.tensor([False, True, False, True])
    assert stop_properly(raw, trunc).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert stop_properly(raw, trunc, c_stop=0.5).tolist() == [1.0, 0.5, 0.0, 0.0]


def test_stop_properly_never_raises_a_negative_reward():
    """verl-style scores (-1 wrong, +1 right): a truncated wrong answer keeps -1 (R * c_stop = 0
    would reward running out of length over answering wrong); a truncated right one gets R *
    c_stop."""
    raw = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    trunc = torch.tensor([True, True, False, False])
    assert stop_properly(raw, trunc).tolist() == [-1.0, 0.0, -1.0, 1.0]
    assert stop_properly(raw, trunc, c_stop=0.5).tolist() == [-1.0, 0.5, -1.0, 1.0]


def test_cosine_eta_vector():
    eta = cosine_length_eta(
        torch.tensor([0, 2048, 4096, 6144, 8192]), 8192, eta_min=-1.0, eta_max=0.0
    )
    torch.testing.assert_close(
        eta, torch.tensor([0.0, -0.1464, -0.5, -0.8536, -1.0]), atol=1e-4, rtol=0
    )


def test_schedule_on_off_vector():
    on = [s for s in range(1300) if length_penalty_on(s, 100, 500)]
    assert on == list(range(0, 100)) + list(range(600, 700)) + list(range(1200, 1300))
    assert not length_penalty_on(5, 0, 500) and length_penalty_on(10**6, 100, 0)


def test_cosine_shaping_skips_truncated_and_uses_wrong_eta():
    r = torch.tensor([1.0, 0.0, 1.0])
    lengths = torch.tensor([4096, 4096, 8192])
    trunc = torch.tensor([False, False, True])
    correct = torch.tensor([True, False, True])
    shaped, term = cosine_length_shaping(r, lengths, trunc, correct, max_len=8192, lam=0.5)
    torch.testing.assert_close(term, torch.tensor([-0.25, -0.25, 0.0]))
    # Demystifying-style: wrong answers on their own scale (-10 -> 0 here)
    _, term = cosine_length_shaping(
        r,
        lengths,
        trunc,
        correct,
        max_len=8192,
        lam=1.0,
        eta=(1.0, 2.0),
        wrong_eta=(-10.0, 0.0),
    )
    torch.testing.assert_close(term, torch.tensor([1.5, -5.0, 0.0]))


def test_overlong_buffer():
    p = overlong_buffer_penalty(torch.tensor([100, 3072, 3584, 4096, 5000]), 4096, 1024)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_keep_groups_is_per_group():
    # [1,0,0,0] keeps its lone correct answer (NeMo-RL's per-sample check would drop it)
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0.5, 0.5, 0.25, 0.5])
    groups = torch.arange(4).repeat_interleave(4)
    assert keep_groups(rewards, groups).tolist() == [True, False, False, True]
    acc = StepAccumulator()  # the sums GroupSampler.collect records, as the step's metrics
    for key, value in group_pass_counts(rewards, groups, 4).items():
        acc.sum(key, value)
    acc.sum("samples_seen", 16)  # GroupSampler.verify's count
    stats = step_metrics(acc.reduce())
    assert stats["dynamic_sampling/frac_all_correct"] == 0.25
    assert stats["dynamic_sampling/frac_all_wrong"] == 0.5  # groups 2 and 3 have no reward >= 1
    assert stats["dynamic_sampling/pass_rate"] == pytest.approx(5 / 16)


def test_reset_policy_interval_spike_stall_and_state():
    p = ReferenceResetPolicy(interval=300, kl_spike_factor=5.0, window=20)
    for step in range(1, 300):
        assert p.should_reset(step, 0.01) is None
    assert p.should_reset(300, 0.01) == "interval"
    p.record_reset(300)
    assert p.num_resets == 1 and p.last_reset_step == 300 and p.kl_history == []
    for step in range(301, 341):  # 20 warm-up steps after the reset, then the window fills
        assert p.should_reset(step, 0.01 if step > 320 else 1.0) is None
    assert p.should_reset(341, 0.049) is None  # below 5x the median
    assert p.should_reset(342, 0.06) == "kl_spike"
    q = ReferenceResetPolicy(interval=0, patience=2)
    q.observe_validation(0.5)
    q.observe_validation(0.4)
    assert q.should_reset(1, 0.0) is None
    q.observe_validation(0.5)
    assert q.should_reset(2, 0.0) == "stall"
    r = ReferenceResetPolicy(interval=300, kl_spike_factor=5.0, window=20)
    r.load_state_dict(p.state_dict())
    assert r == p
    # the state carries no settings: a resumed run's own config decides them
    s = ReferenceResetPolicy(interval=50)
    s.load_state_dict(p.state_dict())
    assert s.interval == 50 and s.num_resets == p.num_resets and s.kl_history == p.kl_history
    # an older checkpoint's saved setting: ignored
    s.load_state_dict({**p.state_dict(), "interval": 300})
    assert s.interval == 50
    with pytest.raises(KeyError):
        r.load_state_dict({"bogus": 1})


# The KL to the reference, steps 101-200 of a prolonged-benchmark run (full recipe, seed 1,
# 2026-12-01), logged right after a reference reset at step 100: the ordinary post-reset rise, then
# one real outlier.
POST_RESET_KL = [
    7.4e-07, 0.00012, 0.0002, 0.0002, 0.00047, 0.00011, 0.0018, 0.001, 0.00066, 0.0013, 0.00041,
    0.0014, 0.0021, 0.0028, 0.0003, 0.00067, 0.003, 0.0011, 0.0026, 0.015, 0.0016, 0.00094, 0.0038,
    0.00094, 0.0036, 0.012, 0.0052, 0.0017, 0.017, 0.002, 0.0049, 0.0026, 0.0039, 0.0023, 0.0078,
    0.0063, 0.0019, 0.0077, 0.0054, 0.0065, 0.0028, 0.015, 0.0029, 0.0035, 0.006, 0.0073, 0.002,
    0.0048, 0.0039, 0.009, 0.0037, 0.0032, 0.0044, 0.0093, 0.005, 0.012, 0.0058, 0.0053, 0.004,
    0.0047, 0.0046, 0.0071, 0.0087, 0.003, 0.0026, 0.0035, 0.003, 0.018, 0.0061, 0.0048, 0.023,
    0.0053, 0.006, 0.0076, 0.0074, 0.0056, 0.0028, 0.0042, 0.005, 0.0086, 0.012, 0.039, 0.0067,
    0.0063, 0.0037, 0.012, 0.015, 0.0041, 0.0091, 0.01, 0.0067, 0.0095, 0.0087, 0.012, 0.0052,
    0.005, 0.0059, 0.015, 0.0073, 0.0063,
]  # fmt: skip


def test_post_reset_rise_is_not_a_spike():
    """RECIPE.md section 7: spike = this step's KL > factor x the median of the last `window` steps.
    After a reset the KL restarts at 0 and rises (x10 over its first 25 steps here); a window of
    that rise must not make the rise itself a spike. The one outlier (0.039 at step 182, 6.5x the
    median of steps 162-181) still is one."""
    p = ReferenceResetPolicy(interval=0, kl_spike_factor=5.0, window=20)
    p.record_reset(100)
    fired = [s for s, kl in enumerate(POST_RESET_KL, 101) if p.should_reset(s, kl)]
    # the rule written out: a window of the 20 steps before, counting only steps more than 20
    # after the reset (steps 121-...); the median of an even window is the mean of its middle two
    want = []
    for i, kl in enumerate(POST_RESET_KL):
        history = POST_RESET_KL[20:i]  # steps 121 .. this one's predecessor
        if len(history) >= 20:
            middle = sorted(history[-20:])[9:11]
            if kl > 5.0 * (middle[0] + middle[1]) / 2:
                want.append(101 + i)
    assert fired == want == [182]


def test_kl_spike_needs_the_floor():
    """A 'spike' of noise near zero (KL ~1e-10 after a reset) is no reason to reset."""
    p = ReferenceResetPolicy(interval=0, kl_spike_factor=5.0, window=3, kl_floor=1e-4)
    for step in range(1, 7):  # 3 warm-up steps, then the window
        assert p.should_reset(step, 1e-10) is None
    assert p.should_reset(7, 1e-8) is None  # 100x the median, but below the floor
    assert p.should_reset(8, 1e-3) == "kl_spike"


def test_importance_weights_are_raw():
    """exp(old - sampler), unmodified: truncation and masking happen once, inside ppo_loss
    (is_mode)."""
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    sampler = torch.tensor([0.0, math.log(10.0), -math.log(10.0), math.log(1.5), -30.0])
    torch.testing.assert_close(
        importance_weights(old, sampler), torch.tensor([1.0, 0.1, 10.0, 2 / 3, math.exp(20.0)])
    )


def test_scheduled_value():
    sched = {0: 4096, 1000: 8192}
    assert [scheduled_value(s, sched, 1) for s in (0, 999, 1000, 5000)] == [4096, 4096, 8192, 8192]
    assert scheduled_value(3, None, 77) == 77
