"""The prorl_v2_1.5b preset in miniature under `torchrun --nproc_per_node=1` (NCCL on a GPU, gloo
on the CPU), one step of benchmarks/gpu_check.sh per variant (`VARIANTS`: base, fp8, offload);
writes RESULTS/preset_<variant>.json, exits 1 naming the first failed check. Details:
docs/benchmarks.md.

    python benchmarks/gpu/preset_check.py --variant base --results DIR --runs /tmp/runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELPERS = os.path.join(ROOT, "tests", "helpers")
SHORT = ["trainer.total_steps=2", "trainer.save_every=0", "trainer.val_before_train=false"]
SHORT += ["trainer.val_every=0"]
VARIANTS = {
    "base": ["trainer.total_steps=2", "trainer.save_every=2", "trainer.val_every=2"],
    "fp8": ["model.fp8=torchao", *SHORT],
    "offload": ["model.cpu_offload=true", *SHORT],
}


class CheckFailed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def launch(out: str, overrides: list[str], log_path: str) -> float:
    """One `torchrun --standalone --nproc_per_node=1 prorl/train.py --config prorl_v2_1.5b ...`;
    seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += ["prorl/train.py", "--config", "prorl_v2_1.5b", *overrides, f"output_dir={out}"]
    print("$", " ".join(cmd), flush=True)
    path = os.pathsep.join(p for p in (HELPERS, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    with open(log_path, errors="replace") as f:
        print(f.read()[-4000:], flush=True)
    check(rc == 0, f"train.py exited {rc} after {seconds:.0f} s (log {log_path})")
    return round(seconds, 1)


def rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(variant: str, results: str, runs: str) -> dict:
    sys.path.insert(0, HELPERS)
    from preset_helpers import preset_overrides, write_bf16_untied_checkpoint, write_data

    base = os.path.join(runs, f"preset-{variant}")
    shutil.rmtree(
        base, ignore_errors=True
    )  # a warm machine keeps an earlier call's run: it resumes
    os.makedirs(base)
    ckpt = write_bf16_untied_checkpoint(os.path.join(base, "ckpt"))
    overrides = [*preset_overrides(ckpt, *write_data(base)), *VARIANTS[variant]]
    out, logs = os.path.join(base, "run"), os.path.join(results, "logs")
    os.makedirs(logs, exist_ok=True)
    numbers = dict(
        variant=variant, launch_s=[launch(out, overrides, f"{logs}/preset_{variant}_1.log")]
    )
    if variant == "base":  # the same command to step 3: it must resume from step 2's checkpoint
        again = [o for o in overrides if not o.startswith("trainer.total_steps=")]
        numbers["launch_s"].append(
            launch(out, [*again, "trainer.total_steps=3"], f"{logs}/preset_{variant}_2.log")
        )
        with open(f"{logs}/preset_{variant}_2.log", errors="replace") as f:
            resumed = "prorl: resumed from" in f.read()
        check(resumed, "the second launch did not resume from step 2's checkpoint")
    steps = [r for r in rows(out) if r.get("step", 0) >= 1 and "actor/pg_loss" in r]
    want = 3 if variant == "base" else 2
    got = [r["step"] for r in steps]
    check(got == list(range(1, want + 1)), f"steps {got}, not 1..{want}")
    for r in steps:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_mean"):
            check(math.isfinite(float(r[key])), f"step {r['step']}: {key} = {r[key]}")
    numbers["step_s"] = [round(float(r.get("timing_s/step", float("nan"))), 3) for r in steps]
    numbers["grad_norm"] = [round(float(r["actor/grad_norm"]), 6) for r in steps]
    if variant == "base":
        reason = steps[1].get("ref/reset_reason")
        check(reason == "interval", f"no reference reset after step 2: {reason!r}")
        vals = [r["val/accuracy"] for r in rows(out) if "val/accuracy" in r]
        check(len(vals) >= 2, f"validation ran {len(vals)} times, expected before and at step 2")
        numbers["val_accuracy"] = [round(v, 4) for v in vals]
        from safetensors.torch import load_file

        final = load_file(os.path.join(out, "checkpoints", "final", "model.safetensors"))
        tied = (final["lm_head.weight"] == final["model.embed_tokens.weight"]).all()
        check(not tied, "the exported head is tied")
    return numbers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument(
        "--results", required=True, help="where preset_<variant>.json and the logs go"
    )
    parser.add_argument(
        "--runs", default="/tmp/prorl-gpu-runs", help="the runs' output directories"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.results, exist_ok=True)
    try:
        numbers = run(args.variant, args.results, args.runs)
    except CheckFailed as exc:
        print(f"preset {args.variant}: FAILED: {exc}", flush=True)
        return 1
    with open(os.path.join(args.results, f"preset_{args.variant}.json"), "w") as f:
        json.dump(numbers, f, indent=1)
    shown = ", ".join(f"{k} {v}" for k, v in numbers.items() if k != "variant")
    print(f"preset {args.variant}: ok: {shown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
