"""The trainer on SmolLM2-135M-Instruct: one real step (sample, verify, update), the log-probs it
trains on, the checkpoint it exports; and the fused ops at the real vocabulary with the tied head.

References: transformers' forward on the same directory (log-probs at the sampling temperature),
transformers loading and generating from the export, float64 torch for the fused ops.
"""

import copy

import pytest
import torch
from conftest import MESSAGES

pytestmark = pytest.mark.slow  # a 135M model: seconds to a minute each

STEP = [
    "trainer.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_response_tokens=12",
    "rollout.temperature=0.8",
    "trainer.mini_batches=1",
    "algorithm.dynamic_sampling=false",  # keep the two groups whatever their rewards
    "reward.length_penalty=false",
    "trainer.recompute_old_logp=true",  # the trainer's own pass over the sampled tokens
    "optim.lr=1e-4",
]


@pytest.fixture(scope="module")
def stepped(smollm2_dir, tokenizer):
    """(trainer, groups sampled by its sampler, the update's metrics, weights before the step)."""
    from prorl.config import load_config
    from prorl.data import builtin
    from prorl.metrics import StepAccumulator, step_metrics
    from prorl.packing import StepBatch
    from prorl.rewards.pool import RewardPool
    from prorl.trainer import Trainer

    train = builtin("digit_sums", n=4, seed=0, split="train")
    val = builtin("digit_sums", n=2, seed=0, split="val")
    cfg = load_config("default", [f"model.path={smollm2_dir}", *STEP])
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = Trainer(cfg, smollm2_dir, tokenizer, train, val, pool)
        before = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
        groups = trainer.sampler.collect(2, 12, 0, StepAccumulator())
        for g in groups:  # mixed rewards: a gradient far from zero whatever the model answered
            g.shaped = [float(i % 2) for i in range(len(g.responses))]
        acc = StepAccumulator()
        batch = StepBatch.of(copy.deepcopy(groups), cfg.rollout.n, trainer.device)
        trainer.update(batch, 12, acc)
        yield trainer, groups, step_metrics(acc.reduce()), before


def test_sampled_logprobs_match_transformers_and_trainer(stepped, hf_model):
    """The sampler's log-probs of the tokens it drew are transformers' log-softmax(logits / T) at
    those tokens, and the trainer's recomputation of them (logged as rollout/logprob_mismatch)
    agrees too."""
    trainer, groups, metrics, _ = stepped
    temperature = trainer.cfg.rollout.temperature
    diffs = []
    for g in groups:
        for tokens, logps in zip(g.responses, g.sampler_logps):
            ids = torch.tensor([g.prompt_ids + tokens])
            with torch.no_grad():
                logits = hf_model(ids).logits[0, len(g.prompt_ids) - 1 : -1].double()
            ref = torch.log_softmax(logits / temperature, -1).gather(
                1, torch.tensor(tokens)[:, None]
            )
            diffs.append(torch.tensor(logps, dtype=torch.float64) - ref[:, 0])
    d = torch.cat(diffs)
    print(
        f"{len(d)} sampled tokens: max |sampler - transformers| {d.abs().max():.2e}; trainer "
        f"mismatch mean {metrics['rollout/logprob_mismatch']:.2e} max "
        f"{metrics['rollout/logprob_mismatch_max']:.2e}"
    )
    assert len(d) >= 8
    assert d.abs().max() < 1e-3
    assert metrics["rollout/logprob_mismatch_max"] < 1e-3


def test_checkpoint_exported_after_a_step_loads_in_transformers(stepped, tokenizer, tmp_path):
    """export_hf after the step: transformers loads the policy's updated weights (tied head kept)
    and its greedy generation on a chat prompt equals prorl's sampler on the policy."""
    import transformers
    from prorl.engine.rollout import NativeGenerator, SamplingParams

    from prorl.data import stop_token_ids

    trainer, _, _, before = stepped
    trainer.models.export_hf(str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    got = hf.state_dict()
    after = trainer.policy.state_dict()
    assert hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    for name in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"):
        assert torch.equal(got[f"model.{name}"], after[name].float()), name
        assert not torch.equal(after[name], before[name]), f"{name} did not move in the step"
    prompt = tokenizer.apply_chat_template(MESSAGES[1], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :]
    params = SamplingParams(
        temperature=0.0, max_new_tokens=10, stop_token_ids=stop_token_ids(tokenizer)
    )
    ours = NativeGenerator(trainer.policy).generate([prompt], params).samples[0].token_ids
    print(tokenizer.decode(ours))
    assert ours == ref.tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_ops_at_the_real_vocabulary(our_model, chat_ids, temperature):
    """linear_logprob_entropy and linear_ppo_loss on the real model's hidden states and its tied
    [49152, 576] head against float64 torch: log-probs, entropies, the loss and both gradients."""
    from prorl.kernels import linear_logprob_entropy, linear_ppo_loss, ppo_loss_reference

    ids = torch.tensor(chat_ids[0] + chat_ids[1])
    with torch.no_grad():
        hidden = our_model(ids, cu_seqlens=torch.tensor([0, len(chat_ids[0]), len(ids)]))
    weight = our_model.lm_head_weight.detach()
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[len(chat_ids[0]) - 1] = -100  # no label across the sequence boundary
    valid = labels != -100
    gen = torch.Generator().manual_seed(0)

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp_all = torch.log_softmax((h64 @ w64.T) / temperature, -1)  # [N, V] float64
    want_lp = logp_all.gather(1, labels.clamp(min=0)[:, None])[:, 0] * valid
    want_ent = -(logp_all.exp() * logp_all).sum(-1)
    got_lp, got_ent = linear_logprob_entropy(hidden, weight, labels, temperature=temperature)
    torch.testing.assert_close(got_lp.double() * valid, want_lp.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        got_ent.double()[valid], want_ent.detach()[valid], rtol=1e-4, atol=1e-4
    )

    old = (
        want_lp.detach() + 0.3 * torch.randn(len(ids), generator=gen, dtype=torch.float64)
    ).float()
    adv = torch.randn(len(ids), generator=gen)
    kw = dict(eps_low=0.2, eps_high=0.28, temperature=temperature)
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = linear_ppo_loss(hh, ww, labels, old, adv, valid, **kw)
    loss.backward()
    kw.pop("temperature")
    lp_for_loss = torch.where(valid, want_lp, torch.zeros((), dtype=torch.float64))
    want_loss, _ = ppo_loss_reference(lp_for_loss, old, adv, valid, **kw)
    want_loss.backward()
    torch.testing.assert_close(loss.double(), want_loss.detach(), rtol=1e-4, atol=1e-6)
    for got, want in ((hh.grad, h64.grad), (ww.grad, w64.grad)):
        scale = want.abs().max()
        assert scale > 0
        assert ((got.double() - want).abs().max() / scale).item() < 1e-4
