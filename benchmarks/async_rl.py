"""Asynchronous RL against the synchronous step on the embedded task, same total cores; a GPU projection.

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks async_rl [--steps 100] [--variants sync,async-k1]
    python -m benchmarks async_rl --quick          # smoke test (CI): 4 tiny steps per variant
    python -m benchmarks async_rl --report-only    # rows, figure and projection from the runs in --work

Every run is the README's main job, `torchrun --standalone --nproc_per_node=2 prorl/train.py` (the
embedded default, one thread per rank, no checkpoints), for `--steps` steps (default 100 of its 150, so
that the three runs fit in 15 minutes of a shared 2-core machine) with held-out greedy accuracy on its
200 problems every `--val-every` steps; a variant changes only the placement:

    sync       2 colocated ranks, each samples and trains (rollout.async.steps_ahead=0)
    async-k1   1 rollout rank + 1 trainer rank, groups sampled at most 1 update before they are trained
    async-k2   the same, at most 2 updates

Rows (benchmarks/results/async_rl.csv, provider = the variant, from its metrics.jsonl): `wall_time` (s,
the whole command: start-up and validations too), `train_time` (s, the sum of `timing_s/step`: the
training steps alone, the time base of the next rows), `steps_per_min`, `gen_tokens_per_s` (generated
tokens, `dynamic_sampling/generated_tokens`, per second of train_time), `rollout_idle` and
`trainer_idle` (fractions of train_time), `overlap_efficiency` (train_time / the busier side's busy time;
the goal is <= 1.1), `val_accuracy` at the last step every run reached and `val_accuracy_delta` (points
against sync at that step; the goal is within 2; 200 problems: one problem is 0.5 points), and the mean
phase seconds per step (`phase_*`). The sides: async, each side's idle time is its own wait
(`timing_s/wait_rollout` on the trainer, `timing_s/wait_trainer` on the rollout rank); sync, both ranks
run both sides one after the other, so the rollout side (generation + verification) idles while the
trainer side (everything else in the step) runs and vice versa.

Projection (provider `projection`, labelled so in every row until a GPU measures it), from the sync
run's phases, `project()`: per step, rollout work G = (gen + verify) seconds and trainer work T =
(log-prob passes + update) seconds, measured on the run's devices; assumed: (1) trainer time scales
as 1/devices; (2) rollout time too, except a `serial` part that does not shrink with more devices, the
long tail of each round (batch decoding runs as many steps as the longest response): `serial` =
1 - mean/max response length (mode `tail`), or 0 (mode `linear`, where async can only tie); (3) the
sync step pays the colocated weight sync it measured, the async one the push it measured (both
stop the step); (4) steps_ahead >= 1 overlaps the sides completely (no step-to-step variance, so k = 1
and k = 2 project the same). Sync on N devices: gen(N) + train(N) + sync; async with r rollout
devices: max(gen(r), train(N - r)) + push, with the best r (`8 gpus`) or one node each (`2x8 gpus`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks import harness

NAME = "async_rl"
ROOT = harness.REPO_ROOT
VARIANTS = {
    "sync": [],
    "async-k1": ["rollout.async.steps_ahead=1", "rollout.async.rollout_ranks=1"],
    "async-k2": ["rollout.async.steps_ahead=2", "rollout.async.rollout_ranks=1"],
}
QUICK = ["data.train_size=64", "data.val_size=16", "trainer.prompts_per_step=8"]
PHASES = {  # phase -> the metrics.jsonl keys summed into it (seconds per step)
    "gen": ("timing_s/gen",),
    "verify": ("timing_s/reward",),
    "logprob": ("timing_s/old_log_prob", "timing_s/ref"),
    "update": ("timing_s/adv", "timing_s/update_actor"),
    "push": ("timing_s/update_weights",),
}


def command(out: Path, steps: int, val_every: int, ranks: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        "prorl/train.py", f"output_dir={out}", f"trainer.total_steps={steps}",
        f"trainer.val_every={val_every}", "trainer.save_every=0", *extra,
    ]  # fmt: skip


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def finished(run: Path, steps: int) -> bool:
    return any(r.get("step") == steps and "timing_s/step" in r for r in read_metrics(run))


def launch(out: Path, cmd: list[str]) -> float:
    """Run `cmd` (a training command) from the repository root, its output in out/train.log; returns
    its wall seconds; raises with the log's tail when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(out / "train.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{out.name} exited {rc}:\n{(out / 'train.log').read_text()[-3000:]}")
    (out / "wall_s.json").write_text(json.dumps({"wall_s": wall}))
    return wall


def summarise(rows: list[dict], wall: float | None = None) -> dict:
    """A run's numbers (module docstring) from its metrics.jsonl rows; `wall`: its command's seconds."""
    steps = [r for r in rows if "timing_s/step" in r]
    if not steps:
        raise ValueError("no training step in metrics.jsonl")
    total = lambda key: sum(r.get(key, 0.0) for r in steps)
    train = total("timing_s/step")
    phases = {p: sum(total(k) for k in keys) / len(steps) for p, keys in PHASES.items()}
    if any("timing_s/wait_rollout" in r for r in steps):  # asynchronous: each side's own waits
        idle = dict(trainer=total("timing_s/wait_rollout"), rollout=total("timing_s/wait_trainer"))
    else:  # synchronous: each side idles while the other runs
        rollout_busy = total("timing_s/gen") + total("timing_s/reward")
        idle = dict(trainer=rollout_busy, rollout=train - rollout_busy)
    busiest = train - min(idle.values())
    mean_len, max_len = total("response_length/mean"), total("response_length/max")
    return dict(
        steps=len(steps),
        wall_time=wall,
        train_time=train,
        steps_per_min=60 * len(steps) / train,
        gen_tokens_per_s=total("dynamic_sampling/generated_tokens") / train,
        rollout_idle=idle["rollout"] / train,
        trainer_idle=idle["trainer"] / train,
        overlap_efficiency=train / busiest,
        accuracy={r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r},
        phases=phases,
        tail=1 - mean_len / max_len if max_len else 0.0,
    )


def project(phases: dict, devices: int, total: int, rollout: int | None, serial: float) -> dict:
    """Projected seconds per step, sync against async on `total` devices (module docstring).

    phases: seconds per step measured on `devices` devices (gen, verify, logprob, update, push: the
    sync run's; `async_push`: the push an async step pays, default `push`). rollout: the async run's
    rollout devices (None: the fastest split). serial: the fraction of rollout time that does not
    shrink with more devices. Returns sync_s, async_s, rollout (devices), speedup (sync_s / async_s)."""
    work = (phases["gen"] + phases["verify"]) * devices  # device-seconds at `devices` devices
    train = (phases["logprob"] + phases["update"]) * devices
    gen = lambda d: serial * work / devices + (1 - serial) * work / d
    sync_s = gen(total) + train / total + phases["push"]
    push = phases.get("async_push", phases["push"])
    splits = [rollout] if rollout else range(1, total)
    async_s, r = min((max(gen(r), train / (total - r)) + push, r) for r in splits)
    return dict(sync_s=sync_s, async_s=async_s, rollout=r, speedup=sync_s / async_s)


def projections(sync: dict, async_push: float | None, devices: int) -> list[tuple[str, str, dict]]:
    """(mode, shape, project()) for 8 GPUs (best split) and 2 x 8 (one node each), linear and tail."""
    phases = dict(sync["phases"], **({"async_push": async_push} if async_push is not None else {}))
    out = []
    for mode, serial in (("linear", 0.0), ("tail", sync["tail"])):
        for shape, total, rollout in (("8 gpus", 8, None), ("2x8 gpus", 16, 8)):
            out.append((mode, shape, project(phases, devices, total, rollout, serial)))
    return out


UNITS = dict(wall_time="s", train_time="s", steps_per_min="1/min", gen_tokens_per_s="tok/s")
UNITS.update(rollout_idle="fraction", trainer_idle="fraction", overlap_efficiency="x")


def csv_rows(runs: dict[str, dict], shape: str, note: str) -> list[dict]:
    """The CSV rows of every run (module docstring), then the projection's."""
    cpu = harness.device_name(SimpleNamespace(type="cpu"))
    common = dict(name=NAME, shape=shape, device=cpu, git_rev=harness.git_rev(), timestamp=harness.utc_now())
    rows, common_steps = [], set.intersection(*(set(s["accuracy"]) for s in runs.values()))
    at = max(common_steps) if common_steps else None
    for variant, s in runs.items():
        case = dict(common, provider=variant, mode="measured", versions=note)
        row = lambda metric, unit, value: rows.append(harness.single_row(metric, unit, value, **case))
        for metric, unit in UNITS.items():
            if s[metric] is not None:
                row(metric, unit, s[metric])
        for phase, seconds in s["phases"].items():
            row(f"phase_{phase}", "s", seconds)
        if at is not None:
            row(f"val_accuracy@{at}", "fraction", s["accuracy"][at])
            if "sync" in runs:
                row("val_accuracy_delta", "points", 100 * (s["accuracy"][at] - runs["sync"]["accuracy"][at]))
    if "sync" in runs:
        pushes = [s["phases"]["push"] for v, s in runs.items() if v != "sync"]
        async_push = max(pushes) if pushes else None
        ranks = runs["sync"].get("ranks", 2)
        for mode, where, p in projections(runs["sync"], async_push, ranks):
            case = dict(common, provider="projection", mode=mode, shape=where)
            case["versions"] = f"projection, not measured: {ranks}-rank sync phases, r={p['rollout']}"
            for key, unit in (("sync_s", "s"), ("async_s", "s"), ("speedup", "x")):
                rows.append(harness.single_row(key, unit, p[key], **case))
    return rows


def plot(runs: dict[str, dict], png: Path) -> Path | None:
    """Each side's busy time beside the training time per run, and held-out accuracy against step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(runs))
    for i, (label, key) in enumerate((("rollout busy", "rollout_idle"), ("trainer busy", "trainer_idle"))):
        busy = [s["train_time"] * (1 - s[key]) for s in runs.values()]
        bars.bar([j + 0.27 * (i - 1) for j in x], busy, 0.27, label=label)
    bars.bar([j + 0.27 for j in x], [s["train_time"] for s in runs.values()], 0.27, label="training time")
    bars.set_xticks(list(x), [f"{v}\n{s['overlap_efficiency']:.2f}x" for v, s in runs.items()])
    bars.set_ylabel("seconds (x labels: overlap efficiency)")
    bars.legend(fontsize=8)
    for variant, s in runs.items():
        steps = sorted(s["accuracy"])
        curves.plot(steps, [100 * s["accuracy"][t] for t in steps], "o-", label=variant)
    curves.set_xlabel("step")
    curves.set_ylabel("held-out greedy accuracy (%)")
    curves.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def run_variants(args, variants: list[str], extra: list[str]) -> dict[str, dict]:
    """Train (unless --report-only) and summarise each variant, in order."""
    runs = {}
    for variant in variants:
        out = args.work / variant
        if variant == "sync" and args.sync_run:
            out = args.sync_run
        elif not args.report_only:
            ranks = args.sync_ranks if variant == "sync" else 2
            cmd = command(out, args.steps, args.val_every, ranks, extra + VARIANTS[variant])
            print(f"{NAME}: {variant}: {' '.join(cmd[1:])}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            print(f"{NAME}: {variant}: {launch(out, cmd):.0f} s", flush=True)
        if not finished(out, args.steps):
            print(f"{NAME}: {variant}: no complete {args.steps}-step run in {out}", flush=True)
            continue
        wall = out / "wall_s.json"
        wall = json.loads(wall.read_text())["wall_s"] if wall.exists() else None
        runs[variant] = dict(summarise(read_metrics(out), wall), ranks=args.sync_ranks)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="RL steps per run (the default's 150: --steps 150)")
    ap.add_argument("--val-every", type=int, default=25, help="held-out accuracy every this many steps")
    ap.add_argument("--variants", type=harness.subset_of(tuple(VARIANTS)), default=list(VARIANTS))
    ap.add_argument("--sync-ranks", type=int, default=2, help="ranks of the sync run (1 on one GPU)")
    ap.add_argument("--sync-run", type=Path, help="a finished run directory to read as the sync run")
    ap.add_argument("--set", action="append", default=[], help="a dotted override for every run")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / NAME, help="run directories")
    ap.add_argument("--out", type=Path, default=harness.RESULTS_DIR / f"{NAME}.csv")
    ap.add_argument("--report-only", action="store_true", help="no training: report the runs in --work")
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
    note = f"OMP_NUM_THREADS=1 per rank, 2 processes; load average {load:.1f} at the start"
    rows = csv_rows(runs, shape, note)
    harness.append_csv(args.out, rows)
    for r in rows:
        print(f"  {r['provider']:<10} {r['mode']:<8} {r['shape'][:24]:<24} {r['metric']:<22} {r['p50']:.4g}")
    png = plot(runs, args.out.with_suffix(".png"))
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
