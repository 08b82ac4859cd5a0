"""Prompt scheduling on a prolonged run: tokens per kept group, kept fraction, accuracy, wall time.

    OMP_NUM_THREADS=1 python -m benchmarks prompt_scheduling [--steps 300] [--providers ...]

The embedded default (torchrun, 2 CPU processes), same seed and steps per provider:
`dynamic-sampling` (scheduler.mode=none), `pass-rate` (prorl/scheduler.py), `exclude-solved`
(open-instruct's rule); plot prompt_scheduling.png. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks import harness, plot

NAME = "prompt_scheduling"
PROVIDERS = {
    "dynamic-sampling": "none",
    "pass-rate": "pass-rate",
    "exclude-solved": "exclude-solved",
}
UNITS = dict(wall_time="s", val_accuracy="fraction", kept_group_fraction="fraction")


def run(provider: str, steps: int, val_every: int, out: Path, timeout: float) -> list[dict]:
    """One training run of the embedded default with this provider's scheduler; its metrics rows."""
    run = [f"output_dir={out}", f"trainer.total_steps={steps}", f"trainer.val_every={val_every}"]
    run += [f"scheduler.mode={PROVIDERS[provider]}", "trainer.save_every=0"]
    cmd = harness.train_command(2, *run, "algorithm.reset.interval=100")
    env = dict(os.environ, **harness.TRAIN_ENV)
    kw = dict(cwd=harness.REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    proc = subprocess.run(cmd, **kw)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        raise RuntimeError(f"{provider}: exit {proc.returncode}\n{tail}")
    rows = harness.read_metrics(out)
    if not rows:
        raise RuntimeError(f"{provider}: the run wrote no {out}/metrics.jsonl rows")
    return rows


def summary(rows: list[dict]) -> dict[str, float]:
    steps = [r for r in rows if "dynamic_sampling/sampled_groups" in r]
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    total = lambda key: sum(r[key] for r in steps)
    passed = total("dynamic_sampling/passed_groups")
    return {
        "gen_tokens_per_kept_group": total("dynamic_sampling/generated_tokens") / max(passed, 1.0),
        "kept_group_fraction": passed / max(total("dynamic_sampling/sampled_groups"), 1.0),
        "wall_time": sum(r.get("timing_s/step", 0.0) for r in steps),
        "val_accuracy": sum(vals[-3:]) / max(len(vals[-3:]), 1),
    }


def main(argv=None) -> int:
    ap = harness.argparser(NAME, __doc__)
    ap.add_argument("--steps", type=int, default=300, help="RL steps per run")
    ap.add_argument("--val-every", type=int, default=25)
    ap.add_argument(
        "--providers", type=harness.subset_of(tuple(PROVIDERS)), default=list(PROVIDERS)
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    ap.add_argument(
        "--quick", action="store_true", help="6 steps each: a smoke test, not a measure"
    )
    ap.add_argument("--out", type=Path, default=harness.RESULTS_DIR / f"{NAME}.csv")
    args = ap.parse_args(argv)
    steps, val_every = (6, 3) if args.quick else (args.steps, args.val_every)
    case = dict(mode=f"{steps}-steps", shape="digit_sums embedded default")
    rows, curves, tokens = [], {}, {}
    key = "dynamic_sampling/gen_tokens_per_kept_group"
    with tempfile.TemporaryDirectory(prefix="prorl-sched-") as tmp:
        for provider in args.providers:
            metrics = run(provider, steps, val_every, Path(tmp) / provider, args.timeout)
            for metric, value in summary(metrics).items():
                unit = UNITS.get(metric, "tokens")
                rows.append(harness.row(metric, unit, [value], provider=provider, **case))
            curves[provider] = [
                (r["step"], r["val/accuracy"]) for r in metrics if "val/accuracy" in r
            ]
            tokens[provider] = [(r["step"], r[key]) for r in metrics if key in r]
    versions = f"OMP_NUM_THREADS=1 2 procs; {harness.command_line(argv)}"
    out = None if args.quick else args.out
    harness.record(NAME, rows, out, device=harness.device_name("cpu"), versions=versions)
    png = plot.scheduling(tokens, curves, args.out.with_suffix(".png"))
    print(f"wrote {'' if args.quick else str(args.out) + ' and '}{png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
