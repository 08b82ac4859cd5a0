"""Random-weight Qwen2 checkpoints of the benchmarks (rl_step, train_step, rollout), built once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# random_checkpoint's default folder
CHECKPOINT_DIR = os.path.join(tempfile.gettempdir(), "prorl-bench")


def qwen2_shape(hidden: int, intermediate: int, layers: int, heads: int, **more) -> dict:
    """`transformers.Qwen2Config` keywords of a model shape."""
    shape = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers)
    return dict(shape, num_attention_heads=heads, **more)


def random_checkpoint(
    config: dict, *, std=None, tokenizer: Path | None = None, folder=CHECKPOINT_DIR
) -> str:
    """The directory of a random-weight Qwen2 checkpoint, built once per machine and config.

    config: `transformers.Qwen2Config` keywords (default 2 KV heads, tied embeddings). Seed 0;
    transformers' own init, or with `std` every parameter but the norms drawn from normal(0, std).
    `tokenizer`: a checkpoint directory whose tokenizer files are copied in. The directory name
    hashes all of these (a new shape, a new directory); it is written under a temporary name and
    renamed, so a concurrent worker sees a whole checkpoint or none."""
    config = dict(dict(num_key_value_heads=2, tie_word_embeddings=True), **config)
    key = json.dumps([config, std, tokenizer and Path(tokenizer).name], sort_keys=True)
    path = os.path.join(folder, f"qwen2-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    if std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, std)
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    for f in (
        ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja") if tokenizer else ()
    ):
        shutil.copy(Path(tokenizer) / f, tmp)
    os.replace(tmp, path)
    return path
