"""Collective bandwidth under torchrun: all-reduce, all-gather, reduce-scatter across message sizes.

    python -m benchmarks collectives [--quick] [--ranks 2]
        [--ops all_reduce,all_gather,reduce_scatter]
    torchrun --nproc_per_node=8 -m benchmarks.collectives [--quick]      # already under torchrun

gloo on CPU, NCCL on CUDA; nccl-tests' conventions (and its own tables where its binaries are on
PATH). Mode = the op, shape = "<size> B world=<n>"; plot collectives.png. Details:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import harness, plot
from benchmarks.report.readme import View

NAME = "collectives"
OPS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = [1024 * 4**i for i in range(9)]  # 1 KiB .. 64 MiB
QUICK_SIZES = [1024, 32 * 1024, 2**20, 8 * 2**20]
BUDGET_BYTES = 2e9  # cap on iters x size per timed batch


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw / algbw."""
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _rows_for(provider, op, size, world, times_s: list[float]) -> list[dict]:
    """time (us), algbw and busbw (GB/s) rows; rates' quantiles come from the opposite time ones."""
    case = dict(provider=provider, mode=op, shape=f"{size} B world={world}")
    t = harness.row("time", "us", [x * 1e6 for x in times_s], **case)
    alg = harness.rate_row(t, size / 1e9, "algbw", "GB/s", seconds_per_unit=1e-6)
    f = bus_factor(op, world)
    return [t, alg, dict(alg, metric="busbw", **{k: alg[k] * f for k in ("p50", "p20", "p80")})]


def _collective(op: str, size: int, world: int, device):
    """(call, size as nccl-tests counts it) of one op on fp32 buffers of `size` bytes."""
    # torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    numel = size // 4
    piece = max(numel // world, 1)
    if op == "all_reduce":
        buf = torch.ones(numel, device=device)
        return (lambda: dist.all_reduce(buf)), numel * 4
    whole, part = torch.ones(piece * world, device=device), torch.ones(piece, device=device)
    if op == "all_gather":
        return (lambda: dist.all_gather_into_tensor(whole, part)), piece * world * 4
    return (lambda: reduce_scatter(part, whole)), piece * world * 4


def _time_collective(call, iters: int, args, device) -> list[float]:
    """Seconds per call, the slowest rank's, of `args.reps` timed batches of `iters` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        call()
    sync()
    times = []
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(float(t))
    return times


def rank_main(args) -> dict | None:
    """One torchrun rank: measure every (op, size); rank 0 returns {rows, device, versions}."""
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.cpu
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    rows = []
    for op in args.ops:
        for size in args.sizes:
            call, size_eff = _collective(op, size, world, device)
            iters = max(1, min(args.iters, int(BUDGET_BYTES // max(size_eff, 1))))
            times = _time_collective(call, iters, args, device)
            rows += _rows_for(f"torch-{backend}", op, size_eff, world, times)
            if rank == 0:
                us = times[len(times) // 2] * 1e6
                print(f"  {op:<15} {size_eff:>10} B  {us:>10.1f} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    # as the ranks ran
    versions = f"{harness.versions_string()} backend={backend} ranks={world}"
    return dict(rows=rows, device=harness.device_name(device), versions=versions)


def parse_nccl_tests(text: str, op: str, world: int) -> list[dict]:
    """Rows from an nccl-tests table: size count type redop root | time algbw busbw #wrong
    (out-of-place)."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8 or not parts[0].isdigit() or not re.fullmatch(r"[\d.]+", parts[5]):
            continue
        case = dict(provider="nccl-tests", mode=op, shape=f"{int(parts[0])} B world={world}")
        for metric, unit, v in zip(("time", "algbw", "busbw"), ("us", "GB/s", "GB/s"), parts[5:8]):
            rows.append(harness.row(metric, unit, [float(v)], **case))
    return rows


def run_nccl_tests(ops, sizes, nproc) -> tuple[list[dict], list[str]]:
    rows, errors = [], []
    for op in ops:
        exe = shutil.which(f"{op}_perf")
        if exe is None:
            continue
        cmd = [exe, "-b", str(min(sizes)), "-e", str(max(sizes)), "-f", "4", "-g", str(nproc)]
        try:
            out = subprocess.run(
                [*cmd, "-d", "float"], capture_output=True, text=True, timeout=600, check=True
            ).stdout
            rows += parse_nccl_tests(out, op, nproc)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"nccl-tests {op}: {exc}")
    return rows, errors


def _args(argv):
    p = harness.argparser(NAME, __doc__)
    add = p.add_argument
    add("--quick", action="store_true", help="sizes 1 KiB, 32 KiB, 1 MiB, 8 MiB; 3 reps")
    add("--ranks", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    add("--threads", type=int, default=1, help="torch threads per rank")
    add("--ops", type=harness.subset_of(OPS), default=",".join(OPS))
    add("--sizes", type=harness.ints, help="comma-separated bytes (default 1 KiB .. 64 MiB by 4x)")
    add("--iters", type=int, default=20, help="calls per timed batch (fewer if large)")
    add("--warmup", type=int, default=3)
    add("--reps", type=int, help="timed batches (default 5; --quick 3)")
    add("--cpu", action="store_true", help="gloo even where CUDA is present")
    add("--out", help=f"CSV to append to (default benchmarks/results/{NAME}.csv)")
    add("--no-plot", action="store_true")
    add("--result", help=argparse.SUPPRESS)  # rank 0's JSON (set by the parent)
    args = p.parse_args(argv)
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    args.reps = args.reps or (3 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if "LOCAL_RANK" in os.environ:  # under torchrun: be a rank
        measured = rank_main(args)
        if measured is None:
            return 0
        if args.result:  # started by the parent below, which writes the CSV
            with open(args.result, "w") as f:
                json.dump(measured, f)
            return 0
        return _finish(args, measured, [])
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*torchrun, f"--nproc_per_node={args.ranks}"]
        cmd += ["-m", "benchmarks.collectives", *argv, "--result", result]
        print(f"{NAME}: {' '.join(cmd[1:-2])}", flush=True)
        env = harness.subprocess_env(args.threads)
        rc = subprocess.run(cmd, cwd=harness.REPO_ROOT, env=env).returncode
        if rc != 0 or not os.path.exists(result):
            print(f"{NAME}: torchrun exited with {rc}", file=sys.stderr)
            return 1
        with open(result) as f:
            measured = json.load(f)
    errors = []
    if torch.cuda.is_available() and not args.cpu:
        nt_rows, errors = run_nccl_tests(args.ops, args.sizes, args.ranks)
        measured["rows"] += [dict(r, device=measured["device"]) for r in nt_rows]
    return _finish(args, measured, errors)


# the console's table
VIEW = View("busbw", ("time", "algbw"), (("nccl-tests", "multiple"),), higher_is_better=True)


def _finish(args, measured: dict, errors: list[str]) -> int:
    out = Path(args.out) if args.out else harness.RESULTS_DIR / f"{NAME}.csv"
    device, versions = measured["device"], measured["versions"]
    rows = harness.record(NAME, measured["rows"], out, device=device, versions=versions, view=VIEW)
    if rows and not args.no_plot:
        try:
            print(f"plot: {plot.bandwidth(rows, out.with_suffix('.png'), list(OPS))}")
        except ImportError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
