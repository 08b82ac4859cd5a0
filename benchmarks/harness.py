"""The shared benchmark harness: providers x modes x shapes -> time, throughput, peak extra memory.

A benchmark module defines `build(provider, mode, shape, device) -> Step | None` (None: no such mode
for the provider) and a `Benchmark`, whose `main` is its command line. Each provider runs in a fresh
worker process; the rows (columns `COLUMNS`) are appended to `benchmarks/results/<name>.csv`. What
is measured and how: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.report.readme import View

MODES = ("forward", "backward", "full")
COLUMNS = ("name", "provider", "mode", "shape", "metric", "unit", "p50", "p20", "p80", "device")
COLUMNS += ("versions", "git_rev", "timestamp", "command")
COLUMNS_BEFORE_COMMAND = COLUMNS[:-1]  # older CSVs: append_csv adds the column (empty)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
H200_BF16_DENSE_TFLOPS = 989.0
# the environment of a training run a benchmark starts: one thread per process, offline
TRAIN_ENV = dict(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")


@dataclass
class Step:
    """One measurable call: `prepare()` untimed, then `run()` timed; `flops`: nominal, of `run`."""

    run: Callable[[], object]
    prepare: Callable[[], None] = lambda: None
    flops: float = 0.0
    measure_memory: bool = True
    note: str = ""  # appended to the `versions` column, e.g. "liger_path=chunk_forward"


def autograd_step(mode: str, forward, leaves, grads, flops: float = 0.0, note: str = "") -> Step:
    """The Step of mode forward | backward | full of `forward()` -> a tuple of outputs,
    differentiated with `grads` (one per output); `leaves` get their `.grad` cleared first."""
    import torch

    saved = {}

    def prepare():  # mode backward: the forward too, untimed
        for t in leaves:
            t.grad = None
        if mode == "backward":
            saved["outs"] = forward()

    backward = lambda outs: torch.autograd.backward(outs, grads[: len(outs)])
    run = dict(forward=forward, full=lambda: backward(forward()))
    run["backward"] = lambda: backward(saved.pop("outs"))
    return Step(run=run[mode], prepare=prepare, flops=flops, note=note)


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty sequence."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def row(metric: str, unit: str, values: Sequence[float], **fields) -> dict:
    """A row of `metric` with the p50/p20/p80 of `values`, plus `fields` (mode, shape, note)."""
    q = {f"p{p}": quantile(values, p / 100) for p in (50, 20, 80)}
    return dict(metric=metric, unit=unit, **q, **fields)


def rate_row(time_row: dict, amount: float, metric: str, unit: str, seconds_per_unit=1e-3) -> dict:
    """`amount` per second from a time row: its p20 is the rate at the p80 time and vice versa."""
    rate = lambda t: amount / (time_row[t] * seconds_per_unit)
    rates = dict(p50=rate("p50"), p20=rate("p80"), p80=rate("p20"))
    return dict(time_row, metric=metric, unit=unit, **rates)


def read_csv(path: Path) -> list[dict]:
    """All rows of a results CSV, p50/p20/p80 as floats (rows without them skipped), `command` ""
    where the CSV predates it."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            r = {k: (v or "") for k, v in r.items() if k is not None}
            try:
                r.update({k: float(r[k]) for k in ("p50", "p20", "p80")})
            except (KeyError, ValueError):
                continue  # a row without numbers (a truncated line)
            rows.append(dict(r, command=r.get("command", "")))
    return rows


def newest(rows: Sequence[dict]) -> dict[tuple, dict]:
    """(device, shape, mode, provider, metric) -> the newest row (by timestamp; ties: the later)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["device"], r["shape"], r["mode"], r["provider"], r["metric"])
        if key not in out or r["timestamp"] >= out[key]["timestamp"]:
            out[key] = r
    return out


def read_metrics(run: Path) -> list[dict]:
    """The rows of a training run's metrics.jsonl ([] before it has one)."""
    path = Path(run) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def train_command(ranks: int | None, *overrides: str) -> list[str]:
    """`prorl/train.py` with `overrides` under `torchrun --standalone` with `ranks` processes
    (None: in this interpreter, one process)."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [sys.executable, *(torchrun if ranks else []), "prorl/train.py", *overrides]


# --- Measurement (runs inside the worker process) -------------------------------------------------


def time_step(step: Step, device, warmup: int, reps: int) -> list[float]:
    """Seconds per `step.run()` for `reps` calls, after `warmup` untimed calls."""
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step.prepare()
        step.run()
    times = []
    for _ in range(reps):
        step.prepare()
        sync()
        t0 = time.perf_counter()
        out = step.run()
        sync()
        times.append(time.perf_counter() - t0)
        del out
    return times


class PeakMemory:
    """Peak memory (MB) between `start()` and `stop()` (docs/benchmarks.md): CUDA
    max_memory_allocated, CPU the resident-set mark VmHWM. `stop()` returns (peak, peak -
    baseline), or None on a CPU where the mark cannot be reset."""

    def __init__(self, device):
        self.device = device

    @staticmethod
    def _vm_hwm_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

    def start(self) -> None:
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated(self.device) / 2**20
            return torch.cuda.reset_peak_memory_stats(self.device)
        with contextlib.suppress(OSError, AttributeError):  # not glibc: a higher baseline
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            self.base = self._vm_hwm_mb()
        except OSError:
            self.base = None

    def stop(self) -> tuple[float, float] | None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.base is None:
            return None
        else:
            peak = self._vm_hwm_mb()
        return peak, peak - self.base


def peak_extra_memory_mb(step: Step, device) -> float | None:
    """Peak memory above the post-`prepare` baseline during one `step.run()`."""
    step.prepare()
    memory = PeakMemory(device)
    memory.start()
    out = step.run()
    peak = memory.stop()
    del out
    if peak is None:
        print("harness: /proc/self/clear_refs not writable: no CPU memory row", file=sys.stderr)
    return peak and peak[1]


def device_name(device) -> str:
    """The GPU's name, or the CPU model of /proc/cpuinfo; `device` a torch.device or its type."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def dist_version(dist: str, absent: str | None = "absent") -> str | None:
    """The installed version of the distribution `dist`, else `absent`."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return absent


def versions_string() -> str:
    """torch, triton and liger-kernel's versions and the thread settings (the `versions` column)."""
    import torch

    parts = [f"torch={torch.__version__}", f"triton={dist_version('triton')}"]
    parts += [f"liger-kernel={dist_version('liger-kernel')}", f"threads={torch.get_num_threads()}"]
    parts.append(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    policy = os.environ.get("OMP_WAIT_POLICY")
    return " ".join(parts + ([f"OMP_WAIT_POLICY={policy}"] if policy else []))


def measure_step(spec: dict, provider: str, mode: str, shape: dict, device) -> list[dict] | None:
    """The rows of one case of an op benchmark: its module's `build`, timed, memory measured."""
    step = importlib.import_module(spec["module"]).build(provider, mode, shape, device)
    if step is None:
        return None
    times = time_step(step, device, spec["warmup"], spec["reps"])
    rows = [row("time", "ms", [t * 1e3 for t in times])]
    if step.flops and device.type == "cuda":
        tflops = [step.flops / t / 1e12 for t in times]
        rows.append(row("tflops", "TFLOPS", tflops))
        rows.append(row("peak_fraction", "%", [100.0 * x / spec["peak_tflops"] for x in tflops]))
    elif step.flops:
        rows.append(row("gflops", "GFLOPS", [step.flops / t / 1e9 for t in times]))
    mb = peak_extra_memory_mb(step, device) if step.measure_memory else None
    if mb is not None:
        rows.append(row("peak_extra_memory", "MB", [mb]))
    return [dict(r, mode=mode, note=step.note) for r in rows]


def worker_main(argv: Sequence[str]) -> None:
    """Entry of the worker process: argv = [spec JSON, result path]. Measures one provider.

    Each (shape, mode) case is `spec["measure"]` ("module:function") called as (spec, provider,
    mode, shape, device) -> rows (None: no such case); a failing case is recorded as an error and
    the others still run. The result file is rewritten after every case, so a later crash (an OOM
    kill) keeps what was measured."""
    import torch

    spec, result_path = json.loads(argv[0]), argv[1]
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    module, func = spec["measure"].split(":")
    measure = getattr(importlib.import_module(module), func)
    provider = spec["provider"]
    res = dict(rows=[], errors=[], device=device_name(device), versions=versions_string())
    for shape in spec["shapes"]:
        for mode in spec["modes"]:
            tag = f"{provider} {mode} {shape['label']}"
            try:
                rows = measure(spec, provider, mode, shape, device)
                if rows is None:
                    continue
                res["rows"] += [dict(r, shape=shape["label"]) for r in rows]
                t = next(r for r in rows if r["mode"] == mode and r["metric"] == "time")
                spread = f"p20 {t['p20']:.3f}, p80 {t['p80']:.3f}"
                print(f"  {tag}: {t['p50']:.3f} ms ({spread})", flush=True)
            except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
                res["errors"].append(f"{tag}: {type(exc).__name__}: {exc}")
                print(f"  {tag}: FAILED {type(exc).__name__}: {exc}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            with open(result_path, "w") as f:
                json.dump(res, f)


# --- Orchestration (the parent process) -----------------------------------------------------------


def git_rev() -> str:
    opts = dict(cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    git = lambda *a: subprocess.run(["git", *a], **opts).stdout.strip()
    try:
        rev, dirty = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def utc_now() -> str:
    """The invocation's timestamp: UTC, ISO 8601, whole seconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def subprocess_env(threads: int) -> dict:
    """The environment of a child process: the thread count, and the repository root importable."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_provider(provider: str, spec: dict, timeout: float | None = None) -> dict:
    """Measure one provider in a fresh worker process (`worker_main`), given `spec` as JSON; its
    rows, errors, device and versions."""
    code = "import sys; from benchmarks.harness import worker_main; worker_main(sys.argv[1:])"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        argv = [sys.executable, "-c", code, json.dumps(dict(spec, provider=provider)), path]
        try:
            env = subprocess_env(spec["threads"])
            rc = subprocess.run(argv, cwd=REPO_ROOT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout} s"
        if not os.path.exists(path):
            return dict(rows=[], errors=[f"{provider}: worker exited without a result (rc={rc})"])
        with open(path) as f:
            res = json.load(f)
        if rc != 0:
            early = f"{provider}: worker exited early (rc={rc}); later cases are missing"
            res["errors"].append(early)
        return res


def command_line(argv: Sequence[str] | None = None) -> str:
    """The invocation as a shell command, from `argv` (default: this process's sys.argv): a script
    of the repository (`benchmarks/__main__.py`, `benchmarks/x.py`) or a package's __main__.py as
    `python -m <module>`, anything else by its file name."""
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0]:
        return ""
    head = Path(argv[0])
    prog = [head.name]
    if head.suffix == ".py":
        try:
            parts = list(head.resolve().relative_to(REPO_ROOT).with_suffix("").parts)
        except ValueError:
            parts = [head.parent.name, "__main__"] if head.name == "__main__.py" else []
        parts = parts[:-1] if parts[-1:] == ["__main__"] else parts
        prog = ["python", "-m", ".".join(parts)] if parts else prog
    return shlex.join(prog + argv[1:])


def append_csv(path: Path, rows: Sequence[dict]) -> None:
    """Append rows (dicts with COLUMNS keys) to `path`, writing the header when the file is new.

    A row without `command` gets `command_line()`. A CSV written before the `command` column existed
    is first rewritten with it (its old rows' command empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            header = tuple(next(csv.reader(f), []))
            old = list(csv.DictReader(f, fieldnames=header))
        if header == COLUMNS_BEFORE_COMMAND:
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
                writer.writeheader()
                writer.writerows(old)
            os.replace(tmp, path)
        elif header != COLUMNS:
            raise ValueError(f"{path} has columns {list(header)}, not {list(COLUMNS)}; use --out")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        command = command_line()
        for r in rows:
            r = {"command": command, **r}
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def run_benchmark(name: str, providers: Sequence[str], spec: dict, out: Path, timeout=None):
    """Measure every provider (one worker each), append all rows to `out`; return (rows, errors).
    spec: what the workers read (Benchmark.main's: module, shapes, modes, device, threads, reps,
    warmup, measure, options)."""
    spec = dict(spec, peak_tflops=H200_BF16_DENSE_TFLOPS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    spec["threads"] = spec["threads"] or cores
    cases = f"{len(providers)} providers x {list(spec['modes'])} x {len(spec['shapes'])} shapes"
    settings = f"threads={spec['threads']}, warmup={spec['warmup']}, reps={spec['reps']}"
    print(f"{name}: {cases} on {spec['device']}, {settings} -> {out}", flush=True)
    rows, errors, stamp = [], [], dict(name=name, git_rev=git_rev(), timestamp=utc_now())
    for provider in providers:
        print(f"[{provider}]", flush=True)
        res = run_provider(provider, spec, timeout)
        errors.extend(res["errors"])
        common = dict(stamp, provider=provider, device=res.get("device"))
        for r in res["rows"]:
            versions = res["versions"] + (f" note={r['note']}" if r.get("note") else "")
            rows.append(dict(r, versions=versions, **common))
    append_csv(out, rows)
    return rows, errors


def record(name: str, rows: list[dict], out: Path | None, *, device: str, versions: str, view=None):
    """Rows measured outside the workers (torchrun ranks, training runs) with the columns they share
    added (a row's own keys win), appended to `out` (None: not written), the summary printed."""
    from benchmarks.report.readme import summary

    stamp = utc_now()
    common = dict(name=name, device=device, versions=versions, git_rev=git_rev(), timestamp=stamp)
    rows = [dict(common, **r) for r in rows]
    if out is not None:
        append_csv(out, rows)
    print(summary(name, rows, view))
    return rows


def argparser(name: str, doc: str) -> argparse.ArgumentParser:
    """The parser of `python -m benchmarks <name>`, described by the first line of `doc`."""
    return argparse.ArgumentParser(f"python -m benchmarks {name}", description=doc.split("\n")[0])


def ints(text: str) -> list[int]:
    """An argparse `type`: comma-separated integers, as a list."""
    return [int(x) for x in text.split(",")]


def subset_of(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse `type`: a comma-separated subset of `choices`, as a list."""

    def parse(text: str) -> list[str]:
        unknown = [x for x in text.split(",") if x not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {tuple(choices)}")
        return text.split(",")

    return parse


def prorl_backend(provider: str, device) -> str:
    """The backend of provider `prorl` (Triton on CUDA, native on the CPU) or `prorl-torch`."""
    if provider.endswith("-torch"):
        return "torch"
    return "triton" if device.type == "cuda" else "native"


@dataclass
class Benchmark:
    """A benchmark's command line: `main(argv)` parses it, runs the providers in their workers,
    appends the rows to the CSV, prints the summary (`view`, then `notes`) and plots. Every one has
    --threads --providers --reps --warmup --timeout --out, --modes with more than one mode and
    --no-plot when it plots; `options` adds --quick and its own; `--gpu` or `--device cuda` means
    CUDA. providers: the defaults (a sequence, which --providers must be a subset of unless
    `known_providers` says otherwise, or a function of the options). derive(rows, args): rows
    computed from the measured ones, appended too. plot(csv, rows, args) -> the PNG paths."""

    name: str
    providers: Sequence[str] | Callable[[argparse.Namespace], Sequence[str]]
    shapes: Callable[[argparse.Namespace], list[dict]]
    options: Callable[[argparse.ArgumentParser], None]
    known_providers: Sequence[str] = ()
    modes: Sequence[str] = ("full",)
    reps: tuple[int, int] = (5, 2)  # timed calls: default, --quick
    warmup: tuple[int, int] = (1, 1)  # untimed calls: default, --quick
    threads: int | None = None  # default: every core
    derive: Callable[[list[dict], argparse.Namespace], list[dict]] | None = None
    view: View | None = None
    notes: Sequence[str] | Callable[[argparse.Namespace], list[str]] = ()
    plot: Callable[[Path, list[dict], argparse.Namespace], list[Path]] | None = None
    measure: str = "benchmarks.harness:measure_step"  # worker_main's measure of one case

    def parser(self) -> argparse.ArgumentParser:
        p = argparser(self.name, importlib.import_module(f"benchmarks.{self.name}").__doc__)
        add = p.add_argument
        self.options(p)
        known = self.known_providers or ([] if callable(self.providers) else self.providers)
        threads = f"torch/OMP threads (default {self.threads or 'all cores'})"
        add("--threads", type=int, default=self.threads, help=threads)
        add("--providers", type=subset_of(known) if known else lambda s: s.split(","))
        if len(self.modes) > 1:
            add("--modes", type=subset_of(self.modes), default=",".join(self.modes))
        (r, qr), (w, qw) = self.reps, self.warmup
        add("--reps", type=int, help=f"timed calls (default {r}, --quick {qr})")
        add("--warmup", type=int, help=f"untimed calls first (default {w}, --quick {qw})")
        add("--timeout", type=float, help="seconds per provider worker")
        add("--out", help=f"CSV to append to (default benchmarks/results/{self.name}.csv)")
        if self.plot:
            add("--no-plot", action="store_true", help="write no PNG")
        return p

    def main(self, argv: Sequence[str] | None = None) -> int:
        from benchmarks.report.readme import summary

        p = self.parser()
        args = p.parse_args(argv)
        out = Path(args.out) if args.out else RESULTS_DIR / f"{self.name}.csv"
        gpu = getattr(args, "gpu", False)
        device = "cuda" if gpu else getattr(args, "device", "cpu")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                p.error(f"{'--gpu' if gpu else '--device cuda'} needs a visible CUDA device")
        providers = self.providers(args) if callable(self.providers) else self.providers
        spec = dict(module=f"benchmarks.{self.name}", shapes=self.shapes(args), options=vars(args))
        spec.update(device=device, modes=getattr(args, "modes", self.modes), measure=self.measure)
        spec.update(threads=args.threads, reps=args.reps or self.reps[args.quick])
        spec.update(warmup=self.warmup[args.quick] if args.warmup is None else args.warmup)
        run = args.providers or providers
        rows, errors = run_benchmark(self.name, run, spec, out, args.timeout)
        derived = self.derive(rows, args) if self.derive else []
        if derived:
            append_csv(out, derived)
        print(summary(self.name, rows + derived, self.view))
        for note in self.notes(args) if callable(self.notes) else self.notes:
            print(f"note: {note}")
        if rows and self.plot and not args.no_plot:
            try:
                for png in self.plot(out, rows + derived, args):
                    print(f"plot: {png}")
            except ImportError as exc:  # matplotlib is optional; the CSV is written either way
                print(f"no plot: {exc}", file=sys.stderr)
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 1 if errors and not rows else 0
