"""The one prepared run for a lent GPU machine: `bash benchmarks/gpu_check.sh [RESULTS_DIR]`.

Steps (benchmarks/gpu/plan.py) run the never-run paths first, each under its own limit, all within
`GPU_CHECK_DEADLINE` (335 s): a step starts only while its whole limit is left, else it is reported
skipped. Then one summary table, headed by the stack it certified (torch, CUDA, which of vLLM, TE
and flash-attn were there). Exit 1 when a step failed or timed out, 2 at once without CUDA.
`GPU_CHECK_ONLY=a,b` / `GPU_CHECK_SKIP=a,b` select steps. What it writes, and the wheels to carry:
docs/benchmarks.md.
"""

from __future__ import annotations

import ast
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
KILL_GRACE_S = 10  # SIGTERM, then this long before SIGKILL (torchrun passes SIGTERM to its ranks)
SITE = "/tmp/prorl-gpu-site"  # carried wheels go here (the image's site-packages stay as they are)
RUNS = "/tmp/prorl-gpu-runs"  # the preset runs' output directories (off RESULTS_DIR)
TAIL_LINES = 25  # of a failed step's log, printed under its end line

# torch's own answer, before anything is installed: [version, CUDA build, a device is usable]
CUDA_PROBE = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, "
CUDA_PROBE += "torch.cuda.is_available()]))"
# what the steps will see, carried wheels included: versions, the import errors of what is missing
PROBE = r"""
import importlib, json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.cuda.is_available())
    out["cuda_version"] = torch.version.cuda
    out["gpu"] = torch.cuda.get_device_name() if out["cuda"] else None
except Exception as exc:
    out["torch"], out["cuda"] = f"unimportable: {exc}", False
for name in ("triton", "transformers", "omegaconf", "math_verify", "safetensors", "matplotlib",
             "transformer_engine", "flash_attn", "vllm", "liger_kernel", "torchao.float8"):
    try:  # torchao.float8: what model.fp8=torchao needs, recorded as torchao
        importlib.import_module(name)
        out[name.split(".")[0]] = getattr(sys.modules[name.split(".")[0]], "__version__", "present")
    except Exception as exc:
        out[name.split(".")[0]] = None
        # not installed at all: no error to record; a missing part of it (a compiled extension,
        # a dependency) is recorded
        absent = isinstance(exc, ModuleNotFoundError) and exc.name == name.split(".")[0]
        if not absent or name == "torchao.float8":
            out[name.split(".")[0] + "_error"] = str(exc)[:200]
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


def step_env() -> dict:
    """The environment of every step: offline, unbuffered, carried wheels and test helpers
    importable."""
    path = [
        SITE,
        os.path.join(ROOT, "tests/helpers"),
        *filter(None, [os.environ.get("PYTHONPATH")]),
    ]
    env = dict(PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    threads = os.environ.get("OMP_NUM_THREADS", "4")
    return dict(os.environ, **env, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=threads)


def run_step(step: Step, logs: str, left_s: float, say: Callable, clock: Callable = time.monotonic):
    """Run one step, its output in logs/<name>.log; kill its whole process group at its limit.
    A step starts only with its whole limit left (`left_s`): a step cut short by the budget would
    read as TIMEOUT, a failure that is not one."""
    limit, skip = step.limit_s, step.skip
    if not skip and left_s < step.limit_s:
        skip = f"{max(left_s, 0):.0f} s left of the budget (GPU_CHECK_DEADLINE), it needs up to "
        skip += f"{step.limit_s:.0f} s"
    if skip:
        say(f"=== [{step.name}] skipped: {skip}")
        return Row(step.name, "skipped", 0.0, skip)
    log_path = os.path.join(logs, f"{step.name}.log")
    t0 = clock()
    say(f"=== [{step.name}] start, limit {limit:.0f} s: {' '.join(step.cmd)}")
    with open(log_path, "w") as log:
        io = dict(cwd=ROOT, env=step_env(), stdout=log, stderr=subprocess.STDOUT)
        proc = subprocess.Popen(step.cmd, **io, start_new_session=True)  # its own process group
        _RUNNING.append(proc)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = _kill_group(proc)
        finally:
            _RUNNING.remove(proc)
    with open(log_path, errors="replace") as f:
        lines = f.read().splitlines()
    last = next((line.strip()[:160] for line in reversed(lines) if line.strip()), "(no output)")
    status, note = ("ok", last) if rc == 0 else ("FAIL", f"exit {rc}: {last}")
    if rc == "timeout":
        status, note = "TIMEOUT", f"ran past its {limit:.0f} s limit"
    seconds = clock() - t0
    say(f"=== [{step.name}] {status} in {seconds:.0f} s ({note})")
    for line in lines[-TAIL_LINES:] if status != "ok" else []:
        say(f"    | {line[:300]}")
    return Row(step.name, status, seconds, note)


_RUNNING: list[subprocess.Popen] = []  # the step running now (its own session: killed as a group)


def _stop(signum, frame) -> None:
    """SIGTERM / SIGINT of the runner (the device tool's limit, ^C): the running step's group
    too."""
    for proc in list(_RUNNING):
        _kill_group(proc)
    raise SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> str:
    """SIGTERM to the step's own process group, SIGKILL after KILL_GRACE_S; returns "timeout"."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    return "timeout"


def run_steps(
    steps: list[Step], results: str, end: float, say: Callable, clock: Callable = time.monotonic
) -> list[Row]:
    """Run `steps` in order, each only while its whole limit is left until `end` (a `clock()`
    value; tests pass a fake clock)."""
    logs = os.path.join(results, "logs")
    os.makedirs(logs, exist_ok=True)
    return [run_step(step, logs, end - clock(), say, clock) for step in steps]


def pinned_gpu_stack() -> dict[str, str]:
    """setup.py's `gpu` extra as {distribution: version}: the stack the GPU paths target."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "gpu":
                    pins = [ast.literal_eval(v).split("==") for v in value.elts]
                    return {name.split("[")[0]: version for name, version in pins}
    return {}


# the probe's key for each distribution of the `gpu` extra
PROBE_KEYS = {"torch": "torch", "vllm": "vllm", "transformer-engine": "transformer_engine"}
PROBE_KEYS["flash-attn"] = "flash_attn"


def stack_line(env: dict, pinned: dict[str, str]) -> str:
    """What this run certified: the probe's torch, CUDA and GPU, which of vLLM / TE / flash-attn
    were importable, and how that differs from the pinned `gpu` extra."""
    gpu = f" on {env['gpu']}" if env.get("gpu") else ""
    head = f"certified stack: torch {env.get('torch', '?')} (CUDA {env.get('cuda_version')}){gpu}"
    have = []
    for dist, key in PROBE_KEYS.items():
        if dist != "torch":
            have.append(f"{dist} {env.get(key) or 'absent'}")
    differs = [f"{d} {v}" for d, v in pinned.items() if env.get(PROBE_KEYS.get(d, d)) != v]
    verdict = (
        "the pinned `gpu` extra exactly"
        if not differs
        else (f"not the pinned `gpu` extra: {', '.join(differs)} untested")
    )
    return f"{head}; {', '.join(have)}; {verdict}"


def summary(rows: list[Row], steps: list[Step], stack: str | None = None) -> str:
    """The table: the stack line (when given), then one line per step, in the order they ran."""
    what = {s.name: s.what for s in steps}
    lines = [stack, ""] if stack else []
    lines += ["| step | status | s | checks | result |", "|---|---|---|---|---|"]
    for r in rows:
        note = r.note.replace("|", "/")
        lines.append(
            f"| {r.name} | {r.status} | {r.seconds:.0f} | {what.get(r.name, '')} | {note} |"
        )
    bad = [r.name for r in rows if r.status in ("FAIL", "TIMEOUT")]
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "FAIL", "TIMEOUT", "skipped")}
    tail = ", ".join(f"{n} {s}" for s, n in counts.items())
    return "\n".join(lines + ["", tail + (f"; failed: {', '.join(bad)}" if bad else "")])


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status in ("FAIL", "TIMEOUT") for r in rows) else 0


def select(steps: list[Step], only: str, skip: str) -> list[Step]:
    """GPU_CHECK_ONLY / GPU_CHECK_SKIP (comma-separated step names) as skips with their reason."""
    names = lambda text: {s.strip() for s in text.split(",") if s.strip()}
    only_set, skip_set = names(only), names(skip)
    for step in steps:
        if step.name in skip_set or (only_set and step.name not in only_set):
            step.skip = step.skip or "left out (GPU_CHECK_ONLY / GPU_CHECK_SKIP)"
    return steps


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    end = t0 + float(os.environ.get("GPU_CHECK_DEADLINE", DEADLINE_S))
    python = os.environ.get("PYTHON", sys.executable)
    why = "no /dev/nvidia*, no nvidia-smi"  # then at once: not even torch is imported
    if glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi"):
        probe = subprocess.run(
            [python, "-c", CUDA_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        version, build, cuda = json.loads(probe.stdout) if probe.returncode == 0 else ("?", None, 0)
        why = None if cuda else f"torch {version} (CUDA build {build}) sees no CUDA device"
    if why:
        tail = (
            "this check is for a CUDA machine; nothing was run. The CPU suite: `python -m pytest`."
        )
        print(f"gpu_check: no GPU here ({why}): {tail}", file=sys.stderr)
        return 2
    out = argv[0] if argv else os.environ.get("OUT") or os.path.join(ROOT, "benchmarks/results/gpu")
    results = os.path.abspath(out)
    os.makedirs(results, exist_ok=True)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(results, python, end, t0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(results: str, python: str, end: float, t0: float) -> int:
    from benchmarks.gpu.plan import install_steps, plan

    log = open(os.path.join(results, "gpu_check.log"), "a", buffering=1)
    say = lambda *parts: [print(*parts, flush=True), print(*parts, file=log)]
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,memory.total,driver_version,clocks.max.sm"
        smi = ["nvidia-smi", query, "--format=csv,noheader"]
        say(subprocess.run(smi, capture_output=True, text=True, check=False).stdout.strip())
    installed = run_steps(install_steps(python), results, end, say)
    if any(r.status != "ok" for r in installed):
        say("gpu_check: the install failed (logs/install.log): nothing else can run")
        return 1
    probe = subprocess.run(
        [python, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=step_env()
    )
    env = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {}
    env = env or {"cuda": True}
    say("=== machine:", json.dumps(env))
    only, skip = (os.environ.get(f"GPU_CHECK_{k}", "") for k in ("ONLY", "SKIP"))
    steps = select(plan(python, env, results), only, skip)
    rows = run_steps(steps, results, end, say)
    stack = stack_line(env, pinned_gpu_stack())
    table = summary(installed + rows, install_steps(python) + steps, stack)
    say("=== summary (" + f"{time.monotonic() - t0:.0f} s in all)\n" + table)
    with open(os.path.join(results, "gpu_check_summary.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(results, "gpu_check_summary.json"), "w") as f:
        rows_json = [dataclasses.asdict(r) for r in installed + rows]
        json.dump({"machine": env, "stack": stack, "rows": rows_json}, f, indent=1)
    return exit_code(rows)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
