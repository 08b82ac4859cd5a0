"""The one prepared run for a lent GPU machine: `bash benchmarks/gpu_check.sh [RESULTS_DIR]`.

Made for one H200 without network, the image's torch and at most 64 MiB of carried wheels (`.whl/`,
the device tool's `carry`): steps (benchmarks/gpu/plan.py) run most crash-prone first, each under
its own limit, all within `GPU_CHECK_DEADLINE` (335 s); then one summary table. Exit 1 when a step
failed or timed out, 2 at once without CUDA. `GPU_CHECK_ONLY=a,b` / `GPU_CHECK_SKIP=a,b` select
steps. Written to RESULTS_DIR (default `$OUT`, else benchmarks/results/gpu/): gpu_check.log,
gpu_check_summary.md / .json, logs/<step>.log, preset_*.json, benchmark CSVs. The wheels to carry,
and how to make them: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 335  # s from the start for everything; + a last step's kill grace: under 6 minutes
MIN_STEP_S = 20  # with less left a step is skipped (unless its own limit is lower)
KILL_GRACE_S = 10  # SIGTERM, then this long before SIGKILL (torchrun passes SIGTERM to its ranks)
SITE = "/tmp/prorl-gpu-site"  # carried wheels go here (the image's site-packages stay as they are)
RUNS = "/tmp/prorl-gpu-runs"  # the preset runs' output directories (off RESULTS_DIR)
TAIL_LINES = 25  # of a failed step's log, printed under its end line

# torch's own answer, before anything is installed: [version, CUDA build, a device is usable]
CUDA_PROBE = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, torch.cuda.is_available()]))"  # noqa: E501
PROBE = r"""
import importlib, importlib.util, json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.cuda.is_available()
    out["cuda_version"] = torch.version.cuda
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name()
except Exception as exc:
    out["torch"], out["cuda"] = f"unimportable: {exc}", False
for name in ("triton", "transformers", "omegaconf", "math_verify", "safetensors", "matplotlib",
             "transformer_engine", "flash_attn", "vllm", "liger_kernel"):
    spec = importlib.util.find_spec(name)
    out[name] = None
    if spec is not None:
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception as exc:
            out[name] = None
            out[name + "_error"] = str(exc)[:200]
try:
    import torchao.float8  # noqa: F401 - what model.fp8=torchao needs
    import torchao
    out["torchao"] = torchao.__version__
except Exception as exc:
    out["torchao"], out["torchao_error"] = None, str(exc)[:200]
print(json.dumps(out))
"""


@dataclasses.dataclass
class Step:
    """One check: `cmd` run from the repository root under `limit_s`, unless `skip` says why not."""

    name: str
    limit_s: float
    cmd: list[str]
    what: str  # one line for the table
    skip: str | None = None  # the reason it cannot run here


@dataclasses.dataclass
class Row:
    name: str
    status: str  # ok | FAIL | TIMEOUT | skipped
    seconds: float
    note: str


class Output:
    """print() to stdout and to the run's own log file."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")


def results_dir(argv: list[str]) -> str:
    return os.path.abspath(
        argv[0] if argv else os.environ.get("OUT") or os.path.join(ROOT, "benchmarks/results/gpu")
    )


def step_env() -> dict:
    """The environment of every step: offline, unbuffered, carried wheels and test helpers
    importable."""
    old = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [SITE, os.path.join(ROOT, "tests/helpers"), *filter(None, [old])]
        ),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"),
    )


def run_step(step: Step, logs: str, left_s: float, say: Callable) -> Row:
    """Run one step, its output in logs/<name>.log; kill its whole process group at its limit."""
    if step.skip:
        say(f"=== [{step.name}] skipped: {step.skip}")
        return Row(step.name, "skipped", 0.0, step.skip)
    limit = min(step.limit_s, left_s)
    if left_s < min(MIN_STEP_S, step.limit_s):
        reason = f"{left_s:.0f} s left of the budget (GPU_CHECK_DEADLINE), it needs up to {step.limit_s:.0f} s"
        say(f"=== [{step.name}] skipped: {reason}")
        return Row(step.name, "skipped", 0.0, reason)
    log_path = os.path.join(logs, f"{step.name}.log")
    say(f"=== [{step.name}] start, limit {limit:.0f} s: {' '.join(step.cmd)}")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            step.cmd,
            cwd=ROOT,
            env=step_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _RUNNING.append(proc)
        try:
            rc = proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        finally:
            _RUNNING.remove(proc)
    seconds = time.monotonic() - t0
    if timed_out:
        status, note = "TIMEOUT", f"ran past its {limit:.0f} s limit"
    elif rc == 0:
        status, note = "ok", _last_line(log_path)
    else:
        status, note = "FAIL", f"exit {rc}: {_last_line(log_path)}"
    say(f"=== [{step.name}] {status} in {seconds:.0f} s ({note})")
    if status != "ok":
        with open(log_path, errors="replace") as f:
            for line in f.read().splitlines()[-TAIL_LINES:]:
                say(f"    | {line[:300]}")
    return Row(step.name, status, seconds, note)


_RUNNING: list[subprocess.Popen] = []  # the step running now (its own session: killed as a group)


def _stop(signum, frame) -> None:
    """SIGTERM / SIGINT of the runner (the device tool's limit, ^C): the running step's group
    too."""
    for proc in list(_RUNNING):
        _kill_group(proc)
    raise SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(path: str) -> str:
    """The step's last non-empty output line (pytest's counts, a preset's numbers), shortened."""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


def run_steps(steps: list[Step], results: str, end: float, say: Callable) -> list[Row]:
    """Run `steps` in order, each within what is left until `end` (a time.monotonic() value)."""
    logs = os.path.join(results, "logs")
    os.makedirs(logs, exist_ok=True)
    return [run_step(step, logs, end - time.monotonic(), say) for step in steps]


def summary(rows: list[Row], steps: list[Step]) -> str:
    """The table: one line per step, in the order they ran."""
    what = {s.name: s.what for s in steps}
    lines = ["| step | status | s | checks | result |", "|---|---|---|---|---|"]
    for r in rows:
        note = r.note.replace("|", "/")
        lines.append(
            f"| {r.name} | {r.status} | {r.seconds:.0f} | {what.get(r.name, '')} | {note} |"
        )
    bad = [r.name for r in rows if r.status in ("FAIL", "TIMEOUT")]
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "FAIL", "TIMEOUT", "skipped")}
    lines.append("")
    lines.append(
        ", ".join(f"{n} {s}" for s, n in counts.items())
        + (f"; failed: {', '.join(bad)}" if bad else "")
    )
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status in ("FAIL", "TIMEOUT") for r in rows) else 0


def select(steps: list[Step], only: str, skip: str) -> list[Step]:
    """GPU_CHECK_ONLY / GPU_CHECK_SKIP (comma-separated step names) as skips with their reason."""
    only_set = {s.strip() for s in only.split(",") if s.strip()}
    skip_set = {s.strip() for s in skip.split(",") if s.strip()}
    for step in steps:
        if step.name in skip_set or (only_set and step.name not in only_set):
            step.skip = step.skip or "left out (GPU_CHECK_ONLY / GPU_CHECK_SKIP)"
    return steps


def no_gpu(why: str) -> int:
    print(
        f"gpu_check: no GPU here ({why}): this check is for a CUDA machine; nothing was run. "
        "The CPU suite is `python -m pytest`.",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    end = t0 + float(os.environ.get("GPU_CHECK_DEADLINE", DEADLINE_S))
    python = os.environ.get("PYTHON", sys.executable)
    if not glob.glob("/dev/nvidia[0-9]*") and shutil.which("nvidia-smi") is None:
        return no_gpu("no /dev/nvidia*, no nvidia-smi")  # at once: not even torch is imported
    cmd = [python, "-c", CUDA_PROBE]
    probe = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    torch_version, cuda_build, cuda = (
        json.loads(probe.stdout) if probe.returncode == 0 else ("?", None, False)
    )
    if not cuda:
        return no_gpu(f"torch {torch_version} (CUDA build {cuda_build}) sees no CUDA device")
    results = results_dir(argv)
    os.makedirs(results, exist_ok=True)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(results, python, end, t0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(results: str, python: str, end: float, t0: float) -> int:
    from benchmarks.gpu.plan import install_steps, plan

    say = Output(os.path.join(results, "gpu_check.log"))
    smi = [
        "nvidia-smi",
        "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
        "--format=csv,noheader",
    ]
    if shutil.which("nvidia-smi"):
        say(subprocess.run(smi, capture_output=True, text=True, check=False).stdout.strip())
    installed = run_steps(install_steps(python), results, end, say)
    if any(r.status != "ok" for r in installed):
        say("gpu_check: the install failed (logs/install.log): nothing else can run")
        return 1
    # what the steps will see, carried wheels included: versions, and what is missing (then skipped)
    cmd = [python, "-c", PROBE]
    probe = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=step_env())
    env = {"cuda": True}
    if probe.returncode == 0:
        env = json.loads(probe.stdout.strip().splitlines()[-1])
    say("=== machine:", json.dumps(env))
    steps = select(
        plan(python, env, results),
        os.environ.get("GPU_CHECK_ONLY", ""),
        os.environ.get("GPU_CHECK_SKIP", ""),
    )
    rows = run_steps(steps, results, end, say)
    table = summary(installed + rows, install_steps(python) + steps)
    say("=== summary (" + f"{time.monotonic() - t0:.0f} s in all)\n" + table)
    with open(os.path.join(results, "gpu_check_summary.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(results, "gpu_check_summary.json"), "w") as f:
        rows_json = [dataclasses.asdict(r) for r in installed + rows]
        json.dump({"machine": env, "rows": rows_json}, f, indent=1)
    return exit_code(rows)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
