"""The run's model directory: `model.path` resolved (`builtin:NAME` is a model shipped in
prorl/assets) and checked before anything loads it, so that a broken directory is named at start-up
(exit code 2). Used by the trainer's command line (prorl/train.py) and by prorl/export.py."""

from __future__ import annotations

import os

from prorl import lifecycle
from prorl.engine.model.hf_io import check_hf_dir
from prorl.lifecycle import Fatal
from prorl.tokenizer import check_tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def resolve_model_path(path: str) -> str:
    """`path` as a Hugging Face directory (`builtin:NAME` -> prorl/assets/NAME); raises
    Fatal(EXIT_CONFIG) naming it when it has no config.json, or a damaged config, weights file or
    tokenizer."""
    if path.startswith("builtin:"):
        path = os.path.join(ASSETS, path.split(":", 1)[1])
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise Fatal(
            lifecycle.EXIT_CONFIG,
            f"model.path={path!r} is not a Hugging Face model directory (no config.json)",
        )
    try:  # a damaged config.json or weights file, no tokenizer or another model's: named now
        check_hf_dir(path)
        check_tokenizer(path)
    except (ValueError, OSError) as exc:
        raise Fatal(lifecycle.EXIT_CONFIG, f"model.path={path!r}: {exc}") from None
    return path
