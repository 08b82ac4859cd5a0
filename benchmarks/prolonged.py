"""ProRL's claims on a small prolonged run: the full recipe vs one-piece ablations, 2+ seeds.

    OMP_NUM_THREADS=1 python -m benchmarks prolonged [--steps 500] [--seeds 1,2] [--jobs 2]
    python -m benchmarks prolonged --quick       # smoke test: 2 variants x 1 seed x 4 tiny steps
    python -m benchmarks prolonged --report-only # tables and figures of the runs already in --work

Every run is `python prorl/train.py --config prolonged` on one thread; a variant changes one thing
(`VARIANTS`). Writes prolonged.csv, prolonged.md and three figures. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.plot import moving_mean, pyplot, save
from prorl.config import load_config

NAME = "prolonged"
VARIANTS = {
    "full": [],
    "no-clip-higher": ["algorithm.eps_high=0.2"],
    "no-dynamic-sampling": ["algorithm.dynamic_sampling=false"],
    "no-kl": ["algorithm.kl_coef=0.0"],
    "kl-no-reset": ["algorithm.reset.interval=0", "algorithm.reset.kl_spike_factor=0"],
    "no-length-penalty": ["reward.length_penalty=false"],
    "fixed-context": ["rollout.max_response_schedule={0: 128}"],
}
STEP_METRICS = {  # CSV metric -> metrics.jsonl key, logged every step
    "entropy": "actor/entropy",
    "response_length": "response_length/mean",
    "kl": "actor/kl_mean",
    "score": "critic/score/mean",
    "step_time": "timing_s/step",
    "generated_tokens": "dynamic_sampling/generated_tokens",
    "clip_fraction": "actor/pg_clipfrac",
}
VAL_METRICS = {"val_pass@1": "val/accuracy", "val_pass@4": "val/pass@4"}
LEVEL_KEY = "val-core/math/{task}/{level}/pass@{k}"  # the task's data_source is math/<task>/<terms>
QUICK = ["trainer.total_steps=4", "trainer.val_every=2", "data.val_size=8"]
QUICK += ["data.train_size=64", "trainer.prompts_per_step=4"]
PANELS = (  # (metric, y label, moving-mean window in steps; 1 for evaluations)
    ("val_pass@1", "held-out pass@1 (4 samples, T 0.6)", 1),
    ("entropy", "policy entropy (nats/token, 20-step mean)", 20),
    ("response_length", "response length (tokens, 20-step mean)", 20),
    ("kl", "KL to the reference (k2, 5-step mean)", 5),
)


def run_dir(work: Path, variant: str, seed: int) -> Path:
    return work / f"{variant}-s{seed}"


def finished(path: Path, steps: int) -> bool:
    """Whether the run at `path` logged its last step (and its final validation)."""
    return any(r.get("step") == steps and "val/accuracy" in r for r in harness.read_metrics(path))


def run_all(
    jobs: list[tuple[str, int]], work: Path, steps: int, extra: list[str], parallel: int, deadline
) -> None:
    """Run the (variant, seed) jobs `parallel` at a time, one thread each. Jobs not started by
    `deadline` (a time.time() value, or None) are left out, and said so; a partial run restarts
    (runs keep no checkpoints)."""
    io = dict(
        cwd=harness.REPO_ROOT, env=dict(os.environ, **harness.TRAIN_ENV), stderr=subprocess.STDOUT
    )
    pending, running = list(jobs), {}
    while pending or running:
        while pending and len(running) < parallel:
            variant, seed = job = pending.pop(0)
            out = run_dir(work, variant, seed)
            if finished(out, steps):
                print(f"prolonged: {variant} seed {seed}: already complete in {out}", flush=True)
                continue
            if deadline is not None and time.time() > deadline:
                print(f"prolonged: deadline reached, not run: {variant} seed {seed}", flush=True)
                continue
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            log = open(out / "train.log", "w")
            run = ["--config", "prolonged", f"output_dir={out}", f"seed={seed}"]
            cmd = harness.train_command(None, *run, f"trainer.total_steps={steps}", *extra)
            proc = subprocess.Popen(cmd + VARIANTS[variant], stdout=log, **io)
            running[job] = (proc, time.time(), log)
            print(f"prolonged: started {variant} seed {seed} -> {out}", flush=True)
        time.sleep(1.0)
        for job, (proc, start, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[job]
            rc, wall = proc.returncode, time.time() - start
            status = "done" if rc == 0 else f"FAILED (exit {rc}, see train.log)"
            print(f"prolonged: {job[0]} seed {job[1]}: {status} in {wall:.0f} s", flush=True)
            if rc != 0:
                tail = (run_dir(work, *job) / "train.log").read_text()[-3000:]
                raise RuntimeError(f"{job[0]} seed {job[1]} failed:\n{tail}")


def rows_of(variant: str, seed: int, metrics: list[dict], task: str = "chain_sums") -> list[dict]:
    """The long-format rows (variant, seed, step, metric, value) of one run of the built-in
    `task`."""
    out = []
    pairs = [(t, k) for t in range(1, 16) for k in (1, 4)]  # terms, samples
    levels = {f"val_pass@{k}/{t}": LEVEL_KEY.format(task=task, level=t, k=k) for t, k in pairs}
    for r in metrics:
        case = dict(variant=variant, seed=seed, step=int(r.get("step", 0)))
        keys = {**VAL_METRICS, **levels} if "val/accuracy" in r else {}
        keys.update(STEP_METRICS if "actor/entropy" in r else {})
        out += [dict(case, metric=m, value=float(r[k])) for m, k in keys.items() if k in r]
        if r.get("ref/reset_reason"):
            out.append(dict(case, metric="reset", value=1.0))
    return out


def series(rows: list[dict], variant: str, metric: str) -> dict[int, list[tuple[int, float]]]:
    """{seed: [(step, value), ...]} of one variant's metric."""
    out: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        if r["variant"] == variant and r["metric"] == metric:
            out.setdefault(int(r["seed"]), []).append((int(r["step"]), float(r["value"])))
    return {s: sorted(v) for s, v in out.items()}


def _mean(ys) -> float:
    return sum(ys) / len(ys) if ys else 0.0


def _over_seeds(rows: list[dict], variant: str, metric: str, per_seed) -> float:
    """The mean over seeds of `per_seed([(step, value), ...])`."""
    return _mean([per_seed(pts) for pts in series(rows, variant, metric).values()])


def _total(rows: list[dict], variant: str, metric: str) -> float:
    """The mean over seeds of each seed's sum over its steps."""
    return _over_seeds(rows, variant, metric, lambda pts: sum(y for _, y in pts))


def _phase_mean(rows, variant: str, metric: str, period: tuple[int, int], on: bool) -> float:
    """The mean over seeds of the mean over the steps (1-based) whose length-penalty phase is
    `on`."""
    in_phase = lambda s: ((s - 1) % sum(period) < period[0]) == on
    return _over_seeds(rows, variant, metric, lambda pts: _mean([y for s, y in pts if in_phase(s)]))


def summary(rows: list[dict], variants: list[str], period=(50, 150)) -> list[dict]:
    """Per variant (docs/benchmarks.md): held-out pass@1 before RL, final and best (per seed), final
    pass@4, mean response length with the length penalty on and off (`period` = its (k_on, k_off)),
    mean entropy over the first and the last 50 steps, generated tokens, training time per run."""
    return [_summary_of(rows, v, period) for v in variants if series(rows, v, "val_pass@1")]


def _summary_of(rows: list[dict], v: str, period: tuple[int, int]) -> dict:
    acc = list(series(rows, v, "val_pass@1").values())
    p4 = [pts[-1][1] for pts in series(rows, v, "val_pass@4").values()]
    last50 = lambda pts: _mean([y for _, y in pts[-50:]])
    t = dict(variant=v, seeds=len(acc), steps=acc[0][-1][0], start=[pts[0][1] for pts in acc])
    t.update(final=[pts[-1][1] for pts in acc], best=[max(y for _, y in pts) for pts in acc])
    t.update(final_pass4=sum(p4) / len(p4) if p4 else float("nan"))
    t.update(length_on=_phase_mean(rows, v, "response_length", period, on=True))
    t.update(length_off=_phase_mean(rows, v, "response_length", period, on=False))
    t.update(entropy_first=_phase_mean(rows, v, "entropy", (50, 10**9), on=True))
    t.update(entropy=_over_seeds(rows, v, "entropy", last50))
    t.update(gen_tokens=_total(rows, v, "generated_tokens"), train_s=_total(rows, v, "step_time"))
    return t


def cumulative_tokens(rows: list[dict], variant: str) -> dict[int, dict[int, float]]:
    """{seed: {step: generated training tokens up to and including that step}} (step 0: 0)."""
    out = {}
    for seed, pts in series(rows, variant, "generated_tokens").items():
        total, out[seed] = 0.0, {0: 0.0}
        for step, y in pts:
            total += y
            out[seed][step] = total
    return out


def pass_at_tokens(rows: list[dict], variant: str, budget: float) -> list[float]:
    """Per seed: held-out pass@1 once the run had generated `budget` training tokens, linear between
    its evaluations (a seed that never reached the budget is left out): the equal-compute view."""
    cum, out = cumulative_tokens(rows, variant), []
    for seed, pts in series(rows, variant, "val_pass@1").items():
        xy = [(cum.get(seed, {}).get(s), y) for s, y in pts]
        xy = [(x, y) for x, y in xy if x is not None]
        for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
            if x0 <= budget <= x1:
                out.append(y0 + (y1 - y0) * (budget - x0) / max(x1 - x0, 1e-9))
                break
    return out


def equal_compute(rows: list[dict], variants: list[str]) -> str:
    """A line per variant: pass@1 at the generated-token total of the cheapest run (every run
    reached it)."""
    totals = [max(c.values()) for v in variants for c in cumulative_tokens(rows, v).values()]
    if not totals:
        return ""
    budget = min(totals)
    head = f"\nEqual compute: held-out pass@1 % at {budget / 1e3:.0f} K generated training tokens "
    lines = [head + "(the cheapest run's total), mean (min-max) over seeds:\n"]
    got = {v: pass_at_tokens(rows, v, budget) for v in variants}
    lines += [f"- {v}: {_mean_range(xs)}" for v, xs in got.items() if xs]
    return "\n".join(lines) + "\n"


def _mean_range(xs: list[float]) -> str:
    return f"{100 * sum(xs) / len(xs):.1f} ({100 * min(xs):.1f}-{100 * max(xs):.1f})"


def markdown(table: list[dict]) -> str:
    head = ["variant", "seeds", "final pass@1 % (min-max)", "best pass@1 % (min-max)"]
    head += ["final pass@4 %", "response length, penalty on / off"]
    head += ["entropy, first / last 50 steps", "generated tokens per run (K)"]
    head += ["training time per run (s)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    lines += [
        f"| {t['variant']} | {t['seeds']} | {_mean_range(t['final'])} | {_mean_range(t['best'])} | "
        f"{100 * t['final_pass4']:.1f} | {t['length_on']:.1f} / {t['length_off']:.1f} | "
        f"{t['entropy_first']:.3f} / {t['entropy']:.3f} | "
        f"{t['gen_tokens'] / 1e3:.0f} | {t['train_s']:.0f} |"
        for t in table
    ]
    start = ""
    if table:  # the same warm start; the seeds differ in the evaluation's samples
        before = _mean_range(table[0]["start"])
        start = f"Held-out pass@1 % before RL (step 0, min-max over seeds): {before}.\n\n"
    return start + "\n".join(lines) + "\n"


def _band(per_seed: dict[int, list[tuple[int, float]]], window: int):
    """(steps, mean, low, high) over the seeds, on the steps every seed has."""
    smooth = lambda pts: dict(zip((s for s, _ in pts), moving_mean([y for _, y in pts], window)))
    smoothed = [smooth(pts) for pts in per_seed.values()]
    steps = sorted(set.intersection(*(set(d) for d in smoothed)))
    cols = [[d[s] for d in smoothed] for s in steps]
    return steps, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def _line(ax, per_seed, window: int, colour, fmt: str, band=True, **style) -> None:
    """The mean over seeds (and its min-max band) of one variant's smoothed metric."""
    steps, mean, lo, hi = _band(per_seed, window)
    ax.plot(steps, mean, fmt, color=colour, **style)
    if band:
        ax.fill_between(steps, lo, hi, color=colour, alpha=0.15, lw=0)


def figures(rows: list[dict], variants: list[str], png: Path) -> list[Path]:
    """`png`: the four PANELS per variant, reference resets marked under the KL panel;
    `<png>_compute.png` and `<png>_levels.png` (docs/benchmarks.md). Returns the paths written."""
    plt = pyplot()
    present = [v for v in variants if series(rows, v, "val_pass@1")]
    if not present:
        return []
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    colours = [plt.get_cmap("tab10").colors[i % 10] for i in range(len(present))]
    for ax, (metric, label, window) in zip(axes.flat, PANELS):
        for v, colour in zip(present, colours):
            if per_seed := series(rows, v, metric):
                fmt, lw = "o-" if window == 1 else "-", 1.6 if v == "full" else 1.0
                _line(ax, per_seed, window, colour, fmt, lw=lw, ms=3, label=v)
        ax.set(xlabel="RL step", ylabel=label)
        ax.grid(alpha=0.3)
    ax_kl, ymax = axes.flat[3], axes.flat[3].get_ylim()[1]
    for i, (v, colour) in enumerate(zip(present, colours)):
        resets = sorted({s for pts in series(rows, v, "reset").values() for s, _ in pts})
        ax_kl.plot(resets, [-(0.03 + 0.025 * i) * ymax] * len(resets), "|", color=colour, ms=6)
    ax_kl.set_ylim(-(0.05 + 0.025 * len(present)) * ymax, ymax)
    ax_kl.text(0.01, 0.02, "| = reference reset (any seed)", transform=ax_kl.transAxes, fontsize=7)
    axes.flat[0].legend(fontsize=7, loc="lower right")
    seeds = len(series(rows, present[0], "val_pass@1"))
    title = f"ProRL pieces, one CPU core per run: mean of {seeds} seed(s), band = min-max"
    fig.suptitle(title, fontsize=10)
    out = [save(fig, png, 110), _compute_figure(plt, rows, present, colours, png)]
    metrics = {r["metric"] for r in rows}
    levels = sorted({m.split("/", 1)[1] for m in metrics if m.startswith("val_pass@1/")}, key=int)
    if levels:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for i, level in enumerate(levels):
            colour = plt.get_cmap("tab10").colors[i % 10]
            per_seed = series(rows, present[0], f"val_pass@1/{level}")
            _line(ax, per_seed, 1, colour, "o-", ms=3, label=f"{level} terms")
            if per_seed := series(rows, present[0], f"val_pass@4/{level}"):  # pass@4 dashed
                _line(ax, per_seed, 1, colour, "--", band=False, lw=0.9)
        title = f"{present[0]}: per level (dashed: pass@4)"
        ax.set(xlabel="RL step", ylabel="held-out pass@1", ylim=(0, 1.02), title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out.append(save(fig, png.with_name(png.stem + "_levels.png"), 100))
    return out


def _compute_figure(plt, rows: list[dict], variants: list[str], colours, png: Path) -> Path:
    """Held-out pass@1 against generated training tokens (mean over seeds of both, per evaluation
    step)."""
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for v, colour in zip(variants, colours):
        acc, cums = series(rows, v, "val_pass@1"), cumulative_tokens(rows, v)
        steps = sorted(set.intersection(*({s for s, _ in pts} for pts in acc.values())))
        steps = [s for s in steps if all(s in cums.get(seed, {}) for seed in acc)]
        if not steps:
            continue
        xs = [sum(cums[seed][s] for seed in acc) / len(acc) / 1e6 for s in steps]
        ys = [sum(dict(acc[seed])[s] for seed in acc) / len(acc) for s in steps]
        ax.plot(xs, ys, "o-", ms=3, color=colour, lw=1.6 if v == "full" else 1.0, label=v)
    ax.set(xlabel="generated training tokens (M, mean over seeds)", ylabel="held-out pass@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("equal-compute view: accuracy against generated tokens", fontsize=9)
    return save(fig, png.with_name(png.stem + "_compute.png"), 100)


def _args(argv) -> argparse.Namespace:
    ap = harness.argparser(NAME, __doc__)
    add = ap.add_argument
    add("--steps", type=int, default=500, help="RL steps per run")
    add("--seeds", type=harness.ints, default=[1, 2], help="comma-separated, for every variant")
    add("--variants", type=harness.subset_of(tuple(VARIANTS)), default=list(VARIANTS))
    add("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    add("--set", action="append", default=[], help="a dotted override for every run (repeatable)")
    add("--work", type=Path, default=harness.REPO_ROOT / "runs" / NAME, help="run directories")
    add("--results", type=Path, default=harness.RESULTS_DIR, help="where rows and figures go")
    add("--deadline-min", type=float, help="start no run after this many minutes")
    add("--report-only", action="store_true", help="no training: report the runs in --work")
    add("--quick", action="store_true", help="2 variants x 1 seed x 4 tiny steps: a smoke test")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    variants, seeds, extra, steps = args.variants, args.seeds, list(args.set), args.steps
    if args.quick:
        variants, seeds, extra, steps = ["full", "fixed-context"], seeds[:1], QUICK + extra, 4
    jobs = [(v, s) for s in seeds for v in variants]
    t0 = time.time()
    if not args.report_only:
        deadline = None if args.deadline_min is None else t0 + 60 * args.deadline_min
        run_all(jobs, args.work, steps, extra, args.jobs, deadline)
    rows, complete = [], [(v, s) for v, s in jobs if finished(run_dir(args.work, v, s), steps)]
    task = load_config("prolonged", extra).data.builtin_task
    for v, s in complete:  # a run cut short is left out of the rows, the table and the figures
        rows += rows_of(v, s, harness.read_metrics(run_dir(args.work, v, s)), task)
    args.results.mkdir(parents=True, exist_ok=True)
    with open(args.results / f"{NAME}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["variant", "seed", "step", "metric", "value"])
        w.writeheader()
        w.writerows(dict(r, value=f"{r['value']:.6g}") for r in rows)
    preset = load_config("prolonged", [])
    table = summary(rows, variants, (preset.reward.length_k_on, preset.reward.length_k_off))
    text = markdown(table) + equal_compute(rows, [t["variant"] for t in table])
    cmd = shlex.join(
        ["python", "-m", "benchmarks", NAME, *(sys.argv[2:] if argv is None else argv)]
    )
    missing = ", ".join(f"{v} seed {s}" for v, s in jobs if (v, s) not in complete) or "none"
    text += (
        f"\n{len(complete)} of {len(jobs)} runs of {steps} steps complete (missing: {missing}); "
    )
    text += f"command: `{cmd}`"
    if not args.report_only:
        cpu = harness.device_name("cpu")
        text += f"; wall time {time.time() - t0:.0f} s ({args.jobs} at a time) on {cpu}"
    (args.results / f"{NAME}.md").write_text(text + ".\n")
    pngs = figures(rows, variants, args.results / f"{NAME}.png")
    print(text + ".\n")
    written = [args.results / f"{NAME}.csv", args.results / f"{NAME}.md", *pngs]
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
