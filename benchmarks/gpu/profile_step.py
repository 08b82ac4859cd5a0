"""Where prorl's RL step spends its time on a GPU, and the fused ops' device-only times.

    python -m benchmarks.gpu.profile_step [--model random] [--steps 6] [--prompts 16] [--n 8]
        [--max-new 128]

Phase times of rl_step's prorl Trainer on cuda:0 (then with each SDPA kernel family off),
torch.profiler's top ops over one step, and ppo_loss's wall and CUDA-graph device times. Prints
only. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import time


def _triton_cache_files() -> int:
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return sum(len(files) for _, _, files in os.walk(root)) if os.path.isdir(root) else 0


def _steps(step, k: int, label: str, responses: int) -> None:
    import torch

    for i in range(k):
        before = _triton_cache_files()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        phases = " ".join(f"{p} {m[p] * 1e3:7.1f}" for p in ("gen", "reward", "old_logp", "update"))
        length, cache = m["tokens"] / responses, _triton_cache_files() - before
        line = f"{label:<14} step {i}: {wall:8.1f} ms | {phases} | resp len {length:.1f}"
        print(f"{line} | triton cache +{cache}", flush=True)


def profile_trainer(args) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.rl_step import model_path, prorl_trainer, work
    from prorl.rewards.pool import RewardPool

    w, path = work(args.model, args.prompts, args.n, args.max_new), model_path(args.model)
    all_backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    all_backends += [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        run = prorl_trainer(w, path, gpu=True, gen="native", pool=pool)
        print(f"model {args.model} ({path}); attention {run.attention()}", flush=True)
        _steps(run.step, args.steps, "default", args.prompts * args.n)
        for off in all_backends[:3]:
            with sdpa_kernel([b for b in all_backends if b != off]):
                label = f"no {off.name.split('_')[0].lower()}"
                _steps(run.step, max(2, args.steps // 2), label, args.prompts * args.n)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run.step()
            torch.cuda.synchronize()
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            print(
                prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60),
                flush=True,
            )


def _ppo_loss_calls(n: int):
    """(forward, forward+backward) closures of a Triton ppo_loss call on n CUDA tokens."""
    import torch
    from prorl.kernels import ppo_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    old = -torch.rand(n, device="cuda", generator=g) * 4
    logp = (old + 0.3 * torch.randn(n, device="cuda", generator=g)).requires_grad_()
    adv = torch.randn(n, device="cuda", generator=g)
    mask = torch.rand(n, device="cuda", generator=g) > 0.1
    ref = old - 0.1
    cu = torch.arange(0, n + 1, 1024, device="cuda", dtype=torch.int32)

    kw = dict(ref_logp=ref, kl_coef=1e-3, cu_seqlens=cu, backend="triton")
    fwd = lambda: ppo_loss(logp, old, adv, mask, **kw)

    def fwd_bwd():
        loss, _ = fwd()
        loss.backward()
        logp.grad = None

    return fwd, fwd_bwd


def ppo_loss_device_times() -> None:
    import triton.testing

    for n in (4096, 65536, 1 << 20):
        for name, fn in zip(("forward", "forward+backward"), _ppo_loss_calls(n)):
            wall = triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3
            try:
                dev = f"{triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3:8.1f} us"
            except Exception as exc:  # noqa: BLE001 - report and go on
                dev = f"capture failed ({type(exc).__name__}: {exc})"
            print(
                f"ppo_loss N={n:>8} {name:<17} wall {wall:8.1f} us   device (CUDA graph) {dev}",
                flush=True,
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.gpu.profile_step", description=__doc__)
    p.add_argument(
        "--model", default="random", help="tiny | random | large (benchmarks/rl_step.py)"
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--skip", default="", help="comma-separated: trainer, ppo_loss")
    args = p.parse_args(argv)
    skip = set(args.skip.split(","))
    if "ppo_loss" not in skip:
        ppo_loss_device_times()
    if "trainer" not in skip:
        profile_trainer(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
