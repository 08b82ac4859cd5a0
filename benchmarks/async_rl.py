"""Asynchronous RL against the synchronous step on the embedded task, same cores; a GPU projection.

    nice -n 5 python -m benchmarks async_rl [--steps 100] [--variants sync,async-k1,async-k2]
    python -m benchmarks async_rl --quick          # smoke test (CI): 4 tiny steps per variant
    python -m benchmarks async_rl --report-only    # rows, figure, projection of the runs in --work

Each variant is the README's main job (`sync`: 2 colocated ranks; `async-kK`: 1 rollout + 1
trainer rank, K steps ahead), and a projection to 8 and 2 x 8 GPUs. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness, plot
from benchmarks.report import readme

NAME = "async_rl"
ASYNC = ["rollout.async_rl.rollout_ranks=1", "algorithm.is_mode=tis"]  # tis: docs/recipe.md §11
VARIANTS = {
    "sync": [],
    **{f"async-k{k}": [f"rollout.async_rl.steps_ahead={k}", *ASYNC] for k in "12"},
}
POLL_S = 0.1  # how often launch() looks for new metrics rows (the time base's resolution)
QUICK = ["data.train_size=64", "data.val_size=16", "trainer.prompts_per_step=8"]
# phase -> the metrics.jsonl keys summed into it (seconds per step); push: + the time between steps
PHASES = dict(gen=("timing_s/gen",), verify=("timing_s/reward",), push=("timing_s/update_weights",))
PHASES.update(logprob=("timing_s/old_log_prob", "timing_s/ref"))
PHASES.update(update=("timing_s/adv", "timing_s/update_actor"))


def command(out: Path, steps: int, val_every: int, ranks: int, extra: list[str]) -> list[str]:
    run = [f"output_dir={out}", f"trainer.total_steps={steps}", f"trainer.val_every={val_every}"]
    return harness.train_command(ranks, *run, "trainer.save_every=0", *extra)


def launch(out: Path, cmd: list[str]) -> dict:
    """Run `cmd` (a training command) from the repository root, its output in out/train.log,
    watching its metrics.jsonl; returns (and saves as out/timing.json) its wall seconds and the
    second at which each metrics row appeared; raises with the log's tail when it fails."""
    out.mkdir(parents=True, exist_ok=True)
    metrics, seen, arrivals, t0 = out / "metrics.jsonl", 0, [], time.time()
    env = dict(os.environ, **harness.TRAIN_ENV)
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=harness.REPO_ROOT, env=env, stdout=log, stderr=log)
        while proc.poll() is None:
            time.sleep(POLL_S)
            if metrics.exists() and metrics.stat().st_size > seen:
                with open(metrics, "rb") as f:
                    f.seek(seen)
                    new = f.read()
                seen += len(new)
                arrivals += [time.time() - t0] * new.count(b"\n")
    if proc.returncode != 0:
        tail = (out / "train.log").read_text()[-3000:]
        raise RuntimeError(f"{out.name} exited {proc.returncode}:\n{tail}")
    timing = dict(wall_s=time.time() - t0, arrivals=arrivals)
    (out / "timing.json").write_text(json.dumps(timing))
    return timing


def training_time(rows: list[dict], arrivals: list[float] | None) -> float:
    """Seconds from the start of the first step to the end of the last, validations left out: seen
    from outside (when each row appeared, `arrivals`) where known, else the sum of timing_s/step."""
    steps = [i for i, r in enumerate(rows) if "timing_s/step" in r]
    testing = sum(rows[i].get("timing_s/testing", 0.0) for i in steps)
    if not arrivals or len(arrivals) != len(rows):
        return sum(rows[i]["timing_s/step"] for i in steps)
    first = rows[steps[0]]  # it appeared after its step and its validation
    start = arrivals[steps[0]] - first["timing_s/step"] - first.get("timing_s/testing", 0.0)
    return arrivals[steps[-1]] - start - testing


def summarise(rows: list[dict], timing: dict) -> dict:
    """A run's numbers (docs/benchmarks.md) from its metrics.jsonl rows and `launch`'s timing ({}
    when the run was not launched here)."""
    steps = [r for r in rows if "timing_s/step" in r]
    if not steps:
        raise ValueError("no training step in metrics.jsonl")
    total = lambda key: sum(r.get(key, 0.0) for r in steps)
    train = training_time(rows, timing.get("arrivals"))
    phases = {p: sum(total(k) for k in keys) / len(steps) for p, keys in PHASES.items()}
    phases["push"] += (train - total("timing_s/step")) / len(steps)  # the push outside a step too
    if any("timing_s/wait_rollout" in r for r in steps):  # asynchronous: each side's own waits
        idle = dict(trainer=total("timing_s/wait_rollout"), rollout=total("timing_s/wait_trainer"))
    else:  # synchronous: each side idles while the other runs
        rollout_busy = total("timing_s/gen") + total("timing_s/reward")
        idle = dict(trainer=rollout_busy, rollout=train - rollout_busy)
    n, max_len = len(steps), total("response_length/max")
    out = dict(wall_time=timing.get("wall_s"), train_time=train, steps_per_min=60 * n / train)
    out.update(gen_tokens_per_s=total("dynamic_sampling/generated_tokens") / train, phases=phases)
    out.update(rollout_idle=idle["rollout"] / train, trainer_idle=idle["trainer"] / train)
    out.update(overlap_efficiency=train / (train - min(idle.values())))
    out.update(steps=n, staleness_mean=total("async/staleness/mean") / n)
    out.update(staleness_max=max(r.get("async/staleness/max", 0.0) for r in steps))
    out.update(accuracy={r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r})
    out.update(tail=1 - total("response_length/mean") / max_len if max_len else 0.0)
    return out


def project(phases: dict, devices: int, total: int, rollout: int | None, serial: float) -> dict:
    """Projected seconds per step, sync against async on `total` devices (docs/benchmarks.md).

    phases: seconds per step measured on `devices` devices (gen, verify, logprob, update, push: the
    sync run's; `async_push`: the push an async step pays, default `push`). rollout: the async run's
    rollout devices (None: the fastest split). serial: the fraction of rollout time that does not
    shrink with more devices. Returns sync_s, async_s, rollout (devices), speedup (sync / async)."""
    work = (phases["gen"] + phases["verify"]) * devices  # device-seconds at `devices` devices
    train = (phases["logprob"] + phases["update"]) * devices
    gen = lambda d: serial * work / devices + (1 - serial) * work / d
    sync_s = gen(total) + train / total + phases["push"]
    push = phases.get("async_push", phases["push"])
    splits = [rollout] if rollout else range(1, total)
    async_s, r = min((max(gen(r), train / (total - r)) + push, r) for r in splits)
    return dict(sync_s=sync_s, async_s=async_s, rollout=r, speedup=sync_s / async_s)


def projections(sync: dict, async_push: float | None, devices: int) -> list[tuple[str, str, dict]]:
    """(mode, shape, project()): 8 GPUs (best split), 2 x 8 (one node each); linear and tail."""
    phases = dict(sync["phases"], **({"async_push": async_push} if async_push is not None else {}))
    out = []
    for mode, serial in (("linear", 0.0), ("tail", sync["tail"])):
        for shape, total, rollout in (("8 gpus", 8, None), ("2x8 gpus", 16, 8)):
            out.append((mode, shape, project(phases, devices, total, rollout, serial)))
    return out


UNITS = dict(wall_time="s", train_time="s", steps_per_min="1/min", gen_tokens_per_s="tok/s")
UNITS.update(rollout_idle="fraction", trainer_idle="fraction", overlap_efficiency="x")
UNITS.update(staleness_mean="updates", staleness_max="updates")


def csv_rows(runs: dict[str, dict], shape: str, note: str) -> list[dict]:
    """The CSV rows of every run (docs/benchmarks.md), then the projection's."""
    import torch

    device = harness.device_name("cuda" if torch.cuda.is_available() else "cpu")
    common = dict(name=NAME, device=device, git_rev=harness.git_rev(), timestamp=harness.utc_now())
    rows, common_steps = [], set.intersection(*(set(s["accuracy"]) for s in runs.values()))
    at = max(common_steps) if common_steps else None
    for variant, s in runs.items():
        values = [(m, u, s[m]) for m, u in UNITS.items() if s[m] is not None]
        values += [(f"phase_{phase}", "s", seconds) for phase, seconds in s["phases"].items()]
        if at is not None:
            values.append(("final_val_accuracy", "fraction", s["accuracy"][at]))
        if at is not None and "sync" in runs:
            delta = 100 * (s["accuracy"][at] - runs["sync"]["accuracy"][at])
            values.append(("val_accuracy_delta", "points", delta))
        case = dict(common, provider=variant, mode="measured", shape=shape, versions=note)
        rows += [harness.row(m, u, [v], **case) for m, u, v in values]
    if "sync" in runs:
        pushes = [s["phases"]["push"] for v, s in runs.items() if v != "sync"]
        ranks = runs["sync"].get("ranks", 2)
        for mode, where, p in projections(runs["sync"], max(pushes, default=None), ranks):
            case = dict(common, provider="projection", mode=mode, shape=where)
            case["versions"] = f"projection, not measured: {ranks}-rank sync, r={p['rollout']}"
            for key, unit in (("sync_s", "s"), ("async_s", "s"), ("speedup", "x")):
                rows.append(harness.row(key, unit, [p[key]], **case))
    return rows


def draw(runs: dict[str, dict], png: Path) -> Path:
    """Each side's busy time beside the training time per run; held-out accuracy against step."""
    fig, (bars, curves) = plot.pyplot().subplots(1, 2, figsize=(11, 4))
    x = range(len(runs))
    for i, side in enumerate(("rollout", "trainer")):
        busy = [s["train_time"] * (1 - s[f"{side}_idle"]) for s in runs.values()]
        bars.bar([j + 0.27 * (i - 1) for j in x], busy, 0.27, label=f"{side} busy")
    train = [s["train_time"] for s in runs.values()]
    bars.bar([j + 0.27 for j in x], train, 0.27, label="training time")
    bars.set_xticks(list(x), [f"{v}\n{s['overlap_efficiency']:.2f}x" for v, s in runs.items()])
    bars.set_ylabel("seconds (x labels: overlap efficiency)")
    for variant, s in runs.items():
        steps = sorted(s["accuracy"])
        curves.plot(steps, [100 * s["accuracy"][t] for t in steps], "o-", label=variant)
    curves.set(xlabel="step", ylabel="held-out greedy accuracy (%)")
    for ax in (bars, curves):
        ax.legend(fontsize=8)
    return plot.save(fig, png, 100)


def run_variants(args, variants: list[str], extra: list[str]) -> dict[str, dict]:
    """Train (unless --report-only) and summarise each variant, in order."""
    runs, dirs = {}, {}
    for variant in variants:
        out = args.work / variant
        if variant == "sync" and args.sync_run:
            out = args.sync_run
        elif not args.report_only:
            ranks = args.sync_ranks if variant == "sync" else 2
            every = args.val_every or args.steps
            cmd = command(out, args.steps, every, ranks, extra + VARIANTS[variant])
            print(f"{NAME}: {variant}: {' '.join(cmd[1:])}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            print(f"{NAME}: {variant}: {launch(out, cmd)['wall_s']:.0f} s", flush=True)
        metrics = harness.read_metrics(out)
        if not any(r.get("step") == args.steps and "timing_s/step" in r for r in metrics):
            print(f"{NAME}: {variant}: no complete {args.steps}-step run in {out}", flush=True)
            continue
        timing = out / "timing.json"
        dirs[variant] = (metrics, json.loads(timing.read_text()) if timing.exists() else {})
    # one time base for every run: seen from outside only when every run was watched
    watched = all(t.get("arrivals") for _, t in dirs.values())
    for variant, (metrics, timing) in dirs.items():
        timing = timing if watched else dict(wall_s=timing.get("wall_s"))
        runs[variant] = dict(summarise(metrics, timing), ranks=args.sync_ranks)
    return runs


def main(argv=None) -> int:
    ap = harness.argparser(NAME, __doc__)
    ap.add_argument("--steps", type=int, default=100, help="RL steps per run (default config: 150)")
    ap.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: at end)")
    ap.add_argument("--variants", type=harness.subset_of(tuple(VARIANTS)), default=list(VARIANTS))
    ap.add_argument("--sync-ranks", type=int, default=2, help="the sync run's (1 on one GPU)")
    ap.add_argument("--sync-run", type=Path, help="a finished run to read as sync")
    ap.add_argument("--set", action="append", default=[], help="a dotted override for every run")
    ap.add_argument("--work", type=Path, default=harness.REPO_ROOT / "runs" / NAME, help="run dirs")
    ap.add_argument("--out", type=Path, default=harness.RESULTS_DIR / f"{NAME}.csv")
    ap.add_argument("--report-only", action="store_true", help="report the runs in --work")
    ap.add_argument("--quick", action="store_true", help="4 tiny steps per variant: a smoke test")
    args = ap.parse_args(argv)
    extra = list(args.set)
    if args.quick:
        args.steps, args.val_every, extra = 4, 2, QUICK + extra
    load = os.getloadavg()[0]
    runs = run_variants(args, args.variants, extra)
    if not runs:
        print(f"{NAME}: no run to report", file=sys.stderr)
        return 1
    shape = f"embedded default, {args.steps} steps" + (" (quick)" if args.quick else "")
    note = f"OMP_NUM_THREADS=1 per rank, sync {args.sync_ranks} ranks, async 1 + 1"
    rows = csv_rows(runs, shape, note + f"; load average {load:.1f} at the start")
    harness.append_csv(args.out, rows)
    print(readme.summary(NAME, rows))
    for r in [r for r in rows if r["provider"] == "projection"]:
        print(f"projection (not measured) {r['mode']} {r['shape']}: {r['metric']} {r['p50']:.4g}")
    try:
        print(f"wrote {args.out} and {draw(runs, args.out.with_suffix('.png'))}")
    except ImportError:  # matplotlib is optional: the CSV is written either way
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
