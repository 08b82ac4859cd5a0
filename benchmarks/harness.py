"""The shared benchmark harness: providers x modes x shapes -> time, throughput and peak extra memory.

A benchmark script defines `build(provider, mode, shape, device) -> Step | None` (None: the provider
has no such mode) and calls `run_benchmark`. Each provider runs in its own fresh worker process (same
interpreter, `OMP_NUM_THREADS` and `torch.set_num_threads` both set to `threads`), so no provider
inherits another's allocator state, compiled-graph caches or freed-but-still-resident memory.

What is measured, per (provider, shape, mode):

- time (ms): `warmup` untimed calls (they also absorb torch.compile and Triton JIT), then `reps` timed
  calls; p50/p20/p80 over the reps (linear interpolation). Each call is `step.prepare()` (untimed: e.g.
  clear `.grad`, or run the forward for mode `backward`) then `step.run()` timed with
  `time.perf_counter`, with `torch.cuda.synchronize()` on both sides on CUDA.
- gflops (CPU) / tflops and peak_fraction (% of `peak_tflops`, CUDA): `step.flops` / time per rep, the
  same nominal FLOP count for every provider of a mode ("effective" throughput).
- peak_extra_memory (MB = 2**20 bytes), one call after the timed ones. The baseline is taken after the
  inputs exist and after `step.prepare()` (so for mode `backward` it excludes what the forward saved):
  * CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus
    `memory_allocated()` before the call (what the caching allocator handed out, not what it reserved).
  * CPU: the kernel's resident-set high-water mark. Before the call: `gc.collect()`, glibc
    `malloc_trim(0)` (returns freed heap pages, so memory left cached by earlier calls cannot hide the
    call's own use), then reset the high-water mark VmHWM to the current resident set by writing 5 to
    /proc/self/clear_refs (Linux >= 4.0) and take it as the baseline. After the call: VmHWM - baseline.
    The mark is exact (kept by the kernel, not sampled); it counts every resident page, so it includes
    allocator rounding and first-touch of thread stacks.
    Where clear_refs cannot be written no memory row is written (a warning is printed).
  Memory is one call, so p20 = p50 = p80.

Rows are appended to the CSV with the columns in `COLUMNS` (one row per metric; DESIGN.md "Public
names"). `device` is the CPU model (/proc/cpuinfo) or the GPU name; `versions` lists torch, triton,
liger-kernel, the thread settings and any note of the provider; `git_rev` is the short commit with
`+dirty` when tracked files differ from it; one `timestamp` (UTC, ISO 8601) per invocation; `command`
is the invocation that produced the row (`command_line()`: the writing process's sys.argv, i.e. the
parent's, since rows are written by the parent, never by a provider's worker). CSVs written before the
`command` column existed get it on the next append, empty (= not recorded) for their old rows.

Timing on shared machines varies (MACHINE-NOTES: up to 30x with 2 threads on 2 busy cores): providers
run one after another, so compare ratios within one invocation and look at the p20-p80 spread.
"""

from __future__ import annotations

import csv
import ctypes
import datetime
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("forward", "backward", "full")
COLUMNS = (
    "name",
    "provider",
    "mode",
    "shape",
    "metric",
    "unit",
    "p50",
    "p20",
    "p80",
    "device",
    "versions",
    "git_rev",
    "timestamp",
    "command",
)
COLUMNS_BEFORE_COMMAND = COLUMNS[:-1]  # older CSVs: append_csv adds the column (empty = not recorded)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
H200_BF16_DENSE_TFLOPS = 989.0


def _noop() -> None:
    return None


@dataclass
class Step:
    """One measurable call: `prepare()` untimed, then `run()` timed. `flops` = nominal FLOPs of `run`."""

    run: Callable[[], object]
    prepare: Callable[[], None] = _noop
    flops: float = 0.0
    measure_memory: bool = True
    note: str = ""  # appended to the `versions` column, e.g. "liger_path=chunk_forward"


@dataclass
class Result:
    """One worker's answer for one provider."""

    provider: str
    rows: list[dict] = field(default_factory=list)  # shape, mode, metric, unit, p50, p20, p80, note
    errors: list[str] = field(default_factory=list)
    device: str = ""
    versions: str = ""


# --------------------------------------------------------------------------------------------------
# Measurement (runs inside the worker process)
# --------------------------------------------------------------------------------------------------


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty sequence."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def time_step(step: Step, device, warmup: int, reps: int) -> list[float]:
    """Seconds per `step.run()` for `reps` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        step.prepare()
        out = step.run()
        del out
    times = []
    for _ in range(reps):
        step.prepare()
        _sync(device)
        t0 = time.perf_counter()
        out = step.run()
        _sync(device)
        times.append(time.perf_counter() - t0)
        del out
    return times


def _proc_status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0  # kB -> MB
    raise KeyError(key)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: freed heap pages may stay resident, the baseline is then higher


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_extra_memory_mb(step: Step, device) -> float | None:
    """Peak memory above the post-`prepare` baseline during one `step.run()` (see module docstring)."""
    import torch

    step.prepare()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step.run()
        torch.cuda.synchronize(device)
        del out
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    _malloc_trim()
    if not _reset_rss_peak():
        print("harness: /proc/self/clear_refs not writable; no CPU memory measurement", file=sys.stderr)
        return None
    base = _proc_status_mb("VmHWM")  # = VmRSS right after the reset
    out = step.run()
    peak = _proc_status_mb("VmHWM")
    del out
    return peak - base


def device_name(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions_string(threads: int) -> str:
    import torch

    parts = [f"torch={torch.__version__}"]
    for dist in ("triton", "liger-kernel"):
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist}=absent")
    parts.append(f"threads={torch.get_num_threads()}")
    parts.append(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    if "OMP_WAIT_POLICY" in os.environ:
        parts.append(f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    return " ".join(parts)


def _metric_rows(step: Step, times: list[float], device, peak_tflops: float) -> list[dict]:
    def row(metric, unit, values):
        return dict(
            metric=metric,
            unit=unit,
            p50=quantile(values, 0.5),
            p20=quantile(values, 0.2),
            p80=quantile(values, 0.8),
        )

    rows = [row("time", "ms", [t * 1e3 for t in times])]
    if step.flops:
        if device.type == "cuda":
            tflops = [step.flops / t / 1e12 for t in times]
            rows.append(row("tflops", "TFLOPS", tflops))
            rows.append(row("peak_fraction", "%", [100.0 * x / peak_tflops for x in tflops]))
        else:
            rows.append(row("gflops", "GFLOPS", [step.flops / t / 1e9 for t in times]))
    return rows


def worker_main(argv: Sequence[str]) -> None:
    """Entry of the worker process: argv = [spec JSON, result path]. Measures one provider."""
    import torch

    spec, result_path = json.loads(argv[0]), argv[1]
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    build = importlib.import_module(spec["module"]).build
    res = Result(spec["provider"], device=device_name(device), versions=versions_string(spec["threads"]))
    for shape in spec["shapes"]:
        for mode in spec["modes"]:
            tag = f"{spec['provider']} {mode} {shape['label']}"
            try:
                step = build(spec["provider"], mode, shape, device)
                if step is None:
                    continue
                times = time_step(step, device, spec["warmup"], spec["reps"])
                rows = _metric_rows(step, times, device, spec["peak_tflops"])
                if step.measure_memory:
                    mb = peak_extra_memory_mb(step, device)
                    if mb is not None:
                        rows.append(dict(metric="peak_extra_memory", unit="MB", p50=mb, p20=mb, p80=mb))
                for r in rows:
                    r.update(shape=shape["label"], mode=mode, note=step.note)
                res.rows.extend(rows)
                print(
                    f"  {tag}: {rows[0]['p50']:.3f} ms (p20 {rows[0]['p20']:.3f}, p80 {rows[0]['p80']:.3f})",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
                res.errors.append(f"{tag}: {type(exc).__name__}: {exc}")
                print(f"  {tag}: FAILED {type(exc).__name__}: {exc}", flush=True)
            step = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            with open(result_path, "w") as f:  # after every case: a later crash (OOM kill) keeps these
                json.dump(res.__dict__, f)


# --------------------------------------------------------------------------------------------------
# Orchestration (the parent process)
# --------------------------------------------------------------------------------------------------


def git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_provider(
    module: str,
    provider: str,
    modes: Sequence[str],
    shapes: Sequence[dict],
    *,
    device: str,
    threads: int,
    warmup: int,
    reps: int,
    peak_tflops: float = H200_BF16_DENSE_TFLOPS,
    timeout: float | None = None,
    entry: str = "benchmarks.harness:worker_main",
    extra: dict | None = None,
) -> Result:
    """Measure one provider in a fresh worker process (see module docstring).

    `entry` ("module:function") is the worker's entry point, called with [spec JSON, result path]; a
    benchmark that measures more than one timed call per case (rl_step.py: the phases of an RL step)
    supplies its own and reads its own keys from `extra`, which is merged into the spec.
    """
    spec = dict(
        module=module,
        provider=provider,
        modes=list(modes),
        shapes=list(shapes),
        device=device,
        threads=threads,
        warmup=warmup,
        reps=reps,
        peak_tflops=peak_tflops,
        **(extra or {}),
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    module_name, func = entry.split(":")
    code = f"import sys; from {module_name} import {func}; {func}(sys.argv[1:])"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, json.dumps(spec), path], cwd=REPO_ROOT, env=env, timeout=timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout} s"
        if not os.path.exists(path):
            return Result(provider, errors=[f"{provider}: worker exited without a result (rc={rc})"])
        with open(path) as f:
            res = Result(**json.load(f))
        if rc != 0:
            res.errors.append(f"{provider}: worker exited early (rc={rc}); later cases are missing")
        return res


def command_line(argv: Sequence[str] | None = None) -> str:
    """The invocation as a shell command, from `argv` (default: this process's sys.argv).

    `python -m benchmarks rl_step --quick` has sys.argv[0] = <repo>/benchmarks/__main__.py and is given
    back as written; another script of the repository is named as a module (`python -m benchmarks.x`),
    anything else by its file name.
    """
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0]:
        return ""
    head = Path(argv[0])
    prog = [head.name]
    if head.suffix == ".py":
        try:
            parts = list(head.resolve().relative_to(REPO_ROOT).with_suffix("").parts)
        except ValueError:
            parts = [head.parent.name] if head.name == "__main__.py" else []
        if parts and parts[-1] == "__main__":
            parts = parts[:-1]
        if parts:
            prog = ["python", "-m", ".".join(parts)]
    return shlex.join(prog + argv[1:])


def _add_command_column(path: Path) -> None:
    """Rewrite a CSV with the columns before `command` to COLUMNS, its rows' command empty."""
    with open(path, newline="") as f:
        old = list(csv.DictReader(f))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(old)
    os.replace(tmp, path)


def append_csv(path: Path, rows: Sequence[dict]) -> None:
    """Append rows (dicts with COLUMNS keys) to `path`, writing the header when the file is new.

    A row without `command` gets `command_line()`. A CSV written before the `command` column existed
    is first rewritten with it (its old rows' command empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > 0:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) == COLUMNS_BEFORE_COMMAND:
            _add_command_column(path)
        elif tuple(header) != COLUMNS:
            raise ValueError(f"{path} has columns {header}, expected {list(COLUMNS)}; use another --out")
        new = False
    else:
        new = True
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        command = command_line()
        for r in rows:
            r = {"command": command, **r}
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def add_standard_args(parser, name: str, *, reps: str, warmup: int, device: bool = False) -> None:
    """The options every op benchmark shares: --threads --providers --reps --warmup --timeout --out (and
    --device cpu|cuda). `reps` describes the default in the help (the benchmark picks it when None)."""
    if device:
        parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch/OMP threads (default: all cores)")
    parser.add_argument("--providers", default=None, help="comma-separated subset of the providers")
    parser.add_argument("--reps", type=int, default=None, help=f"timed calls ({reps})")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed calls before timing")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per provider worker")
    parser.add_argument(
        "--out", default=None, help=f"CSV to append to (default benchmarks/results/{name}.csv)"
    )


def check_device(parser, args) -> None:
    """Fail the command line early when --device cuda is asked for without a visible CUDA device."""
    if getattr(args, "device", "cpu") == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda needs a visible CUDA device")


def run_benchmark(
    name: str,
    module: str,
    providers: Sequence[str],
    modes: Sequence[str],
    shapes: Sequence[dict],
    *,
    device: str = "cpu",
    threads: int | None = None,
    warmup: int = 1,
    reps: int = 5,
    out: Path | None = None,
    peak_tflops: float = H200_BF16_DENSE_TFLOPS,
    timeout: float | None = None,
    entry: str = "benchmarks.harness:worker_main",
    extra: dict | None = None,
) -> tuple[list[dict], list[str]]:
    """Measure every provider (one worker each), append all rows to the CSV; return (rows, errors).

    `shapes` are dicts with at least a `label` (the CSV `shape` column) and whatever `build` reads.
    `entry` and `extra`: see `run_provider`.
    """
    threads = threads or default_threads()
    out = Path(out) if out else RESULTS_DIR / f"{name}.csv"
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rev = git_rev()
    print(
        f"{name}: {len(providers)} providers x {list(modes)} x {len(shapes)} shapes on {device}, "
        f"threads={threads}, warmup={warmup}, reps={reps} -> {out}",
        flush=True,
    )
    rows, errors = [], []
    for provider in providers:
        print(f"[{provider}]", flush=True)
        res = run_provider(
            module,
            provider,
            modes,
            shapes,
            device=device,
            threads=threads,
            warmup=warmup,
            reps=reps,
            peak_tflops=peak_tflops,
            timeout=timeout,
            entry=entry,
            extra=extra,
        )
        errors.extend(res.errors)
        for r in res.rows:
            versions = res.versions + (f" note={r['note']}" if r.get("note") else "")
            rows.append(
                dict(
                    r,
                    name=name,
                    provider=provider,
                    device=res.device,
                    versions=versions,
                    git_rev=rev,
                    timestamp=stamp,
                )
            )
    append_csv(out, rows)
    return rows, errors


# --------------------------------------------------------------------------------------------------
# Summary table
# --------------------------------------------------------------------------------------------------


def summary_table(rows: Sequence[dict], *, floor: str | None, reference: str = "naive") -> str:
    """Plain-text table per (shape, mode): p50 time, ratios to `floor` and `reference`, rate, memory."""
    by = {(r["shape"], r["mode"], r["provider"], r["metric"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    rate_metric = "tflops" if any(r["metric"] == "tflops" for r in rows) else "gflops"
    head = (
        f"{'provider':<18} {'time ms p50':>12} {'(p20-p80)':>20} {'x floor':>8} {'x ' + reference:>9} "
        f"{rate_metric:>8} {'peak MB':>9} {'mem x ' + reference:>12}"
    )
    lines = []
    for shape in shapes:
        for mode in MODES:
            present = [p for p in providers if (shape, mode, p, "time") in by]
            if not present:
                continue
            lines += ["", f"== {mode}  {shape}", head, "-" * len(head)]
            t_floor = by.get((shape, mode, floor, "time"))
            t_ref = by.get((shape, mode, reference, "time"))
            m_ref = by.get((shape, mode, reference, "peak_extra_memory"))
            for p in present:
                t = by[(shape, mode, p, "time")]
                rate = by.get((shape, mode, p, rate_metric))
                mem = by.get((shape, mode, p, "peak_extra_memory"))
                spread = f"({t['p20']:.3f}-{t['p80']:.3f})"
                x_floor = f"{t['p50'] / t_floor['p50']:.2f}" if t_floor else "-"
                x_ref = f"{t['p50'] / t_ref['p50']:.2f}" if t_ref else "-"
                rate_s = f"{rate['p50']:.1f}" if rate else "-"
                mem_s = f"{mem['p50']:.1f}" if mem else "-"
                mem_x = f"{mem['p50'] / m_ref['p50']:.3f}" if mem and m_ref and m_ref["p50"] > 0 else "-"
                lines.append(
                    f"{p:<18} {t['p50']:>12.3f} {spread:>20} {x_floor:>8} {x_ref:>9} {rate_s:>8} "
                    f"{mem_s:>9} {mem_x:>12}"
                )
    return "\n".join(lines)
