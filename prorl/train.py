"""Entry point of the ProRL v2 trainer.

    torchrun --standalone --nproc_per_node=2 prorl/train.py                      # the embedded default
    torchrun --nproc_per_node=8 prorl/train.py --config prorl_v2_1.5b model.path=/models/x \\
        data.train_files=[/data/train.parquet] data.val_files=[/data/val.parquet]

With no arguments it runs the embedded default on the CPU: the shipped tiny reasoner
(prorl/assets/tiny-reasoner, made by `python -m prorl.warmstart`) trained with the full recipe on the
built-in digit-sum task, held-out accuracy printed before and after, metrics, a checkpoint and a PNG of
the training curves written to the run directory.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import time

# `torchrun prorl/train.py` puts prorl/ itself first on sys.path; drop it so that files in this folder
# never shadow top-level modules. The package is imported through the installation (README).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def resolve_model_path(path: str) -> str:
    if path.startswith("builtin:"):
        path = os.path.join(ASSETS, path.split(":", 1)[1])
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"prorl: model.path={path!r} is not a Hugging Face model directory (no config.json)")
    return path


def load_examples(cfg, split: str):
    from prorl import data

    files = cfg.data.train_files if split == "train" else cfg.data.val_files
    if files:  # "path" or "path:weight" (weighted mixing, see prorl.data)
        return data.load_mixture(list(files), seed=cfg.seed)
    size = (cfg.data.train_size if split == "train" else cfg.data.val_size) or None
    return data.builtin(cfg.data.builtin_task, n=size, seed=cfg.seed, split=split)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ProRL v2 trainer", allow_abbrev=False)
    ap.add_argument("--config", default="default", help="preset name in prorl/configs or a YAML path")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=10")
    args = ap.parse_args(argv)

    from prorl.config import ConfigError, load_config, resolve_output_dir, to_yaml

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"prorl: config error: {exc}", file=sys.stderr)
        return 2

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        resolve_output_dir(cfg)
    if dist.is_initialized():  # every rank writes to rank 0's directory
        box = [cfg.output_dir]
        dist.broadcast_object_list(box, src=0)
        cfg.output_dir = box[0]
    from transformers import PreTrainedTokenizerFast

    from prorl.engine.checkpoint import Checkpointer, CheckpointError, config_hash
    from prorl.report import Reporter
    from prorl.rewards import builtin_keys
    from prorl.rewards.pool import RewardPool
    from prorl.rewards.selftest import self_test
    from prorl.trainer import Trainer

    for module in cfg.reward.plugins:  # user verifiers: each module calls prorl.rewards.register(...)
        importlib.import_module(module)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    train, val = load_examples(cfg, "train"), load_examples(cfg, "val")
    sources = tuple(sorted({e.data_source for e in train + val}))
    reporter = Reporter(cfg, rank)
    if rank == 0:
        print(to_yaml(cfg), flush=True)
        reporter.save_config(to_yaml(cfg))
    with RewardPool(
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        preload=builtin_keys(sources),
    ) as pool:
        try:  # a verifier that silently scores everything 0 would waste the whole run
            status = self_test(sources, pool)
        except RuntimeError as exc:
            print(f"prorl: {exc}", file=sys.stderr)
            return 3
        reporter.say("prorl: reward self-test: " + ", ".join(f"{k} {v}" for k, v in status.items()))
        trainer = Trainer(cfg, model_path, tokenizer, train, val, pool)
        # resume from the latest complete checkpoint of this output_dir, if any (RECIPE §7, issue 8)
        ckpt = Checkpointer(os.path.join(cfg.output_dir, "checkpoints"), keep_last=cfg.trainer.keep_last)
        chash = config_hash(to_yaml(cfg))  # changed settings are reported on resume
        holder: dict = {}
        state = {
            "model": trainer.policy,
            "reference": trainer.reference,
            "optimizer": trainer.optimizer,
            "trainer": holder,
        }
        try:
            info = ckpt.load(state, config_hash=chash)
        except CheckpointError as exc:
            print(f"prorl: cannot resume: {exc}", file=sys.stderr)
            return 4
        t_start = time.time()
        if info is not None:
            trainer.restore(holder)
            reporter.resume(trainer.step_count)
            reporter.say(
                f"prorl: resumed from {info.path} (step {trainer.step_count})"
                + (" - the config changed since that save" if info.config_changed else "")
            )
        else:
            acc0 = trainer.validate()
            reporter.validation(0, acc0)
            mode = "greedy" if cfg.trainer.val_temperature == 0 else f"T={cfg.trainer.val_temperature}"
            reporter.say(f"prorl: held-out accuracy before RL: {acc0:.1%} ({len(val)} problems, {mode})")
        saved_at = trainer.step_count
        while trainer.step_count < cfg.trainer.total_steps:
            metrics = trainer.step()
            step = trainer.step_count
            if cfg.trainer.val_every and (
                step % cfg.trainer.val_every == 0 or step == cfg.trainer.total_steps
            ):
                metrics["val/accuracy"] = trainer.validate()
            reporter.log(metrics)
            if cfg.trainer.save_every and (
                step % cfg.trainer.save_every == 0 or step == cfg.trainer.total_steps
            ):
                state["trainer"] = trainer.checkpoint_state()
                ckpt.save(step, state, config_hash=chash)
                saved_at = step
        if saved_at != trainer.step_count and cfg.trainer.save_every:
            state["trainer"] = trainer.checkpoint_state()
            ckpt.save(trainer.step_count, state, config_hash=chash)
        reporter.say(f"prorl: trained to step {trainer.step_count} in {time.time() - t_start:.0f} s")
        out = reporter.finish(trainer)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0 and out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
