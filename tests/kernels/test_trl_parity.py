"""ppo_loss and the TRL adapter against TRL 1.16's own GRPOTrainer loss: same inputs, same numbers.

TRL's own code computes the expected values. Most tests call `GRPOTrainer._compute_loss` unbound, on
a small stand-in for the trainer (`_TrainerStub`) holding the attributes the method reads, whose
model forward (`_get_per_token_logps_and_entropies`) returns our float64 log-probs and entropies;
the adapter `trl_compute_loss` runs on the same stand-in. So the clipping, KL, importance sampling,
aggregation and logged metrics under test are TRL's, not a copy, and agree to round-off (1e-12;
TRL's clip fractions are float32 means). The last tests run the ADAPTERS.md snippet in a real
GRPOTrainer (the tiny local Qwen2 of prorl/assets), where TRL itself also computes the
importance-sampling ratios (from a rollout function's sampler log-probs); its log-probs are float32
there (TRL's fused LM head), so the bounds are float32 ones.

Mapping (docs/ops.md): per_token_logps -> logp, old_per_token_logps -> old_logp, ref_per_token_logps
-> ref_logp, completion_mask -> mask, epsilon / epsilon_high -> eps_low / eps_high, beta -> kl_coef
with kl_estimator="k3" and no clamp; dapo -> agg="token-mean" with normalizer = num_items_in_batch /
num_processes * gradient_accumulation_steps / steps_per_generation; grpo ->
agg="seq-mean-token-mean" with normalizer = B * gradient_accumulation_steps (TRL counts every row,
even one without completion tokens); importance_sampling_ratio -> is_weights.
"""

import math
import re
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prorl.kernels import ppo_loss
from prorl.kernels.adapters import trl_compute_loss, trl_grpo_loss

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl); CI installs it")
grpo_trainer = pytest.importorskip(
    "trl.trainer.grpo_trainer", reason="TRL without trl.trainer.grpo_trainer"
)

ROOT = Path(__file__).resolve().parents[2]
LOSS_TYPES = ["dapo", "grpo", "bnpo", "dr_grpo"]
SHAPES = [(1, 1), (6, 9), (16, 64)]
TRL_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


class _Accelerator:
    num_processes = 1

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x


class _TrainerStub(SimpleNamespace):
    """The attributes GRPOTrainer._compute_loss reads, for one process; defaults are TRL 1.16's."""

    def __init__(
        self,
        logp,
        entropies,
        *,
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        use_bias_correction_kl=True,
        grad_accum=1,
        steps_per_generation=1,
        is_correction=False,
        training=True,
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
            vllm_importance_sampling_correction=True,
            current_gradient_accumulation_steps=grad_accum,
            model=SimpleNamespace(training=training),
            accelerator=_Accelerator(),
            args=SimpleNamespace(
                delta=None,
                use_bias_correction_kl=use_bias_correction_kl,
                steps_per_generation=steps_per_generation,
            ),
            aux_loss_enabled=False,
            max_completion_length=logp.shape[1],  # read by loss_type="dr_grpo"
            _entropy_bonus_enabled=False,
            _metrics=defaultdict(lambda: defaultdict(list)),
        )
        # the model forward: hand TRL our differentiable log-probs and entropies
        self._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropies, None)


def _batch(seed=0, b=6, t=9, adv_per_token=False, far=False):
    """float64 [b, t] inputs with clipping on both sides and empty rows (b > 2); `far`: some
    |logp - old| > 20."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    if far:
        sel = torch.rand(b, t, generator=g) < 0.15
        old = torch.where(
            sel, logp + 25 * torch.sign(torch.randn(b, t, generator=g, dtype=torch.float64)), old
        )
    ref = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    sampler = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if b > 2:
        lengths[0], lengths[2] = t, 0  # a full row and one without completion tokens
    # TRL's completion_mask is an int tensor
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    shape = (b, t) if adv_per_token else (b,)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    entropies = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    return (logp, old, ref, mask, adv), sampler, entropies


def _inputs(old, ref, mask, adv, num_items=None, is_ratio=None):
    b, t = mask.shape
    inputs = {
        "prompt_ids": torch.ones(b, 3, dtype=torch.long),
        "prompt_mask": torch.ones(b, 3, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(
            float(num_items if num_items is not None else mask.sum() + 3)
        ),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return inputs


def _run(
    compute_loss, logp, old, ref, mask, adv, entropies, *, num_items=None, is_ratio=None, **stub_kw
):
    """compute_loss(trainer, model, inputs) on a fresh stand-in: loss, gradient, logged metrics."""
    logp = logp.clone().requires_grad_()
    stub = _TrainerStub(logp, entropies, **stub_kw)
    loss = compute_loss(stub, None, _inputs(old, ref, mask, adv, num_items, is_ratio))
    loss.backward()
    mode = "train" if stub.model.training else "eval"
    return loss.detach(), logp.grad, {k: v[-1] for k, v in stub._metrics[mode].items()}


def _trl(*args, **kw):
    return _run(grpo_trainer.GRPOTrainer._compute_loss, *args, **kw)


def _ours(*args, **kw):
    return _run(trl_compute_loss, *args, **kw)


def _assert_same_metrics(ours, theirs):
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for k, v in theirs.items():
        # TRL's clip fractions are float32 means
        rel = 1e-6 if k.startswith("clip_ratio") else 1e-12
        if math.isnan(v):
            assert math.isnan(ours[k]), k
        else:
            assert ours[k] == pytest.approx(v, rel=rel, abs=1e-12), k


def _assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-14)
    _assert_same_metrics(ours[2], theirs[2])


def _is_ratio(old, sampler, mask, level):
    """An importance-sampling ratio of the kind TRL stores (in the real-trainer tests TRL computes
    it)."""
    diff = (old - sampler) * mask
    if level == "token":
        return torch.exp(diff).clamp(max=2.0)
    return torch.exp(diff.sum(-1, keepdim=True).clamp(max=3.0))  # sequence level: [B, 1]


# --------------------------------------------------------------------------------------------------
# ppo_loss itself (the kernel) against TRL, in ppo_loss's own arguments, on every backend
# --------------------------------------------------------------------------------------------------


def _ppo(logp, old, ref, mask, adv, **kw):
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


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_ppo_loss_dapo_global_token_normaliser(beta, backend):
    batch, _, ent = _batch()
    # the generation batch holds more tokens than this micro-batch
    num_items = int(batch[3].sum()) + 17
    theirs = _trl(
        *batch,
        ent,
        num_items=num_items,
        beta=beta,
        # ppo_loss's KL term is k3 alone (the adapter adds TRL's correction)
        use_bias_correction_kl=False,
        grad_accum=2,
        steps_per_generation=4,
    )
    ours = _ppo(
        *batch, kl_coef=beta, agg="token-mean", normalizer=num_items * 2 / 4, backend=backend
    )
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-14)
    assert ours[2]["clipfrac_low"].item() == pytest.approx(
        theirs[2]["clip_ratio/low_mean"], abs=1e-6
    )
    assert ours[2]["clipfrac_high"].item() == pytest.approx(
        theirs[2]["clip_ratio/high_mean"], abs=1e-6
    )
    assert ours[2]["clipfrac_low"] > 0 and ours[2]["clipfrac_high"] > 0
    if beta:
        assert ours[2]["kl_mean"].item() == pytest.approx(theirs[2]["kl"], rel=1e-9)


def test_ppo_loss_grpo_sequence_mean_then_batch_mean(backend):
    batch, _, ent = _batch(seed=5)
    theirs = _trl(
        *batch, ent, loss_type="grpo", beta=0.04, use_bias_correction_kl=False, grad_accum=2
    )
    b = batch[0].shape[0]
    ours = _ppo(*batch, kl_coef=0.04, agg="seq-mean-token-mean", normalizer=b * 2, backend=backend)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------------
# The adapter: trl_compute_loss in place of GRPOTrainer._compute_loss, loss + gradient + logged
# metrics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_level", [None, "token", "sequence"])
@pytest.mark.parametrize("adv_per_token", [False, True])
@pytest.mark.parametrize("beta,bias_correction", [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_adapter_matches_trl(shape, loss_type, beta, bias_correction, adv_per_token, is_level):
    seed = 10 * SHAPES.index(shape) + LOSS_TYPES.index(loss_type)
    batch, sampler, ent = _batch(seed, *shape, adv_per_token=adv_per_token)
    logp, old, ref, mask, adv = batch
    is_ratio = None if is_level is None else _is_ratio(old, sampler, mask, is_level)
    kw = dict(
        loss_type=loss_type,
        beta=beta,
        use_bias_correction_kl=bias_correction,
        grad_accum=3,
        steps_per_generation=2,
        is_correction=is_level is not None,
        is_ratio=is_ratio,
    )
    theirs, ours = _trl(*batch, ent, **kw), _ours(*batch, ent, **kw)
    _assert_same(ours, theirs)
    assert set(theirs[2]) == set(TRL_METRICS) - ({"kl"} if beta == 0 else set())
    if shape == (16, 64):  # the batch reaches both clips and an empty row
        assert theirs[2]["clip_ratio/low_mean"] > 0 and theirs[2]["clip_ratio/high_mean"] > 0
        assert (mask.sum(-1) == 0).any() and theirs[1].abs().sum() > 0


def test_adapter_on_every_backend(backend, monkeypatch):
    monkeypatch.setenv("PRORL_KERNEL_BACKEND", backend)
    batch, sampler, ent = _batch(seed=7, b=8, t=12)
    is_ratio = _is_ratio(batch[1], sampler, batch[3], "token")
    for bias_correction in (True, False):
        kw = dict(
            beta=0.04, use_bias_correction_kl=bias_correction, is_correction=True, is_ratio=is_ratio
        )
        _assert_same(_ours(*batch, ent, **kw), _trl(*batch, ent, **kw))


@pytest.mark.parametrize("use_vllm,correction", [(False, True), (True, False)])
def test_adapter_applies_the_is_ratio_only_where_trl_does(use_vllm, correction):
    batch, sampler, ent = _batch(seed=13, b=8, t=12)
    inputs = _inputs(*batch[1:], is_ratio=_is_ratio(batch[1], sampler, batch[3], "token"))
    results = []
    for compute_loss in (grpo_trainer.GRPOTrainer._compute_loss, trl_compute_loss):
        logp = batch[0].clone().requires_grad_()
        stub = _TrainerStub(logp, ent, is_correction=use_vllm)
        stub.vllm_importance_sampling_correction = correction
        loss = compute_loss(stub, None, inputs)
        loss.backward()
        results.append(
            (loss.detach(), logp.grad, {k: v[-1] for k, v in stub._metrics["train"].items()})
        )
    _assert_same(results[1], results[0])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_adapter_with_tool_mask(loss_type):
    """Tool-call tokens (tool_mask 0) are left out of the loss and of every metric, as in TRL."""
    batch, _, ent = _batch(seed=12, b=8, t=16)
    tool_mask = (torch.rand(8, 16, generator=torch.Generator().manual_seed(1)) > 0.3).long()
    results = []
    for compute_loss in (grpo_trainer.GRPOTrainer._compute_loss, trl_compute_loss):
        logp = batch[0].clone().requires_grad_()
        stub = _TrainerStub(logp, ent, loss_type=loss_type, beta=0.04)
        inputs = _inputs(*batch[1:]) | {"tool_mask": tool_mask}
        loss = compute_loss(stub, None, inputs)
        loss.backward()
        results.append(
            (loss.detach(), logp.grad, {k: v[-1] for k, v in stub._metrics["train"].items()})
        )
    _assert_same(results[1], results[0])
    assert (results[0][1][(tool_mask == 0)] == 0).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_adapter_in_evaluation(loss_type):
    """model.eval(): TRL divides by neither the accumulation steps nor steps_per_generation."""
    batch, _, ent = _batch(seed=8)
    kw = dict(loss_type=loss_type, beta=0.04, grad_accum=4, steps_per_generation=2, training=False)
    _assert_same(_ours(*batch, ent, **kw), _trl(*batch, ent, **kw))


def test_trl_grpo_loss_from_tensors():
    batch, sampler, _ = _batch(seed=9, b=7, t=10)
    logp, old, ref, mask, adv = batch
    is_ratio = _is_ratio(old, sampler, mask, "sequence")
    for loss_type in LOSS_TYPES:
        theirs = _trl(
            *batch,
            torch.zeros_like(logp),
            loss_type=loss_type,
            beta=0.04,
            grad_accum=3,
            is_correction=True,
            is_ratio=is_ratio,
            num_items=int(mask.sum()) + 5,
        )
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
            num_items_in_batch=torch.tensor(float(mask.sum() + 5)),
            gradient_accumulation_steps=3,
            max_completion_length=logp.shape[1],
            importance_sampling_ratio=is_ratio,
        )
        ours.backward()
        torch.testing.assert_close(ours.detach(), theirs[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(x.grad, theirs[1], rtol=1e-12, atol=1e-14)


def test_log_ratio_beyond_20():
    """Beyond |logp - old| = 20 ppo_loss clamps the ratio and TRL does not. On the clipped side (A >
    0 and logp - old > 20, A < 0 and logp - old < -20) both give the clipped constant: same numbers.
    On the other side ours is TRL's on the log-ratio clamped to +-20, with zero gradient at those
    tokens."""
    batch, _, ent = _batch(seed=11, b=16, t=64, adv_per_token=True, far=True)
    logp, old, ref, mask, adv = batch
    lr = logp - old
    far = (lr.abs() > 20) & (mask > 0)
    clipped_side = far & (lr * adv > 0)
    assert clipped_side.any() and (far & ~clipped_side).any()

    # only clipped-side far tokens (and TRL's unclamped ratio in the bias-corrected KL): identical
    adv_clipped = torch.where(far & ~clipped_side, -adv, adv)
    for beta in (0.0, 0.04):
        kw = dict(beta=beta, loss_type="dapo")
        same = (logp, old, ref, mask, adv_clipped)
        _assert_same(_ours(*same, ent, **kw), _trl(*same, ent, **kw))

    # far tokens on the unclipped side: ours = TRL's with old moved to logp -+ 20
    old_clamped = logp - lr.clamp(-20, 20)
    ours = _ours(logp, old, ref, mask, adv, ent, loss_type="dapo")
    theirs = _trl(logp, old_clamped, ref, mask, adv, ent, loss_type="dapo")
    raw = _trl(logp, old, ref, mask, adv, ent, loss_type="dapo")
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-14)
    unclipped_far = far & ~clipped_side
    torch.testing.assert_close(
        ours[1][~unclipped_far], theirs[1][~unclipped_far], rtol=1e-12, atol=1e-14
    )
    assert (ours[1][unclipped_far] == 0).all() and (theirs[1][unclipped_far] != 0).all()
    # TRL's unclamped exp(25) differs, as documented
    assert not torch.isclose(ours[0], raw[0], rtol=1e-3)


@pytest.mark.parametrize(
    "setting,value,named",
    [
        ("loss_type", "cispo", "loss_type='cispo'"),
        ("importance_sampling_level", "sequence", "importance_sampling_level='sequence'"),
        ("top_entropy_quantile", 0.5, "top_entropy_quantile=0.5"),
        ("off_policy_mask_threshold", 0.1, "off_policy_mask_threshold=0.1"),
        ("_entropy_bonus_enabled", True, "entropy bonus"),
        ("aux_loss_enabled", True, "router auxiliary loss"),
    ],
)
def test_settings_not_fused_are_refused_by_name(setting, value, named):
    batch, _, ent = _batch()
    stub = _TrainerStub(batch[0], ent)
    setattr(stub, setting, value)
    with pytest.raises(ValueError, match=re.escape(named)):
        trl_compute_loss(stub, None, _inputs(*batch[1:]))
    stub = _TrainerStub(batch[0], ent)
    stub.args.delta = 2.0
    with pytest.raises(ValueError, match="delta=2.0"):
        trl_compute_loss(stub, None, _inputs(*batch[1:]))


# --------------------------------------------------------------------------------------------------
# The ADAPTERS.md snippet in a real GRPOTrainer, against TRL's own _compute_loss on the same
# micro-batches
# --------------------------------------------------------------------------------------------------

MODEL = ROOT / "prorl" / "assets" / "tiny-reasoner"


def _snippet(name):
    text = (ROOT / "kernels" / "ADAPTERS.md").read_text()
    m = re.search(rf"<!-- snippet:{re.escape(name)} -->\s*```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"no snippet {name!r} in kernels/ADAPTERS.md"
    return m.group(1)


def _train(is_mode, tmp_path):
    """Three optimizer steps of TRL's GRPOTrainer with the snippet's subclass (TRL's defaults plus
    beta=0.04 and num_iterations=2); each micro-batch's loss, parameter gradient and logged metrics,
    ours and TRL's. is_mode: None (TRL's generation, no importance sampling) or a
    vllm_importance_sampling_mode, with completions and sampler log-probs from a rollout function
    standing in for vLLM."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    namespace = {}
    exec(_snippet("trl"), namespace)
    records = []

    class Probe(namespace["FusedGRPOTrainer"]):
        def _compute_loss(self, model, inputs):
            params = [p for p in model.parameters() if p.requires_grad]
            logged = self._metrics["train"]
            before = {k: len(v) for k, v in logged.items()}
            ours = super()._compute_loss(model, inputs)  # the snippet's
            ours_logged = {k: v[-1] for k, v in logged.items() if len(v) > before.get(k, 0)}
            ours_grad = torch.autograd.grad(ours, params, retain_graph=True)
            before = {k: len(v) for k, v in logged.items()}
            theirs = grpo_trainer.GRPOTrainer._compute_loss(self, model, inputs)
            theirs_logged = {k: v.pop() for k, v in logged.items() if len(v) > before.get(k, 0)}
            theirs_grad = torch.autograd.grad(theirs, params)
            records.append(
                (ours.detach(), theirs.detach(), ours_grad, theirs_grad, ours_logged, theirs_logged)
            )
            return ours

    tok = PreTrainedTokenizerFast.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64)

    def rollout(prompts, trainer):  # vLLM's part: completions and their sampler log-probs
        g = torch.Generator().manual_seed(len(records))
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        lengths = torch.randint(1, 9, (len(prompts),), generator=g).tolist()
        completion_ids = [torch.randint(3, 99, (n,), generator=g).tolist() for n in lengths]
        logprobs = []
        with torch.no_grad():
            for p, c in zip(prompt_ids, completion_ids):
                logits = trainer.model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
                lp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(c)[:, None])[
                    :, 0
                ]
                logprobs.append(
                    (lp + 0.3 * torch.randn(len(c), generator=g, dtype=lp.dtype)).tolist()
                )
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        beta=0.04,
        num_iterations=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=3e-3,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        log_completions=False,
        **({} if is_mode is None else dict(vllm_importance_sampling_mode=is_mode)),
    )
    ds = Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)])
    reward = lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Probe(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=ds,
            processing_class=tok,
            **({} if is_mode is None else dict(rollout_func=rollout)),
        )
    if (
        is_mode is not None
    ):  # TRL's vLLM path from here on: it computes the IS ratio from the sampler log-probs
        trainer.use_vllm = True
        trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
        trainer._last_loaded_step = -1
    threads = torch.get_num_threads()
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return records


@pytest.mark.slow
@pytest.mark.parametrize(
    "is_mode", [None, "sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]
)
def test_snippet_in_a_real_grpo_trainer(is_mode, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is local: nothing may be downloaded
    records = _train(is_mode, tmp_path)
    assert len(records) == 6  # 3 optimizer steps x 2 micro-batches
    clipped = 0
    for ours, theirs, ours_grad, theirs_grad, ours_logged, theirs_logged in records:
        # float32 log-probs (TRL's fused LM head): float32 round-off, not the 0.4% / 7% of a wrong
        # setting
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        scale = max(g.abs().max() for g in theirs_grad)
        assert scale > 0
        assert max((a - b).abs().max() for a, b in zip(ours_grad, theirs_grad)) <= 1e-4 * scale
        assert set(ours_logged) == set(TRL_METRICS) == set(theirs_logged)
        for k, v in theirs_logged.items():
            assert ours_logged[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        clipped += theirs_logged["clip_ratio/region_mean"] > 0
    assert clipped > 0  # the second iteration over a batch is off-policy enough to clip
