"""engine/checkpoint.py: exact resume, atomic commit, identity, retention, disk checks, HF export.

Exact resume is checked against an uninterrupted run of the same code: the steps after a restore
give bit-identical losses and weights (torch.equal), with the batch drawn from the restored RNG
streams (torch, python, numpy), a cosine schedule in warmup, and fresh objects built from a
different seed.
"""

import dataclasses
import json
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_helpers import LENGTHS, TINY_QWEN2, random_decoder, run_ranks
from prorl.engine import checkpoint, distributed, parallel
from prorl.engine.checkpoint import Checkpointer, CheckpointError
from prorl.engine.model import load_hf, save_hf
from prorl.engine.optim import Optimizer, OptimizerConfig
from prorl.engine.parallel import export_hf
from prorl.kernels import linear_logprob_entropy

OPT = OptimizerConfig(
    lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, schedule="cosine", warmup_steps=2, total_steps=10
)


@pytest.fixture
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


class Counter:
    """A trainer-side stateful whose state changes shape as it runs (a growing list, new keys)."""

    def __init__(self):
        self.history, self.seen = [], {}

    def state_dict(self):
        return {"history": list(self.history), "seen": dict(self.seen)}

    def load_state_dict(self, state):
        self.history, self.seen = list(state["history"]), dict(state["seen"])


def rng_step(model, opt, counter, seqs=slice(None)):
    """One step whose batch comes from the global RNG streams: torch (tokens), python and numpy (a
    loss scale), so a resume that missed any of them would see another batch."""
    ids = [torch.randint(0, TINY_QWEN2.vocab_size, (n,)) for n in LENGTHS][seqs]
    scale = random.random() + float(np.random.rand())
    labels = [torch.cat([s[1:], torch.tensor([-100])]) for s in ids]
    cu = torch.tensor(
        [0, *torch.tensor([len(s) for s in ids]).cumsum(0).tolist()], dtype=torch.int32
    )
    hidden = model(torch.cat(ids), cu_seqlens=cu)
    logp, _ = linear_logprob_entropy(
        hidden, model.lm_head_weight, torch.cat(labels), return_entropy=False
    )
    loss = -scale * logp.float().sum() / sum(n - 1 for n in LENGTHS)
    loss.backward()
    opt.step()
    counter.history.append(float(loss.detach()))
    counter.seen[f"step{len(counter.history)}"] = len(counter.history)
    return loss.detach()


def _seed(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resume_is_bit_identical(tmp_path, deterministic):
    _seed(0)
    model, counter, data = random_decoder(), Counter(), {"position": 0, "epoch": 0}
    opt = Optimizer(model, OPT)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep_last=2)
    # docs/recipe.md §7: the reference policy too
    reference = random_decoder(seed=3).requires_grad_(False)
    state = {
        "reference": reference,
        "model": model,
        "optimizer": opt,
        "counter": counter,
        "data": data,
    }
    assert ckpt.load(state) is None  # nothing yet
    for _ in range(2):
        rng_step(model, opt, counter)
        data["position"] += len(LENGTHS)
    ckpt.save(2, state, config_hash="abc")
    # the second sees the schedule move
    want_losses = [rng_step(model, opt, counter) for _ in range(2)]
    want = {k: v.clone() for k, v in model.state_dict().items()}

    _seed(123)  # fresh objects, other weights, other RNG positions
    model2, counter2, data2 = random_decoder(seed=7), Counter(), {"position": -1}
    opt2 = Optimizer(model2, OPT)
    reference2 = random_decoder(seed=4).requires_grad_(False)
    state2 = {
        "reference": reference2,
        "model": model2,
        "optimizer": opt2,
        "counter": counter2,
        "data": data2,
    }
    info = ckpt.load(state2, config_hash="abc")
    assert (info.step, info.config_changed, info.path) == (2, False, ckpt.step_dir(2))
    assert data2 == {"position": 8, "epoch": 0} and counter2.history == counter.history[:2]
    # third step of the schedule
    assert opt2.lr == pytest.approx(OPT.lr) and opt2.skipped_total == 0
    losses = [rng_step(model2, opt2, counter2) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    for name, tensor in model2.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    assert counter2.state_dict() == counter.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(reference2.parameters(), reference.parameters()))


def test_saving_before_the_first_step_changes_nothing(tmp_path):
    """DCP initialises an empty optimizer state with a zero-lr step; the saved optimizer must not
    keep it."""
    model = random_decoder()
    opt = Optimizer(model, OPT)
    Checkpointer(str(tmp_path)).save(0, {"model": model, "optimizer": opt})
    assert not opt.optimizer.state and all(p.grad is None for p in model.parameters())


def _layout(directory):
    return sorted(os.listdir(directory))


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep_last=None)
    model = random_decoder()
    ckpt.save(1, {"model": model})
    # an interrupted save (even one that got as far as its marker) and a crash between rename and
    # marker
    os.makedirs(tmp_path / "step_00000005.tmp")
    (tmp_path / "step_00000005.tmp" / "COMPLETE").write_text("{}")
    os.makedirs(tmp_path / "step_00000006")
    assert ckpt.latest() == ckpt.step_dir(1) and ckpt.complete_steps() == [1]
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpt.load({"model": model}, step=6)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpt.load({"model": model}, path=str(tmp_path / "step_00000005.tmp"))
    ckpt.save(2, {"model": model})  # the next save clears both
    assert _layout(tmp_path) == ["step_00000001", "step_00000002"]


def test_a_failing_save_leaves_the_last_complete_one(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path))
    model = random_decoder()
    ckpt.save(1, {"model": model})
    import torch.distributed.checkpoint as dcp

    def broken_save(state_dict, checkpoint_id, **kwargs):
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        ckpt.save(2, {"model": model})
    assert ckpt.latest() == ckpt.step_dir(1) and "step_00000002.tmp" in _layout(tmp_path)
    monkeypatch.undo()
    ckpt.save(3, {"model": model})
    assert _layout(tmp_path) == ["step_00000001", "step_00000003"]


def test_wrong_model_is_refused_and_config_change_reported(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(4, {"model": random_decoder(), "data": {"position": 3}}, config_hash="old")
    bigger = random_decoder(cfg=dataclasses.replace(TINY_QWEN2, num_layers=3))
    with pytest.raises(
        CheckpointError, match=r"different model under 'model'.*layers': 2.*layers': 3"
    ):
        ckpt.load({"model": bigger})
    with pytest.raises(CheckpointError, match=r"has no \['optimizer'\]"):
        model = random_decoder()
        ckpt.load({"model": model, "optimizer": Optimizer(model, OPT)})
    info = ckpt.load({"model": random_decoder()}, config_hash="new")
    assert info.config_changed and info.meta["config_hash"] == "old"
    meta = json.loads((tmp_path / "step_00000004" / "meta.json").read_text())
    assert meta["models"]["model"]["summary"]["num_layers"] == 2 and meta["world_size"] == 1


def test_retention_keeps_the_last_k(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep_last=2)
    model = random_decoder()
    for step in (10, 20, 30, 40):
        ckpt.save(step, {"model": model})
    assert ckpt.complete_steps() == [30, 40] and _layout(tmp_path) == [
        "step_00000030",
        "step_00000040",
    ]


def test_disk_and_permission_checks(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="not writable"):
        Checkpointer(str(blocker / "ckpt"))
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    model = random_decoder()
    full = ckpt.preflight({"model": model, "optimizer": Optimizer(model, OPT)})
    params = sum(p.numel() * 4 for p in model.parameters())
    assert full >= 3 * params  # weights + AdamW's two moments
    real = checkpoint.shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(CheckpointError, match="not enough free disk space"):
        ckpt.save(1, {"model": model})
    assert _layout(tmp_path / "ckpt") == []  # nothing half-written


def test_export_hf_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip(
        "transformers", reason="the export is loaded back by transformers"
    )
    model = parallel.parallelize(random_decoder(), activation_checkpointing=True)  # wrapped names
    export_hf(model, str(tmp_path / "hf"))
    back = load_hf(str(tmp_path / "hf"))
    for name, tensor in parallel.full_state_dict(model).items():
        assert torch.equal(back.state_dict()[name], tensor), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    ids = torch.arange(12)[None] % TINY_QWEN2.vocab_size
    with torch.no_grad():
        want = back.logits(back(ids[0]))
        torch.testing.assert_close(hf(ids).logits[0], want, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# Two ranks, FSDP2


def _fsdp_resume_worker(rank, world, hf_dir, ckpt_dir, export_dir):
    torch.use_deterministic_algorithms(True)
    seqs = slice(rank * 2, rank * 2 + 2)

    def build(path, seed):
        model = parallel.parallelize(
            parallel.meta_decoder(TINY_QWEN2), activation_checkpointing=True
        )
        parallel.materialize(model, "cpu", hf_path=path, seed=seed)
        return model, Optimizer(model, OPT), Counter()

    _seed(100 + rank)  # per-rank RNG streams: each rank draws its own batch
    model, opt, counter = build(hf_dir, 0)
    ckpt = Checkpointer(ckpt_dir)
    for _ in range(2):
        rng_step(model, opt, counter, seqs)
    ckpt.save(2, {"model": model, "optimizer": opt, "counter": counter})
    want_loss = distributed.all_reduce_sum(rng_step(model, opt, counter, seqs))
    want = parallel.full_state_dict(model)
    export_hf(model, export_dir)

    _seed(7)
    model2, opt2, counter2 = build(None, 5)  # random init, other RNG state
    info = ckpt.load({"model": model2, "optimizer": opt2, "counter": counter2})
    loss = distributed.all_reduce_sum(rng_step(model2, opt2, counter2, seqs))
    got = parallel.full_state_dict(model2)
    identical = torch.equal(loss, want_loss) and all(
        torch.equal(got[k], v) for k, v in want.items()
    )
    return info.step, identical, float(loss), want


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_gloo_available(), reason="gloo backend unavailable")
def test_fsdp2_resume_and_export(tmp_path):
    """Two gloo ranks: save sharded after 2 steps, restore into fresh sharded objects (randomly
    initialised, RNG re-seeded), the third step is bit-identical on both ranks; the sharded model
    exports to an HF directory equal to its full weights."""
    hf_dir = str(tmp_path / "init")
    save_hf(random_decoder(), hf_dir)
    results = run_ranks(
        _fsdp_resume_worker, tmp_path, hf_dir, str(tmp_path / "ckpt"), str(tmp_path / "hf")
    )
    for rank in (0, 1):
        step, identical, _, _ = results[rank]
        assert step == 2 and identical, rank
    exported = load_hf(str(tmp_path / "hf")).state_dict()
    for name, tensor in results[0][3].items():
        assert torch.equal(exported[name], tensor), name
