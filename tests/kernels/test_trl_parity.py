"""ppo_loss against TRL's GRPOTrainer loss: same inputs, same loss and gradient.

TRL's own code computes the expected values: `GRPOTrainer._compute_loss` is called unbound, with a
small stand-in for the trainer (`_TrainerStub`) that supplies the attributes the method reads and returns
our log-probs from `_get_per_token_logps_and_entropies` (the model forward it would otherwise run). So the
loss formula, the clipping, the KL estimator and the aggregation under test are TRL's, not a copy.
The one transcription (marked below) is TRL's truncated importance-sampling ratio, which TRL computes at
generation time in `_generate_and_score_completions`, a method that needs a full trainer.

Argument mapping (KERNEL-NOTES.md): per_token_logps -> logp, old_per_token_logps -> old_logp,
ref_per_token_logps -> ref_logp, completion_mask -> mask, epsilon / epsilon_high -> eps_low / eps_high,
beta -> kl_coef with kl_estimator="k3" and no clamp; loss_type="dapo" -> agg="token-mean" with
normalizer = num_items_in_batch / num_processes * gradient_accumulation_steps / steps_per_generation;
loss_type="grpo" -> agg="seq-mean-token-mean" with normalizer = B * gradient_accumulation_steps (TRL
counts every row, even one without completion tokens); importance_sampling_ratio -> is_weights.
"""

import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from prorl.kernels import native_available, ppo_loss
from prorl.kernels._backend import triton_available
from prorl.kernels.adapters import trl_grpo_loss

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl); CI installs it")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL without trl.trainer.grpo_trainer")

BACKENDS = [
    "torch",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not native_available(), reason="native library not built (see pip output)"),
    ),
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not (triton_available() and os.environ.get("TRITON_INTERPRET") == "1"),
            reason="triton on CPU tensors needs triton installed and TRITON_INTERPRET=1",
        ),
    ),
]


class _Accelerator:
    num_processes = 1

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x


class _TrainerStub(SimpleNamespace):
    """The attributes GRPOTrainer._compute_loss reads, for a single process without vLLM or entropy tricks."""

    def __init__(
        self,
        logp,
        *,
        loss_type,
        beta,
        epsilon,
        epsilon_high,
        grad_accum=1,
        steps_per_generation=1,
        is_correction=False,
    ):
        super().__init__(
            loss_type=loss_type,
            beta=beta,
            epsilon_low=epsilon,
            epsilon_high=epsilon_high,
            importance_sampling_level="token",
            top_entropy_quantile=1.0,
            off_policy_mask_threshold=None,
            use_vllm=is_correction,
            vllm_importance_sampling_correction=is_correction,
            current_gradient_accumulation_steps=grad_accum,
            model=SimpleNamespace(training=True),
            accelerator=_Accelerator(),
            args=SimpleNamespace(
                delta=None, use_bias_correction_kl=False, steps_per_generation=steps_per_generation
            ),
            aux_loss_enabled=False,
            max_completion_length=logp.shape[1],  # read by loss_type="dr_grpo"
            _entropy_bonus_enabled=False,
            _metrics=defaultdict(lambda: defaultdict(list)),
        )
        # the model forward: hand TRL our differentiable log-probs (and dummy entropies for its metrics)
        self._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)


def _batch(seed=0, b=6, t=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    ref = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    sampler = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    lengths = torch.tensor([9, 4, 0, 7, 1, 6])[:b]  # one row without completion tokens
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # TRL's completion_mask is an int tensor
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return (logp, old, ref, mask, adv), sampler


def _trl_loss(logp, old, ref, mask, adv, *, num_items=None, is_ratio=None, **stub_kw):
    """TRL's loss, gradient and logged metrics (clip_ratio/..., kl)."""
    logp = logp.clone().requires_grad_()
    b, t = logp.shape
    inputs = {
        "prompt_ids": torch.ones(b, 3, dtype=torch.long),
        "prompt_mask": torch.ones(b, 3, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    if num_items is not None:
        inputs["num_items_in_batch"] = torch.tensor(float(num_items), dtype=torch.float64)
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    stub = _TrainerStub(logp, epsilon=0.2, epsilon_high=0.28, **stub_kw)
    loss = grpo_trainer.GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.detach(), logp.grad, {k: v[-1] for k, v in stub._metrics["train"].items()}


def _our_loss(logp, old, ref, mask, adv, **kw):
    """Ours, with TRL's clip range and KL estimator (k3, unclamped)."""
    logp = logp.clone().requires_grad_()
    loss, metrics = ppo_loss(
        logp,
        old,
        adv,
        mask,
        ref_logp=ref,
        eps_low=0.2,
        eps_high=0.28,
        kl_estimator="k3",
        kl_clamp="none",
        **kw,
    )
    loss.backward()
    return loss.detach(), logp.grad, metrics


def _assert_same(ours, theirs, beta):
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-14)
    assert ours[1].abs().sum() > 0
    # the metrics TRL logs with the same meaning (TRL's clip fractions are float32 means)
    assert ours[2]["clipfrac_low"].item() == pytest.approx(theirs[2]["clip_ratio/low_mean"], abs=1e-6)
    assert ours[2]["clipfrac_high"].item() == pytest.approx(theirs[2]["clip_ratio/high_mean"], abs=1e-6)
    assert ours[2]["clipfrac"].item() == pytest.approx(theirs[2]["clip_ratio/region_mean"], abs=1e-6)
    assert ours[2]["clipfrac_low"] > 0 and ours[2]["clipfrac_high"] > 0
    if beta:
        assert ours[2]["kl_mean"].item() == pytest.approx(theirs[2]["kl"], rel=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_dapo_global_token_normaliser_with_epsilon_high(beta, backend):
    batch, _ = _batch()
    num_items = int(batch[3].sum()) + 17  # the generation batch holds more tokens than this micro-batch
    theirs = _trl_loss(
        *batch, num_items=num_items, loss_type="dapo", beta=beta, grad_accum=2, steps_per_generation=4
    )
    # TRL: num_items_in_batch / num_processes * gradient_accumulation_steps / steps_per_generation
    ours = _our_loss(*batch, kl_coef=beta, agg="token-mean", normalizer=num_items * 2 / 4, backend=backend)
    _assert_same(ours, theirs, beta)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_sequence_mean_then_batch_mean(beta, backend):
    batch, _ = _batch(seed=5)
    theirs = _trl_loss(*batch, loss_type="grpo", beta=beta, grad_accum=2)
    ours = _our_loss(
        *batch, kl_coef=beta, agg="seq-mean-token-mean", normalizer=batch[0].shape[0] * 2, backend=backend
    )
    _assert_same(ours, theirs, beta)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dapo_with_truncated_importance_sampling(backend):
    batch, sampler = _batch(seed=2)
    logp, old, ref, mask, adv = batch
    # TRANSCRIPTION of TRL's vllm_importance_sampling_mode="token_truncate" ratio, computed at generation time
    # in _generate_and_score_completions: exp((old - sampling) * mask) clamped to at most clip_max
    clip_max = 2.0  # vllm_importance_sampling_clip_max (TRL's default 3.0 would truncate nothing here)
    raw = torch.exp((old - sampler) * mask)
    assert (raw > clip_max).any()  # the truncation is exercised
    trl_ratio = torch.clamp(raw, min=None, max=clip_max)
    num_items = int(mask.sum())
    theirs = _trl_loss(
        *batch, num_items=num_items, is_ratio=trl_ratio, loss_type="dapo", beta=0.04, is_correction=True
    )
    ours = _our_loss(
        *batch,
        kl_coef=0.04,
        is_weights=torch.exp(old - sampler),
        is_mode="tis",
        is_bounds=(0.0, clip_max),
        normalizer=num_items,
        backend=backend,
    )
    _assert_same(ours, theirs, 0.04)


# --------------------------------------------------------------------------------------------------
# The drop-in adapter (prorl.kernels.adapters.trl_grpo_loss): TRL's names in, TRL's loss out
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_adapter_matches_trl(loss_type, backend):
    batch, sampler = _batch(seed=7)
    logp, old, ref, mask, adv = batch
    num_items = int(mask.sum()) + 5
    is_ratio = torch.clamp(torch.exp((old - sampler) * mask), max=2.0)  # as TRL stores it (see above)
    kw = dict(loss_type=loss_type, beta=0.04, grad_accum=3, steps_per_generation=2)
    theirs = _trl_loss(*batch, num_items=num_items, is_ratio=is_ratio, is_correction=True, **kw)
    x = logp.clone().requires_grad_()
    ours = trl_grpo_loss(
        x,
        old,
        adv,
        mask,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.04,
        ref_per_token_logps=ref,
        num_items_in_batch=torch.tensor(float(num_items)),
        gradient_accumulation_steps=3,
        steps_per_generation=2,
        max_completion_length=logp.shape[1],
        importance_sampling_ratio=is_ratio,
        backend=backend,
    )
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, theirs[1], rtol=1e-12, atol=1e-14)
    assert x.grad.abs().sum() > 0
