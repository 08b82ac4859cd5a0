"""The no-grad log-prob passes under FSDP2 on 2 gloo ranks: after `Updater.response_logprobs` the
model is back in its sharded state. FSDP2 keeps the root (embeddings, final norm, LM head) unsharded
after a forward and reshards it in backward; a no-grad pass has none, so without a reshard the
reference would hold its full root (0.9 GB at 1.5B, 2.2 GB at 7B) through the update and the
colocated vLLM wake."""

from pathlib import Path

from dist_helpers import run_ranks

TINY_REASONER = str(Path(__file__).resolve().parents[2] / "prorl" / "assets" / "tiny-reasoner")


def _passes(rank, world):
    import torch
    from torch.distributed.tensor import DTensor

    from prorl.config import load_config
    from prorl.packing import StepBatch
    from prorl.policy import PolicyModels
    from prorl.sampling import Group
    from prorl.update import Updater

    overrides = [f"model.path={TINY_REASONER}", "model.fsdp=true", "rollout.n=2"]
    cfg = load_config("default", [*overrides, "trainer.micro_batch_tokens=16"])
    models = PolicyModels(cfg, TINY_REASONER)
    updater = Updater(cfg, models)
    # 2 responses of 9 and 12 tokens to one 5-token prompt: two micro-batches of <= 16 tokens
    group = Group(0, [1, 2, 3, 4, 5], [[6] * 9, [7] * 12], [[0.0] * 9, [0.0] * 12], [False] * 2)
    batch = StepBatch.of([group], 2, models.device)
    sharded = {}
    for name in ("reference", "policy"):
        model = getattr(models, name)
        logp = updater.response_logprobs(model, batch)
        params = dict(model.named_parameters())
        sharded[name] = sorted(k for k, p in params.items() if not isinstance(p, DTensor))
        assert logp.shape == (21,) and bool(torch.isfinite(logp).all())
    return sharded


def test_no_grad_passes_leave_the_model_sharded(tmp_path):
    res = run_ranks(_passes, tmp_path, world=2, timeout_s=300)
    for rank, unsharded in res.items():
        # every parameter a DTensor shard again: none left as FSDP2's full unsharded tensor
        assert unsharded == {"reference": [], "policy": []}, (rank, unsharded)
