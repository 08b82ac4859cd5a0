"""A verl user's second hour (issue 30): a preset without data, a response budget past the model's
context, a failed start, a run with nothing validated, evaluation progress, and verl's metric names
in a step.

References: the tiny reasoner's config.json (a context of 256 tokens), its digit-sum prompts (25
tokens each, counted with its tokenizer here), the sampler's own Rollouts (when each sample
stopped), and verl 0.9.1's metric names (prorl.metrics.VERL_METRICS; tests/peers/test_verl_config.py
finds each in verl's source).
"""

import json
import os
from pathlib import Path

import pytest
from prorl.engine.model import load_hf
from prorl.engine.rollout import NativeGenerator, SamplingParams
from train_helpers import ROOT, run, train_command
from transformers import PreTrainedTokenizerFast

import prorl.eval_run as eval_module
import prorl.rewards as rewards
from prorl import data
from prorl.config import ConfigError, load_config
from prorl.lifecycle import Fatal
from prorl.metrics import VERL_METRICS
from prorl.report import Reporter, accuracy_line
from prorl.rewards.pool import RewardPool
from prorl.train import check_context, main, parse_config
from prorl.trainer import Trainer

TINY = str(Path(ROOT) / "prorl" / "assets" / "tiny-reasoner")
CONTEXT = json.load(open(os.path.join(TINY, "config.json")))["max_position_embeddings"]


def test_a_preset_for_another_model_without_data_is_refused():
    with pytest.raises(ConfigError, match="--config prorl_v2_1.5b .* sets no data.train_files"):
        parse_config(["--config", "prorl_v2_1.5b", "model.path=/models/x"])
    assert main(["--config", "prorl_v2_1.5b", "model.path=/models/x"]) == 2
    # on purpose: the builtin task named, or data given
    cfg, _, _ = parse_config(
        ["--config", "prorl_v2_1.5b", "model.path=/m", "data.builtin_task=digit_sums"]
    )
    assert cfg.data.builtin_task == "digit_sums"
    parse_config(["--config", "prorl_v2_1.5b", "model.path=/m", "data.train_files=/d/t.parquet"])
    parse_config(["--config", "default"])  # the embedded default trains its builtin task


def test_a_response_budget_past_the_context_is_named_at_start():
    cfg = load_config("default", [f"rollout.max_response_tokens={CONTEXT}"])
    with pytest.raises(Fatal) as info:
        check_context(cfg, TINY)
    msg = str(info.value)
    assert info.value.code == 2 and f"rollout.max_response_tokens={CONTEXT}" in msg
    assert f"context of {CONTEXT} tokens" in msg and "max_position_embeddings" in msg
    said = []
    cfg = load_config(
        "default", [f"rollout.max_response_tokens={CONTEXT - 10}", "data.max_prompt_tokens=64"]
    )
    check_context(cfg, TINY, said.append)
    assert (
        len(said) == 1
        and f"64 + rollout.max_response_tokens={CONTEXT - 10} = {CONTEXT + 54}" in said[0]
    )
    check_context(load_config("default"), TINY, said.append)  # 64 + 40 fit in 256: nothing said
    assert len(said) == 1


def test_a_failed_start_leaves_no_empty_checkpoints_folder(tmp_path):
    out = tmp_path / "run"
    done = run(
        train_command(out, ["reward.function=/no/such/reward.py:compute_score"], nproc=None), 300
    )
    assert done.returncode == 2, done.stderr
    assert "/no/such/reward.py" in done.stderr and "'compute_score'" in done.stderr
    assert out.is_dir() and "checkpoints" not in os.listdir(out)


def test_nothing_validated_is_said_in_words_and_validation_time_has_verls_name(tmp_path):
    assert "nan" not in accuracy_line([]) and "not measured" in accuracy_line([])
    assert (
        accuracy_line([(0, 0.25), (5, 0.5)])
        == "held-out accuracy 25.0% -> 50.0% (mean of the last 1 evaluations)"
    )
    cfg = load_config("default", [f"output_dir={tmp_path}", "logging.tensorboard=false"])
    reporter = Reporter(cfg, 0)
    reporter.start()
    reporter.validation(0, {"val/accuracy": 0.5}, 3.0)
    reporter.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["timing_s/testing"] == 3.0 and "timing_s/val" not in row


@pytest.fixture(scope="module")
def tiny():
    return load_hf(TINY), PreTrainedTokenizerFast.from_pretrained(TINY)


def test_the_native_sampler_reports_each_sample_as_it_finishes(tiny):
    model, tok = tiny
    prompts, _, _ = data.encode_prompts(data.builtin("digit_sums", n=4, split="val"), tok, 64)
    calls = []
    params = SamplingParams(
        n=4, temperature=1.0, max_new_tokens=30, stop_token_ids=data.stop_token_ids(tok, TINY)
    )
    out = NativeGenerator(model).generate(prompts, params, on_finished=calls.append)
    # one report per decode step at which samples stopped (a stop sample of length L stopped at step
    # L - 1), plus one for the samples cut at max_new_tokens
    stopped = [len(s.token_ids) for s in out.samples if s.finish_reason == "stop"]
    cut = sum(s.finish_reason == "length" for s in out.samples)
    expected = [stopped.count(length) for length in sorted(set(stopped))] + ([cut] if cut else [])
    assert calls == expected and sum(calls) == 16 and len(calls) > 1


def test_evaluation_progress_is_per_finished_sample(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(eval_module, "PROGRESS_EVERY_S", 0.0)
    lines = []
    examples = data.builtin("digit_sums", n=4, split="val")
    inputs = eval_module.EvalInputs(model=model, tokenizer=tok)
    settings = eval_module.EvalSettings(k=2, max_tokens=30, prompts_per_generate=4, num_workers=1)
    eval_module.evaluate(examples, inputs, settings, log=lines.append)
    progress = [line for line in lines if "samples finished" in line]
    generate_calls = [line for line in lines if line.startswith("eval: generated")]
    assert len(generate_calls) == 1 and len(progress) > 1  # several reports within the one call
    assert progress[-1].startswith("eval: 8/8 samples finished")


def test_a_step_carries_verls_metric_names_and_the_reward_functions_extras(tiny, tmp_path):
    """One trainer step scored by a verl reward function (constant -0.5, extras `one` and `chars`):
    every verl name present, no old name, the score verl's convention allows, the extras
    averaged."""
    fn = tmp_path / "const.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': -0.5, 'one': 1, 'chars': "
        "len(solution_str), 'note': 'text is not a metric'}\n"
    )
    rewards.use_function(f"{fn}:compute_score")
    try:
        _, tok = tiny
        train = data.builtin("digit_sums", n=16, seed=0, split="train")
        prompt_len = {len(p) for p in data.encode_prompts(train, tok, 64)[0]}
        assert prompt_len == {25}  # every digit-sum prompt: 25 tokens
        over = [
            "trainer.prompts_per_step=4",
            "rollout.n=4",
            "rollout.max_response_tokens=16",
            "trainer.mini_batches=1",
        ]
        over += [
            "algorithm.dynamic_sampling=false",
            "reward.length_penalty=false",
            "reward.c_stop=1.0",
        ]
        with RewardPool(num_workers=1, timeout_s=30.0, preload=()) as pool:
            for limit, clipped in ((25, 1.0), (26, 0.0)):
                cfg = load_config(
                    "default", [f"model.path={TINY}", f"data.max_prompt_tokens={limit}", *over]
                )
                m = Trainer(cfg, TINY, tok, train, [], pool).step()
                # verl's: prompts at the prompt budget
                assert m["prompt_length/clip_ratio"] == clipped
    finally:
        rewards.use_function(None)
    missing = [k for k in VERL_METRICS if k not in m]
    assert not missing, missing
    old = ("timing_s/old_logp", "timing_s/update", "timing_s/sync", "timing_s/val")
    assert not [k for k in old if k in m]
    assert m["critic/score/mean"] == -0.5 and m["reward_extra/one/mean"] == 1.0
    assert m["reward_extra/chars/mean"] >= 0 and "reward_extra/note/mean" not in m
    samples = 4 * 4
    total = (m["prompt_length/mean"] + m["response_length/mean"]) * samples
    assert m["perf/total_num_tokens"] == pytest.approx(total)
    assert m["perf/throughput"] == pytest.approx(total / m["timing_s/step"])  # one rank
    assert m["perf/time_per_step"] == m["timing_s/step"]


def test_a_run_from_a_verl_config_with_a_verl_reward_file(tmp_path):
    """The issue's end state, in miniature: `prorl/train.py --verl-config` on a verl-style file with
    verl overrides, verl's compute_score file scoring in training and validation, verl's names in
    metrics.jsonl."""
    fn = tmp_path / "gsm8k_like.py"
    fn.write_text(
        "import re\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    found = re.findall(r'boxed\\{(\\d+)\\}', solution_str)\n"
        "    right = bool(found) and found[-1] == str(ground_truth)\n"
        "    return {'score': 1.0 if right else -1.0, 'acc': float(right)}\n"
    )
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    data.write_jsonl(data.builtin("digit_sums", n=32, seed=0, split="train"), str(train_file))
    data.write_jsonl(data.builtin("digit_sums", n=4, seed=0, split="val"), str(val_file))
    out = tmp_path / "run"
    layout = str(Path(__file__).resolve().parent / "data" / "verl_layout" / "trainer.yaml")
    verl = [
        f"actor_rollout_ref.model.path={TINY}",
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
    ]
    verl += [
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_prompt_length=64",
    ]
    verl += ["data.max_response_length=24", "trainer.total_training_steps=2", "trainer.test_freq=2"]
    verl += [f"custom_reward_function.path={fn}", "reward.num_workers=1", "trainer.save_freq=-1"]
    done = run(
        train_command(
            out, ["--verl-config", layout, *verl, "logging.tensorboard=false"], nproc=None
        ),
        600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "trainer.prompts_per_step=4" in done.stdout
        and "reward self-test: function ok" in done.stdout
    )
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert not [k for k in VERL_METRICS if k not in r]
        # score = 2 acc - 1 for every sample; no dynamic sampling (verl's default): the same samples
        assert r["critic/score/mean"] == pytest.approx(2 * r["reward_extra/acc/mean"] - 1)
    final = rows[-1]
    assert "timing_s/testing" in final and "val-core/math/acc/mean@1" in final
    assert final["val-core/math/reward/mean@1"] == pytest.approx(
        2 * final["val-core/math/acc/mean@1"] - 1
    )
