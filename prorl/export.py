"""A training checkpoint as a Hugging Face model directory (as verl's model_merger does for verl).

    python -m prorl.export runs/<ts>/checkpoints/step_00000300 /models/my-policy [--dtype bfloat16]

A checkpoint (engine/checkpoint.py) holds the policy's shards as torch.distributed.checkpoint writes
them, whatever the number of ranks that saved it; this reads them into one process (DCP reshards),
builds the decoder from the run's model (the checkpoint's saved config names it), and writes
config.json, model.safetensors, generation_config.json (prorl/generation_config.py) and the
tokenizer: loadable by `transformers`, `prorl.eval --model` and vLLM. The run's final export
(`checkpoints/final`) is the same thing for the last step; this is for any other step, and for a
run that was stopped. `--key reference` exports the reference policy instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed.checkpoint as dcp

from prorl.engine.checkpoint import MARKER, META, CheckpointError, verify_checkpoint
from prorl.engine.checkpoint_state import ModelState
from prorl.engine.model import load_hf, save_hf
from prorl.generation_config import write_generation_config
from prorl.lifecycle import Fatal
from prorl.model_dir import resolve_model_path


def export_checkpoint(
    checkpoint: str, out: str, *, dtype: str | None = None, key: str = "model"
) -> str:
    """Write checkpoint `checkpoint`'s `key` model to `out` as a Hugging Face directory; returns
    `out`."""
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(checkpoint, MARKER)):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no {MARKER} marker)")
    # sizes and checksums of the manifest written at save
    damage = verify_checkpoint(checkpoint).damage
    if damage:
        raise CheckpointError(f"checkpoint {checkpoint} is damaged: " + "; ".join(damage))
    with open(os.path.join(checkpoint, META)) as f:
        meta = json.load(f)
    if key not in meta.get("keys", []):
        raise CheckpointError(f"{checkpoint} holds no {key!r} (it holds {meta.get('keys')})")
    config = (meta.get("extra") or {}).get("config") or {}
    model_path = resolve_model_path(config.get("model", {}).get("path", ""))
    # the run's architecture; its weights are replaced
    model = load_hf(model_path, dtype=torch.float32)
    dcp.load({key: ModelState(model)}, checkpoint_id=checkpoint, no_dist=True)
    dtype = dtype or config.get("model", {}).get("dtype", "float32")
    save_hf(model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]), out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    tokenizer.save_pretrained(out)
    write_generation_config(out, tokenizer, model_path, config.get("trainer", {}))
    return out


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META)) and os.path.isfile(os.path.join(path, MARKER))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prorl.export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint directory: RUN_DIR/checkpoints/step_NNNNNNNN")
    ap.add_argument("out", help="the Hugging Face directory to write")
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="default: the run's"
    )
    ap.add_argument("--key", choices=("model", "reference"), default="model")
    args = ap.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, key=args.key)
        print(f"prorl.export: wrote {out}")
    except (CheckpointError, Fatal, FileNotFoundError, ValueError) as exc:
        print(f"prorl.export: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
