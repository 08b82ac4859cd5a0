"""ppo_loss: the recipe.md §3-§4 vectors, and every option against the float64 autograd reference.

The expected numbers come from docs/recipe.md (worked by hand there) or from `ppo_loss_reference`, a
plain float64 per-sequence loop differentiated by autograd, independent of the op's closed-form
gradient. Every backend runs every case: torch, native (when built) and triton (CPU tensors under
the Triton interpreter, which tests/conftest.py switches on when there is no CUDA; on a CUDA machine
the triton cases here skip — they would need the tensors on the GPU).
"""

import math

import pytest
import torch
from prorl.kernels import ppo_loss, ppo_loss_reference


def _one_token(r, a, **kw):
    """Loss and d loss / d logp for one token with ratio r and advantage a (old_logp = 0)."""
    logp = torch.tensor([math.log(r)], dtype=torch.float64, requires_grad=True)
    loss, metrics = ppo_loss(
        logp,
        torch.zeros(1, dtype=torch.float64),
        torch.tensor([float(a)]),
        torch.ones(1, dtype=torch.bool),
        **kw,
    )
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# docs/recipe.md §3: (r, A, options, loss, whether the token gets a gradient)
PG_VECTORS = [
    (1.1, +1, {}, -1.10, True),
    (1.5, +1, {}, -1.28, False),
    (1.5, +1, {"eps_high": 0.4}, -1.40, False),  # v1's symmetric 0.2 / 0.4
    (0.7, +1, {}, -0.70, True),
    (0.5, -1, {}, 0.80, False),
    (1.3, -1, {}, 1.30, True),
    (4.0, -1, {}, 4.00, True),
    (4.0, -1, {"dual_clip": 3.0}, 3.00, False),
]


@pytest.mark.parametrize("r,a,kw,expected,has_grad", PG_VECTORS)
def test_recipe_policy_vectors(r, a, kw, expected, has_grad, backend):
    loss, grad, metrics = _one_token(r, a, backend=backend, **kw)
    assert loss == pytest.approx(expected, abs=1e-12)
    # d(-A r)/d logp = -A r on the unclipped branch; exactly 0 when clipped
    assert grad == (pytest.approx(-a * r, abs=1e-12) if has_grad else 0.0)
    clipped = not has_grad and "dual_clip" not in kw
    assert metrics["clipfrac"].item() == float(clipped)
    assert metrics["dualclip_frac"].item() == float("dual_clip" in kw)


def _agg_batch():
    """Token losses [1, 1] and [0, 0, 0, 0] (docs/recipe.md §3): r = 1, so the loss is -A."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([-1.0, 0.0])
    zeros = torch.zeros(2, 4, dtype=torch.float64)
    return zeros, adv, mask


@pytest.mark.parametrize(
    "agg,expected",
    [("token-mean", 1 / 3), ("seq-mean-token-mean", 0.5), ("seq-mean-token-sum", 1.0)],
)
def test_recipe_aggregation_padded_and_packed(agg, expected, backend):
    zeros, adv, mask = _agg_batch()
    loss, _ = ppo_loss(zeros, zeros, adv, mask, agg=agg, backend=backend)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    packed = torch.zeros(6, dtype=torch.float64)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    loss, _ = ppo_loss(
        packed,
        packed,
        adv,
        torch.ones(6, dtype=torch.bool),
        agg=agg,
        cu_seqlens=cu,
        backend=backend,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_recipe_aggregation_split_over_two_ranks():
    """Rank 0 holds the [1, 1] sequence, rank 1 the [0, 0, 0, 0] one: the denominator is still 6."""
    zeros, adv, mask = _agg_batch()
    global_tokens = mask.sum()  # what all_reduce(mask.sum()) gives; a tensor: no host sync
    parts = [
        ppo_loss(
            zeros[i : i + 1],
            zeros[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            normalizer=global_tokens,
        )[0]
        for i in range(2)
    ]
    assert sum(parts).item() == pytest.approx(1 / 3, abs=1e-12)
    # the pitfall: local denominators give (1 + 0) / 2 = 0.5 after averaging the two ranks
    local = [
        ppo_loss(zeros[i : i + 1], zeros[i : i + 1], adv[i : i + 1], mask[i : i + 1])[0]
        for i in range(2)
    ]
    assert (sum(local) / 2).item() == pytest.approx(0.5, abs=1e-12)
    # seq-mean-token-mean: the global sequence count (2) plays the same role
    parts = [
        ppo_loss(
            zeros[i : i + 1],
            zeros[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            agg="seq-mean-token-mean",
            normalizer=2,
        )[0]
        for i in range(2)
    ]
    assert sum(parts).item() == pytest.approx(0.5, abs=1e-12)


# docs/recipe.md §4: (logp, ref) -> (k1, k2, k3) unclamped
KL_VECTORS = [
    (-1.0, -1.5, (0.5, 0.125, 0.1065)),
    (-2.0, -0.5, (-1.5, 1.125, 1.9817)),
    (-0.1, -12.0, (11.9, 70.805, 10.9)),
]


@pytest.mark.parametrize("logp,ref,expected", KL_VECTORS)
def test_recipe_kl_vectors(logp, ref, expected, backend):
    for est, value in zip(("k1", "k2", "k3"), expected):
        lp = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
        # A = 0 and old = logp: the policy term is 0, so loss = kl_coef * KL
        loss, metrics = ppo_loss(
            lp,
            lp.detach(),
            torch.zeros(1),
            torch.ones(1, dtype=torch.bool),
            ref_logp=torch.tensor([ref], dtype=torch.float64),
            kl_coef=1.0,
            kl_estimator=est,
            kl_clamp="none",
            backend=backend,
        )
        loss.backward()
        assert loss.item() == pytest.approx(value, abs=1e-4), est
        assert metrics["kl_loss"].item() == pytest.approx(value, abs=1e-4)
        d = logp - ref
        assert lp.grad.item() == pytest.approx(
            {"k1": 1.0, "k2": d, "k3": 1 - math.exp(-d)}[est], abs=1e-12
        )


@pytest.mark.parametrize("clamp,expected", [("log-ratio", 50.0), ("output", 10.0)])
def test_recipe_kl_clamp_rows(clamp, expected, backend):
    """(logp, ref) = (-0.1, -12.0), k2: 50 with the log-ratio clamped to 10, 10 with the output
    clamped."""
    lp = torch.tensor([-0.1], dtype=torch.float64, requires_grad=True)
    loss, _ = ppo_loss(
        lp,
        lp.detach(),
        torch.zeros(1),
        torch.ones(1, dtype=torch.bool),
        ref_logp=torch.tensor([-12.0], dtype=torch.float64),
        kl_coef=1.0,
        kl_estimator="k2",
        kl_clamp=clamp,
        kl_clamp_value=10.0,
        backend=backend,
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert lp.grad.item() == 0.0  # the clamp is active: no gradient


def test_is_modes_by_hand(backend):
    """r = 1, A = -1 (per-token loss 1) so the loss is the mean corrected weight."""
    w = torch.tensor([0.3, 1.0, 6.0], dtype=torch.float64)
    args = (
        torch.zeros(3, dtype=torch.float64),
        torch.zeros(3, dtype=torch.float64),
        -torch.ones(3),
        torch.ones(3, dtype=torch.bool),
    )
    cases = [("none", [0.3, 1.0, 6.0]), ("tis", [0.3, 1.0, 2.0]), ("icepop", [0.0, 1.0, 0.0])]
    for mode, weights in cases:
        loss, m = ppo_loss(
            *args,
            is_weights=w,
            is_mode=mode,
            is_bounds=(0.5, 2.0) if mode == "tis" else (0.5, 5.0),
            backend=backend,
        )
        assert loss.item() == pytest.approx(sum(weights) / 3, abs=1e-12), mode
        assert m["is_mean"].item() == pytest.approx(7.3 / 3) and m["is_max"].item() == 6.0
        assert m["is_frac_modified"].item() == pytest.approx(
            {"none": 0, "tis": 1 / 3, "icepop": 2 / 3}[mode]
        )


# --------------------------------------------------------------------------------------------------
# Against the float64 reference
# --------------------------------------------------------------------------------------------------


def _random_padded(b=8, t=12, seed=0, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    # ratios spread well outside the clip range, so that every branch is taken
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6
    ref = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.8
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if empty_row:
        lengths[1] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    isw = torch.exp(torch.randn(b, t, generator=g, dtype=torch.float64) * 0.7)
    return logp, old, ref, mask, adv, isw


OPTION_SETS = [
    {},
    {"dual_clip": 3.0, "eps_high": 0.4},
    {"kl_coef": 0.3, "kl_estimator": "k1"},
    {"kl_coef": 0.3, "kl_estimator": "k2", "kl_clamp_value": 0.5},
    {"kl_coef": 0.3, "kl_estimator": "k3", "kl_clamp": "output", "kl_clamp_value": 0.2},
    {
        "kl_coef": 0.1,
        "kl_estimator": "k3",
        "kl_clamp": "none",
        "is_mode": "tis",
        "is_bounds": (0.5, 1.5),
    },
    {"is_mode": "icepop", "is_bounds": (0.7, 1.6), "dual_clip": 2.0},
    {"is_mode": "none"},
]


def _run(fn, logp, *args, **kw):
    logp = logp.detach().clone().requires_grad_()
    loss, metrics = fn(logp, *args, **kw)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def _compare(got, ref, dtype=torch.float64):
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got[0].double(), ref[0], **tol)
    torch.testing.assert_close(got[1].double(), ref[1], **tol)
    for k in (
        "pg_loss",
        "kl_loss",
        "num_tokens",
        "clipfrac_low",
        "clipfrac_high",
        "dualclip_frac",
        "approx_kl",
        "kl_mean",
        "ratio_mean",
    ):
        torch.testing.assert_close(
            got[2][k].double(), torch.as_tensor(ref[2][k], dtype=torch.float64), **tol, msg=k
        )


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
)
def test_against_reference_padded(options, agg, backend):
    logp, old, ref, mask, adv, isw = _random_padded(seed=2)
    kw = dict(
        ref_logp=ref if "kl_coef" in options else None,
        agg=agg,
        is_weights=isw if "is_mode" in options else None,
        **options,
    )
    got = _run(ppo_loss, logp, old, adv, mask, backend=backend, **kw)
    want = _run(ppo_loss_reference, logp, old, adv, mask, **kw)
    _compare(got, want)
    # and the same as the torch backend, metric by metric (IS statistics included)
    if backend != "torch":
        plain = _run(ppo_loss, logp, old, adv, mask, backend="torch", **kw)
        torch.testing.assert_close(got[0], plain[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[1], plain[1], rtol=1e-12, atol=1e-14)
        assert got[2].keys() == plain[2].keys()
        for k in plain[2]:
            torch.testing.assert_close(got[2][k], plain[2][k], rtol=1e-12, atol=1e-14, msg=k)
    # the inputs take every branch: clipped on both sides, dual-clipped, clamped, truncated
    m = got[2]
    assert m["clipfrac_low"] > 0 and m["clipfrac_high"] > 0 and m["clipfrac"] < 1
    assert m["dualclip_frac"] > 0 if "dual_clip" in options else m["dualclip_frac"] == 0
    if options.get("is_mode") in ("tis", "icepop"):
        assert 0 < m["is_frac_modified"] < 1


@pytest.mark.parametrize("options", OPTION_SETS[:3] + OPTION_SETS[5:6])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_padded_and_packed_agree(options, agg, backend):
    """The same sequences padded [B, T] and packed [N] with cu_seqlens (and per-token
    advantages)."""
    logp, old, ref, mask, adv, isw = _random_padded(seed=1)
    kw = dict(agg=agg, backend=backend, **options)
    pad_kw = dict(kw, ref_logp=ref, is_weights=isw if "is_mode" in options else None)
    got_pad = _run(ppo_loss, logp, old, adv, mask, **pad_kw)
    lengths = mask.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    pack = lambda x: x[mask]
    adv_tok = adv[:, None].expand_as(logp)
    pack_kw = dict(
        kw,
        ref_logp=pack(ref),
        is_weights=pack(isw) if "is_mode" in options else None,
        cu_seqlens=cu,
    )
    for advantages in (adv, pack(adv_tok)):  # per sequence [S] and per token [N]
        got_pack = _run(
            ppo_loss,
            pack(logp),
            pack(old),
            advantages,
            torch.ones(int(lengths.sum()), dtype=torch.bool),
            **pack_kw,
        )
        torch.testing.assert_close(got_pack[0], got_pad[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got_pack[1], got_pad[1][mask], rtol=1e-12, atol=1e-14)
        assert (got_pad[1][~mask] == 0).all()
        ref_kw = {k: v for k, v in pack_kw.items() if k != "backend"}
        want = _run(
            ppo_loss_reference,
            pack(logp),
            pack(old),
            advantages,
            torch.ones(int(lengths.sum())),
            **ref_kw,
        )
        _compare(got_pack, want)


def test_packed_tokens_outside_cu_seqlens_are_masked(backend):
    logp, old, _, _, _, _ = _random_padded(b=1, t=10, seed=2, empty_row=False)
    logp, old = logp[0], old[0]
    adv = torch.tensor([1.0, -1.0])
    cu = torch.tensor([2, 5, 8])  # tokens 0, 1, 8, 9 belong to no sequence
    got = _run(
        ppo_loss,
        logp,
        old,
        adv,
        torch.ones(10, dtype=torch.bool),
        cu_seqlens=cu,
        agg="seq-mean-token-mean",
        backend=backend,
    )
    want = _run(
        ppo_loss,
        logp[2:8],
        old[2:8],
        adv,
        torch.ones(6, dtype=torch.bool),
        cu_seqlens=cu - 2,
        agg="seq-mean-token-mean",
        backend=backend,
    )
    torch.testing.assert_close(got[0], want[0])
    assert (got[1][[0, 1, 8, 9]] == 0).all()
    torch.testing.assert_close(got[1][2:8], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs(dtype, backend):
    """fp32/bf16 log-probs are computed in fp32: compared with float64 on the same (rounded)
    inputs."""
    logp, old, ref, mask, adv, _ = _random_padded(seed=3)
    lp, o, rf = (x.to(dtype) for x in (logp, old, ref))
    kw = dict(ref_logp=rf, kl_coef=0.2, agg="seq-mean-token-mean")
    got = _run(ppo_loss, lp, o, adv.float(), mask, backend=backend, **kw)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype
    want = _run(
        ppo_loss_reference,
        lp.double(),
        o.double(),
        adv.float().double(),
        mask,
        ref_logp=rf.double(),
        kl_coef=0.2,
        agg="seq-mean-token-mean",
    )
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-6)
    grad_tol = (
        {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    )
    torch.testing.assert_close(got[1].double(), want[1], **grad_tol)


# --------------------------------------------------------------------------------------------------
# Masking, normaliser, bad input
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
)
def test_all_masked_gives_zero_loss_and_grad(agg, backend):
    logp, old, ref, mask, adv, isw = _random_padded(seed=4)
    mask = torch.zeros_like(mask)
    logp[0, 0] = float("nan")  # masked tokens may hold anything
    got = _run(
        ppo_loss,
        logp,
        old,
        adv,
        mask,
        ref_logp=ref,
        kl_coef=0.1,
        is_weights=isw,
        is_mode="tis",
        agg=agg,
        backend=backend,
    )
    assert got[0].item() == 0.0
    assert (got[1] == 0).all()
    for k, v in got[2].items():
        assert torch.isfinite(v).all() and v.item() == 0.0, k


def test_masked_garbage_is_ignored(backend):
    logp, old, ref, mask, adv, isw = _random_padded(seed=5)
    kw = dict(kl_coef=0.1, is_mode="icepop", backend=backend)
    clean = _run(ppo_loss, logp, old, adv, mask, ref_logp=ref, is_weights=isw, **kw)
    junk = lambda x: torch.where(mask, x, torch.full_like(x, float("nan")))
    dirty = _run(
        ppo_loss,
        junk(logp),
        junk(old),
        adv,
        mask,
        ref_logp=junk(ref),
        is_weights=junk(isw),
        **kw,
    )
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_normalizer_number_or_tensor(backend):
    logp, old, _, mask, adv, _ = _random_padded(seed=6)
    n = mask.sum()
    for norm in (float(n) * 4, n * 4):
        loss, _, _ = _run(ppo_loss, logp, old, adv, mask, normalizer=norm, backend=backend)
        local, _, _ = _run(ppo_loss, logp, old, adv, mask, backend=backend)
        torch.testing.assert_close(loss * 4, local)


def test_logp_without_grad_and_detached_metrics():
    logp, old, _, mask, adv, _ = _random_padded(seed=7)
    loss, metrics = ppo_loss(logp, old, adv, mask)
    assert not loss.requires_grad
    loss, metrics = ppo_loss(logp.clone().requires_grad_(), old, adv, mask)
    assert loss.requires_grad and not any(v.requires_grad for v in metrics.values())


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(old_logp=torch.zeros(3, 4)), ValueError),
        (dict(advantages=torch.zeros(3)), ValueError),
        (dict(advantages=torch.zeros(2, dtype=torch.long)), TypeError),
        (dict(agg="mean"), ValueError),
        (dict(kl_estimator="k4"), ValueError),
        (dict(normalizer=0), ValueError),
        (dict(dual_clip=0.5), ValueError),
        (dict(cu_seqlens=torch.tensor([0, 4, 8])), ValueError),
    ],
)
def test_bad_input(change, error):
    args = dict(
        logp=torch.zeros(2, 4),
        old_logp=torch.zeros(2, 4),
        advantages=torch.zeros(2),
        mask=torch.ones(2, 4, dtype=torch.bool),
    )
    args.update(change)
    kw = {k: args.pop(k) for k in list(args) if k not in ("logp", "old_logp", "advantages", "mask")}
    with pytest.raises(error):
        ppo_loss(args["logp"], args["old_logp"], args["advantages"], args["mask"], **kw)


def test_packed_needs_cu_seqlens_for_sequence_modes():
    x = torch.zeros(6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_loss(x, x, x, torch.ones(6), agg="seq-mean-token-mean")
    with pytest.raises(ValueError, match="normalizer"):
        ppo_loss(x, x, x, torch.ones(6), agg="constant")
