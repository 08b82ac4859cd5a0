"""ProRL's claims on a prolonged run, in miniature: the full recipe against one-piece ablations, >= 2 seeds.

    OMP_NUM_THREADS=1 python -m benchmarks prolonged [--steps 500] [--seeds 1,2] [--jobs 2]
    python -m benchmarks prolonged --quick       # smoke test: 2 variants x 1 seed x 4 tiny steps
    python -m benchmarks prolonged --report-only # tables and figures from the runs already in --work

Every run is `python prorl/train.py --config prolonged` (prorl/configs/prolonged.yaml: the long
reasoner on sums of 2 to 6 two-digit terms, prorl/chain_sums.py) in one process with one thread,
with the same seed list and step count for every variant; a variant changes one thing:

    full                 clip 0.2/0.28, dynamic sampling, k2 KL 1e-3 with a reference reset every 100
                         steps, cosine length penalty (on 50 / off 150 steps), context 80 tokens, 128
                         from step 150
    no-clip-higher       eps_high = eps_low = 0.2
    no-dynamic-sampling  every group trained on, all-equal ones included
    no-kl                KL coefficient 0 (the KL to the reference is still measured)
    kl-no-reset          the reference is never reset (no interval, no spike rule)
    no-length-penalty    no cosine length term
    fixed-context        128 tokens from the first step

The full design (the defaults: 7 variants x 2 seeds x 500 steps) is sized for the 2-core machine
with `--jobs 2`: a step took ~1.1-1.5 s on one core of the shared machine (6 prompts x 8 samples),
so about 75-100 min two at a time, longer when the machine is busy (README: the measured wall time).
The schedules are functions of the step and the LR is constant, so a shorter run (`--steps 300`) is
the first part of the longer one (seen: the 300- and 500-step runs of a seed log the same numbers up
to step 300). Runs are ordered seed-major (every variant's first seed before any second seed), so a
stopped benchmark still covers every variant; a run whose metrics.jsonl already reaches the last
step is not run again. `--set key=value` applies to every run (the variants' own overrides come
last); give such runs their own `--work` and `--results`. Outputs (benchmarks/results, or
--results): `prolonged.csv` with rows (variant, seed, step, metric, value) of every evaluation and
step (`val_pass@1` = mean over 4 samples at T 0.6 on the 250 held-out problems, `val_pass@4`, per
level `val_pass@1/<terms>` and `val_pass@4/<terms>`, `entropy`, `response_length`, `kl`, `score`,
`reset` = 1 at a reference reset, `step_time`, `generated_tokens`, `clip_fraction`); `prolonged.png`
(held-out pass@1, entropy, response length, KL with reset markers: mean over seeds, min-max band);
`prolonged_levels.png` (pass@1 per level, first variant); `prolonged_compute.png` (pass@1 against
generated training tokens); `prolonged.md` (the table: final and best pass@1 with the spread across
seeds, final pass@4, length by length-penalty phase, entropy, generated tokens, training time; then
pass@1 at equal generated tokens).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks import _prolonged_plot, harness
from prorl.config import load_config

NAME = "prolonged"
ROOT = Path(__file__).resolve().parents[1]
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


def run_dir(work: Path, variant: str, seed: int) -> Path:
    return work / f"{variant}-s{seed}"


def finished(path: Path, steps: int) -> bool:
    """Whether the run at `path` logged its last step (and its final validation)."""
    rows = read_metrics(path)
    return any(r.get("step") == steps and "val/accuracy" in r for r in rows)


def read_metrics(path: Path) -> list[dict]:
    file = path / "metrics.jsonl"
    if not file.exists():
        return []
    with open(file) as f:
        return [json.loads(line) for line in f if line.strip()]


def command(variant: str, seed: int, out: Path, steps: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "prorl/train.py", "--config", "prolonged", f"output_dir={out}", f"seed={seed}",
        f"trainer.total_steps={steps}", *extra, *VARIANTS[variant],
    ]  # fmt: skip


def run_all(
    jobs: list[tuple[str, int]], work: Path, steps: int, extra: list[str], parallel: int, deadline
):
    """Run the (variant, seed) jobs `parallel` at a time, one thread each; returns {job: wall
    seconds}. Jobs not started by `deadline` (a time.time() value, or None) are left out, and said
    so."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    pending, running, walls = list(jobs), {}, {}
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
            # a partial run restarts (runs keep no checkpoints)
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            log = open(out / "train.log", "w")
            proc = subprocess.Popen(
                command(variant, seed, out, steps, extra),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            running[job] = (proc, time.time(), log)
            print(f"prolonged: started {variant} seed {seed} -> {out}", flush=True)
        time.sleep(1.0)
        for job, (proc, start, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[job]
            walls[job] = time.time() - start
            status = (
                "done"
                if proc.returncode == 0
                else f"FAILED (exit {proc.returncode}, see train.log)"
            )
            print(f"prolonged: {job[0]} seed {job[1]}: {status} in {walls[job]:.0f} s", flush=True)
            if proc.returncode != 0:
                tail = (run_dir(work, *job) / "train.log").read_text()[-3000:]
                raise RuntimeError(f"{job[0]} seed {job[1]} failed:\n{tail}")
    return walls


def rows_of(variant: str, seed: int, metrics: list[dict], task: str = "chain_sums") -> list[dict]:
    """The long-format rows (variant, seed, step, metric, value) of one run of the built-in
    `task`."""
    out = []
    levels = {
        f"val_pass@{k}/{t}": LEVEL_KEY.format(task=task, level=t, k=k)
        for t in range(1, 16)
        for k in (1, 4)
    }
    for r in metrics:
        step = int(r.get("step", 0))
        keys = dict(VAL_METRICS) if "val/accuracy" in r else {}
        if "val/accuracy" in r:
            keys.update({m: k for m, k in levels.items() if k in r})
        if "actor/entropy" in r:
            keys.update(STEP_METRICS)
        for metric, key in keys.items():
            if key in r:
                out.append(
                    dict(variant=variant, seed=seed, step=step, metric=metric, value=float(r[key]))
                )
        if r.get("ref/reset_reason"):
            out.append(dict(variant=variant, seed=seed, step=step, metric="reset", value=1.0))
    return out


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["variant", "seed", "step", "metric", "value"])
        w.writeheader()
        w.writerows(dict(r, value=f"{r['value']:.6g}") for r in rows)


def series(rows: list[dict], variant: str, metric: str) -> dict[int, list[tuple[int, float]]]:
    """{seed: [(step, value), ...]} of one variant's metric."""
    out: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        if r["variant"] == variant and r["metric"] == metric:
            out.setdefault(int(r["seed"]), []).append((int(r["step"]), float(r["value"])))
    return {s: sorted(v) for s, v in out.items()}


def summary(
    rows: list[dict], variants: list[str], period: tuple[int, int] = (50, 150)
) -> list[dict]:
    """Per variant: final and best held-out pass@1 (mean over seeds and min-max), final pass@4, mean
    response length over the steps with the length penalty on and off (`period` = its (k_on, k_off);
    the phase is that of the full recipe, whichever variant), the first and the last 50 steps' mean
    entropy, generated tokens and training time per run, the number of seeds."""
    table = []
    for v in variants:
        acc = series(rows, v, "val_pass@1")
        if not acc:
            continue
        final = [pts[-1][1] for pts in acc.values()]
        best = [max(y for _, y in pts) for pts in acc.values()]
        p4 = [pts[-1][1] for pts in series(rows, v, "val_pass@4").values()]

        first = next(iter(acc.values()))
        table.append(
            dict(
                variant=v,
                seeds=len(acc),
                steps=first[-1][0],
                start=[pts[0][1] for pts in acc.values()],
                final=final,
                best=best,
                final_pass4=sum(p4) / len(p4) if p4 else float("nan"),
                length_on=_phase_mean(rows, v, "response_length", period, on=True),
                length_off=_phase_mean(rows, v, "response_length", period, on=False),
                entropy_first=_phase_mean(rows, v, "entropy", (50, 10**9), on=True),
                entropy=_tail_mean(rows, v, "entropy"),
                gen_tokens=_total(rows, v, "generated_tokens"),
                train_s=_total(rows, v, "step_time"),
            )
        )
    return table


def cumulative_tokens(rows: list[dict], variant: str) -> dict[int, dict[int, float]]:
    """{seed: {step: generated training tokens up to and including that step}} (step 0: 0)."""
    out = {}
    for seed, pts in series(rows, variant, "generated_tokens").items():
        total, cum = 0.0, {0: 0.0}
        for step, y in pts:
            total += y
            cum[step] = total
        out[seed] = cum
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
    lines = [
        f"\nEqual compute: held-out pass@1 % at {budget / 1e3:.0f} K generated training tokens "
    ]
    lines[0] += "(the cheapest run's total), mean (min-max) over seeds:\n"
    for v in variants:
        got = pass_at_tokens(rows, v, budget)
        if got:
            lines.append(f"- {v}: {_mean_range(got)}")
    return "\n".join(lines) + "\n"


def _tail_mean(rows: list[dict], variant: str, metric: str, last: int = 50) -> float:
    """The mean over seeds of each seed's mean over its `last` logged steps."""
    per_seed = [[y for _, y in pts[-last:]] for pts in series(rows, variant, metric).values()]
    return sum(sum(p) / len(p) for p in per_seed if p) / max(len(per_seed), 1)


def _phase_mean(
    rows: list[dict], variant: str, metric: str, period: tuple[int, int], on: bool
) -> float:
    """The mean over seeds of the mean over the steps (1-based) whose length-penalty phase is
    `on`."""
    k_on, k_off = period
    per_seed = [
        [y for s, y in pts if ((s - 1) % (k_on + k_off) < k_on) == on]
        for pts in series(rows, variant, metric).values()
    ]
    return sum(sum(p) / len(p) for p in per_seed if p) / max(len(per_seed), 1)


def _total(rows: list[dict], variant: str, metric: str) -> float:
    """The mean over seeds of each seed's sum over its steps."""
    per_seed = [sum(y for _, y in pts) for pts in series(rows, variant, metric).values()]
    return sum(per_seed) / max(len(per_seed), 1)


def _mean_range(xs: list[float]) -> str:
    return f"{100 * sum(xs) / len(xs):.1f} ({100 * min(xs):.1f}-{100 * max(xs):.1f})"


def markdown(table: list[dict]) -> str:
    head = (
        "| variant | seeds | final pass@1 % (min-max) | best pass@1 % (min-max) | final pass@4 % | "
    )
    head += "response length, penalty on / off | entropy, first / last 50 steps | generated tokens per run (K) | "
    head += "training time per run (s) |\n|---|---|---|---|---|---|---|---|---|\n"
    lines = [
        f"| {t['variant']} | {t['seeds']} | {_mean_range(t['final'])} | {_mean_range(t['best'])} | "
        f"{100 * t['final_pass4']:.1f} | {t['length_on']:.1f} / {t['length_off']:.1f} | "
        f"{t['entropy_first']:.3f} / {t['entropy']:.3f} | "
        f"{t['gen_tokens'] / 1e3:.0f} | {t['train_s']:.0f} |"
        for t in table
    ]
    start = ""
    if table:  # the same warm start; the seeds differ in the evaluation's samples
        start = f"Held-out pass@1 % before RL (step 0, min-max over seeds): {_mean_range(table[0]['start'])}.\n\n"
    return start + head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog=f"python -m benchmarks {NAME}", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--steps", type=int, default=500, help="RL steps per run")
    ap.add_argument(
        "--seeds", default="1,2", help="comma-separated seeds, the same for every variant"
    )
    ap.add_argument("--variants", type=harness.subset_of(tuple(VARIANTS)), default=list(VARIANTS))
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    ap.add_argument(
        "--set", action="append", default=[], help="a dotted override for every run (repeatable)"
    )
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / NAME, help="run directories")
    ap.add_argument(
        "--results", type=Path, default=harness.RESULTS_DIR, help="where rows and figures go"
    )
    ap.add_argument(
        "--deadline-min", type=float, default=None, help="start no run after this many minutes"
    )
    ap.add_argument(
        "--report-only", action="store_true", help="no training: report the runs in --work"
    )
    ap.add_argument(
        "--quick", action="store_true", help="2 variants x 1 seed x 4 tiny steps: a smoke test"
    )
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants, extra, steps = args.variants, list(args.set), args.steps
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
        rows += rows_of(v, s, read_metrics(run_dir(args.work, v, s)), task)
    args.results.mkdir(parents=True, exist_ok=True)
    write_rows(args.results / f"{NAME}.csv", rows)
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
        cpu = harness.device_name(SimpleNamespace(type="cpu"))
        text += f"; wall time {time.time() - t0:.0f} s ({args.jobs} at a time) on {cpu}"
    text += ".\n"
    (args.results / f"{NAME}.md").write_text(text)
    pngs = _prolonged_plot.figures(rows, variants, args.results / f"{NAME}.png")
    print(text)
    written = [args.results / f"{NAME}.csv", args.results / f"{NAME}.md", *pngs]
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
