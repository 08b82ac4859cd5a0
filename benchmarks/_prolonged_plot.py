"""Figures of `python -m benchmarks prolonged` from its rows (variant, seed, step, metric, value)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.plot import _pyplot, _save

PANELS = (  # (metric, y label, moving-mean window in steps; 1 for evaluations)
    ("val_pass@1", "held-out pass@1 (4 samples, T 0.6)", 1),
    ("entropy", "policy entropy (nats/token, 20-step mean)", 20),
    ("response_length", "response length (tokens, 20-step mean)", 20),
    ("kl", "KL to the reference (k2, 5-step mean)", 5),
)


def _smooth(ys: list[float], window: int) -> list[float]:
    return [
        sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
        for i in range(len(ys))
    ]


def _by_seed(rows: list[dict], variant: str, metric: str) -> dict[int, list[tuple[int, float]]]:
    out: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        if r["variant"] == variant and r["metric"] == metric:
            out.setdefault(int(r["seed"]), []).append((int(r["step"]), float(r["value"])))
    return {s: sorted(v) for s, v in out.items()}


def _band(per_seed: dict[int, list[tuple[int, float]]], window: int):
    """(steps, mean, low, high) over the seeds, on the steps every seed has."""
    smoothed = []
    for pts in per_seed.values():
        ys = _smooth([y for _, y in pts], window)
        smoothed.append(dict(zip((s for s, _ in pts), ys)))
    steps = sorted(set.intersection(*(set(d) for d in smoothed)))
    cols = [[d[s] for d in smoothed] for s in steps]
    return steps, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def figures(rows: list[dict], variants: list[str], png: Path) -> list[Path]:
    """`png`: the four panels, one colour per variant (mean over seeds, min-max band), reference
    resets marked on the KL panel (ticks at the bottom, one row per variant); `<png>_levels.png`:
    held-out pass@1 per level of the first variant. Returns the paths written."""
    plt = _pyplot()
    present = [v for v in variants if _by_seed(rows, v, "val_pass@1")]
    if not present:
        return []
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    colours = plt.get_cmap("tab10").colors
    for ax, (metric, label, window) in zip(axes.flat, PANELS):
        for i, v in enumerate(present):
            per_seed = _by_seed(rows, v, metric)
            if not per_seed:
                continue
            steps, mean, lo, hi = _band(per_seed, window)
            style = "o-" if window == 1 else "-"
            ax.plot(
                steps,
                mean,
                style,
                color=colours[i % 10],
                lw=1.6 if v == "full" else 1.0,
                ms=3,
                label=v,
            )
            ax.fill_between(steps, lo, hi, color=colours[i % 10], alpha=0.15, lw=0)
        ax.set(xlabel="RL step", ylabel=label)
        ax.grid(alpha=0.3)
    ax_kl = axes.flat[3]
    ymax = ax_kl.get_ylim()[1]
    for i, v in enumerate(present):
        resets = sorted({s for pts in _by_seed(rows, v, "reset").values() for s, _ in pts})
        ax_kl.plot(
            resets, [-(0.03 + 0.025 * i) * ymax] * len(resets), "|", color=colours[i % 10], ms=6
        )
    ax_kl.set_ylim(-(0.05 + 0.025 * len(present)) * ymax, ymax)
    ax_kl.text(0.01, 0.02, "| = reference reset (any seed)", transform=ax_kl.transAxes, fontsize=7)
    axes.flat[0].legend(fontsize=7, loc="lower right")
    seeds = len(_by_seed(rows, present[0], "val_pass@1"))
    fig.suptitle(
        f"ProRL pieces, one CPU core per run: mean of {seeds} seed(s), band = min-max", fontsize=10
    )
    out = [_save(fig, png, 110)]

    out += _compute_figure(plt, rows, present, png.with_name(png.stem + "_compute.png"))
    levels = sorted(
        {r["metric"].split("/", 1)[1] for r in rows if r["metric"].startswith("val_pass@1/")},
        key=int,
    )
    if levels:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for i, level in enumerate(levels):
            per_seed = _by_seed(rows, present[0], f"val_pass@1/{level}")
            steps, mean, lo, hi = _band(per_seed, 1)
            ax.plot(steps, mean, "o-", ms=3, color=colours[i % 10], label=f"{level} terms")
            ax.fill_between(steps, lo, hi, color=colours[i % 10], alpha=0.15, lw=0)
            per_seed = _by_seed(rows, present[0], f"val_pass@4/{level}")
            if per_seed:  # pass@4 dashed: does RL widen what the model can solve, or sharpen it?
                steps, mean, _, _ = _band(per_seed, 1)
                ax.plot(steps, mean, "--", lw=0.9, color=colours[i % 10])
        ax.set(
            xlabel="RL step",
            ylabel="held-out pass@1",
            ylim=(0, 1.02),
            title=f"{present[0]}: per level (dashed: pass@4)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out.append(_save(fig, png.with_name(png.stem + "_levels.png"), 100))
    return out


def _compute_figure(plt, rows: list[dict], variants: list[str], png: Path) -> list[Path]:
    """Held-out pass@1 against generated training tokens (mean over seeds of both, per evaluation
    step): dynamic sampling's refills cost tokens, so equal steps are not equal compute."""
    fig, ax = plt.subplots(figsize=(6.4, 4))
    colours = plt.get_cmap("tab10").colors
    for i, v in enumerate(variants):
        acc, tok = _by_seed(rows, v, "val_pass@1"), _by_seed(rows, v, "generated_tokens")
        cums = {}
        for seed, pts in tok.items():
            total, cums[seed] = 0.0, {0: 0.0}
            for step, y in pts:
                total += y
                cums[seed][step] = total
        steps = sorted(set.intersection(*({s for s, _ in pts} for pts in acc.values())))
        steps = [s for s in steps if all(s in cums.get(seed, {}) for seed in acc)]
        if not steps:
            continue
        xs = [sum(cums[seed][s] for seed in acc) / len(acc) / 1e6 for s in steps]
        ys = [sum(dict(acc[seed])[s] for seed in acc) / len(acc) for s in steps]
        ax.plot(xs, ys, "o-", ms=3, color=colours[i % 10], lw=1.6 if v == "full" else 1.0, label=v)
    ax.set(xlabel="generated training tokens (M, mean over seeds)", ylabel="held-out pass@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("equal-compute view: accuracy against generated tokens", fontsize=9)
    return [_save(fig, png, 100)]
