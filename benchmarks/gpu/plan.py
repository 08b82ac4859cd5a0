"""What `benchmarks/gpu_check.sh` runs, in order (benchmarks/gpu/check.py runs it).

First the paths no GPU has run yet (asynchronous RL on CUDA, the preset on NCCL, FP8), whose limits
together fit the deadline (`PRIORITY_S`), then the other CUDA checks and benchmark rows, each only
while its whole limit is left. Limits are ceilings sized from the H200 runs (docs/benchmarks.md).
"""

from __future__ import annotations

import glob
import os

from benchmarks.gpu.check import ROOT, RUNS, SITE, Step

# the GPU's rules enforced: FP8 shapes, device placement, validation batching (may not exist yet)
GPU_RULES = "tests/gpu/test_gpu_rules.py"


# the never-run steps: with the install they must fit check.DEADLINE_S with their whole limits
NEVER_RUN = ("async_rl", "preset", "preset_fp8")


def install_steps(python: str) -> list[Step]:
    """Carried wheels into SITE, then prorl editable, without the native CPU build or fetching."""
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    pip = f"{python} -m pip install -q --no-index --no-deps --no-build-isolation"
    script = [
        f"{pip} --no-compile --upgrade --target {SITE} {' '.join(wheels)}" if wheels else "true",
        f"PRORL_TARGET_DEVICE=none {pip} -e .",
        f"{python} -c 'import prorl.trainer, prorl.kernels; print(\"prorl imports ok\")'",
    ]
    what = f"{len(wheels)} carried wheels, prorl editable"
    return [Step("install", 60, ["bash", "-c", " && ".join(script)], what)]


def plan(python: str, env: dict, results: str) -> list[Step]:
    """The steps for a machine described by `env` (check.PROBE's answer), most crash-prone first."""

    def pytest(name: str, *args: str) -> list[str]:
        return [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--durations=5",
                f"--junitxml={results}/logs/{name}.xml", *args]  # fmt: skip

    why = env.get("torchao_error", "absent")
    torchao = (
        None
        if env.get("torchao")
        else f"torchao is not importable ({why}): carry its wheel in .whl/"
    )
    preset = [python, "benchmarks/gpu/preset_check.py", "--results", results, "--runs", RUNS]
    bench = [python, "-m", "benchmarks"]
    named = {GPU_RULES, "tests/gpu/test_fp8_cuda.py", "tests/gpu/test_cuda_paths.py"}
    files = glob.glob(os.path.join(ROOT, "tests/gpu/test_*.py"))
    others = sorted({os.path.relpath(f, ROOT) for f in files} - named)
    rules = (
        None
        if os.path.exists(os.path.join(ROOT, GPU_RULES))
        else f"{GPU_RULES} is not in this tree"
    )
    no_vllm = "" if env.get("vllm") else "; vLLM's own batching: not installable here (CUDA vLLM)"
    attention = ["tests/engine/test_attention.py", "-k", "cuda or flex_eager or flash_matches"]
    main_job = (f"rm -rf {RUNS}/default && exec {python} -m torch.distributed.run --standalone"
                f" --nproc_per_node=1 prorl/train.py output_dir={RUNS}/default"
                " trainer.total_steps=30 trainer.val_every=30 trainer.save_every=0")  # fmt: skip
    async_rl = ["async_rl", "--variants", "async-k1", "--steps", "30", "--val-every", "30",
                "--work", f"{RUNS}/async_rl", "--out", f"{results}/async_rl.csv"]  # fmt: skip
    ppo = ["ppo_loss", "--device", "cuda", "--reps", "20", "--warmup", "3"]
    llpe = ["linear_logprob_entropy", "--gpu", "--warmup", "1", "--reps", "3", "--timeout", "25",
            "--shape", "16384,1536,151936", "--providers",
            "prorl,naive" + (",liger-flce" if env.get("liger_kernel") else "")]  # fmt: skip
    steps = [
        # never run on a GPU: these three first, their limits with the install's within the deadline
        Step("async_rl", 75, [*bench, *async_rl], "asynchronous RL on cuda:0: 1 rollout + 1 trainer"
             " process, k=1, 30 steps"),
        Step("preset", 120, [*preset, "--variant", "base"],
             "the preset in miniature on NCCL, 1 rank: bf16 untied head, FSDP2, AC, validation, "
             "reset, save, resume" + no_vllm),
        Step("preset_fp8", 75, [*preset, "--variant", "fp8"],
             "the preset in miniature, model.fp8=torchao, odd packed token counts, NCCL", torchao),
        # then while each whole limit is left
        Step("fp8_cuda", 60, pytest("fp8_cuda", "tests/gpu/test_fp8_cuda.py"),
             "torchao's real FP8 GEMMs vs float64; TE when installed", torchao),
        Step("preset_offload", 75, [*preset, "--variant", "offload"],
             "the preset with model.cpu_offload=true (FSDP2 CPUOffloadPolicy; NCCL + gloo)"),
        Step("gpu_rules", 90, pytest("gpu_rules", GPU_RULES), "CUDA's rules: FP8 odd token counts,"
             " offload probe device, validation batching", rules),
        Step("cuda_paths", 110, pytest("cuda_paths", "tests/gpu/test_cuda_paths.py"),
             "compiled Triton kernels vs float64, no host sync, sampler vs HF, trainer on CUDA"),
        Step("gpu_other", 60, pytest("gpu_other", *others), "the other files of tests/gpu",
             None if others else "no other file in tests/gpu"),
        # only the CUDA cases: test_flex_compiled_matches_reference compiles for the CPU (~40 s)
        Step("attention", 60, pytest("attention", *attention),
             "SDPA and FlexAttention forward and backward on CUDA (flash-attn: not installable)"),
        # a warm machine keeps an earlier call's run directory: start afresh
        Step("main_job", 70, ["bash", "-c", main_job],
             "the embedded default on cuda:0, 30 of its 150 steps (accuracy before/after)"),
        Step("ppo_loss", 45, [*bench, *ppo, "--out", f"{results}/ppo_loss.csv"],
             "ppo_loss rows on CUDA"),
        Step("llpe", 60, [*bench, *llpe, "--out", f"{results}/linear_logprob_entropy.csv"],
             "linear_logprob_entropy rows at the 1.5B shape"),
    ]  # fmt: skip
    missing = [n for n in ("omegaconf", "math_verify") if env.get(n) is None]
    for step in steps if missing else []:
        if step.name.startswith(("preset", "main_job", "async_rl")) and not step.skip:
            step.skip = (
                f"{', '.join(missing)} not importable: carry the wheels (benchmarks/gpu/check.py)"
            )
    return steps
