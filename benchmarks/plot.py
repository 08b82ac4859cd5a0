"""Plots of a benchmark results CSV: time per provider per mode, and peak extra memory per provider.

    python -m benchmarks plot [linear_logprob_entropy | path/to/results.csv] [--outdir DIR]

Reads the long-format CSV the harness appends to (columns in harness.COLUMNS). For every (device,
shape, provider, mode, metric) only the newest row (by timestamp) is drawn, so re-runs replace older
points. One panel per (device, shape); bars grouped by mode, one bar per provider, at the p50 with a
p20-p80 whisker; time on a log axis (the matmul floor and the unfused baseline differ by orders of
magnitude). Writes <stem>_time.png and <stem>_memory.png next to the CSV (or into --outdir).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from benchmarks.harness import MODES, RESULTS_DIR


def load_latest(path: Path) -> list[dict]:
    """Rows of the CSV, newest per (device, shape, provider, mode, metric), numbers as floats."""
    latest: dict[tuple, dict] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            key = (r["device"], r["shape"], r["provider"], r["mode"], r["metric"])
            if key not in latest or r["timestamp"] >= latest[key]["timestamp"]:
                latest[key] = r
    rows = list(latest.values())
    for r in rows:
        for k in ("p50", "p20", "p80"):
            r[k] = float(r[k])
    return rows


def _colours() -> list[str]:
    import matplotlib.pyplot as plt

    return plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _bars(ax, rows: list[dict], metric: str, ylabel: str, log: bool) -> None:
    # every provider of the panel keeps its slot and colour, so the time and memory figures line up
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    modes = [m for m in MODES if any(r["mode"] == m and r["metric"] == metric for r in rows)]
    by = {(r["provider"], r["mode"]): r for r in rows if r["metric"] == metric}
    width = 0.8 / max(1, len(providers))
    colours = _colours()
    for i, provider in enumerate(providers):
        xs, ys, lo, hi = [], [], [], []
        for j, mode in enumerate(modes):
            r = by.get((provider, mode))
            if r is None:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            ys.append(r["p50"])
            lo.append(max(0.0, r["p50"] - r["p20"]))
            hi.append(max(0.0, r["p80"] - r["p50"]))
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=provider, color=colours[i % len(colours)])
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)


def plot(csv_path: Path, outdir: Path | None = None) -> list[Path]:
    """Draw the time and memory figures of `csv_path`; return the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_latest(csv_path)
    outdir = Path(outdir) if outdir else csv_path.parent
    outdir.mkdir(parents=True, exist_ok=True)
    panels = list(dict.fromkeys((r["device"], r["shape"]) for r in rows))
    written = []
    for metric, ylabel, log, suffix in (
        ("time", "time per call, ms (p50, p20-p80)", True, "time"),
        ("peak_extra_memory", "peak extra memory, MB", False, "memory"),
    ):
        shown = [
            p for p in panels if any((r["device"], r["shape"]) == p and r["metric"] == metric for r in rows)
        ]
        if not shown:
            continue
        fig, axes = plt.subplots(len(shown), 1, figsize=(11, 4.2 * len(shown)), squeeze=False)
        for ax, (device, shape) in zip(axes[:, 0], shown):
            panel_rows = [r for r in rows if r["device"] == device and r["shape"] == shape]
            _bars(ax, panel_rows, metric, ylabel, log)
            threads = next((v for v in panel_rows[0]["versions"].split() if v.startswith("threads=")), "")
            ax.set_title(f"{panel_rows[0]['name']}  {shape}  ({device}, {threads})", fontsize=10)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = outdir / f"{csv_path.stem}_{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks plot", description=__doc__.split("\n")[0])
    p.add_argument(
        "results",
        nargs="?",
        default="linear_logprob_entropy",
        help="a benchmark name (benchmarks/results/<name>.csv) or a CSV path",
    )
    p.add_argument("--outdir", default=None, help="where to write the PNGs (default: next to the CSV)")
    args = p.parse_args(argv)
    path = Path(args.results)
    if path.suffix != ".csv":
        path = RESULTS_DIR / f"{args.results}.csv"
    if not path.exists():
        p.error(f"{path} does not exist; run `python -m benchmarks {path.stem}` first")
    for png in plot(path, args.outdir):
        print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
