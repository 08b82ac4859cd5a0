"""FusedGRPOTrainer against TRL 1.16's own GRPOTrainer: the same training run, the same numbers.

Each test trains the tiny local Qwen2 (prorl/assets, float32) twice from the same seed, once with
GRPOTrainer and once with FusedGRPOTrainer, and compares every micro-batch's loss, the logged
metrics and the parameter update (final - initial weights). Both runs sample the same completions
(one generation round, sampled before any update), so the two differ only where the log-probs are
computed: TRL's chunked head on the logits vs linear_ppo_loss / linear_logprob_entropy on the hidden
states, float32 round-off apart. The fused run must also never reach TRL's head
(`ChunkedLogProbFunction`) nor the LM-head module with gradients on.
"""

import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl); CI installs it")
pytest.importorskip("datasets", reason="TRL's trainer needs datasets (installed with trl)")

MODEL = Path(__file__).resolve().parents[2] / "prorl" / "assets" / "tiny-reasoner"
METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _snippet(name):
    text = (MODEL.parents[2] / "kernels" / "ADAPTERS.md").read_text()
    m = re.search(rf"<!-- snippet:{re.escape(name)} -->\s*```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"no snippet {name!r} in kernels/ADAPTERS.md"
    return m.group(1)


def _setup(tmp_path, **config):
    """(model, tok, reward, args, ds) for a small GRPO run; `config` overrides GRPOConfig fields."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    kw = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        gradient_accumulation_steps=2,
        num_iterations=2,
        # 2 iterations x 2 micro-batches: one generation round, then two optimizer steps
        max_steps=2,
        # an update linear in the gradient (Adam's first steps are ~lr sign(g): ill-posed)
        optim="sgd",
        learning_rate=2.0,  # large enough for the second iteration to clip
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        log_completions=False,
        temperature=0.9,
    )
    kw.update(config)
    args = trl.GRPOConfig(**kw)
    ds = Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)])

    def reward(completions, **_):
        return [float(sum(map(ord, c)) % 7) for c in completions]

    return model, tok, reward, args, ds


def _rollout(tok):
    """vLLM's part for TRL's vLLM path: completions and sampler log-probs (the model's plus
    noise)."""

    def rollout(prompts, trainer):
        g = torch.Generator().manual_seed(0)
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        lengths = torch.randint(1, 9, (len(prompts),), generator=g).tolist()
        completion_ids = [torch.randint(3, 99, (n,), generator=g).tolist() for n in lengths]
        logprobs = []
        with torch.no_grad():
            for p, c in zip(prompt_ids, completion_ids):
                logits = trainer.model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
                lp = torch.log_softmax(logits / trainer.temperature, -1)
                lp = lp.gather(-1, torch.tensor(c)[:, None])[:, 0]
                logprobs.append((lp + 0.3 * torch.randn(len(c), generator=g)).tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout


def _train(cls, tmp_path, is_mode=None, **config):
    """Train with `cls`: (losses per micro-batch, logged metrics, initial and final parameters,
    whether gradients were on at each LM-head module call)."""
    if is_mode is not None:
        config = dict(config, vllm_importance_sampling_mode=is_mode)
    model, tok, reward, args, ds = _setup(tmp_path, **config)
    initial = {k: p.detach().clone() for k, p in model.named_parameters()}
    losses, head_calls = [], []
    hook = lambda *_: head_calls.append(torch.is_grad_enabled())
    model.get_output_embeddings().register_forward_hook(hook)

    class Recording(cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(loss.detach().clone())
            return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = {} if is_mode is None else dict(rollout_func=_rollout(tok))
        trainer = Recording(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=ds,
            processing_class=tok,
            **extra,
        )
    # TRL's vLLM path from here on: it computes the IS ratio from the sampler's
    if is_mode is not None:
        trainer.use_vllm = True
        trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
        trainer._last_loaded_step = -1
    threads = torch.get_num_threads()
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    final = {k: p.detach().clone() for k, p in model.named_parameters()}
    logged = [h for h in trainer.state.log_history if "entropy" in h]  # one per optimizer step
    return losses, logged, initial, final, head_calls


def _compare(tmp_path, monkeypatch, is_mode=None, rtol=1e-5, **config):
    from prorl.kernels.adapters import FusedGRPOTrainer
    from trl.trainer import utils as trl_utils

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    stock = _train(trl.GRPOTrainer, tmp_path / "stock", is_mode, **config)

    calls = []
    original = trl_utils._ChunkedLogProbFunction

    class Counting(original):
        @staticmethod
        def apply(*args):
            calls.append("trl head")
            return original.apply(*args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Counting)
    fused = _train(FusedGRPOTrainer, tmp_path / "fused", is_mode, **config)
    assert calls == []  # neither the update nor the old/reference passes reached TRL's head
    # the LM-head module ran for generation only, without gradients
    assert fused[4] and not any(fused[4])

    losses, theirs = torch.stack(fused[0]), torch.stack(stock[0])
    assert len(losses) == 4
    torch.testing.assert_close(losses, theirs, rtol=rtol, atol=1e-7)
    assert len(fused[1]) == len(stock[1]) == config.get("max_steps", 2)
    for ours_log, their_log in zip(fused[1], stock[1]):
        for k in METRICS + (("kl",) if config.get("beta") else ()):
            assert ours_log[k] == pytest.approx(their_log[k], rel=rtol, abs=1e-7), k
    # parameter updates: float32 round-off of the update, not of the weights
    for name, before in stock[2].items():
        ours, ref = fused[3][name] - before, stock[3][name] - before
        scale = ref.abs().max()
        assert scale > 0, name
        assert (ours - ref).abs().max() <= 10 * rtol * scale, name
    return stock, fused


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss_type,beta,bias_correction",
    [
        ("dapo", 0.0, True),
        ("grpo", 0.04, True),
        ("bnpo", 0.04, False),
        ("dr_grpo", 0.04, True),
        ("dapo", 0.04, False),
    ],
)
def test_fused_trainer_matches_grpo_trainer(
    loss_type, beta, bias_correction, tmp_path, monkeypatch
):
    stock, _ = _compare(
        tmp_path,
        monkeypatch,
        loss_type=loss_type,
        beta=beta,
        use_bias_correction_kl=bias_correction,
    )
    # the second iteration is off-policy enough to clip
    assert stock[1][-1]["clip_ratio/region_mean"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_fused_trainer_on_policy_with_truncated_completions_masked(
    loss_type, tmp_path, monkeypatch
):
    """num_iterations=1: TRL skips the old log-prob pass (old = the current log-prob, detached);
    with mask_truncated_completions every completion that hit max_completion_length is left out."""
    stock, _ = _compare(
        tmp_path,
        monkeypatch,
        loss_type=loss_type,
        num_iterations=1,
        max_steps=1,
        gradient_accumulation_steps=4,
        max_completion_length=14,
        mask_truncated_completions=True,
    )
    assert stock[1][0]["clip_ratio/region_mean"] == 0.0  # ratio 1 on-policy
    assert 0 < stock[1][0]["completions/clipped_ratio"] < 1  # some completions truncated, some not


@pytest.mark.slow
@pytest.mark.parametrize("is_mode,beta", [("token_truncate", 0.04), ("sequence_mask", 0.0)])
def test_fused_trainer_with_vllm_importance_sampling(is_mode, beta, tmp_path, monkeypatch):
    """TRL's vLLM path (a rollout function stands in for vLLM): TRL computes the IS ratio from the
    sampler log-probs and its old log-prob pass (ours: fused), the loss weighs by it. A
    sequence-level ratio is exp(sum over the row of old - sampler): the old passes' float32
    round-off grows with it (1e-4)."""
    kw = dict(loss_type="dapo", beta=beta, use_bias_correction_kl=False)  # through linear_ppo_loss
    _compare(tmp_path, monkeypatch, is_mode, rtol=1e-4, **kw)


@pytest.mark.parametrize(
    "config,named",
    [
        (dict(loss_type="cispo"), "loss_type='cispo'"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
        (dict(delta=2.0), "delta=2.0"),
    ],
)
def test_unsupported_settings_refused_when_built(config, named, tmp_path, monkeypatch):
    from prorl.kernels.adapters import FusedGRPOTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok, reward, args, ds = _setup(tmp_path, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=re.escape(named)):
            FusedGRPOTrainer(
                model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok
            )


def test_logit_softcapping_refused_when_built(tmp_path, monkeypatch):
    from prorl.kernels.adapters import FusedGRPOTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok, reward, args, ds = _setup(tmp_path)
    model.config.final_logit_softcapping = 30.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
            FusedGRPOTrainer(
                model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok
            )


def test_adapters_snippet_trains(tmp_path, monkeypatch):
    from prorl.kernels.adapters import FusedGRPOTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer, reward, args, dataset = _setup(tmp_path, max_steps=1)
    before = model.model.norm.weight.detach().clone()
    namespace = dict(model=model, tokenizer=tokenizer, reward=reward, args=args, dataset=dataset)
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            exec(_snippet("trl-trainer"), namespace)
        finally:
            torch.set_num_threads(threads)
    assert type(namespace["trainer"]) is FusedGRPOTrainer
    assert not torch.equal(model.model.norm.weight, before)  # it trained
