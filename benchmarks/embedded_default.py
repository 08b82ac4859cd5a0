"""The embedded default's result beside its control: RL vs the same minutes of supervised training.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 prorl/train.py     # -> runs/<ts>/
    OMP_NUM_THREADS=1 python -m prorl.warmstart --init prorl/assets/tiny-reasoner \\
        --out /tmp/sft_control --steps 1500 --eval-every 100 --lr 1e-3 --minutes 8  # the control
    python -m benchmarks embedded_default --run runs/<ts> \\
        --control /tmp/sft_control/warmstart.jsonl

Held-out greedy accuracy against wall time for both (the same 200 problems): embedded_default.png
and rows in embedded_default.csv. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import harness, plot

NAME = "embedded_default"


def rl_curve(run: Path) -> list[tuple[float, float]]:
    """(seconds since the first step, held-out accuracy) of an RL run; accuracy before RL at 0 s."""
    elapsed, curve, rows = 0.0, [], harness.read_metrics(run)
    if not rows:
        raise FileNotFoundError(
            f"{run}/metrics.jsonl: no such file or no rows (not a run directory?)"
        )
    for r in rows:
        elapsed += r.get("timing_s/step", 0.0)
        if "val/accuracy" in r:
            curve.append((elapsed, r["val/accuracy"]))
    return curve


def control_curve(path: Path, start_accuracy: float) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in open(path)]
    return [(0.0, start_accuracy)] + [(r["elapsed_s"], r["val_greedy_accuracy"]) for r in rows]


def main(argv=None) -> int:
    ap = harness.argparser(NAME, __doc__)
    ap.add_argument("--run", required=True, type=Path, help="run directory of the embedded default")
    ap.add_argument("--control", required=True, type=Path, help="the SFT control's warmstart.jsonl")
    ap.add_argument("--out", type=Path, default=harness.RESULTS_DIR / f"{NAME}.csv")
    args = ap.parse_args(argv)
    rl = rl_curve(args.run)
    control = control_curve(args.control, rl[0][1])
    rows = []
    for provider, curve in (("prorl-rl", rl), ("sft-control", control)):
        last = [a for _, a in curve[-3:]]
        case = dict(provider=provider, mode="greedy-200-heldout", shape="digit_sums")
        case["versions"] = "OMP_NUM_THREADS=1 2 procs" if provider == "prorl-rl" else "1 proc"
        for metric, unit, value in (
            ("accuracy_before", "fraction", curve[0][1]),
            ("accuracy_after_mean_last3", "fraction", sum(last) / len(last)),
            ("accuracy_max", "fraction", max(a for _, a in curve)),
            ("wall_time", "s", curve[-1][0]),
        ):
            rows.append(harness.row(metric, unit, [value], **case))
    harness.record(NAME, rows, args.out, device=harness.device_name("cpu"), versions="")
    curves = {"RL (prorl, embedded default)": rl, "further SFT (control)": control}
    xlabel, ylabel = "minutes of training after the warm-start", "held-out greedy accuracy (200)"
    png = plot.curves(curves, args.out.with_suffix(".png"), xlabel, ylabel)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
