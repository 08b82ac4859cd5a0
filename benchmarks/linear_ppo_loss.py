"""Benchmark of `prorl.kernels.linear_ppo_loss` (loss from hidden states, 6NDV) against its GEMM floor.

    python -m benchmarks linear_ppo_loss [--quick] [--threads N] [--shape N,D,V] [--providers a,b] [--out CSV]

The op computes its gradients in the forward, so the one mode is `full` (forward + backward, one loss).
Every provider is credited with the same nominal 6NDV FLOPs (effective throughput), and `x floor` in the
summary is time / the floor's time. Inputs as benchmarks/linear_logprob_entropy.py (hidden ~ N(0, 1),
weight ~ N(0, 0.02)); the loss is the ProRL one of benchmarks/ppo_loss.py on N packed tokens.

Providers (CPU, fp32):
- `prorl`: ours, fused, native backend: logits of a row block stored over the whole vocabulary, 6NDV.
- `prorl-torch`: the same plan with the torch tile ops.
- `prorl-unfused`: linear_logprob_entropy (native, 8NDV: logits recomputed in backward) then ppo_loss.
- `naive`: eager logits [N, V], log_softmax, gather, then the verl-style loss; autograd.
- `sgemm-floor`: the three products alone, Z = H W^T, dH = Z W, dW = Z^T H, into preallocated buffers.
"""

from __future__ import annotations

import math
import sys

from benchmarks import harness
from benchmarks.linear_logprob_entropy import VIEW, floor_step, inputs, make_shape
from benchmarks.ppo_loss import BETA, EPS_HIGH, EPS_LOW, naive_ppo_loss

NAME = "linear_ppo_loss"
PROVIDERS = ("prorl", "prorl-torch", "prorl-unfused", "naive", "sgemm-floor")
CPU_SHAPE = (2048, 896, 151936)  # Qwen2.5-0.5B LM head, one 2K-token micro-batch
QUICK_SHAPE = (256, 128, 8192)


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` on `shape` (mode `full` only)."""
    import torch

    n, d, v = shape["N"], shape["D"], shape["V"]
    flops = float(6 * n * d * v)
    if provider == "sgemm-floor":
        return floor_step("backward", shape, device, flops)  # Z, then dH and dW: the op's three products
    h, w, y, _, _ = inputs(shape, device)
    g = torch.Generator(device=device).manual_seed(1)
    old = torch.randn(n, generator=g, device=device) * 0.3 - math.log(v)  # near logp ~ -log V: ratios ~ 1
    ref = old + torch.randn(n, generator=g, device=device) * 0.3
    adv = torch.randn(n, generator=g, device=device)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logp=ref, kl_coef=BETA, kl_estimator="k2")
    backend = "triton" if device.type == "cuda" else "native"

    if provider in ("prorl", "prorl-torch"):
        from prorl.kernels import linear_ppo_loss

        be = "torch" if provider == "prorl-torch" else backend
        loss_fn = lambda: linear_ppo_loss(h, w, y, old, adv, mask, backend=be, **kw)[0]
        note = f"prorl_backend={be} fused_6NDV"
    elif provider == "prorl-unfused":
        from prorl.kernels import linear_logprob_entropy, ppo_loss

        def loss_fn():
            logp, _ = linear_logprob_entropy(h, w, y, backend=backend, return_entropy=False)
            return ppo_loss(logp, old, adv, mask, backend=backend, **kw)[0]

        note = f"prorl_backend={backend} unfused_8NDV"
    elif provider == "naive":

        def loss_fn():
            logp = torch.log_softmax((h @ w.t()).float(), dim=-1).gather(1, y[:, None]).squeeze(1)
            return naive_ppo_loss(logp, old, adv, mask.float(), ref)[0]

        note = "eager_logits"
    else:
        raise ValueError(f"unknown provider {provider!r}")
    one = (torch.ones((), device=device),)
    return harness.autograd_step(mode, lambda: (loss_fn(),), (h, w), one, flops, note=note)


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"tiny shape {QUICK_SHAPE}, 2 reps (seconds)")
    p.add_argument("--shape", default=None, help=f"N,D,V (default {CPU_SHAPE})")


def _shapes(args) -> list[dict]:
    dims = (
        tuple(int(x) for x in args.shape.split(","))
        if args.shape
        else QUICK_SHAPE
        if args.quick
        else CPU_SHAPE
    )
    return [make_shape(*dims, "float32", 1.0)]


BENCHMARK = harness.Benchmark(NAME, PROVIDERS, _shapes, _options, view=VIEW)
main = BENCHMARK.main

if __name__ == "__main__":
    sys.exit(main())
