"""prorl.eval: the pass@k estimator against brute-force enumeration, and an end-to-end evaluation of
a tiny random checkpoint whose scores are known by construction (a verifier driven by the ground
truth) or recomputed here from the per-sample file eval.py writes."""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections import defaultdict

import pytest
import torch

import prorl.rewards as rewards
from prorl import data
from prorl.eval import EvalInputs, EvalSettings, evaluate, main
from prorl.eval_metrics import pass_at_k, pass_ks, summarize


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (c correct) that hold a correct one."""
    flags = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(flags, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_hand_cases():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5  # 3 of the 6 pairs hold the correct sample
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(16, 0, 16) == 0.0 and pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(16, 2, 8) == pytest.approx(1 - 3003 / 12870)  # C(14,8) / C(16,8)
    for bad in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (
                    n,
                    c,
                    k,
                )
    # pass@1 is the plain fraction correct (the "mean over k" of docs/recipe.md)
    assert all(pass_at_k(16, c, 1) == pytest.approx(c / 16) for c in range(17))


def test_pass_ks():
    assert pass_ks(1) == [1] and pass_ks(2) == [1, 2] and pass_ks(16) == [1, 2, 4, 8, 16]
    assert pass_ks(6) == [1, 2, 4, 6]


def _record(index, source, score, correct=None, length=3, finish="stop"):
    return dict(
        index=index,
        data_source=source,
        score=score,
        correct=score >= 1.0 if correct is None else correct,
        timed_out=False,
        errored=False,
        finish_reason=finish,
        response_tokens=length,
    )


def test_summarize_hand_made():
    # math: prompt 0 has 1 of 4 correct, prompt 1 has 4 of 4; ifeval: continuous scores, none
    # perfect
    recs = [_record(0, "math", s) for s in (1, 0, 0, 0)] + [
        _record(1, "math", 1.0) for _ in range(4)
    ]
    recs += [_record(2, "ifeval", s, finish="length") for s in (0.5, 0.25, 0.5, 0.75)]
    out = summarize(recs, 4, filtered={"math": 2})
    m, f = out["by_source"]["math"], out["by_source"]["ifeval"]
    assert m["primary"] == "pass@1" and f["primary"] == "mean_score"
    assert (m["prompts"], m["samples"], m["filtered"]) == (2, 8, 2)
    assert m["pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["pass@4"] == 1.0 and m["mean_score"] == pytest.approx(5 / 8)
    assert (
        f["pass@4"] == 0.0 and f["mean_score"] == pytest.approx(0.5) and f["truncated_frac"] == 1.0
    )
    assert out["all"]["prompts"] == 3 and out["all"]["pass@1"] == pytest.approx(1.25 / 3)
    with pytest.raises(ValueError, match="k=4"):
        summarize(recs[:-1], 4)


# -- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random ~0.5M-parameter Qwen2 with the warm-start's character tokenizer and chat
    template."""
    from prorl.engine.model import Decoder, save_hf

    from prorl.warmstart import build_tokenizer, tiny_config

    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    model = Decoder(tiny_config(len(tokenizer)))
    model.init_weights(torch.Generator().manual_seed(0))
    save_hf(model, str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture
def eval_verifier():
    saved = dict(rewards._REGISTRY)
    rewards.register("evaltest", "eval_helpers:by_ground_truth")
    yield
    rewards._REGISTRY.clear()
    rewards._REGISTRY.update(saved)


def _example(source, truth, text="1+2+3="):
    return data.Example([{"role": "user", "content": text}], source, truth)


EXAMPLES = [
    _example("evaltest/binary", "always"),
    _example("evaltest/binary", "never"),
    _example("evaltest/binary", "parity", "9+9+9="),
    _example("evaltest/binary", "always", "x" * 200),  # 200+ prompt tokens: filtered, not truncated
    _example("evaltest/graded", "half"),
]
K = 4


def _recompute(samples: list[dict], k: int) -> dict:
    """pass@j (by subset enumeration) and mean score per data source, from the per-sample rows."""
    by_source: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        by_source[s["data_source"]][s["index"]].append(s)
    out = {}
    for ds, prompts in by_source.items():
        flat = [s for rows in prompts.values() for s in rows]
        out[ds] = {"prompts": len(prompts), "mean_score": sum(s["score"] for s in flat) / len(flat)}
        for j in pass_ks(k):
            per_prompt = [
                sum(any(r["score"] >= 1.0 for r in sub) for sub in itertools.combinations(rows, j))
                / math.comb(len(rows), j)
                for rows in prompts.values()
            ]
            out[ds][f"pass@{j}"] = sum(per_prompt) / len(per_prompt)
    return out


def test_cli_end_to_end(tiny_model_dir, eval_verifier, tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    data.write_jsonl(EXAMPLES, str(path))
    out_dir = tmp_path / "out"
    args = ["--model", tiny_model_dir, "--data", str(path), "--k", str(K), "--max-tokens", "6"]
    args += [
        "--max-prompt-tokens",
        "64",
        "--temperature",
        "1.0",
        "--num-workers",
        "1",
        "--out",
        str(out_dir),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "evaltest/binary" in printed and "evaltest/graded" in printed and "\nall " in printed

    results = json.loads((out_dir / "results.json").read_text())
    samples = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    with open(out_dir / "results.csv", newline="") as f:
        csv_rows = {r["data_source"]: r for r in csv.DictReader(f)}

    # the long prompt is filtered and counted; every kept prompt has K samples
    assert results["n_examples"] == 5 and results["n_filtered"] == 1
    assert results["by_source"]["evaltest/binary"]["filtered"] == 1
    assert sorted({s["index"] for s in samples}) == [0, 1, 2, 4] and len(samples) == 4 * K
    assert all(1 <= s["response_tokens"] <= 6 for s in samples)

    # known by construction
    score_of = {i: [s["score"] for s in samples if s["index"] == i] for i in (0, 1, 2, 4)}
    assert score_of[0] == [1.0] * K and score_of[1] == [0.0] * K and score_of[4] == [0.5] * K
    # parity: the recorded score is the stated function of the recorded response
    for s in samples:
        if s["index"] == 2:
            assert s["score"] == float(len(s["response"]) % 2 == 0)
    graded = results["by_source"]["evaltest/graded"]
    assert graded["mean_score"] == 0.5 and graded["pass@1"] == 0.0 and graded["pass@4"] == 0.0
    c = sum(s == 1.0 for s in score_of[2])  # correct samples of the parity prompt
    binary = results["by_source"]["evaltest/binary"]
    assert binary["pass@1"] == pytest.approx((1 + 0 + c / K) / 3)
    assert binary["pass@4"] == pytest.approx((1 + 0 + (c > 0)) / 3)

    # every number equals a brute-force recomputation from the per-sample file, in JSON and CSV
    expected = _recompute(samples, K)
    for ds, metrics in expected.items():
        for name, value in metrics.items():
            assert results["by_source"][ds][name] == pytest.approx(value), (ds, name)
            assert float(csv_rows[ds][name]) == pytest.approx(value), (ds, name)
    overall = _recompute([dict(s, data_source="all") for s in samples], K)["all"]
    for name, value in overall.items():
        assert results["all"][name] == pytest.approx(value)
        assert float(csv_rows["all"][name]) == pytest.approx(value)


def test_api_with_loaded_model_and_pool(tiny_model_dir, eval_verifier):
    from prorl.engine.model import load_hf
    from transformers import PreTrainedTokenizerFast

    from prorl.rewards.pool import RewardPool

    model = load_hf(tiny_model_dir).train()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    with RewardPool(num_workers=1, preload=()) as pool:
        inputs = EvalInputs(model=model, tokenizer=tokenizer, pool=pool)
        # two generate calls, the first scored while the second runs
        settings = EvalSettings(k=2, max_tokens=4, prompts_per_generate=1)
        res = evaluate(EXAMPLES[:2], inputs, settings, log=None)
    assert model.training  # restored
    assert res["all"]["pass@1"] == 0.5 and res["all"]["pass@2"] == 0.5
    assert [(s["index"], s["sample"]) for s in res["samples"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.tally("bad_inputs")
def test_unimplemented_backend_is_a_clear_error(tiny_model_dir, capsys):
    assert main(["--model", tiny_model_dir, "--builtin", "digit_sums", "--backend", "vllm"]) == 2
    assert "not implemented yet" in capsys.readouterr().err
    with pytest.raises(NotImplementedError, match="native"):
        evaluate([], EvalInputs(tiny_model_dir), EvalSettings(backend="vllm"))


def test_an_interrupted_evaluation_reports_what_it_scored(tmp_path):
    """Ctrl-C / SIGTERM during generation (prorl.eval's main asks for partial results): the prompts
    already generated are scored and summarised, the result says it was interrupted; without the
    request the interrupt propagates (the trainer's validation must abort at once on a second
    signal)."""
    from prorl.engine.model import load_hf
    from prorl.engine.rollout import NativeGenerator
    from transformers import PreTrainedTokenizerFast

    path = str(
        __import__("pathlib").Path(__file__).resolve().parents[2]
        / "prorl"
        / "assets"
        / "tiny-reasoner"
    )
    model, tok = load_hf(path), PreTrainedTokenizerFast.from_pretrained(path)
    native = NativeGenerator(model)

    class Interrupted:
        calls = 0

        def generate(self, prompts, params, on_finished=None):
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt
            return native.generate(prompts, params, on_finished)

    examples = data.builtin("digit_sums", n=6, split="val")
    kw = dict(k=2, max_tokens=40, prompts_per_generate=2, num_workers=1)
    inputs = EvalInputs(model=model, tokenizer=tok, generator=Interrupted())
    res = evaluate(examples, inputs, EvalSettings(partial_on_interrupt=True, **kw), log=None)
    assert res["interrupted"] and res["n_evaluated"] == 2 and res["all"]["prompts"] == 2
    inputs.generator = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        evaluate(examples, inputs, EvalSettings(**kw), log=None)


def test_two_files_of_one_data_source_get_a_row_each(tiny_model_dir, eval_verifier, tmp_path):
    """Two benchmark files of the same data_source (issue 40): the source's row merges them, and
    each file has its own row; avg@k (the mean correctness of k samples) is named."""
    a, b, out_dir = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out"
    data.write_jsonl([_example("evaltest/binary", "always")], str(a))
    data.write_jsonl([_example("evaltest/binary", "never")] * 2, str(b))
    args = ["--model", tiny_model_dir, "--data", str(a), str(b), "--k", str(K), "--max-tokens",
            "4", "--num-workers", "1", "--out", str(out_dir)]  # fmt: skip
    assert main(args) == 0
    results = json.loads((out_dir / "results.json").read_text())
    assert results["by_source"]["evaltest/binary"]["pass@1"] == pytest.approx(1 / 3)
    assert results["by_file"][f"evaltest/binary ({a})"]["pass@1"] == 1.0
    assert results["by_file"][f"evaltest/binary ({b})"]["pass@1"] == 0.0
    assert results["by_file"][f"evaltest/binary ({b})"]["prompts"] == 2
    assert results["all"][f"avg@{K}"] == results["all"]["pass@1"] == pytest.approx(1 / 3)
    with open(out_dir / "results.csv", newline="") as f:
        rows = [r["data_source"] for r in csv.DictReader(f)]
    assert rows == ["evaltest/binary", f"evaltest/binary ({a})", f"evaltest/binary ({b})", "all"]


def test_majority_voting_on_math_answers(eval_verifier):
    """maj@k by hand: prompt 0 answers 3, 3, 4 (3 right): right; prompt 1 answers 5, 6, 6 (5 right):
    wrong; prompt 2 gives no answer: wrong; ties go to the answer counted first. A source the
    math verifier does not score gets no maj@k."""
    from prorl.eval_metrics import summarize

    def rec(i, j, text, ok):
        return dict(index=i, sample=j, data_source="openai/gsm8k", response=text, correct=ok,
                    score=float(ok), timed_out=False, errored=False, finish_reason="stop",
                    response_tokens=3)  # fmt: skip

    records = [rec(0, 0, "so \\boxed{3}", True), rec(0, 1, "<think>x</think>\\boxed{ 3 }", True),
               rec(0, 2, "\\boxed{4}", False), rec(1, 0, "#### 5", True),
               rec(1, 1, "\\boxed{6}", False), rec(1, 2, "Answer: 6", False),
               rec(2, 0, "no idea", False), rec(2, 1, "<think>cut", False),
               rec(2, 2, "", False)]  # fmt: skip
    out = summarize(records, 3)["all"]
    assert out["maj@3"] == pytest.approx(1 / 3) and out["avg@3"] == pytest.approx(3 / 9)
    tie = [rec(0, 0, "\\boxed{1}", False), rec(0, 1, "\\boxed{2}", True)]
    assert summarize(tie, 2)["all"]["maj@2"] == 0.0
    other = [dict(r, data_source="evaltest/binary") for r in records]
    assert "maj@3" not in summarize(other, 3)["all"]
