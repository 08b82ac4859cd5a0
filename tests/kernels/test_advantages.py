"""group_advantages and batch_whiten: the recipe.md §2 worked examples, a per-group loop reference.

The two-process (gloo) test of the cross-rank merge is in test_distributed.py.
"""

import warnings

import pytest
import torch
from prorl.kernels import batch_whiten, group_advantages, group_advantages_reference

ONE_GROUP = torch.tensor([1.0, 0.0, 0.0, 1.0])
G1 = torch.zeros(4, dtype=torch.int64)


def _close(got, expected, atol=1e-6):
    torch.testing.assert_close(
        got.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=atol
    )


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(mode="grpo", eps=0.0), [1.0, -1.0, -1.0, 1.0]),  # population std
        (dict(mode="grpo"), [0.999998, -0.999998, -0.999998, 0.999998]),  # + 1e-6
        (dict(mode="grpo", std_unbiased=True, eps=0.0), [0.866025, -0.866025, -0.866025, 0.866025]),
        (
            dict(mode="grpo", std_unbiased=True),
            [0.5 / (1 / 3**0.5 + 1e-6) * s for s in (1, -1, -1, 1)],
        ),
        (dict(mode="dr-grpo"), [0.5, -0.5, -0.5, 0.5]),
        (dict(mode="reinforce++-baseline"), [1.0, -1.0, -1.0, 1.0]),
    ],
)
def test_recipe_one_group(kw, expected):
    _close(group_advantages(ONE_GROUP, G1, **kw), expected)


def test_recipe_two_groups():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    _close(
        group_advantages(rewards, groups, mode="dr-grpo"),
        [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75],
    )
    adv, metrics = group_advantages(rewards, groups, return_metrics=True)
    assert metrics["whiten_std"].item() == pytest.approx(0.467707, abs=1e-6)
    expected = [1.069045, -1.069045, -1.069045, 1.069045, 0.534522, 0.534522, 0.534522, -1.603567]
    _close(adv, expected)


def test_recipe_lengths_token_vs_sequence_weighting():
    lengths = torch.tensor([100, 300, 300, 100])
    adv, metrics = group_advantages(ONE_GROUP, G1, lengths=lengths, return_metrics=True)
    assert metrics["whiten_mean"].item() == pytest.approx(-0.25, abs=1e-12)
    assert metrics["whiten_std"].item() == pytest.approx(0.433013, abs=1e-6)
    _close(adv, [1.732051, -0.577350, -0.577350, 1.732051])
    _close(
        group_advantages(ONE_GROUP, G1, lengths=lengths, weighting="sequence"),
        [1.0, -1.0, -1.0, 1.0],
    )


def test_recipe_unfiltered_all_correct_group():
    """An all-correct group left in (not filtered first) shifts the baseline: +0.377964 on its every
    token."""
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    lengths = torch.tensor([100, 300, 300, 100, 200, 200, 200, 200])
    adv = group_advantages(rewards, groups, lengths=lengths)
    _close(adv[4:], [0.377964] * 4)


def test_recipe_rewards_with_negatives_and_shift_invariance():
    rewards = torch.tensor([1.0, -1.0, -0.5, 1.0])
    expected = [0.980196, -1.260252, -0.700140, 0.980196]
    _close(group_advantages(rewards, G1), expected)
    _close(group_advantages(rewards + 7.0, G1), expected)
    # adding a constant to ONE group of several changes nothing either
    both = torch.cat([rewards, ONE_GROUP])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    shifted = both + torch.tensor([0.0] * 4 + [-3.0] * 4)
    for mode in ("reinforce++-baseline", "grpo", "dr-grpo"):
        torch.testing.assert_close(
            group_advantages(shifted, groups, mode=mode), group_advantages(both, groups, mode=mode)
        )


@pytest.mark.filterwarnings("ignore:.*group.* of size 1")
@pytest.mark.parametrize("mode", ["reinforce++-baseline", "grpo", "dr-grpo"])
@pytest.mark.parametrize("weighting", ["token", "sequence"])
@pytest.mark.parametrize("std_unbiased", [False, True])
def test_against_per_group_loop(mode, weighting, std_unbiased):
    g = torch.Generator().manual_seed(0)
    b = 40
    rewards = torch.rand(b, generator=g, dtype=torch.float64)
    groups = torch.randint(100, 110, (b,), generator=g)  # non-contiguous ids, shuffled members
    lengths = torch.randint(1, 500, (b,), generator=g)
    kw = dict(mode=mode, weighting=weighting, std_unbiased=std_unbiased, lengths=lengths)
    got = group_advantages(rewards, groups, **kw)
    torch.testing.assert_close(
        got, group_advantages_reference(rewards, groups, **kw), rtol=1e-12, atol=1e-12
    )
    # dense ids with num_groups (no torch.unique) give the same result
    dense = torch.unique(groups, return_inverse=True)[1]
    torch.testing.assert_close(
        group_advantages(rewards, dense, num_groups=10, **kw), got, rtol=0, atol=0
    )


def test_singleton_group_and_nonfinite_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.5, float("nan"), 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 2, 2, 2])  # group 1 has one member; group 2 one NaN reward
    with pytest.warns(RuntimeWarning) as record:
        adv, metrics = group_advantages(rewards, groups, mode="dr-grpo", return_metrics=True)
    messages = " ".join(str(w.message) for w in record)
    assert "size 1" in messages and "non-finite" in messages
    _close(adv, [0.5, -0.5, 0.0, 0.0, 0.5, -0.5])
    assert (
        metrics["num_singleton_groups"].item() == 1 and metrics["num_invalid_rewards"].item() == 1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in ("grpo", "reinforce++-baseline"):
            adv = group_advantages(rewards, groups, mode=mode)
            assert torch.isfinite(adv).all() and adv[3] == 0
            if mode == "grpo":
                assert adv[2] == 0  # group of one: centred 0, std 0


def test_integer_rewards_and_empty_batch():
    adv = group_advantages(torch.tensor([1, 0, 0, 1]), G1)
    assert adv.dtype == torch.float32
    _close(adv, [1.0, -1.0, -1.0, 1.0])
    empty = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0,)


def test_bad_input():
    with pytest.raises(ValueError):
        group_advantages(ONE_GROUP, G1, mode="ppo")
    with pytest.raises(ValueError):
        group_advantages(ONE_GROUP, G1.float())
    with pytest.raises(ValueError):
        group_advantages(ONE_GROUP, G1[:3])
    with pytest.raises(IndexError):
        group_advantages(ONE_GROUP, torch.tensor([0, 1, 2, 3]), num_groups=3)


# --------------------------------------------------------------------------------------------------
# batch_whiten
# --------------------------------------------------------------------------------------------------


def test_batch_whiten_token_weighted_population():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=g) < 0.6
    values_with_junk = torch.where(mask, values, torch.full_like(values, float("nan")))
    out = batch_whiten(values_with_junk, mask)
    x = values[mask]
    expected = (x - x.mean()) / x.var(unbiased=False).sqrt()
    torch.testing.assert_close(out[mask], expected, rtol=1e-12, atol=1e-12)
    assert (out[~mask] == 0).all()


def test_batch_whiten_per_sequence_values_with_lengths_equals_broadcast_tokens():
    """Per-sequence values weighted by lengths == the same values broadcast to every token."""
    values = torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64)
    lengths = torch.tensor([1, 3, 3, 1])
    per_seq = batch_whiten(values, lengths)
    tokens = values[:, None].expand(4, 3)
    mask = torch.arange(3)[None, :] < lengths[:, None]
    per_tok = batch_whiten(tokens, mask)
    torch.testing.assert_close(per_tok[:, 0], per_seq)
    # sequence weighting: each row weighs 1 whatever its length
    torch.testing.assert_close(
        batch_whiten(tokens, mask, weighting="sequence")[:, 0],
        batch_whiten(values, lengths, weighting="sequence"),
    )
    _close(batch_whiten(values, lengths, weighting="sequence"), [1.0, -1.0, -1.0, 1.0])


def test_batch_whiten_is_stable_far_from_zero_and_floors_variance():
    """A large offset: sum(x^2) - (sum x)^2 / n would lose the variance; the two-pass/Chan form does
    not."""
    base = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    torch.testing.assert_close(
        batch_whiten(base + 1e9, mask), batch_whiten(base, mask), rtol=1e-6, atol=1e-6
    )
    constant = batch_whiten(torch.full((5,), 3.0), torch.ones(5, dtype=torch.bool))
    assert (constant == 0).all()  # variance floored at 1e-8: no division by zero
    # nothing valid
    assert (batch_whiten(torch.randn(3), torch.zeros(3, dtype=torch.bool)) == 0).all()
