"""Trainer.update in-process: micro-batching, the on-policy shortcut and shared prompts change the
cost, not the result.

Two trainers load the same shipped checkpoint and are fed the same sampled groups; one takes the
plain path (one forward per mini-batch, old log-probs recomputed), the other the variant under test.
The groups' rewards are set to alternate within every group, so every group carries an advantage and
the gradient is far from zero. The optimizer is plain SGD: AdamW's first step moves every weight by
about +-lr whatever the size of its gradient, so gradients at round-off level (two summation orders)
would flip whole steps. The gradients of every optimizer step and the weights after the update must
agree to float32 round-off.
"""

import copy

import pytest
import torch
from tiny_trainer import make_trainer

from prorl.metrics import StepAccumulator, step_metrics
from prorl.packing import StepBatch
from prorl.sampling import shape_rewards

BASE = [
    "trainer.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_response_tokens=24",
    # every group is trained on: both trainers see the same groups
    "algorithm.dynamic_sampling=false",
    "reward.length_penalty=false",
    "trainer.recompute_old_logp=true",
    "trainer.micro_batch_tokens=0",
]
SGD_LR = 0.05
# the SGD swap (with_sgd) bypasses the step counter that LambdaLR installs on AdamW
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")


def make(setup, overrides):
    return make_trainer(setup, [*BASE, *overrides])


def run_update(trainer, groups, max_new=24):
    """trainer.update on a copy of `groups`; returns the step's metrics."""
    acc = StepAccumulator()
    trainer.update(
        StepBatch.of(copy.deepcopy(groups), trainer.cfg.rollout.n, trainer.device), max_new, acc
    )
    return step_metrics(acc.reduce())


def with_sgd(trainer):
    """Replace the trainer's AdamW by plain SGD and record the gradients of every optimizer step."""
    grads = []
    sgd = torch.optim.SGD(trainer.optimizer.params, lr=SGD_LR)
    step = sgd.step

    def recording_step(*args, **kwargs):
        grads.append([p.grad.detach().clone() for p in trainer.optimizer.params])
        return step(*args, **kwargs)

    sgd.step = recording_step
    trainer.optimizer.optimizer = sgd
    return grads


def updated(tiny_setup, overrides, groups, max_new=24):
    trainer = make(tiny_setup, overrides)
    grads = with_sgd(trainer)
    metrics = run_update(trainer, groups, max_new)
    weights = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    return weights, grads, metrics


def sampled_groups(tiny_setup, overrides):
    trainer = make(tiny_setup, overrides)
    groups = trainer.sampler.collect(2, 24, 0, StepAccumulator())
    shape_rewards(groups, trainer.cfg.reward, 0, 24)
    assert sum(len(t) for g in groups for t in g.responses) > 0
    # mixed rewards in every group: non-zero advantages, a gradient far from round-off
    for g in groups:
        g.shaped = [float(i % 2) for i in range(len(g.responses))]
    return groups


def assert_same(a, b):
    weights_a, grads_a, metrics_a = a
    weights_b, grads_b, metrics_b = b
    assert len(grads_a) == len(grads_b) > 0
    for step_a, step_b in zip(grads_a, grads_b):
        assert max(float(g.abs().max()) for g in step_a) > 1e-3, "the gradient is (nearly) zero"
        for g_a, g_b in zip(step_a, step_b):
            torch.testing.assert_close(g_a, g_b, rtol=1e-4, atol=1e-7)
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=1e-5, atol=1e-6, msg=name)
    for key in ("actor/pg_loss", "actor/kl_mean", "actor/entropy", "rollout/logprob_mismatch"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "constant"])
def test_micro_batches_equal_one_pass(tiny_setup, agg):
    groups = sampled_groups(tiny_setup, ["trainer.mini_batches=2"])
    one = updated(tiny_setup, ["trainer.mini_batches=2", f"algorithm.agg={agg}"], groups)
    # 40 tokens: each mini-batch (8 sequences of ~20-45 tokens) splits into several micro-batches
    many = updated(
        tiny_setup,
        ["trainer.mini_batches=2", f"algorithm.agg={agg}", "trainer.micro_batch_tokens=40"],
        groups,
    )
    assert_same(one, many)
    before = make(tiny_setup, []).policy.state_dict()
    assert any(not torch.equal(before[k], one[0][k]) for k in one[0]), "the update changed nothing"


def test_on_policy_shortcut_equals_recomputed_old_logp(tiny_setup):
    groups = sampled_groups(tiny_setup, ["trainer.mini_batches=1"])
    recomputed = updated(tiny_setup, ["trainer.mini_batches=1"], groups)
    shortcut = updated(
        tiny_setup,
        [
            "trainer.mini_batches=1",
            "trainer.recompute_old_logp=false",
            "trainer.micro_batch_tokens=64",
        ],
        groups,
    )
    assert_same(recomputed, shortcut)


def test_first_mini_batch_takes_old_logp_from_its_own_pass(tiny_setup, monkeypatch):
    """With M mini-batches the first one differentiates the policy that sampled its groups, so its
    old_logp is logp.detach(): the no-grad pass of the policy covers only the later mini-batches'
    groups (their tokens, counted from the groups), and the update equals the one that recomputes
    everything."""
    from prorl import update as update_module
    from prorl.update import Updater

    mb = ["trainer.mini_batches=2"]
    groups = sampled_groups(tiny_setup, mb)
    assert len(groups) == 2
    recomputed = updated(tiny_setup, mb, groups)  # BASE: recompute_old_logp=true
    no_grad_tokens, calls = [], []
    real_logprobs, real_loss = Updater.logprobs, update_module.ppo_loss

    def recording_logprobs(self, model, batch, grad, entropy=False):
        if model is self.policy and not grad:
            no_grad_tokens.append(batch.num_tokens)
        return real_logprobs(self, model, batch, grad, entropy)

    def recording_loss(logp, old, *args, **kwargs):
        calls.append((logp.detach().float(), old))
        return real_loss(logp, old, *args, **kwargs)

    monkeypatch.setattr(Updater, "logprobs", recording_logprobs)
    monkeypatch.setattr(update_module, "ppo_loss", recording_loss)
    skipped = updated(tiny_setup, [*mb, "trainer.recompute_old_logp=false"], groups)
    second = groups[1]  # mini-batch 1 of 2: the second group; share_prompts packs its prompt once
    assert no_grad_tokens == [len(second.prompt_ids) + sum(len(r) for r in second.responses)]
    assert torch.equal(calls[0][1], calls[0][0])  # mini-batch 0: old_logp is logp.detach(), exactly
    assert_same(recomputed, skipped)


def test_token_budget_chunks_cover_in_order_and_respect_the_budget():
    from prorl.algorithm import token_budget_chunks

    lengths = [3, 4, 5, 20, 1, 1, 8]
    chunks = token_budget_chunks(lengths, 8)
    assert chunks == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    for a, b in chunks:
        assert sum(lengths[a:b]) <= 8 or b - a == 1
    assert token_budget_chunks(lengths, 0) == [(0, 7)]
    assert token_budget_chunks([], 8) == []


def test_loss_normalizer_counts_by_aggregation():
    from prorl.algorithm import loss_normalizer

    # three packed sequences: 2 valid tokens, none, 1 valid token
    mask = torch.tensor([0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    cu = torch.tensor([0, 3, 5, 8])
    assert float(loss_normalizer("token-mean", mask, cu, 10)) == 3
    assert float(loss_normalizer("seq-mean-token-mean", mask, cu, 10)) == 2
    assert float(loss_normalizer("seq-mean-token-sum", mask, cu, 10)) == 2
    assert float(loss_normalizer("constant", mask, cu, 10)) == 30


def test_shared_prompts_equal_repeated_prompts(tiny_setup):
    groups = sampled_groups(tiny_setup, ["trainer.mini_batches=2"])
    shared = updated(
        tiny_setup, ["trainer.mini_batches=2", "trainer.micro_batch_tokens=100"], groups
    )
    repeated = updated(
        tiny_setup,
        ["trainer.mini_batches=2", "trainer.micro_batch_tokens=100", "trainer.share_prompts=false"],
        groups,
    )
    assert_same(shared, repeated)


def _single_rank_group(tmp_path):
    """A one-process gloo group, as `torchrun --nproc_per_node=1` makes."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def test_bf16_updates_keep_fp32_master_weights(tiny_setup, tmp_path):
    """bf16 compute: with FSDP (one rank is enough) the policy's master weights stay fp32, so an
    update far below bf16's resolution still moves them; without FSDP the trainer warns that bf16
    weights lose such updates (and they are indeed lost to rounding)."""
    import torch.distributed as dist

    tiny = ["model.dtype=bfloat16", "optim.lr=1e-7", "optim.weight_decay=0"]
    tiny.append("trainer.recompute_old_logp=false")
    with pytest.warns(RuntimeWarning, match="no fp32 master copy"):
        plain = make(tiny_setup, tiny)
    groups = sampled_groups(tiny_setup, [])
    before = {k: v.detach().float().clone() for k, v in plain.policy.state_dict().items()}
    run_update(plain, groups)
    after = {k: v.detach().float() for k, v in plain.policy.state_dict().items()}
    moved_bf16 = sum(int((after[k] != before[k]).sum()) for k in before)
    _single_rank_group(tmp_path)
    try:
        sharded = make(tiny_setup, [*tiny, "model.fsdp=true"])
        assert sharded.models.fsdp
        params = dict(sharded.policy.named_parameters())
        assert all(p.dtype == torch.float32 for p in params.values()), "master weights must be fp32"
        start = {k: p.detach().full_tensor().clone() for k, p in params.items()}
        run_update(sharded, groups)
        end = {k: p.detach().full_tensor() for k, p in params.items()}
    finally:
        dist.destroy_process_group()
    moved = sum(int((end[k] != start[k]).sum()) for k in start)
    total = sum(v.numel() for v in start.values())
    # Adam's first step moves every weight with a gradient by ~lr: far below bf16's spacing (2^-8
    # relative)
    print(f"moved fp32-master {moved} / {total}, bf16 weights {moved_bf16} / {total}")
    assert moved > 0.5 * total, (moved, total)
    assert moved_bf16 < 0.01 * total, (moved_bf16, total)


def test_export_gathers_a_sharded_policy(tiny_setup, tmp_path):
    """export_hf under FSDP without a sampler copy (the vLLM backend's case): the policy is gathered
    from its shards and written in the configured dtype; transformers loads it and its weights are
    the policy's."""
    import torch.distributed as dist
    import transformers

    _single_rank_group(tmp_path)
    try:
        trainer = make(tiny_setup, ["model.fsdp=true"])
        trainer.models.sampler_model = None  # as with rollout.backend=vllm
        trainer.models.export_hf(str(tmp_path / "final"))
        want = {k: p.detach().full_tensor() for k, p in trainer.policy.named_parameters()}
    finally:
        dist.destroy_process_group()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    got = dict(hf.named_parameters())
    assert torch.equal(got["model.embed_tokens.weight"], want["embed_tokens.weight"])
    assert torch.equal(
        got["model.layers.0.mlp.up_proj.weight"], want["layers.0.mlp.up_proj.weight"]
    )


def test_cpu_offload_reaches_fsdp(tiny_setup, tmp_path):
    """model.cpu_offload is FSDP2's CPUOffloadPolicy, which needs a GPU (it pins host memory): on
    this CPU the trainer says so when it applies the parallel plan."""
    import torch.distributed as dist

    _single_rank_group(tmp_path)
    try:
        with pytest.raises(ValueError, match="model.cpu_offload .* needs a CUDA device"):
            make(tiny_setup, ["model.fsdp=true", "model.cpu_offload=true"])
    finally:
        dist.destroy_process_group()


def test_each_response_is_packed_once_per_step(tiny_setup, monkeypatch):
    """The old-policy, reference and update passes share one plan: every response goes through
    `packing.pack` once per step, not once per pass kind (3.6 s each at the preset's sizes)."""
    from prorl import packing

    trainer = make(tiny_setup, ["trainer.mini_batches=2", "trainer.micro_batch_tokens=64"])
    groups = sampled_groups(tiny_setup, [])
    packed, pack = [], packing.pack

    def counting(entries, *args, **kwargs):
        packed.extend(id(r) for _, responses in entries for r in responses)
        return pack(entries, *args, **kwargs)

    monkeypatch.setattr(packing, "pack", counting)
    run_update(trainer, groups)  # BASE: old log-probs recomputed, a pass of their own
    assert len(packed) == len(set(packed)) == sum(len(g.responses) for g in groups)
