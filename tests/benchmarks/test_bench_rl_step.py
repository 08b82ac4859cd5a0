"""Smoke test of benchmarks/rl_step.py: one step each of prorl and TRL's GRPOTrainer on the tiny
reasoner into a temp CSV, and the ablation swaps checked against prorl's own path. Never asserts
speed."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import rl_step


def test_rl_step_prorl_and_trl_one_step(tmp_path, run_main):
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
    pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs datasets")
    out = tmp_path / "rl_step.csv"
    args = "--providers prorl,trl --models tiny --prompts 2 --n 2 --max-new 8".split()
    args += ["--warmup", "0", "--reps", "1", "--threads", "1", "--out", str(out), "--no-plot"]
    rows = run_main(rl_step.main, args, out, "speed-up vs trl")
    by = {(r["provider"], r["mode"], r["metric"]): r for r in rows}
    for provider in ("prorl", "trl"):
        for phase in ("gen", "reward", "old_logp", "update", "other", "step"):
            assert (provider, phase, "time") in by, (provider, phase)
        for metric in ("tokens_per_s", "response_tokens", "peak_memory"):
            assert (provider, "step", metric) in by
        step = float(by[(provider, "step", "time")]["p50"])
        assert float(by[(provider, "gen", "time")]["p50"]) > 0
        assert float(by[(provider, "update", "time")]["p50"]) > 0
        # the phases are disjoint parts of the step: what is left over is not negative
        assert float(by[(provider, "other", "time")]["p50"]) > -0.01 * step
        assert 0 < float(by[(provider, "step", "response_tokens")]["p50"]) <= 2 * 2 * 8
    for r in rows:
        assert r["name"] == "rl_step" and r["shape"] == "tiny P=2 n=2 L=8"
        p20, p50, p80 = float(r["p20"]), float(r["p50"]), float(r["p80"])
        assert all(math.isfinite(x) for x in (p20, p50, p80)) and p20 <= p50 <= p80
        assert "OMP_NUM_THREADS=1" in r["versions"] and "threads=1" in r["versions"]


@pytest.fixture(scope="module")
def trainer():
    from transformers import PreTrainedTokenizerFast

    path = rl_step.model_path("tiny")
    run = rl_step.prorl_trainer(rl_step.work("tiny", 2, 2, 8), path, gpu=False)  # no reward pool
    return run.trainer, PreTrainedTokenizerFast.from_pretrained(path), path


def test_ablations_compute_what_prorl_computes(trainer):
    from prorl.engine.rollout import SamplingParams
    from prorl.kernels import linear_logprob_entropy

    from benchmarks._rl_step_peers import HFGenerator, naive_lle, padded_logprobs
    from prorl.packing import pack

    tr, tok, path = trainer
    prompts = tr.sampler.prompts[:2]
    # transformers.generate: its sampled-token log-probs are the policy's (same weights, same
    # distribution)
    params = SamplingParams(
        n=2, temperature=1.0, max_new_tokens=10, stop_token_ids=tr.stop_ids, seed=1
    )
    samples = HFGenerator(tr.policy, path, tok.pad_token_id).generate(prompts, params).samples
    assert len(samples) == 4 and all(
        1 <= len(s.token_ids) == len(s.logprobs) <= 10 for s in samples
    )
    # sequences of unequal length, so that padding is real
    seqs = [(prompts[s.prompt_index], s.token_ids[: 3 + i]) for i, s in enumerate(samples)]
    batch = pack([(p, [t]) for p, t in seqs], share=False)
    logp, ent = tr.updater.logprobs(tr.policy, batch, grad=False, entropy=True)
    sampler = torch.tensor([x for (_, t), s in zip(seqs, samples) for x in s.logprobs[: len(t)]])
    torch.testing.assert_close(logp, sampler, atol=1e-4, rtol=0)
    # padded [S, Lmax] batch: the same values at the real tokens
    logp_pad, ent_pad = padded_logprobs(tr.policy, batch, 1.0, grad=False, entropy=True)
    torch.testing.assert_close(logp_pad, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pad, ent, atol=1e-5, rtol=0)
    ids, cu = batch.ids, batch.cu_seqlens
    labels = torch.full_like(ids, -100)
    labels[batch.hidden_rows] = batch.labels
    # unfused path: the fused op's values
    hidden = tr.policy(ids, cu_seqlens=cu)
    fused = linear_logprob_entropy(hidden, tr.policy.lm_head_weight, labels)
    naive = naive_lle(hidden, tr.policy.lm_head_weight, labels)
    torch.testing.assert_close(naive[0], fused[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(naive[1], fused[1], atol=1e-5, rtol=0)


def test_gpu_gen_overrides_and_refusal(capsys):
    w = rl_step.work("tiny", 2, 2, 8)
    cpu = rl_step.prorl_overrides(w, "p", gpu=False)
    assert "model.dtype=float32" in cpu and not any(o.startswith("rollout.backend=") for o in cpu)
    native = rl_step.prorl_overrides(w, "p", gpu=True, gen="native")
    assert "model.dtype=bfloat16" in native and "rollout.backend=native" in native
    assert not any("gpu_memory_utilization" in o for o in native)
    assert "rollout.backend=vllm" in rl_step.prorl_overrides(
        w, "p", gpu=True
    )  # the default stays vLLM
    with pytest.raises(ValueError):
        rl_step.prorl_overrides(w, "p", gpu=True, gen="hf")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            rl_step.main(["--gpu", "--gpu-gen", "native", "--models", "tiny,random", "--no-plot"])
        assert "--gpu needs a visible CUDA device" in capsys.readouterr().err
