"""Benchmark of `prorl.kernels.linear_logprob_entropy` against unfused and fused peers.

    python -m benchmarks linear_logprob_entropy [--quick] [--threads N] [--providers a,b]
        [--out CSV]
    python -m benchmarks linear_logprob_entropy --gpu  # bf16; benchmarks/gpu/ has its script

Modes forward / backward / full, every provider credited with the op's nominal FLOPs (2NDV, 6NDV,
8NDV); `CPU_PROVIDERS`, `GPU_PROVIDERS` (`--gpu`, bf16). Details: docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from benchmarks import harness
from benchmarks.report.readme import View

NAME = "linear_logprob_entropy"
CPU_PROVIDERS = ("prorl", "prorl-torch", "naive", "naive-compile", "liger-logp", "liger-grpo-loss")
CPU_PROVIDERS += ("sgemm-floor",)
GPU_PROVIDERS = ("prorl", "prorl-torch", "naive", "liger-flce", "liger-flce-fp32acc", "gemm-floor")
CPU_SHAPE = (2048, 896, 151936)  # Qwen2.5-0.5B LM head, one 2K-token micro-batch
QUICK_SHAPE = (256, 128, 8192)
GPU_SHAPES = ((16384, 1536, 151936), (16384, 4096, 128256))  # Qwen2.5-1.5B-like, Llama-3-8B heads
_FLOP_FACTOR = {"forward": 2, "backward": 6, "full": 8}


def naive_logprob_entropy(hidden, weight, labels, temperature=1.0, ignore_index=-100):
    """Unfused eager log-prob and entropy: the [N, V] logits and several [N, V] fp32 temporaries."""
    logits = (hidden @ weight.t()).float() / temperature  # [N, V]
    valid = labels != ignore_index
    picked = torch.where(valid, labels, 0)[:, None]
    logp = torch.log_softmax(logits, dim=-1).gather(1, picked).squeeze(1)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    zero = logp.new_zeros(())
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def make_shape(n: int, d: int, v: int, dtype: str) -> dict:
    return dict(N=n, D=d, V=v, dtype=dtype, label=f"N={n} D={d} V={v} {dtype}")


def inputs(shape: dict, device, requires_grad: bool = True):
    """hidden [N, D] ~ N(0, 1) (a normed hidden state), weight [V, D] ~ N(0, 0.02), labels, upstream
    grads."""
    n, d, v = shape["N"], shape["D"], shape["V"]
    dtype = getattr(torch, shape["dtype"])
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype).requires_grad_(requires_grad)
    weight = torch.randn(v, d, generator=g, device=device) * 0.02
    weight = weight.to(dtype).requires_grad_(requires_grad)
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    grads = [torch.randn(n, generator=g, device=device) for _ in range(2)]
    return hidden, weight, labels, *grads


def floor_step(mode: str, shape: dict, device, flops: float) -> harness.Step:
    """The op's matmuls alone into preallocated outputs: forward Z; backward Z, dH, dW; full
    both."""
    h, w, _, _, _ = inputs(shape, device, requires_grad=False)
    z = torch.empty(shape["N"], shape["V"], dtype=h.dtype, device=device)  # [N, V], also used as dZ
    gh, gw = torch.empty_like(h), torch.empty_like(w)
    logits = lambda: torch.mm(h, w.t(), out=z)
    grads = lambda: (torch.mm(z, w, out=gh), torch.mm(z.t(), h, out=gw))
    calls = dict(forward=[logits], backward=[logits, grads], full=[logits, logits, grads])[mode]
    run = lambda: [f() for f in calls]
    return harness.Step(run=run, flops=flops, measure_memory=False, note="matmuls_only")


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` in `mode` on `shape` (None: the provider lacks the
    mode)."""
    n, d, v = shape["N"], shape["D"], shape["V"]
    flops = float(_FLOP_FACTOR[mode] * n * d * v)
    if provider in ("sgemm-floor", "gemm-floor"):
        return floor_step(mode, shape, device, flops)
    if provider == "liger-grpo-loss" and mode != "full":
        return None
    h, w, y, g_lp, g_ent = inputs(shape, device)
    grads, note = (g_lp, g_ent), ""
    if provider in ("prorl", "prorl-torch"):
        from prorl.kernels import linear_logprob_entropy

        backend = harness.prorl_backend(provider, device)
        forward = lambda: linear_logprob_entropy(h, w, y, backend=backend)
        note = f"prorl_backend={backend}"
    elif provider == "naive":
        forward = lambda: naive_logprob_entropy(h, w, y)
    elif provider == "naive-compile":
        compiled = torch.compile(naive_logprob_entropy, dynamic=False)
        forward, note = lambda: compiled(h, w, y), "torch.compile"
    elif provider == "liger-logp":
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

        chunked = LigerFusedLinearPPOBase.chunk_forward
        forward, note = lambda: (chunked(h[None], w, y[None], temperature=1.0)[0],), "logp_only"
    elif provider == "liger-grpo-loss":  # its forward computes the gradients, its backward scales
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, temperature=1.0)
        mask, adv = torch.ones(1, n, device=device), torch.randn(1, device=device)
        forward = lambda: (loss_fn(h[None], w, y[None], mask, adv)[0],)
        grads, note = (torch.ones((), device=device),), "grpo_loss_logp_only"
    else:  # liger-flce, liger-flce-fp32acc: per-token cross entropy = -logp, the same work
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as flce

        accum = torch.float32 if provider.endswith("fp32acc") else None
        forward = lambda: (flce(h, w, y, reduction="none", accum_dtype=accum),)
        note = "minus_logp_only"
    return harness.autograd_step(mode, forward, (h, w), grads, flops, note=note)


def _shapes(args) -> list[dict]:
    dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    dims = [QUICK_SHAPE] if args.quick else list(GPU_SHAPES) if args.gpu else [CPU_SHAPE]
    return [make_shape(n, d, v, dtype) for n, d, v in ([args.shape] if args.shape else dims)]


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"tiny shape {QUICK_SHAPE}, 2 reps")
    p.add_argument("--gpu", action="store_true", help="CUDA, bf16, the H200 shapes and providers")
    p.add_argument("--shape", type=harness.ints, help="N,D,V (overrides the default shapes)")
    p.add_argument("--dtype", help="float32 (CPU default) | bfloat16 (GPU default) | float16")


def _notes(args) -> list[str]:
    notes = ["liger-* providers compute log-probs only (no entropy); liger-grpo-loss adds its loss"]
    for s in _shapes(args):
        size = 4 if s["dtype"] == "float32" else 2
        mb = (s["N"] + s["V"]) * s["D"] * size / 2**20
        notes.append(f"{s['label']}: backward/full peaks include dh and dW, {mb:.1f} MB")
    return notes


# the console's table: docs/results.md's columns, the throughput and both floors
VIEW = View(
    extras=("gflops", "tflops", "peak_fraction", "peak_extra_memory"),
    ratios=(("naive", "speedup"), ("sgemm-floor", "multiple"), ("gemm-floor", "multiple")),
)
providers = lambda args: GPU_PROVIDERS if args.gpu else CPU_PROVIDERS
known = tuple(dict.fromkeys(CPU_PROVIDERS + GPU_PROVIDERS))
settings = dict(modes=harness.MODES, view=VIEW, notes=_notes)
BENCHMARK = harness.Benchmark(NAME, providers, _shapes, _options, known, **settings)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
