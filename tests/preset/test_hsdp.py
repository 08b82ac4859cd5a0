"""HSDP (`model.dp_replicate`): the prorl_v2_1.5b preset in miniature on 4 gloo ranks as 2 replicas
x 2 shards, against plain FSDP2 over the same 4 ranks. What a user moving from one node to several
relies on:

- the replicas change nothing but where the shards live: the batch split, the global token
  normaliser, advantage whitening, dynamic sampling's merges and the gradient sum run over all 4
  ranks, so every metric and the trained weights equal the 1-D run's up to round-off (gloo sums in
  another order);
- a 2 x 2 run that stopped after its step-1 checkpoint resumes from it (DCP of the 2-D-sharded model
  and optimizer, the prompt scheduler's record, the samples carried over) and continues as the
  uninterrupted 1-D run did;
- the gradients cross the replicas once per mini-batch: each backward reduce-scatters within a
  replica, and only a mini-batch's last one all-reduces across the replicas (across nodes);
- the 2-D mesh is row-major (each shard group is consecutive ranks: one node's, under torchrun), and
  the disk-space check before a save counts a replicated shard once, as DCP writes it.

Each rank runs `prorl.train.main`, the command line's own code, three times in one process: 1-D for
2 steps; 2 x 2 for 1 step (saved); 2 x 2 resumed to 2 steps.
"""

import io
import json

import pytest
import torch
from dist_helpers import run_ranks
from preset_helpers import preset_overrides, write_bf16_untied_checkpoint, write_data

pytestmark = pytest.mark.slow

STEPS = 2
VOLATILE = ("timing_s/", "perf/")  # wall-clock metrics differ between any two runs


def _runs(rank, world, tmp, ckpt, train, val):
    import contextlib
    import os

    import torch.distributed as dist

    from prorl import report
    from prorl import train as train_cli

    # as torchrun sets them (preset_rewards)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    # matplotlib: seconds per run, no HSDP in it
    report.plot_run = lambda *args, **kwargs: "(not plotted)"
    common = [
        *preset_overrides(ckpt, train, val),
        "scheduler.mode=pass-rate",
        "trainer.save_every=1",
    ]
    # 2 prompts per rank and step, in 2 mini-batches; no validation: the least work that still
    # samples unevenly across ranks, refills, whitens, steps the optimizer twice per step and saves
    common += [
        "trainer.prompts_per_step=8",
        "trainer.mini_batches=2",
        "trainer.val_before_train=false",
    ]
    common += ["trainer.val_every=0", "trainer.collective_timeout_s=120"]
    plan = [
        ("flat", ["model.dp_replicate=1", f"trainer.total_steps={STEPS}"]),
        ("hsdp", ["model.dp_replicate=2", "trainer.total_steps=1"]),
        ("hsdp", ["model.dp_replicate=2", f"trainer.total_steps={STEPS}"]),  # resumes from step 1
    ]
    said, events = [], _count_collectives(rank)
    for i, (name, extra) in enumerate(plan):
        # a fresh process group per run, as a new torchrun launch has (main destroys it at the end)
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/init-{i}", rank=rank, world_size=world
        )
        if i == 0:
            layout = _mesh_layout()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = train_cli.main(
                ["--config", "prorl_v2_1.5b", *common, *extra, f"output_dir={tmp}/{name}"]
            )
        assert code == 0, out.getvalue()[-3000:]
        said.append(out.getvalue())
        events.append("RUN")
    return said, layout, events


def _count_collectives(rank: int) -> list[str]:
    """Records, in order, this rank's gradient collectives: "AR" for an all-reduce over its
    replicate group (ranks r % 2 and r % 2 + 2), "RS" for a reduce-scatter over its shard group
    (2 (r // 2) and the next), "STEP" when the optimizer steps, "RUN" at the end of a run."""
    import torch.distributed as dist
    from prorl.engine import optim

    events = []
    groups = {"AR": [rank % 2, rank % 2 + 2], "RS": [2 * (rank // 2), 2 * (rank // 2) + 1]}

    def counted(kind, real, group_at):
        def call(*args, **kwargs):
            group = kwargs.get("group", args[group_at] if len(args) > group_at else None)
            if group is not None and dist.get_process_group_ranks(group) == groups[kind]:
                events.append(kind)
            return real(*args, **kwargs)

        return call

    dist.all_reduce = counted("AR", dist.all_reduce, 2)
    # FSDP2's reduce-scatter (torch 2.13: reduce_scatter_single)
    dist.reduce_scatter_single = counted("RS", dist.reduce_scatter_single, 2)
    step = optim.Optimizer.step
    optim.Optimizer.step = lambda self: (events.append("STEP"), step(self))[1]
    return events


def _mesh_layout():
    """This rank's place in the 2 x 2 mesh, its shard group, the error for 3 replicas of 4 ranks,
    and the bytes a checkpoint's disk-space check expects from all ranks, 1-D and 2 x 2 (DCP writes
    a replicated shard once)."""
    from dist_helpers import random_decoder
    from prorl.engine import checkpoint, distributed, parallel

    mesh = parallel.data_parallel_mesh(2)
    try:
        parallel.data_parallel_mesh(3)
        error = None
    except ValueError as exc:
        error = str(exc)
    save_bytes = {}
    for replicate in (1, 2):
        model = parallel.parallelize(random_decoder(), dp_replicate=replicate)
        save_bytes[replicate] = distributed.all_reduce_sum(
            float(checkpoint._tensor_bytes(model.state_dict()))
        )
    unsharded = sum(v.numel() * v.element_size() for v in random_decoder().state_dict().values())
    layout = mesh.mesh_dim_names, mesh.get_coordinate(), mesh["dp_shard"].mesh.tolist(), error
    return layout, save_bytes, unsharded


def _split(events: list[str], end: str) -> list[list[str]]:
    """The events before each `end` (what follows the last one is dropped)."""
    out, current = [], []
    for e in events:
        if e == end:
            out.append(current)
            current = []
        else:
            current.append(e)
    return out


def step_rows(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def saved_weights(step_dir, ckpt) -> dict[str, torch.Tensor]:
    """The policy's fp32 master weights in a DCP checkpoint, read into one process (DCP
    reshards)."""
    import torch.distributed.checkpoint as dcp
    from prorl.engine.checkpoint_state import ModelState
    from prorl.engine.model import load_hf

    model = load_hf(ckpt, dtype=torch.float32)
    dcp.load({"model": ModelState(model)}, checkpoint_id=str(step_dir), no_dist=True)
    return {k: v.detach().double() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    d = tmp_path_factory.mktemp("preset-hsdp")
    ckpt = write_bf16_untied_checkpoint(str(d / "ckpt"))
    train, val = write_data(str(d))
    return ckpt, train, val


def test_two_by_two_hsdp_equals_flat_fsdp2_and_resumes(preset, tmp_path):
    ckpt, train, val = preset
    res = run_ranks(
        _runs, tmp_path, str(tmp_path), ckpt, train, val, world=4, init=False, timeout_s=600
    )
    # row-major: shard groups are consecutive ranks, as torchrun numbers one node's processes
    for rank, (_, (layout, save_bytes, unsharded), _) in res.items():
        assert save_bytes == {1: unsharded, 2: unsharded}, (save_bytes, unsharded)
        names, coordinate, shard_group, error = layout
        assert names == ("dp_replicate", "dp_shard") and list(coordinate) == [
            rank // 2,
            rank % 2,
        ], layout
        assert shard_group == [2 * (rank // 2), 2 * (rank // 2) + 1], layout
        assert "dp_replicate=3 must be >= 1 and divide the 4 ranks" in error, error
    said = res[0][0]
    # one all-reduce across the replicas per FSDP unit (each block and the root) and mini-batch,
    # however many micro-batches reduce-scatter into it
    units = 1 + json.load(open(f"{ckpt}/config.json"))["num_hidden_layers"]
    for rank, (_, _, events) in res.items():
        flat, *hsdp = _split(events, "RUN")
        assert flat and "AR" not in flat, (rank, flat)  # 1-D: no replicate group
        windows = [w for run in hsdp for w in _split(run, "STEP")]  # one per optimizer step
        assert len(windows) == 2 * STEPS, (rank, windows)  # 2 mini-batches a step
        for w in windows:
            assert w.count("AR") == units and w.count("RS") % units == 0, (rank, w)
        assert max(w.count("RS") for w in windows) > units, (rank, windows)  # micro-batched
    assert "prorl: resumed from" in said[2] and "step 1" in said[2], said[2][-2000:]

    flat, hsdp = step_rows(tmp_path / "flat"), step_rows(tmp_path / "hsdp")
    assert sorted(flat) == sorted(hsdp) and max(flat) == STEPS, (sorted(flat), sorted(hsdp))
    for step, row in flat.items():
        assert row.keys() == hsdp[step].keys(), step
        for key, value in row.items():
            if isinstance(value, float):
                # seen: 1e-7 relative (grad norm); the 2 replicas not summed: 6e-5 (pg_loss)
                assert hsdp[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
            else:
                assert hsdp[step][key] == value, (step, key)
    assert flat[1]["actor/grad_norm"] > 0 and flat[STEPS]["actor/grad_norm"] > 0
    # what the miniature exercised: refill rounds, groups carried into step 2, a reference reset
    # after it
    assert flat[1]["dynamic_sampling/rounds"] > 1 and flat[2]["dynamic_sampling/carried_groups"] > 0
    assert flat[2]["ref/reset_reason"] == "interval"

    # the trained weights: what each step moved them (AdamW at lr 2e-6 moves each by ~lr), to
    # round-off
    start = {k: v.double() for k, v in _hf_weights(ckpt).items()}
    for step in range(1, STEPS + 1):
        name = f"step_{step:08d}"
        a = saved_weights(tmp_path / "flat" / "checkpoints" / name, ckpt)
        b = saved_weights(tmp_path / "hsdp" / "checkpoints" / name, ckpt)
        for key in a:
            moved = a[key] - start[key]
            assert moved.abs().max() > 1e-7, key  # every tensor trains, the untied head too
            # a few fp32 ulps of the weights (~0.05), 1/200 of one step's move
            torch.testing.assert_close(b[key] - start[key], moved, rtol=0, atol=1e-8, msg=key)


def _hf_weights(ckpt) -> dict[str, torch.Tensor]:
    from prorl.engine.model import load_hf

    return load_hf(ckpt, dtype=torch.float32).state_dict()
