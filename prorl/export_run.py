"""The export behind prorl/export.py's command line (its docstring says what is written):
`export_checkpoint`, also used by `prorl.eval --model CHECKPOINT`. It brings torch and the
engine."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp

from prorl.engine.checkpoint import MARKER, META, CheckpointError, verify_checkpoint
from prorl.engine.checkpoint_state import ModelState
from prorl.engine.model import load_hf, save_hf
from prorl.generation_config import write_generation_config
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
