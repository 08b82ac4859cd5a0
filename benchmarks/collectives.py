"""Collective bandwidth under torchrun: all-reduce, all-gather, reduce-scatter across message sizes.

    python -m benchmarks collectives [--quick] [--ranks 2] [--ops all_reduce,all_gather,reduce_scatter]
    torchrun --nproc_per_node=8 -m benchmarks.collectives [--quick]      # already under torchrun

The floor that FSDP2's communication stands on (an FSDP2 step is one all-gather of the parameters per
forward and backward and one reduce-scatter of the gradients). Backend: gloo on CPU, NCCL on CUDA (one
GPU per rank, `LOCAL_RANK`). `python -m benchmarks collectives` starts `torchrun --standalone` itself
with `--ranks` processes (default 2); each rank sets `torch.set_num_threads(--threads)` (default 1).

Conventions are nccl-tests' (PERFORMANCE.md there): `size` is the bytes of the whole buffer - the
all-reduce buffer, the all-gather OUTPUT (n x the per-rank piece), the reduce-scatter INPUT; fp32
elements; time is per call, the slowest rank's, averaged over `--iters` calls after `--warmup` calls
(with a barrier before each timed batch); algbw = size / time; busbw = algbw x 2(n-1)/n for all-reduce
and x (n-1)/n for all-gather and reduce-scatter, the per-link bandwidth a ring needs, comparable
across rank counts. p50/p20/p80 are over `--reps` batches. Sizes: 1 KiB to 64 MiB by 4x (`--quick`:
1 KiB, 32 KiB, 1 MiB, 8 MiB).

When nccl-tests' binaries (`all_reduce_perf`, `all_gather_perf`, `reduce_scatter_perf`) are on PATH
and CUDA is present, the parent also runs each single-process over `--ranks` GPUs (`-g N`, same sizes)
and records their out-of-place time / algbw / busbw under provider `nccl-tests` (UNVERIFIED: no GPU
or nccl-tests when this was written; the parser reads their standard table).

Rows (harness.COLUMNS): provider `torch-gloo` / `torch-nccl` / `nccl-tests`, mode = the op, shape =
"<size> B world=<n>", metrics `time` (us), `algbw` and `busbw` (GB/s, 1e9 bytes). Plot:
collectives.png (busbw against size, one line per op and provider). On a shared 2-core CPU, gloo's
numbers measure memory copies and loopback TCP under contention: compare shapes, not absolute values.
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

from benchmarks import harness

NAME = "collectives"
OPS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = [1024 * 4**i for i in range(9)]  # 1 KiB .. 64 MiB
QUICK_SIZES = [1024, 32 * 1024, 2**20, 8 * 2**20]
NCCL_TESTS = {
    "all_reduce": "all_reduce_perf",
    "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf",
}


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw / algbw."""
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _rows_for(provider, op, size, world, times_s: list[float]) -> list[dict]:
    """time (us), algbw, busbw rows (GB/s); rate quantiles come from the opposite time quantiles."""
    q = {k: harness.quantile(times_s, f) for k, f in (("p50", 0.5), ("p20", 0.2), ("p80", 0.8))}
    shape = f"{size} B world={world}"
    rows = [
        dict(
            provider=provider,
            mode=op,
            shape=shape,
            metric="time",
            unit="us",
            **{k: v * 1e6 for k, v in q.items()},
        )
    ]
    alg = {"p50": size / q["p50"] / 1e9, "p20": size / q["p80"] / 1e9, "p80": size / q["p20"] / 1e9}
    rows.append(dict(provider=provider, mode=op, shape=shape, metric="algbw", unit="GB/s", **alg))
    f = bus_factor(op, world)
    rows.append(
        dict(
            provider=provider,
            mode=op,
            shape=shape,
            metric="busbw",
            unit="GB/s",
            **{k: v * f for k, v in alg.items()},
        )
    )
    return rows


def rank_main(args) -> dict | None:
    """One torchrun rank: measure every (op, size); rank 0 returns {rows, device, versions}, others None."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.cpu
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows = []
    for op in args.ops.split(","):
        for size in [int(s) for s in args.sizes.split(",")]:
            numel = size // 4
            piece = max(numel // world, 1)
            if op == "all_reduce":
                buf = torch.ones(numel, device=device)
                call = lambda buf=buf: dist.all_reduce(buf)
            elif op == "all_gather":
                inp, out = torch.ones(piece, device=device), torch.empty(piece * world, device=device)
                call = lambda inp=inp, out=out: dist.all_gather_into_tensor(out, inp)
            elif op == "reduce_scatter":
                inp, out = torch.ones(piece * world, device=device), torch.empty(piece, device=device)
                call = lambda inp=inp, out=out: reduce_scatter(out, inp)
            else:
                raise ValueError(f"unknown op {op!r}; one of {OPS}")
            size_eff = (numel if op == "all_reduce" else piece * world) * 4
            iters = max(1, min(args.iters, int(args.budget_bytes // max(size_eff, 1))))
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
            rows += _rows_for(f"torch-{backend}", op, size_eff, world, times)
            if rank == 0:
                print(f"  {op:<15} {size_eff:>10} B  {times[len(times) // 2] * 1e6:>10.1f} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    versions = f"{harness.versions_string(args.threads)} backend={backend} ranks={world}"  # as the ranks ran
    return dict(rows=rows, device=harness.device_name(device), versions=versions)


def parse_nccl_tests(text: str, op: str, world: int) -> list[dict]:
    """Rows from an nccl-tests table: size count type redop root | time algbw busbw #wrong (out-of-place)."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8 or not parts[0].isdigit() or not re.fullmatch(r"[\d.]+", parts[5]):
            continue
        size, t_us, algbw, busbw = int(parts[0]), float(parts[5]), float(parts[6]), float(parts[7])
        shape = f"{size} B world={world}"
        for metric, unit, v in (("time", "us", t_us), ("algbw", "GB/s", algbw), ("busbw", "GB/s", busbw)):
            rows.append(
                dict(
                    provider="nccl-tests", mode=op, shape=shape, metric=metric, unit=unit, p50=v, p20=v, p80=v
                )
            )
    return rows


def run_nccl_tests(ops, sizes, nproc) -> tuple[list[dict], list[str]]:
    rows, errors = [], []
    for op in ops:
        exe = shutil.which(NCCL_TESTS[op])
        if exe is None:
            continue
        cmd = [exe, "-b", str(min(sizes)), "-e", str(max(sizes)), "-f", "4", "-g", str(nproc), "-d", "float"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
            rows += parse_nccl_tests(out, op, nproc)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"nccl-tests {op}: {exc}")
    return rows, errors


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for provider in dict.fromkeys(r["provider"] for r in rows):
        for op in OPS:
            pts = sorted(
                (int(r["shape"].split()[0]), r["p50"])
                for r in rows
                if r["provider"] == provider and r["mode"] == op and r["metric"] == "busbw"
            )
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{op} ({provider})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes, nccl-tests convention)")
    ax.set_ylabel("bus bandwidth (GB/s, p50)")
    ax.legend(fontsize=7)
    world = rows[0]["shape"].split("world=")[1] if rows else "?"
    ax.set_title(f"collectives, {world} ranks - {rows[0].get('device', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _args(argv):
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="sizes 1 KiB, 32 KiB, 1 MiB, 8 MiB; 3 reps")
    p.add_argument("--ranks", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes", default=None, help="comma-separated bytes (default 1 KiB .. 64 MiB by 4x)")
    p.add_argument("--iters", type=int, default=20, help="calls per timed batch (fewer for large sizes)")
    p.add_argument("--budget-bytes", type=float, default=2e9, help="cap on iters x size per timed batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=None, help="timed batches (default 5; --quick 3)")
    p.add_argument("--cpu", action="store_true", help="gloo even where CUDA is present")
    p.add_argument("--out", default=None, help=f"CSV to append to (default benchmarks/results/{NAME}.csv)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # rank 0's JSON (set by the parent)
    args = p.parse_args(argv)
    args.sizes = args.sizes or ",".join(map(str, QUICK_SIZES if args.quick else SIZES))
    args.reps = args.reps or (3 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
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
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.ranks}",
        ]
        cmd += [
            "-m",
            "benchmarks.collectives",
            *(argv if argv is not None else sys.argv[1:]),
            "--result",
            result,
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(harness.REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        print(f"{NAME}: {' '.join(cmd[1:-2])}", flush=True)
        rc = subprocess.run(cmd, cwd=harness.REPO_ROOT, env=env).returncode
        if rc != 0 or not os.path.exists(result):
            print(f"{NAME}: torchrun exited with {rc}", file=sys.stderr)
            return 1
        measured = _load(result)
    errors = []
    import torch

    if torch.cuda.is_available() and not args.cpu:
        nt_rows, errors = run_nccl_tests(
            args.ops.split(","), [int(s) for s in args.sizes.split(",")], args.ranks
        )
        for r in nt_rows:
            r["device"] = measured["device"]
        measured["rows"] += nt_rows
    return _finish(args, measured, errors)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _finish(args, measured: dict, errors: list[str]) -> int:
    out = Path(args.out) if args.out else harness.RESULTS_DIR / f"{NAME}.csv"
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    versions = measured["versions"]
    rows = [
        dict(
            r,
            name=NAME,
            device=measured["device"],
            versions=versions,
            git_rev=harness.git_rev(),
            timestamp=stamp,
        )
        for r in measured["rows"]
    ]
    harness.append_csv(out, rows)
    by = {(r["provider"], r["mode"], r["shape"], r["metric"]): r for r in rows}
    print(
        f"\n{'provider':<12} {'op':<15} {'size B':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"
    )
    for (provider, op, shape, metric), r in by.items():
        if metric == "time":
            alg, bus = by[(provider, op, shape, "algbw")], by[(provider, op, shape, "busbw")]
            print(
                f"{provider:<12} {op:<15} {shape.split()[0]:>10} {r['p50']:>10.1f} {alg['p50']:>11.3f} "
                f"{bus['p50']:>11.3f}"
            )
    if rows and not args.no_plot:
        png = plot(rows, out.with_suffix(".png"))
        if png:
            print(f"plot: {png}")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
