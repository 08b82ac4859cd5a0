"""Benchmark of `prorl.kernels.ppo_loss` against the same loss in eager torch, as trainers write it.

    python -m benchmarks ppo_loss [--quick] [--threads N] [--sizes N1,N2] [--providers a,b]
        [--out CSV]
    python -m benchmarks ppo_loss --device cuda

The ProRL v2 loss on padded [B, T] log-probs, modes forward / backward / full. Providers: `prorl`,
`prorl-torch`, `naive` (verl's eager loss), `trl-style` (TRL's, k3 KL). Details: docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from benchmarks import harness

NAME = "ppo_loss"
PROVIDERS = ("prorl", "prorl-torch", "naive", "trl-style")
CPU_SIZES = (4096, 65536, 1048576)
QUICK_SIZES = (2048,)
ROW = 1024  # tokens per padded row
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 1e-4
NOTE = "trl-style uses TRL's k3 KL (no clamp); the others ProRL's k2 with a log-ratio clamp"


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def naive_ppo_loss(logp, old, adv, mask, ref):
    """verl-style eager loss: (loss, pg_clipfrac, ppo_kl); adv [B, 1] broadcasts over T."""
    log_ratio = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = _masked_mean(-log_ratio, mask)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    d = torch.clamp(logp - ref, min=-10.0, max=10.0)
    kl_loss = _masked_mean(0.5 * d.square(), mask)
    return _masked_mean(pg_losses, mask) + BETA * kl_loss, pg_clipfrac, ppo_kl


def trl_style_loss(logp, old, adv, mask, ref):
    """TRL-style eager loss (dapo, k3): (loss, low clip fraction, high clip fraction)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv) + BETA * per_token_kl
    loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    is_low = (coef_1 < 1 - EPS_LOW) & (adv < 0)
    is_high = (coef_1 > 1 + EPS_HIGH) & (adv > 0)
    return loss, _masked_mean(is_low.float(), mask), _masked_mean(is_high.float(), mask)


def make_shape(n: int, dtype: str = "float32") -> dict:
    t = min(n, ROW)
    return dict(N=n, T=t, dtype=dtype, label=f"N={n} B={n // t} T={t} {dtype}")


def _inputs(shape: dict, device):
    """logp [B, T] (leaf), old/ref near it, adv [B], mask [B, T] with ~10% of each row padding."""
    b, t = shape["N"] // shape["T"], shape["T"]
    g = torch.Generator(device=device).manual_seed(0)
    logp = -torch.rand(b, t, generator=g, device=device) * 3
    old = logp + torch.randn(b, t, generator=g, device=device) * 0.3
    ref = logp + torch.randn(b, t, generator=g, device=device) * 0.3
    lengths = torch.randint(int(0.8 * t), t + 1, (b,), generator=g, device=device)
    mask = torch.arange(t, device=device)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g, device=device)
    logp, old, ref = (x.to(getattr(torch, shape["dtype"])) for x in (logp, old, ref))
    return logp.requires_grad_(), old, ref, adv, mask


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` in `mode` on `shape`."""
    logp, old, ref, adv, mask = _inputs(shape, device)
    one = (torch.ones((), device=device),)
    if provider in ("prorl", "prorl-torch"):
        from prorl.kernels import ppo_loss

        backend = harness.prorl_backend(provider, device)
        kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, ref_logp=ref, kl_coef=BETA, kl_estimator="k2")
        forward = lambda: (ppo_loss(logp, old, adv, mask, backend=backend, **kw)[0],)
        return harness.autograd_step(mode, forward, (logp,), one, note=f"prorl_backend={backend}")
    losses = dict(naive=(naive_ppo_loss, "verl_style_eager"))
    losses["trl-style"] = (trl_style_loss, "trl_style_eager_k3")
    loss, note = losses[provider]
    maskf, adv2 = mask.to(logp.dtype), adv[:, None]
    forward = lambda: (loss(logp, old, adv2, maskf, ref)[0],)
    return harness.autograd_step(mode, forward, (logp,), one, note=note)


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"N in {QUICK_SIZES}, 2 reps (seconds)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sizes", type=harness.ints, help=f"token counts N (default {CPU_SIZES})")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 (of the log-probs)")


def _shapes(args) -> list[dict]:
    return [
        make_shape(n, args.dtype) for n in args.sizes or (QUICK_SIZES if args.quick else CPU_SIZES)
    ]


settings = dict(modes=harness.MODES, reps=(20, 2), warmup=(2, 2), notes=[NOTE])
BENCHMARK = harness.Benchmark(NAME, PROVIDERS, _shapes, _options, **settings)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
