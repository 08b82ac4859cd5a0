"""Benchmark of `prorl.kernels.linear_ppo_loss` (loss from hidden states, 6NDV) vs its GEMM floor.

    python -m benchmarks linear_ppo_loss [--quick] [--threads N] [--shape N,D,V] [--providers a,b]
        [--out CSV]

Mode `full` only, every provider credited with 6NDV FLOPs; `prorl-unfused` is linear_logprob_entropy
then ppo_loss. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import math

import torch

from benchmarks import harness
from benchmarks.linear_logprob_entropy import VIEW, floor_step, inputs, make_shape
from benchmarks.ppo_loss import BETA, EPS_HIGH, EPS_LOW, naive_ppo_loss

NAME = "linear_ppo_loss"
PROVIDERS = ("prorl", "prorl-torch", "prorl-unfused", "naive", "sgemm-floor")
CPU_SHAPE = (2048, 896, 151936)  # Qwen2.5-0.5B LM head, one 2K-token micro-batch
QUICK_SHAPE = (256, 128, 8192)


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` on `shape` (mode `full` only)."""
    n, d, v = shape["N"], shape["D"], shape["V"]
    flops = float(6 * n * d * v)
    if provider == "sgemm-floor":  # Z, then dH and dW: the op's three products
        return floor_step("backward", shape, device, flops)
    h, w, y, _, _ = inputs(shape, device)
    g = torch.Generator(device=device).manual_seed(1)
    old = torch.randn(n, generator=g, device=device) * 0.3 - math.log(v)  # logp ~ -log V: ratio ~ 1
    ref = old + torch.randn(n, generator=g, device=device) * 0.3
    adv = torch.randn(n, generator=g, device=device)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logp=ref, kl_coef=BETA, kl_estimator="k2")
    backend = harness.prorl_backend(provider, device)
    if provider in ("prorl", "prorl-torch"):
        from prorl.kernels import linear_ppo_loss

        loss_fn = lambda: linear_ppo_loss(h, w, y, old, adv, mask, backend=backend, **kw)[0]
        note = f"prorl_backend={backend} fused_6NDV"
    elif provider == "prorl-unfused":
        from prorl.kernels import linear_logprob_entropy, ppo_loss

        def loss_fn():
            logp, _ = linear_logprob_entropy(h, w, y, backend=backend, return_entropy=False)
            return ppo_loss(logp, old, adv, mask, backend=backend, **kw)[0]

        note = f"prorl_backend={backend} unfused_8NDV"
    else:  # naive

        def loss_fn():
            logp = torch.log_softmax((h @ w.t()).float(), dim=-1).gather(1, y[:, None]).squeeze(1)
            return naive_ppo_loss(logp, old, adv, mask.float(), ref)[0]

        note = "eager_logits"
    one = (torch.ones((), device=device),)
    return harness.autograd_step(mode, lambda: (loss_fn(),), (h, w), one, flops, note=note)


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"tiny shape {QUICK_SHAPE}, 2 reps")
    p.add_argument("--shape", type=harness.ints, help=f"N,D,V (default {CPU_SHAPE})")


def _shapes(args) -> list[dict]:
    return [make_shape(*(args.shape or (QUICK_SHAPE if args.quick else CPU_SHAPE)), "float32")]


BENCHMARK = harness.Benchmark(NAME, PROVIDERS, _shapes, _options, view=VIEW)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
