"""Run under `torchrun --standalone --nproc_per_node=2` (gloo, CPU); exits non-zero on any mismatch.

Each rank holds one half of a batch (whole groups). Every rank also builds the whole batch and
computes the single-process answer from it, twice: with the op under test on the full batch, and
with an independent float64 reference written here (a per-group Python loop for the advantages,
autograd through the plain PPO formula for the loss). The distributed results must equal both:

- group_advantages(..., process_group=WORLD): reinforce++-baseline (token and sequence weighting),
  grpo and dr-grpo; batch_whiten(..., process_group=WORLD) on per-sequence values weighted by
  length, on per-token values under a mask (token and sequence weighting), and far from zero (offset
  1e8);
- ppo_loss token-mean with normalizer = all_reduce(this rank's valid tokens), fed with this rank's
  distributed advantages: the sum of the ranks' losses is the single-process loss, and each rank's
  gradient is its slice of the single-process gradient (fp64 inputs tightly, fp32 inputs within fp32
  rounding).

Used by tests/kernels/test_distributed_torchrun.py.
"""

from __future__ import annotations

import itertools
import math
import os
import sys

import torch
import torch.distributed as dist
from prorl.kernels import batch_whiten, group_advantages, ppo_loss
from prorl.kernels._backend import native_available

GROUPS, N_PER_GROUP, T = 6, 4, 12
B = GROUPS * N_PER_GROUP
EPS_LOW, EPS_HIGH, KL_COEF = 0.2, 0.28, 0.1

failures: list[str] = []


def check(name, got, want, tol):
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    err = (got - want).abs().max().item() if got.numel() else 0.0
    # tolerances are relative to the largest value
    scale = want.abs().max().item() if want.numel() else 0.0
    if not err <= tol * scale:  # also catches NaN
        failures.append(f"{name}: max |got - want| = {err:.3g} > {tol:.1g} * {scale:.3g}")


def data():
    g = torch.Generator().manual_seed(1234)
    rewards = torch.rand(B, generator=g, dtype=torch.float64).round() + 0.1 * torch.rand(
        B, generator=g
    )
    groups = torch.arange(B) // N_PER_GROUP
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # ratios on both sides of the clip
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    logp[~mask] = float("nan")  # padding may hold anything
    per_token = torch.randn(B, T, generator=g, dtype=torch.float64)
    return rewards, groups, lengths, mask, logp, old, ref, per_token


# ---- independent float64 references (single process, whole batch) --------------------------------


def ref_group_advantages(rewards, groups, lengths, mode, weighting):
    r, ids, lens = rewards.tolist(), groups.tolist(), lengths.tolist()
    centred, adv = [0.0] * len(r), [0.0] * len(r)
    for gid in sorted(set(ids)):
        members = [i for i, k in enumerate(ids) if k == gid]
        mu = sum(r[i] for i in members) / len(members)
        std = math.sqrt(sum((r[i] - mu) ** 2 for i in members) / len(members))
        for i in members:
            centred[i] = r[i] - mu
            adv[i] = (r[i] - mu) / (std + 1e-6) if mode == "grpo" else r[i] - mu
    if mode == "reinforce++-baseline":
        w = [float(n) if weighting == "token" else 1.0 for n in lens]
        mu = sum(wi * c for wi, c in zip(w, centred)) / sum(w)
        var = sum(wi * (c - mu) ** 2 for wi, c in zip(w, centred)) / sum(w)
        adv = [(c - mu) / math.sqrt(max(var, 1e-8)) for c in centred]
    return torch.tensor(adv, dtype=torch.float64)


def ref_whiten(values, weights):
    """values, weights: flat float64; population mean/variance under the weights, 0 where weight is
    0."""
    v = [float(x) for x in values.tolist()]
    w = [float(x) for x in weights.tolist()]
    wt = sum(w)
    mu = sum(wi * vi for wi, vi in zip(w, v) if wi > 0) / wt
    var = sum(wi * (vi - mu) ** 2 for wi, vi in zip(w, v) if wi > 0) / wt
    sd = math.sqrt(max(var, 1e-8))
    return torch.tensor(
        [(vi - mu) / sd if wi > 0 else 0.0 for wi, vi in zip(w, v)], dtype=torch.float64
    )


def ref_token_mean_loss(logp, old, adv, mask, ref):
    """The plain formula in float64, differentiated by autograd: (loss, dloss/dlogp)."""
    lp = torch.where(mask, logp, torch.zeros_like(logp)).double().requires_grad_()
    old, ref, a = old.double(), ref.double(), adv.double()[:, None]
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    d = lp - ref  # k2, |d| far below the clamp
    per_token = pg + KL_COEF * 0.5 * d * d
    m = mask.double()
    loss = (per_token * m).sum() / m.sum()
    loss.backward()
    return loss.detach(), lp.grad * m


# ---- the run -------------------------------------------------------------------------------------


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, f"run with --nproc_per_node=2, got world size {world}"
    wg = dist.group.WORLD
    rewards, groups, lengths, mask, logp, old, ref, per_token = data()
    # whole groups: N_PER_GROUP divides B / 2
    rows = slice(0, B // 2) if rank == 0 else slice(B // 2, B)

    # group_advantages: each mode, distributed vs op on the full batch vs the Python loop.
    local_adv = {}
    for mode, weighting in (
        ("reinforce++-baseline", "token"),
        ("reinforce++-baseline", "sequence"),
        ("grpo", "token"),
        ("dr-grpo", "token"),
    ):
        # the others need no cross-rank statistic
        pg_arg = wg if mode == "reinforce++-baseline" else None
        kw = dict(mode=mode, weighting=weighting)
        got = group_advantages(
            rewards[rows], groups[rows], lengths=lengths[rows], process_group=pg_arg, **kw
        )
        full = group_advantages(rewards, groups, lengths=lengths, **kw)
        want = ref_group_advantages(rewards, groups, lengths, mode, weighting)
        check(f"group_advantages {mode}/{weighting} vs full-batch op", got, full[rows], 1e-12)
        check(f"group_advantages {mode}/{weighting} vs reference", got, want[rows], 1e-12)
        local_adv[(mode, weighting)] = got

    # batch_whiten: per-sequence values weighted by length, near and far from zero.
    for offset, tol in ((0.0, 1e-12), (1e8, 1e-6)):
        values = rewards + offset
        got = batch_whiten(values[rows], lengths[rows], process_group=wg)
        what = f"batch_whiten per-sequence offset={offset:g}"
        check(f"{what} vs full-batch op", got, batch_whiten(values, lengths)[rows], tol)
        check(f"{what} vs reference", got, ref_whiten(values, lengths.double())[rows], tol)
    # batch_whiten: per-token values under a mask; sequence weighting spreads 1 over each row's
    # tokens.
    for weighting in ("token", "sequence"):
        got = batch_whiten(per_token[rows], mask[rows], weighting=weighting, process_group=wg)
        full = batch_whiten(per_token, mask, weighting=weighting)
        m = mask.double()
        w = m if weighting == "token" else m / m.sum(-1, keepdim=True)
        want = ref_whiten(per_token.reshape(-1), w.reshape(-1)).view(B, T)
        check(f"batch_whiten per-token {weighting} vs full-batch op", got, full[rows], 1e-12)
        check(f"batch_whiten per-token {weighting} vs reference", got, want[rows], 1e-12)

    # ppo_loss token-mean with the global normaliser, on this rank's distributed advantages.
    adv_full = ref_group_advantages(rewards, groups, lengths, "reinforce++-baseline", "token")
    want_loss, want_grad = ref_token_mean_loss(logp, old, adv_full, mask, ref)
    backends = ["torch"] + (["native"] if native_available() else [])
    for backend, (dtype, tol) in itertools.product(
        backends, ((torch.float64, 1e-12), (torch.float32, 2e-6))
    ):
        n = mask[rows].sum().to(dtype)
        dist.all_reduce(n, group=wg)  # global valid tokens: a tensor, no host sync
        lp = logp[rows].to(dtype).clone().requires_grad_()
        adv = local_adv[("reinforce++-baseline", "token")].to(dtype)
        opts = dict(
            eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=KL_COEF, kl_estimator="k2", backend=backend
        )
        local_old, local_ref = old[rows].to(dtype), ref[rows].to(dtype)
        loss, metrics = ppo_loss(
            lp, local_old, adv, mask[rows], ref_logp=local_ref, normalizer=n, **opts
        )
        loss.backward()
        total = loss.detach().double().clone()
        dist.all_reduce(total, group=wg)
        grads = [torch.empty(B // 2, T, dtype=dtype) for _ in range(world)]
        dist.all_gather(grads, lp.grad.contiguous(), group=wg)
        name = f"{backend}/{str(dtype).removeprefix('torch.')}"
        check(f"ppo_loss {name}: sum of rank losses vs reference", total, want_loss, tol)
        check(
            f"ppo_loss {name}: this rank's grad vs reference slice", lp.grad, want_grad[rows], tol
        )
        check(f"ppo_loss {name}: gathered grad vs reference", torch.cat(grads), want_grad, tol)
        # and vs the op itself on the whole batch in one process
        lp_full = logp.to(dtype).clone().requires_grad_()
        full_adv, full_ref = adv_full.to(dtype), ref.to(dtype)
        full_loss, _ = ppo_loss(lp_full, old.to(dtype), full_adv, mask, ref_logp=full_ref, **opts)
        full_loss.backward()
        check(f"ppo_loss {name}: sum of rank losses vs full-batch op", total, full_loss, tol)
        check(
            f"ppo_loss {name}: gathered grad vs full-batch op", torch.cat(grads), lp_full.grad, tol
        )
        if not bool(torch.isfinite(lp.grad).all()):
            failures.append(f"ppo_loss {name}: non-finite gradient (padding holds NaN)")
        if int(metrics["num_tokens"]) != int(mask[rows].sum()):
            failures.append(
                f"ppo_loss {name}: num_tokens "
                f"{int(metrics['num_tokens'])} != {int(mask[rows].sum())}"
            )

    # Every rank learns whether any rank failed, so both exit with the same status.
    bad = torch.tensor([len(failures)], dtype=torch.int64)
    dist.all_reduce(bad, group=wg)
    for f in failures:
        print(f"[rank {rank}] MISMATCH {f}", file=sys.stderr, flush=True)
    if rank == 0 and int(bad) == 0:
        threads = os.environ.get("OMP_NUM_THREADS")
        print(
            f"OK: {world} ranks = one process (ppo_loss "
            f"backends {backends}; OMP_NUM_THREADS={threads})"
        )
    dist.destroy_process_group()
    return 1 if int(bad) else 0


if __name__ == "__main__":
    sys.exit(main())
