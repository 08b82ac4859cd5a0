"""`generation_config.json` for an exported model (`checkpoints/final`, `python -m prorl.export`):
what `transformers`' generate and vLLM read as the model's stopping ids and sampling defaults.

The base model's own file is the starting point (its fields kept); `eos_token_id` becomes every id
the run stopped its samples at (prorl.data.stop_token_ids: the tokenizer's eos, ChatML's
<|im_end|>, the base file's ids), so that a generate() call on the export stops where training did;
without base sampling defaults, the run's validation sampling is written (trainer.val_temperature
and val_top_p: the settings its held-out accuracy was measured with; temperature 0 is greedy).
"""

from __future__ import annotations

import json
import os

from prorl.data import stop_token_ids

FILE = "generation_config.json"


def generation_config(tokenizer, model_path: str, trainer_cfg: dict) -> dict:
    """The export's generation_config.json as a dict (module docstring). `trainer_cfg`: the run's
    `trainer` section (val_temperature, val_top_p)."""
    base = os.path.join(model_path, FILE)
    out: dict = {}
    if os.path.isfile(base):
        with open(base) as f:
            out = json.load(f)
    ids = stop_token_ids(tokenizer, model_path)
    if ids:
        out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    for key in ("bos_token_id", "pad_token_id"):
        if out.get(key) is None and getattr(tokenizer, key, None) is not None:
            out[key] = getattr(tokenizer, key)
    if not any(k in out for k in ("do_sample", "temperature", "top_p", "top_k")):
        temperature = float(trainer_cfg.get("val_temperature", 0.0))
        out["do_sample"] = temperature > 0
        if temperature > 0:
            out["temperature"] = temperature
            out["top_p"] = float(trainer_cfg.get("val_top_p", 1.0))
    return out


def write_generation_config(out_dir: str, tokenizer, model_path: str, trainer_cfg: dict) -> str:
    path = os.path.join(out_dir, FILE)
    with open(path, "w") as f:
        json.dump(generation_config(tokenizer, model_path, trainer_cfg), f, indent=2)
        f.write("\n")
    return path
