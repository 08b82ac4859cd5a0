"""Plots of the benchmark results CSVs: time and memory bars, and each benchmark's own figure.

    python -m benchmarks plot [linear_logprob_entropy | path/to/results.csv] [--outdir DIR]

The command draws, per (device, shape) panel, the newest row of every (provider, mode, metric) as a
bar at the p50 with a p20-p80 whisker: <stem>_time.png and <stem>_memory.png. The other functions
draw one benchmark's figure. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from benchmarks.harness import MODES, RESULTS_DIR, argparser, newest, read_csv


def load_latest(path: Path) -> list[dict]:
    """Rows of the CSV, newest per (device, shape, provider, mode, metric), numbers as floats."""
    return list(newest(read_csv(path)).values())


def pyplot():
    """matplotlib.pyplot on the Agg backend (ImportError without matplotlib: plots are optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, dpi: int) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


def moving_mean(ys: list[float], window: int) -> list[float]:
    """The mean of each value and the up to `window - 1` before it."""
    parts = (ys[max(0, i - window + 1) : i + 1] for i in range(len(ys)))
    return [sum(part) / len(part) for part in parts]


def _threads(row: dict) -> str:
    return next((v for v in row.get("versions", "").split() if v.startswith("threads=")), "")


def _machine(row: dict) -> str:
    return f"{row.get('device', '')}, {_threads(row)}, {row.get('timestamp', '')[:10]}"


def _spread(r: dict) -> tuple[float, float]:
    """The p20-p80 whisker of a bar at p50, as (below, above)."""
    return max(0.0, r["p50"] - r["p20"]), max(0.0, r["p80"] - r["p50"])


def _bars(ax, by: dict, groups: list, providers: list, reference: str | None = None) -> None:
    """Bars at the p50 with p20-p80 whiskers of `by[(group, provider)]`: one x tick per group, one
    bar (and colour) per provider; with `reference`, each bar's ratio to its bar of the same run
    above it."""
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        shown = [(j, by[(g, provider)]) for j, g in enumerate(groups) if (g, provider) in by]
        if not shown:
            continue
        xs = [j - 0.4 + width * (i + 0.5) for j, _ in shown]
        err = list(zip(*(_spread(r) for _, r in shown)))
        heights = [r["p50"] for _, r in shown]
        ax.bar(xs, heights, width, yerr=err, capsize=2, label=provider, color=f"C{i}")
        for x, (j, r) in zip(xs, shown):
            ref = by.get((groups[j], reference))
            if ref is not None and ref is not r and ref["timestamp"] == r["timestamp"]:
                ax.text(
                    x, r["p80"] * 1.08, f"{r['p50'] / ref['p50']:.2f}x", ha="center", fontsize=7
                )
    ax.grid(axis="y", alpha=0.3)


def plot(csv_path: Path, outdir: Path | None = None) -> list[Path]:
    """Draw the time and memory figures of `csv_path`; return the PNG paths written."""
    plt = pyplot()
    rows = load_latest(csv_path)
    outdir = Path(outdir) if outdir else csv_path.parent
    outdir.mkdir(parents=True, exist_ok=True)
    panels = list(dict.fromkeys((r["device"], r["shape"]) for r in rows))
    written = []
    for metric, ylabel, scale, suffix in (
        ("time", "time per call, ms (p50, p20-p80)", "log", "time"),
        ("peak_extra_memory", "peak extra memory, MB", "linear", "memory"),
    ):
        measured = {(r["device"], r["shape"]) for r in rows if r["metric"] == metric}
        shown = [p for p in panels if p in measured]
        if not shown:
            continue
        fig, axes = plt.subplots(len(shown), 1, figsize=(11, 4.2 * len(shown)), squeeze=False)
        for ax, (device, shape) in zip(axes[:, 0], shown):
            panel = [r for r in rows if r["device"] == device and r["shape"] == shape]
            # every provider of the panel keeps its slot and colour in the time and memory figures
            providers = list(dict.fromkeys(r["provider"] for r in panel))
            by = {(r["mode"], r["provider"]): r for r in panel if r["metric"] == metric}
            modes = [m for m in MODES if m in {mode for mode, _ in by}]
            _bars(ax, by, modes, providers)
            ax.set_xticks(range(len(modes)), modes)
            ax.set(ylabel=ylabel, yscale=scale)
            title = f"{panel[0]['name']}  {shape}  ({device}, {_threads(panel[0])})"
            ax.set_title(title, fontsize=10)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        written.append(save(fig, outdir / f"{csv_path.stem}_{suffix}.png", 110))
    return written


def rates(csv_path: Path, png: Path, shapes: list[str], providers: list[str], reference: str):
    """Tokens/s per shape and provider (the newest row of each, in the given orders), p50 bars with
    p20-p80 whiskers, and the ratio to `reference` above each bar where both rows come from the same
    run."""
    rows = [r for r in load_latest(csv_path) if r["metric"] == "tokens_per_s"]
    shapes = [s for s in shapes if any(r["shape"] == s for r in rows)]
    providers = [p for p in providers if any(r["provider"] == p for r in rows)]
    fig, ax = pyplot().subplots(figsize=(12, 4.8))
    _bars(ax, {(r["shape"], r["provider"]): r for r in rows}, shapes, providers, reference)
    ax.set_xticks(range(len(shapes)), [s.replace(" new", "\nnew") for s in shapes], fontsize=8)
    ax.set(yscale="log", ylabel="generated tokens/s (p50, p20-p80)")
    ratio = f"ratio = p50 / {reference} p50 of the same run"
    threads = _threads(rows[0]) if rows else ""
    ax.set_title(f"rollout: tokens/s, sampling T=1, no stop ({threads}; {ratio})")
    ax.legend(fontsize=8)
    return save(fig, png, 110)


def phases(rows: list[dict], png: Path, phase_names: list[str]) -> Path | None:
    """One panel per shape: a stacked bar of the phases per provider (p50 ms), whisker on the
    step."""
    steps = [r for r in rows if r["mode"] == "step" and r["metric"] == "time"]
    shapes = list(dict.fromkeys(r["shape"] for r in steps))
    if not shapes:
        return None
    by = {(r["shape"], r["provider"], r["mode"], r["metric"]): r for r in rows}
    fig, axes = pyplot().subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        providers = [
            p
            for p in dict.fromkeys(r["provider"] for r in rows)
            if (shape, p, "step", "time") in by
        ]
        shown = [ph for ph in phase_names if any((shape, p, ph, "time") in by for p in providers)]
        for i, p in enumerate(providers):
            bottom = 0.0
            for j, phase in enumerate(shown):
                v = by.get((shape, p, phase, "time"))
                height = max(v["p50"], 0.0) if v else 0.0  # `other` can be a hair below 0
                ax.bar(i, height, bottom=bottom, color=f"C{j}", label=phase if i == 0 else None)
                bottom += height
            t = by[(shape, p, "step", "time")]
            ax.errorbar(i, t["p50"], yerr=[[x] for x in _spread(t)], color="k", capsize=3)
        ax.set_xticks(range(len(providers)), providers, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms per optimizer step (p50)")
        ax.set_title(shape, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"RL step by phase - {_machine(rows[0])}", fontsize=8)
    return save(fig, png, 120)


def scaling(rows: list[dict], shapes: list[dict], png: Path, keys: dict[str, str]) -> Path | None:
    """Time per step against the work multiple, one line per quantity of `keys` (shape key ->
    legend) doubled from `shapes[0]`, with the linear ideal."""
    t = {r["shape"]: r for r in rows if r["mode"] == "step" and r["metric"] == "time"}
    base = shapes[0]
    if base["label"] not in t:
        return None
    t0 = t[base["label"]]["p50"]
    fig, ax = pyplot().subplots(figsize=(5.5, 4.5))
    for key, name in keys.items():
        grown = [s for s in shapes[1:] if s["label"] in t and s[key] != base[key]]
        pts = [(1.0, t0)] + [(s[key] / base[key], t[s["label"]]["p50"]) for s in grown]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.plot([1, 2, 4], [t0 * x for x in (1, 2, 4)], "k--", lw=1, label="linear in work")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set(xlabel=f"work multiple (from {base['label']})", ylabel="ms per step (p50)")
    ax.legend(fontsize=8)
    ax.set_title(f"prorl step scaling - {_machine(rows[0])}", fontsize=8)
    return save(fig, png, 120)


def bandwidth(rows: list[dict], png: Path, ops: list[str]) -> Path:
    """Bus bandwidth against message size, one line per (op, provider)."""
    fig, ax = pyplot().subplots(figsize=(6, 4.5))
    for provider in dict.fromkeys(r["provider"] for r in rows):
        for op in ops:
            mine = [
                r
                for r in rows
                if (r["provider"], r["mode"], r["metric"]) == (provider, op, "busbw")
            ]
            pts = sorted((int(r["shape"].split()[0]), r["p50"]) for r in mine)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{op} ({provider})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="size (bytes, nccl-tests convention)", ylabel="bus bandwidth (GB/s, p50)")
    ax.legend(fontsize=7)
    world = rows[0]["shape"].split("world=")[1] if rows else "?"
    device = rows[0].get("device", "") if rows else ""
    ax.set_title(f"collectives, {world} ranks - {device}", fontsize=8)
    return save(fig, png, 120)


def curves(lines: dict[str, list[tuple[float, float]]], png: Path, xlabel: str, ylabel: str):
    """(seconds, accuracy) curves against minutes, one marker style per line; lines named
    "<group> <rest>" (e.g. "prorl seed 0") share their group's colour."""
    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    styles = itertools.cycle(("o-", "s--", "^:", "d-.", "v-", "x--"))
    colours = {}
    for (name, pts), style in zip(lines.items(), styles):
        colour = colours.setdefault(name.split()[0], f"C{len(colours)}")
        ax.plot([t / 60 for t, _ in pts], [a for _, a in pts], style, label=name, color=colour)
    top = max((a for pts in lines.values() for _, a in pts), default=1.0)
    ax.set(xlabel=xlabel, ylabel=ylabel, ylim=(0, min(1.05, top + 0.15)))
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, png, 100)


def scheduling(tokens: dict, accuracy: dict, png: Path, window: int = 10) -> Path:
    """Prompt scheduling: generated tokens per kept group (moving mean over `window` steps) and
    held-out accuracy, against steps, one line per provider."""
    fig, (ax_t, ax_a) = pyplot().subplots(1, 2, figsize=(10, 3.6))
    for name, pts in tokens.items():
        ax_t.plot([s for s, _ in pts], moving_mean([y for _, y in pts], window), lw=1.2, label=name)
    for (name, pts), style in zip(accuracy.items(), ("o-", "s--", "^:")):
        ax_a.plot([s for s, _ in pts], [a for _, a in pts], style, label=name)
    ax_t.set(xlabel="step", ylabel=f"generated tokens per kept group ({window}-step mean)")
    ax_a.set(xlabel="step", ylabel="held-out greedy accuracy", ylim=(0, 1.05))
    for ax in (ax_t, ax_a):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, png, 100)


def main(argv: list[str] | None = None) -> int:
    p = argparser("plot", __doc__)
    p.add_argument("results", nargs="?", default="linear_logprob_entropy", help="a name or a CSV")
    p.add_argument("--outdir", help="where to write the PNGs (default: next to the CSV)")
    args = p.parse_args(argv)
    path = Path(args.results)
    path = path if path.suffix == ".csv" else RESULTS_DIR / f"{args.results}.csv"
    if not path.exists():
        p.error(f"{path} does not exist; run `python -m benchmarks {path.stem}` first")
    for png in plot(path, args.outdir):
        print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
