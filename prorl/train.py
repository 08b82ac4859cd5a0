"""Entry point of the ProRL v2 trainer.

    torchrun --standalone --nproc_per_node=2 prorl/train.py             # the embedded default
    torchrun --nproc_per_node=8 prorl/train.py --config prorl_v2_1.5b model.path=/models/x \\
        data.train_files=[/data/train.parquet] data.val_files=[/data/val.parquet]
    torchrun ... -m prorl.train ...                                     # the same, as a module
    torchrun ... --no-python prorl-train ...    # the installed command (prorl-train: one process)
    torchrun ... prorl/train.py --verl-config ppo_trainer.yaml [verl.key=value ...]  # a verl config

With no arguments it runs the embedded default on the CPU: the shipped tiny reasoner trained with
the full recipe on the built-in digit-sum task, held-out accuracy printed before and after, metrics,
a checkpoint and a PNG of the training curves in the run directory. With `model.path=` and no
`--config` it runs the recipe's own defaults (prorl/config.py) on that model: the embedded default's
toy settings (a 40-token budget, lr 3e-5, ...) belong to the no-argument run only. The preset and
every non-default value are printed at start; `--print-config` prints the resolved configuration and
exits; `--help` lists every key. The command line is checked, and `--help` answered, before torch
and transformers are loaded; the run itself is prorl/train_run.py.

Lifecycle (prorl/lifecycle.py has the exit codes):
- Re-running the same command on the same `output_dir` resumes from its latest complete checkpoint;
  `metrics.jsonl` is cut back to that step, so the resumed run's rows follow on as if never stopped.
  With `trainer.deterministic=true` on the CPU the result is bit-identical to an uninterrupted run
  (tests/prorl/test_resume.py and tests/preset kill runs with SIGKILL to check it). A resume with
  settings that fix the run's data and batch changed is refused before anything is touched.
- SIGTERM or Ctrl-C: the current step is finished, a checkpoint saved (if `trainer.save_every` > 0),
  and the process exits 0. All ranks agree on the step to stop after. Under torchrun the agent
  forwards the signal and kills workers that are still alive after `--shutdown-timeout` (default 30
  s) - raise it when a step plus a save takes longer. A second signal, 2 s or more after the first,
  aborts at once.
- A dead, frozen or hung rank: a rank waiting long in a collective says which
  (trainer.wait_warning_s); collectives time out (trainer.collective_timeout_s, sized from the
  config) and the run ends with exit code 7; the last complete checkpoint is untouched.
- An unwritable output directory, or too little disk for one checkpoint: a clear error and exit code
  5 before the first step.
- A damaged checkpoint (a file whose size or checksum differs from the manifest written at save, or
  is missing): the previous complete one is resumed, with a warning naming the file; when every one
  is damaged, exit code 4 naming the files. A missing RNG file: resumed with a warning naming it.
- Asynchronous RL (rollout.async_rl.steps_ahead >= 1): rollout ranks that stop delivering groups or
  weights (dead, hung past the timeout, or holding weights other than the version they report) end
  the run with exit code 8 on the trainers; a dead rank also makes torchrun stop the others.
- A weight or optimizer state that became NaN or infinite: exit code 9 naming the tensor and the
  step, before the save or the final export that would have kept it.
- A broken model directory (config.json, a truncated safetensors file) or data file (not UTF-8, an
  empty prompt or ground truth, an empty file): exit code 2 naming the file (and row and field).
"""

from __future__ import annotations

import argparse
import os
import sys

from prorl import verl_compat
from prorl.config import ConfigError, load_config, preset_path, reference, to_yaml
from prorl.config_checks import repeated_overrides
from prorl.exits import EXIT_CONFIG
from prorl.lazy import forwarder


def parse_config(argv: list[str] | None):
    """(config, preset name) from the command line; raises ConfigError. Without --config the
    embedded default applies to the no-argument run (and runs that only resize it), the recipe's
    defaults when a model is given (`model.path=`)."""
    ap = argparse.ArgumentParser(
        description="ProRL v2 trainer",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="configuration keys (dotted overrides key=value):\n" + reference(),
    )
    ap.add_argument("--config", default=None, help="preset name in prorl/configs or a YAML path")
    ap.add_argument(
        "--verl-config", default=None, help="a verl ppo_trainer YAML (prorl/verl_compat)"
    )
    ap.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )
    ap.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=10"
    )
    args = ap.parse_intermixed_args(argv)  # options anywhere among the overrides
    if (repeated := repeated_overrides(args.overrides)) and os.environ.get("RANK", "0") == "0":
        print(f"prorl: warning: {repeated}", file=sys.stderr)
    # verl's keys (from --verl-config and among the overrides) translated; the rest are prorl's
    values, overrides, verl = verl_compat.from_command_line(args.verl_config, args.overrides)
    preset = args.config
    if preset is None:
        own_model = "model.path" in values or any(o.startswith("model.path=") for o in overrides)
        preset = None if own_model else "default"
    # stderr beside --print-config's YAML
    if verl is not None and int(os.environ.get("RANK", "0")) == 0:
        print(
            verl_compat.format_table(verl, args.verl_config, list_ignored=args.print_config),
            file=sys.stderr if args.print_config else None,
        )
    cfg = verl_compat.load_with_derived(values, lambda v: load_config(preset, overrides, v))
    explicit = "data.builtin_task" in values or any(
        o.startswith("data.builtin_task=") for o in overrides
    )
    check_training_data(cfg, preset, explicit)
    return cfg, preset, args.print_config


def check_training_data(cfg, preset: str | None, explicit: bool) -> None:
    """A preset for another model than the embedded one (`--config prorl_v2_1.5b`) without
    data.train_files would validate and train the builtin task at the preset's sizes for hours:
    refused (ConfigError) unless data.builtin_task is given on purpose, on the command line or in
    the file."""
    from omegaconf import OmegaConf

    if preset in (None, "default") or cfg.data.train_files or cfg.model.path.startswith("builtin:"):
        return
    if (
        explicit
        or OmegaConf.select(OmegaConf.load(preset_path(preset)), "data.builtin_task") is not None
    ):
        return
    raise ConfigError(
        f"--config {preset} trains model.path={cfg.model.path!r} but sets no data.train_files: "
        "give data.train_files=[FILE] (verl parquet / JSONL), or data.builtin_task=NAME to train "
        "on a generated task on purpose"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, preset, print_only = parse_config(argv)
    except ConfigError as exc:
        print(f"prorl: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if print_only:
        print(to_yaml(cfg), end="")
        return 0
    # torch, transformers and the engine load only now, after the command line was checked
    from prorl import train_run

    return train_run.launch(cfg, preset)


__getattr__ = forwarder(__name__, "prorl.train_run")  # `from prorl.train import ...`


if __name__ == "__main__":
    sys.exit(main())
