"""Stock vs prorl drop-in inside TRL, verl and OpenRLHF: one update's time and peak extra memory.

    python -m benchmarks dropin [--quick] [--vocab 32768,151936] [--providers a,b] [--threads N]
        [--out CSV]

A tiny random Qwen2; one call = one update of the peer's own code. Providers: `trl` / `trl-fused`
(`trl-loss` on request), `verl` / `verl-fused`, `openrlhf` / `openrlhf-fused` (with the stand-ins of
tests/peers/peer_stubs.py). Details: docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import tempfile
import warnings

import torch

from benchmarks import harness
from benchmarks.plot import plot as plot_csv

NAME = "dropin"
PROVIDERS = ("trl", "trl-fused", "verl", "verl-fused", "openrlhf", "openrlhf-fused")
KNOWN = PROVIDERS + ("trl-loss",)
B, P, C, D = 8, 8, 128, 128
VOCABS = (32768, 151936)
QUICK_VOCABS = (4096,)


def qwen2(v: int, seed: int = 0):
    """The tiny random Qwen2 at vocabulary `v` (fp32, untied LM head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(hidden_size=D, intermediate_size=3 * D, num_hidden_layers=2, num_attention_heads=4)
    config = Qwen2Config(vocab_size=v, **shape, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=P + C)  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def grpo_micro_batch(v: int, b: int = B, seed: int = 0) -> dict:
    """A GRPOTrainer micro-batch as its _prepare_inputs returns it (on-policy: no old log-probs)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, v, (b, n), generator=g)
    return dict(
        prompt_ids=ids(P), prompt_mask=torch.ones(b, P, dtype=torch.long), completion_ids=ids(C),
        completion_mask=torch.ones(b, C, dtype=torch.long), advantages=torch.randn(b, generator=g),
        num_items_in_batch=torch.tensor(float(b * C)),
    )  # fmt: skip


def grpo_trainer(cls, model, **config):
    """`cls` (GRPOTrainer or a subclass) with TRL's defaults on the CPU, on `model`, for
    compute_loss."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig

    tok = PreTrainedTokenizerFast.from_pretrained(harness.REPO_ROOT / "prorl/assets/tiny-reasoner")
    kw = dict(per_device_train_batch_size=B, num_generations=B, max_completion_length=C)
    kw.update(use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), **(kw | config))
    ds = Dataset.from_list([{"prompt": "1+1="}] * B)
    reward = lambda completions, **_: [0.0] * len(completions)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok
        )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def _stub(peer: str):
    sys.path.insert(0, str(harness.REPO_ROOT / "tests" / "peers"))
    import peer_stubs

    peer_stubs.stub_missing(peer, getattr(peer_stubs, f"{peer.upper()}_STUBS"))


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    v = shape["V"]
    model = qwen2(v)
    clear = lambda: model.zero_grad(set_to_none=True)
    peer, fused = provider.split("-")[0], provider.endswith(("-fused", "-loss"))
    note = f"B={B} P={P} C={C}" + (" prorl" if fused else " stock")
    if peer == "trl":
        from prorl.kernels.adapters import FusedGRPOTrainer, trl_compute_loss
        from trl import GRPOTrainer

        class LossDropIn(GRPOTrainer):
            def _compute_loss(self, model, inputs):
                return trl_compute_loss(self, model, inputs)

        cls = {"trl-fused": FusedGRPOTrainer, "trl-loss": LossDropIn}.get(provider, GRPOTrainer)
        trainer = grpo_trainer(cls, model)
        inputs = grpo_micro_batch(v)
        run = lambda: trainer.compute_loss(trainer.model, inputs).backward()
    elif peer == "verl":
        _stub("verl")
        from verl.models.transformers.monkey_patch import patch_forward_with_backends

        if fused:
            import prorl.kernels.adapters.verl_fused_plugin  # noqa: F401
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
        mb = grpo_micro_batch(v)
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)

        def run():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)
            (out.log_probs.sum() + out.entropy.sum()).backward()
    else:
        _stub("openrlhf")
        sys.modules["flash_attn.ops.triton.cross_entropy"] = None  # a stand-in: the torch path
        from openrlhf.models import Actor
        from prorl.kernels.adapters import openrlhf_actor_forward

        if fused:
            Actor.forward = openrlhf_actor_forward(Actor.forward)
        actor = Actor(model)
        actor.packing_samples = False
        mb = grpo_micro_batch(v)
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
        att, action_mask = torch.ones_like(ids), mb["completion_mask"].bool()

        def run():
            lp, out = actor(ids, action_mask, att, return_output=True, return_entropy=True)
            (lp.sum() + out.entropy.sum()).backward()

    return harness.Step(run=run, prepare=clear, note=note)


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"V={QUICK_VOCABS}, 2 reps")
    p.add_argument("--vocab", type=harness.ints, help=f"comma-separated V (default {VOCABS})")


def _shapes(args) -> list[dict]:
    vocabs = args.vocab or (QUICK_VOCABS if args.quick else VOCABS)
    return [dict(V=v, label=f"V={v} B={B} T={P}+{C} D={D} fp32") for v in vocabs]


plot = lambda csv, rows, args: plot_csv(csv)
BENCHMARK = harness.Benchmark(NAME, PROVIDERS, _shapes, _options, KNOWN, reps=(3, 2), plot=plot)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
