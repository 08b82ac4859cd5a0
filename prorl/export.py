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
import sys

from prorl.exits import Fatal
from prorl.lazy import forwarder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prorl.export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint directory: RUN_DIR/checkpoints/step_NNNNNNNN")
    ap.add_argument("out", help="the Hugging Face directory to write")
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="default: the run's"
    )
    ap.add_argument("--key", choices=("model", "reference"), default="model")
    args = ap.parse_args(argv)
    # torch and the engine load only now, after the command line was checked
    from prorl.export_run import CheckpointError, export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, key=args.key)
        print(f"prorl.export: wrote {out}")
    except (CheckpointError, Fatal, FileNotFoundError, ValueError) as exc:
        print(f"prorl.export: {exc}", file=sys.stderr)
        return 2
    return 0


__getattr__ = forwarder(__name__, "prorl.export_run")  # `from prorl.export import ...`


if __name__ == "__main__":
    raise SystemExit(main())
