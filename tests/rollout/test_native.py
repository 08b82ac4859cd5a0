"""NativeGenerator: greedy equals transformers' greedy generate; sampled log-probs equal the
training model's recomputed ones; draws are reproducible and independent of batch composition;
update_weights."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from prorl.engine.model import load_hf  # noqa: E402
from prorl.engine.rollout import NativeGenerator, SamplingParams  # noqa: E402
from rollout_checkpoints import recompute_logprobs, save_random_qwen2  # noqa: E402

PROMPTS = [[5, 9, 17, 3], [200, 7], [11, 12, 13, 14, 15, 16, 17], [42]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=128)
    return str(path), save_random_qwen2(path, std=0.15, **cfg)


def test_greedy_matches_transformers_generate(checkpoint):
    path, hf = checkpoint
    gen = NativeGenerator(load_hf(path))
    out = gen.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    for sample in out.samples:
        prompt = torch.tensor([PROMPTS[sample.prompt_index]])
        ref = hf.generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert sample.token_ids == ref[0, prompt.shape[1] :].tolist()
        assert sample.finish_reason == "length"


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 50), (1.3, 0.8, -1)]
)
def test_sampled_logprobs_match_trainer(checkpoint, temperature, top_p, top_k):
    path, _ = checkpoint
    model = load_hf(path)
    gen = NativeGenerator(model)
    params = SamplingParams(
        n=3, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=10, seed=7
    )
    out = gen.generate(PROMPTS, params)
    assert len(out.samples) == 12
    diffs = []
    for s in out.samples:
        ref = recompute_logprobs(model, PROMPTS[s.prompt_index], s.token_ids, temperature)
        diffs.append(torch.tensor(s.logprobs) - ref)
    d = torch.cat(diffs)
    assert d.abs().max() < 1e-4, (d.abs().max(), d.pow(2).mean().sqrt())


def test_stop_tokens_and_reproducibility(checkpoint):
    path, _ = checkpoint
    gen = NativeGenerator(load_hf(path))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=3)
    a = gen.generate(PROMPTS, params)
    b = gen.generate(PROMPTS, params)
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    # the first prompt sampled alone draws the same tokens: other prompts in the batch change
    # nothing
    alone = gen.generate([PROMPTS[0]], params)
    assert [s.token_ids for s in alone.samples] == [
        s.token_ids for s in a.samples if s.prompt_index == 0
    ]
    # stop on the most frequent early token: those samples end with it and are marked "stop"
    first = a.samples[0].token_ids[2]
    stopped = gen.generate(
        PROMPTS, SamplingParams(n=4, max_new_tokens=16, seed=3, stop_token_ids=[first])
    )
    for s_full, s_stop in zip(a.samples, stopped.samples):
        if first in s_full.token_ids:
            cut = s_full.token_ids.index(first) + 1
            assert s_stop.token_ids == s_full.token_ids[:cut] and s_stop.finish_reason == "stop"
        else:
            assert s_stop.token_ids == s_full.token_ids and s_stop.finish_reason == "length"
    assert any(s.finish_reason == "stop" for s in stopped.samples)


def test_update_weights_in_place(checkpoint):
    path, _ = checkpoint
    model = load_hf(path)
    gen = NativeGenerator(model)
    before = gen.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    ptr = model.embed_tokens.weight.data_ptr()
    other = load_hf(path)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    gen.update_weights(other.state_dict())
    assert model.embed_tokens.weight.data_ptr() == ptr
    after = gen.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    ref = NativeGenerator(other).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8)
    )
    assert [s.token_ids for s in after.samples] == [s.token_ids for s in ref.samples]
    assert [s.token_ids for s in after.samples] != [s.token_ids for s in before.samples]
    with pytest.raises(KeyError):
        gen.update_weights({"nope.weight": torch.zeros(1)})


def test_a_sampler_on_the_trained_model_samples_after_each_optimizer_step(checkpoint):
    """The sampler's fused weight copies are rebuilt after the trainer's AdamW step (torch's fused
    kernel writes the parameters without bumping their versions): its log-probs after a step equal
    those of a fresh sampler on a copy of the updated model."""
    import copy

    from prorl.engine.optim import Optimizer, OptimizerConfig

    path, _ = checkpoint
    model = load_hf(path)
    gen, opt = NativeGenerator(model), Optimizer(model, OptimizerConfig(lr=1e-2))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    gen.generate(PROMPTS, params)  # builds the copies
    model(torch.tensor([PROMPTS[2]])).float().square().mean().backward()
    opt.step()
    after = gen.generate(PROMPTS, params)
    ref = NativeGenerator(copy.deepcopy(model)).generate(PROMPTS, params)
    assert [s.token_ids for s in after.samples] == [s.token_ids for s in ref.samples]
    for a, b in zip(after.samples, ref.samples, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_compaction_keeps_every_row(checkpoint):
    """A stop token most rows hit early: the cache is compacted (several times) and every sample is
    still the prefix, up to its first stop token, of the same sample drawn without stop tokens."""
    path, _ = checkpoint
    gen = NativeGenerator(load_hf(path))
    params = SamplingParams(n=8, temperature=2.0, max_new_tokens=24, seed=11)
    full = gen.generate(PROMPTS, params)
    counts = torch.bincount(torch.tensor([t for s in full.samples for t in s.token_ids[:6]]))
    stops = counts.topk(3).indices.tolist()  # the tokens most drawn early
    stopped = gen.generate(PROMPTS, SamplingParams(**{**params.__dict__, "stop_token_ids": stops}))
    n_stop = 0
    for a, b in zip(full.samples, stopped.samples):
        cut = next((i + 1 for i, t in enumerate(a.token_ids) if t in stops), None)
        assert b.token_ids == a.token_ids[:cut]
        assert b.logprobs == pytest.approx(a.logprobs[: len(b.token_ids)], abs=1e-5)
        assert b.finish_reason == ("stop" if cut is not None else "length")
        n_stop += cut is not None
    assert n_stop > len(full.samples) // 2  # compaction (at 3/4 live) did happen


@pytest.mark.slow
def test_compiled_decode_matches_eager(checkpoint):
    path, hf = checkpoint
    eager = NativeGenerator(load_hf(path))
    compiled = NativeGenerator(load_hf(path), compile=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    for sample in compiled.generate(PROMPTS, greedy).samples:  # greedy still equals transformers
        prompt = torch.tensor([PROMPTS[sample.prompt_index]])
        ref = hf.generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert sample.token_ids == ref[0, prompt.shape[1] :].tolist()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5, stop_token_ids=[7])
    a, b = eager.generate(PROMPTS, params), compiled.generate(PROMPTS, params)
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    for x, y in zip(a.samples, b.samples):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
