"""Benchmark of `prorl.kernels.linear_logprob_entropy` against unfused and fused peers.

    python -m benchmarks linear_logprob_entropy [--quick] [--threads N] [--providers a,b] [--out CSV]
    python -m benchmarks linear_logprob_entropy --gpu   # H200 comparison: gpu_linear_logprob_entropy.sh

The op: per-token log p(label) and entropy of softmax(hidden [N, D] @ weight[V, D].T / T), fp32 outputs.
Modes (harness.py): `forward` (the forward with autograd recording, as in training), `backward` (the
backward alone, its forward run untimed), `full` (forward + backward of both outputs with random
upstream gradients, as an RL loss gives them). Effective throughput counts the op's nominal FLOPs for
every provider: 2NDV forward, 6NDV backward (logits recomputed), 8NDV full.

Providers (CPU, fp32):
- `prorl`: ours, native C++/OpenMP backend (`backend="native"`); on CUDA the Triton backend.
- `prorl-torch`: ours, chunked torch backend (`backend="torch"`).
- `naive`: eager unfused recipe: logits = (h @ W.T).float() / T, log_softmax + gather for logp, entropy
  as logsumexp - sum(softmax * logits) (verl's `entropy_from_logits`); materialises several [N, V].
- `naive-compile`: the same function under `torch.compile` (compile time is absorbed by the warm-up).
- `liger-logp`: Liger-Kernel's chunked selective log-prob, the per-token path inside
  `LigerFusedLinearGRPOLoss` (`LigerFusedLinearPPOBase.chunk_forward`: vocab chunks of 4096, its own
  autograd backward). It computes log-probs ONLY, no entropy: it does less work than the op.
- `liger-grpo-loss`: the whole `LigerFusedLinearGRPOLoss` (beta=0, no reference model, one sequence of
  N tokens, its default compiled loss math), mode `full` only: its forward already computes the
  gradients chunk by chunk, so `forward`/`backward` alone mean nothing for it. Also no entropy.
- `sgemm-floor`: just the op's matmuls at BLAS speed, one GEMM per product into preallocated outputs:
  forward Z = H W^T (2NDV); backward Z again, dH = dZ W, dW = dZ^T H (6NDV); full both (8NDV). No
  exponentials, no memory row. `x floor` in the summary is time / this time.
GPU providers (`--gpu`, bf16): `prorl` (triton), `prorl-torch`, `naive`, `liger-flce` (Liger's Triton
`liger_fused_linear_cross_entropy(reduction="none")`: per-token -logp only, no entropy, no temperature,
default bf16 dW accumulation), `liger-flce-fp32acc` (the same with `accum_dtype=torch.float32`, as ours
accumulates) and `gemm-floor` (the bf16 GEMMs). The `--gpu` path ran on an H200 (2026-11-30, shape 16384 x
1536 x 151936, providers prorl, naive, liger-flce, gemm-floor: benchmarks/results/gpu); the other shape and
providers have not run.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import harness

NAME = "linear_logprob_entropy"
CPU_PROVIDERS = (
    "prorl",
    "prorl-torch",
    "naive",
    "naive-compile",
    "liger-logp",
    "liger-grpo-loss",
    "sgemm-floor",
)
GPU_PROVIDERS = ("prorl", "prorl-torch", "naive", "liger-flce", "liger-flce-fp32acc", "gemm-floor")
CPU_SHAPE = (2048, 896, 151936)  # Qwen2.5-0.5B LM head, one 2K-token micro-batch
QUICK_SHAPE = (256, 128, 8192)
GPU_SHAPES = ((16384, 1536, 151936), (16384, 4096, 128256))  # Qwen2.5-1.5B-like and Llama-3-8B heads
_FLOP_FACTOR = {"forward": 2, "backward": 6, "full": 8}


def naive_logprob_entropy(hidden, weight, labels, temperature: float = 1.0, ignore_index: int = -100):
    """Unfused eager log-prob and entropy: the [N, V] logits and several [N, V] temporaries in fp32."""
    import torch

    logits = (hidden @ weight.t()).float() / temperature  # [N, V]
    valid = labels != ignore_index
    logp = torch.log_softmax(logits, dim=-1).gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    zero = logp.new_zeros(())
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def make_shape(n: int, d: int, v: int, dtype: str, temperature: float) -> dict:
    return dict(N=n, D=d, V=v, dtype=dtype, temperature=temperature, label=f"N={n} D={d} V={v} {dtype}")


def _inputs(shape: dict, device, requires_grad: bool = True):
    """hidden [N, D] ~ N(0, 1) (a normed hidden state), weight [V, D] ~ N(0, 0.02), labels, upstream grads."""
    import torch

    n, d, v = shape["N"], shape["D"], shape["V"]
    dtype = getattr(torch, shape["dtype"])
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype).requires_grad_(requires_grad)
    weight = (torch.randn(v, d, generator=g, device=device) * 0.02).to(dtype).requires_grad_(requires_grad)
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    g_lp = torch.randn(n, generator=g, device=device)
    g_ent = torch.randn(n, generator=g, device=device)
    return hidden, weight, labels, g_lp, g_ent


def _autograd_step(mode: str, forward, leaves, grads, flops: float, note: str = "") -> harness.Step:
    """A Step for `forward()` -> tuple of outputs, differentiated with `grads` (one per output)."""
    import torch

    def clear_grads():
        for t in leaves:
            t.grad = None

    if mode == "forward":
        return harness.Step(run=forward, prepare=clear_grads, flops=flops, note=note)
    if mode == "full":

        def run_full():
            outs = forward()
            torch.autograd.backward(outs, grads[: len(outs)])

        return harness.Step(run=run_full, prepare=clear_grads, flops=flops, note=note)
    saved = {}

    def prepare_backward():
        clear_grads()
        saved["outs"] = forward()

    def run_backward():
        outs = saved.pop("outs")
        torch.autograd.backward(outs, grads[: len(outs)])

    return harness.Step(run=run_backward, prepare=prepare_backward, flops=flops, note=note)


def _floor_step(mode: str, shape: dict, device, flops: float) -> harness.Step:
    import torch

    h, w, _, _, _ = _inputs(shape, device, requires_grad=False)
    z = torch.empty(shape["N"], shape["V"], dtype=h.dtype, device=device)  # [N, V], also used as dZ
    gh, gw = torch.empty_like(h), torch.empty_like(w)

    def logits():
        torch.mm(h, w.t(), out=z)

    def grads():
        torch.mm(z, w, out=gh)
        torch.mm(z.t(), h, out=gw)

    run = {
        "forward": logits,
        "backward": lambda: (logits(), grads()),
        "full": lambda: (logits(), logits(), grads()),
    }[mode]
    return harness.Step(run=run, flops=flops, measure_memory=False, note="matmuls_only")


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` in `mode` on `shape` (None: the provider lacks that mode)."""
    import torch

    n, d, v, temp = shape["N"], shape["D"], shape["V"], shape["temperature"]
    flops = float(_FLOP_FACTOR[mode] * n * d * v)
    if provider in ("sgemm-floor", "gemm-floor"):
        return _floor_step(mode, shape, device, flops)
    if provider == "liger-grpo-loss" and mode != "full":
        return None
    h, w, y, g_lp, g_ent = _inputs(shape, device)

    if provider in ("prorl", "prorl-torch"):
        from prorl.kernels import linear_logprob_entropy

        backend = "torch" if provider == "prorl-torch" else ("triton" if device.type == "cuda" else "native")
        forward = lambda: linear_logprob_entropy(h, w, y, temp, backend=backend)
        return _autograd_step(mode, forward, (h, w), (g_lp, g_ent), flops, note=f"prorl_backend={backend}")
    if provider == "naive":
        forward = lambda: naive_logprob_entropy(h, w, y, temp)
        return _autograd_step(mode, forward, (h, w), (g_lp, g_ent), flops)
    if provider == "naive-compile":
        compiled = torch.compile(naive_logprob_entropy, dynamic=False)
        forward = lambda: compiled(h, w, y, temp)
        return _autograd_step(mode, forward, (h, w), (g_lp, g_ent), flops, note="torch.compile")
    if provider == "liger-logp":
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

        forward = lambda: (LigerFusedLinearPPOBase.chunk_forward(h[None], w, y[None], temperature=temp)[0],)
        return _autograd_step(mode, forward, (h, w), (g_lp,), flops, note="logp_only")
    if provider == "liger-grpo-loss":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, temperature=temp)
        mask = torch.ones(1, n, device=device)
        adv = torch.randn(1, device=device)

        def clear_grads():
            h.grad = w.grad = None

        def run_loss():
            loss, _ = loss_fn(h[None], w, y[None], mask, adv)
            loss.backward()

        return harness.Step(run=run_loss, prepare=clear_grads, flops=flops, note="grpo_loss_logp_only")
    if provider in ("liger-flce", "liger-flce-fp32acc"):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        if temp != 1.0:
            raise ValueError("liger's fused linear cross entropy has no temperature; use --temperature 1")
        accum = torch.float32 if provider.endswith("fp32acc") else None
        # per-token cross entropy = -logp; the sign does not change the work
        forward = lambda: (liger_fused_linear_cross_entropy(h, w, y, reduction="none", accum_dtype=accum),)
        return _autograd_step(mode, forward, (h, w), (g_lp,), flops, note="minus_logp_only")
    raise ValueError(f"unknown provider {provider!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"tiny shape {QUICK_SHAPE}, 2 reps (seconds)")
    p.add_argument("--gpu", action="store_true", help="CUDA, bf16, the H200 shapes and GPU providers")
    harness.add_standard_args(p, NAME, reps="default 5, --quick 2", warmup=1)
    p.add_argument("--modes", default=",".join(harness.MODES), help="comma-separated subset of the modes")
    p.add_argument("--shape", default=None, help="N,D,V (overrides the default shapes)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (GPU default) | float16")
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args(argv)

    device = "cuda" if args.gpu else "cpu"
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            p.error("--gpu needs a visible CUDA device (this torch sees none)")
    dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    if args.shape:
        dims = [tuple(int(x) for x in args.shape.split(","))]
    elif args.quick:
        dims = [QUICK_SHAPE]
    else:
        dims = list(GPU_SHAPES) if args.gpu else [CPU_SHAPE]
    shapes = [make_shape(n, d, v, dtype, args.temperature) for n, d, v in dims]
    providers = (
        args.providers.split(",") if args.providers else list(GPU_PROVIDERS if args.gpu else CPU_PROVIDERS)
    )
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in harness.MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {harness.MODES}")
    reps = args.reps or (2 if args.quick else 5)

    rows, errors = harness.run_benchmark(
        NAME,
        "benchmarks.linear_logprob_entropy",
        providers,
        modes,
        shapes,
        device=device,
        threads=args.threads,
        warmup=args.warmup,
        reps=reps,
        out=args.out,
        timeout=args.timeout,
    )
    floor = "gemm-floor" if args.gpu else "sgemm-floor"
    print(harness.summary_table(rows, floor=floor, reference="naive"))
    print()
    for s in shapes:
        size = 4 if s["dtype"] == "float32" else 2
        grads_mb = (s["N"] + s["V"]) * s["D"] * size / 2**20
        print(
            f"note {s['label']}: backward/full peaks include dh and dW themselves, (N+V)*D*{size} B = "
            f"{grads_mb:.1f} MB"
        )
    print("note: liger-* providers compute log-probs only (no entropy); liger-grpo-loss adds its loss math")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
