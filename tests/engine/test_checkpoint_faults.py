"""Damaged checkpoints (issue 20): the newest of two is corrupted in each way a disk, a copy or a
crash can leave it; the load falls back to the previous one with a warning naming the damaged file,
and with every checkpoint damaged it refuses with a CheckpointError naming the files. A missing RNG
file costs only determinism (a warning naming it). Replicated and FSDP2 runs of one model are the
same model."""

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import random_decoder, run_ranks
from prorl.engine import distributed, parallel
from prorl.engine.checkpoint import Checkpointer, CheckpointError, model_identity


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _zero_fill(path):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(bytes(size))


def _shard(step_dir, rank=0):
    return os.path.join(step_dir, f"__{rank}_0.distcp")


def _edit_manifest(step_dir, edit):
    """Rewrite manifest.json as `edit(parsed manifest)` returns it."""
    path = os.path.join(step_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    with open(path, "w") as f:
        json.dump(edit(manifest), f)


def _entry(manifest, name, value):
    manifest["files"][name] = value
    return manifest


def _unlisted_zero_filled_shard(step_dir):
    """The shard dropped from the manifest, then zero-filled: nothing of the manifest names it any
    more."""
    _edit_manifest(
        step_dir, lambda m: {"files": {k: v for k, v in m["files"].items() if k != "__0_0.distcp"}}
    )
    _zero_fill(_shard(step_dir))


# (what is done to the newest checkpoint, the file the warning must name)
CORRUPTIONS = {
    "truncated shard": (lambda d: _truncate(_shard(d)), "__0_0.distcp"),
    "zero-filled shard": (lambda d: _zero_fill(_shard(d)), "__0_0.distcp"),
    "missing shard": (lambda d: os.remove(_shard(d)), "__0_0.distcp"),
    "truncated meta.json": (lambda d: _truncate(os.path.join(d, "meta.json")), "meta.json"),
    "truncated objects.pt": (lambda d: _truncate(os.path.join(d, "objects.pt")), "objects.pt"),
    "missing objects.pt": (lambda d: os.remove(os.path.join(d, "objects.pt")), "objects.pt"),
    "missing DCP .metadata": (lambda d: os.remove(os.path.join(d, ".metadata")), ".metadata"),
    "missing manifest.json": (
        lambda d: os.remove(os.path.join(d, "manifest.json")),
        "manifest.json",
    ),
    "zero-filled manifest.json": (
        lambda d: _zero_fill(os.path.join(d, "manifest.json")),
        "manifest.json",
    ),
    "manifest files a list": (
        lambda d: _edit_manifest(d, lambda m: {"files": list(m["files"])}),
        "manifest.json",
    ),
    "manifest a JSON list": (lambda d: _edit_manifest(d, lambda m: [m]), "manifest.json"),
    "manifest entry without size": (
        lambda d: _edit_manifest(d, lambda m: _entry(m, "meta.json", {"sha256": "0" * 64})),
        "manifest.json",
    ),
    "manifest null entry": (
        lambda d: _edit_manifest(d, lambda m: _entry(m, "objects.pt", None)),
        "manifest.json",
    ),
    "manifest size a string": (
        lambda d: _edit_manifest(
            d, lambda m: _entry(m, "objects.pt", {**m["files"]["objects.pt"], "size": "9"})
        ),
        "manifest.json",
    ),
    "manifest path outside the checkpoint": (
        lambda d: _edit_manifest(
            d, lambda m: _entry(m, "../step_00000001/meta.json", m["files"]["meta.json"])
        ),
        "manifest.json",
    ),
    "shard unlisted and zero-filled": (_unlisted_zero_filled_shard, "__0_0.distcp"),
}


def _two_checkpoints(tmp_path):
    """Checkpoints 1 and 2 of a model whose weights and trainer state differ between them."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep_last=None)
    model, data = random_decoder(seed=1), {"position": 1}
    ckpt.save(1, {"model": model, "data": data})
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    data["position"] = 2
    ckpt.save(2, {"model": model, "data": data})
    return ckpt, first


@pytest.mark.tally("faults")
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, case):
    corrupt, name = CORRUPTIONS[case]
    ckpt, first = _two_checkpoints(tmp_path)
    corrupt(ckpt.step_dir(2))
    model, data = random_decoder(seed=9), {}
    with caplog.at_level(logging.WARNING, logger="prorl.engine.checkpoint"):
        info = Checkpointer(ckpt.directory).load({"model": model, "data": data})
    assert info.step == 1 and data == {"position": 1}
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, first[key]), key
    damaged = os.path.join(ckpt.step_dir(2), name)
    assert any(damaged in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records), (
        caplog.text
    )

    # asked for by step: refused, named
    with pytest.raises(CheckpointError, match="is damaged") as err:
        Checkpointer(ckpt.directory).load({"model": model, "data": data}, step=2)
    assert damaged in str(err.value)

    corrupt(ckpt.step_dir(1))  # every checkpoint damaged: refused, each file named
    with pytest.raises(CheckpointError, match="no usable checkpoint") as err:
        Checkpointer(ckpt.directory).load({"model": model, "data": data})
    assert damaged in str(err.value) and os.path.join(ckpt.step_dir(1), name) in str(err.value)


@pytest.mark.tally("faults")
def test_a_damaged_newer_checkpoint_does_not_push_good_ones_out_of_keep_last(tmp_path):
    """Saved at steps 1 and 3, step 3 damaged: the run resumes step 1 and saves step 2. keep_last=2
    keeps 1 and 2 (the good ones up to the save); the damaged 3 neither counts nor is deleted by the
    save."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep_last=2)
    model = random_decoder(seed=1)
    ckpt.save(1, {"model": model})
    ckpt.save(3, {"model": model})
    _zero_fill(_shard(ckpt.step_dir(3)))
    assert ckpt.load({"model": model}).step == 1
    ckpt.save(2, {"model": model})
    assert ckpt.complete_steps() == [1, 2, 3]
    ckpt.save(4, {"model": model})
    assert ckpt.complete_steps() == [3, 4]


@pytest.mark.tally("faults")
def test_a_missing_or_damaged_rng_file_is_named_and_the_rest_loads(tmp_path, caplog):
    ckpt, _ = _two_checkpoints(tmp_path)
    rng_file = os.path.join(ckpt.step_dir(2), "rng", "rank_00000.pt")
    for damage in (_zero_fill, os.remove):
        damage(rng_file)
        caplog.clear()
        data = {}
        with caplog.at_level(logging.WARNING, logger="prorl.engine.checkpoint"):
            info = Checkpointer(ckpt.directory).load({"model": random_decoder(), "data": data})
        assert info.step == 2 and data == {"position": 2}
        warned = [r.getMessage() for r in caplog.records if rng_file in r.getMessage()]
        assert warned and "no longer bit-identical" in warned[0], caplog.text


@pytest.mark.tally("faults")
def test_a_load_that_fails_anyway_is_a_checkpoint_error_naming_it(tmp_path, monkeypatch):
    """Files that match their manifest but do not fit this run (a DCP planner's refusal, say) end as
    a CheckpointError naming the checkpoint - train.py's exit 4 - not as a raw traceback (exit
    1)."""
    import torch.distributed.checkpoint as dcp

    ckpt, _ = _two_checkpoints(tmp_path)

    def refusing_load(state_dict, checkpoint_id, **kwargs):
        raise RuntimeError(
            "Size mismatch between saved torch.Size([4]) and current torch.Size([8])"
        )

    monkeypatch.setattr(dcp, "load", refusing_load)
    with pytest.raises(
        CheckpointError, match=r"loading checkpoint .*step_00000002 failed: RuntimeError: Size"
    ):
        Checkpointer(ckpt.directory).load({"model": random_decoder(), "data": {}})


def test_a_checkpoint_saved_before_manifests_still_loads(tmp_path):
    """Format 1 (no manifest.json): the required files and a readable meta.json are checked, no
    more."""
    ckpt, _ = _two_checkpoints(tmp_path)
    step_dir = ckpt.step_dir(2)
    os.remove(os.path.join(step_dir, "manifest.json"))
    meta = json.loads(open(os.path.join(step_dir, "meta.json")).read())
    with open(os.path.join(step_dir, "meta.json"), "w") as f:
        json.dump({**meta, "format": 1}, f)
    data = {}
    assert Checkpointer(ckpt.directory).load({"model": random_decoder(), "data": data}).step == 2
    assert data == {"position": 2}


def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path):
    import hashlib

    ckpt, _ = _two_checkpoints(tmp_path)
    step_dir = ckpt.step_dir(2)
    listed = json.loads(open(os.path.join(step_dir, "manifest.json")).read())["files"]
    walk = [os.path.join(root, n) for root, _, names in os.walk(step_dir) for n in names]
    on_disk = {os.path.relpath(p, step_dir) for p in walk}
    assert set(listed) == on_disk - {"manifest.json", "COMPLETE"}
    for name, entry in listed.items():
        blob = open(os.path.join(step_dir, name), "rb").read()
        assert entry == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}, name


# --------------------------------------------------------------------------------------------------
# Two ranks: a damaged shard of rank 1, and replicated <-> FSDP2


def _fsdp_worker(rank, world, ckpt_dir):
    from dist_helpers import TINY_QWEN2

    def sharded():
        model = parallel.parallelize(parallel.meta_decoder(TINY_QWEN2))
        parallel.materialize(model, "cpu", seed=rank + 11)
        return model

    plain = random_decoder(seed=3)  # the same weights on both ranks: a replicated run
    same_identity = model_identity(plain) == model_identity(sharded())
    ckpt = Checkpointer(ckpt_dir, keep_last=None)
    ckpt.save(1, {"model": plain})
    model = sharded()
    ckpt.save(2, {"model": model})
    saved_2 = parallel.full_state_dict(model)
    distributed.barrier()
    if rank == 0:
        _zero_fill(_shard(ckpt.step_dir(2), rank=1))
    distributed.barrier()
    # model.fsdp switched on for a run saved replicated: the same model, resharded
    fresh = sharded()
    info = Checkpointer(ckpt_dir).load({"model": fresh})
    got = parallel.full_state_dict(fresh)
    from_replicated = all(torch.equal(got[k], v) for k, v in plain.state_dict().items())
    differs_from_2 = any(not torch.equal(got[k], v) for k, v in saved_2.items())
    return same_identity, info.step, from_replicated, differs_from_2


@pytest.mark.slow
@pytest.mark.tally("faults")
@pytest.mark.skipif(not dist.is_gloo_available(), reason="gloo backend unavailable")
def test_fsdp2_a_damaged_shard_of_rank_1_falls_back_to_the_replicated_save(tmp_path):
    results = run_ranks(_fsdp_worker, tmp_path, str(tmp_path / "ckpt"))
    for rank in (0, 1):
        assert results[rank] == (True, 1, True, True), (rank, results[rank])


@pytest.mark.tally("faults")
@pytest.mark.parametrize(
    "case", ["manifest files a list", "manifest entry without size", "manifest null entry"]
)
def test_a_resume_with_every_manifest_damaged_exits_4_naming_them(tmp_path, case):
    """What train.py runs before anything of the run is touched: exit 4 naming each manifest, no
    traceback (these three raised AttributeError, KeyError and TypeError there)."""
    from prorl.config import load_config
    from prorl.lifecycle import EXIT_RESUME, Fatal
    from prorl.train import refuse_incompatible_resume

    ckpt, _ = _two_checkpoints(tmp_path)
    for step in (1, 2):
        CORRUPTIONS[case][0](ckpt.step_dir(step))
    with pytest.raises(Fatal) as err:
        refuse_incompatible_resume(Checkpointer(ckpt.directory), load_config("default"), rank=0)
    assert err.value.code == EXIT_RESUME
    for step in (1, 2):
        assert os.path.join(ckpt.step_dir(step), "manifest.json") in str(err.value), str(err.value)
