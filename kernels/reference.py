"""The float64 references that every backend of every op is tested against: each op's math written
out plainly (full logits, one sequence or group at a time), differentiated by autograd where the op
has a gradient. Nothing here shares code with the ops under test (only the constant
RATIO_LOG_CLAMP).

For tests and benchmarks, not speed. Each is also importable from its op's module
(`from prorl.kernels.ppo_loss import ppo_loss_reference`).
"""

from __future__ import annotations

import torch

from ._ppo_common import RATIO_LOG_CLAMP

__all__ = ["group_advantages_reference", "linear_logprob_entropy_reference", "ppo_loss_reference"]


def linear_logprob_entropy_reference(hidden, weight, labels, temperature=1.0, ignore_index=-100):
    """Unfused float64 reference: full [N, V] logits, log_softmax, gather, entropy;
    differentiable."""
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    z = (h @ weight.double().t()) / temperature
    logprobs = torch.log_softmax(z, dim=-1)
    y = labels.reshape(-1)
    valid = y != ignore_index
    lp = logprobs.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1)
    ent = -(logprobs.exp() * logprobs).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, lp, zero).view(labels.shape), torch.where(valid, ent, zero).view(
        labels.shape
    )


def ppo_loss_reference(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    eps_low=0.2,
    eps_high=0.28,
    dual_clip=None,
    ref_logp=None,
    kl_coef=0.0,
    kl_estimator="k2",
    kl_clamp="log-ratio",
    kl_clamp_value=10.0,
    is_weights=None,
    is_mode="none",
    is_bounds=(0.5, 5.0),
    agg="token-mean",
    normalizer=None,
    cu_seqlens=None,
):
    """Unfused float64 reference, one sequence at a time, differentiated by autograd w.r.t. `logp`.

    Same arguments as `ppo_loss`; masked tokens must hold finite values. Returns (loss, metrics)
    with pg_loss, kl_loss, num_tokens, clipfrac_low, clipfrac_high, dualclip_frac, approx_kl,
    kl_mean, ratio_mean.
    """
    f64 = lambda x: None if x is None else x.double()
    padded_numel = logp.numel()
    if logp.dim() == 2:  # padded: the same as packed with one sequence per row
        b, t = logp.shape
        cu_seqlens = torch.arange(b + 1) * t
        logp, old_logp, mask, ref_logp, is_weights, advantages = (
            None if x is None else x.reshape(-1) if x.dim() == 2 else x
            for x in (logp, old_logp, mask, ref_logp, is_weights, advantages)
        )
    n = logp.shape[0]
    bounds = [0, n] if cu_seqlens is None else cu_seqlens.tolist()
    per_seq_adv = advantages.shape[0] != n
    rows = []  # per sequence j: (logp, old, adv, mask, ref, isw), each [T_j]
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        adv = advantages[j].expand(b - a) if per_seq_adv else advantages[a:b]
        rows.append(
            [None if x is None else x[a:b] for x in (logp, old_logp, mask, ref_logp, is_weights)]
        )
        rows[-1].insert(2, adv)
    lo, hi = 1 - eps_low, 1 + eps_high
    seq_pg, seq_kl, counts, tot = (
        [],
        [],
        [],
        {"low": 0.0, "high": 0.0, "dual": 0.0, "akl": 0.0, "kl": 0.0, "ratio": 0.0},
    )
    for lp, old, adv, m, ref, isw in rows:
        lp, old, adv, ref, isw, m = (
            f64(lp),
            f64(old),
            f64(adv),
            f64(ref),
            f64(isw),
            (m != 0).double(),
        )
        ratio = torch.exp(torch.clamp(lp - old, -RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
        pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, lo, hi))
        if dual_clip is not None:
            capped = torch.minimum(pg, -dual_clip * adv)
            tot["dual"] += float((((adv < 0) & (pg > -dual_clip * adv)).double() * m).sum())
            pg = torch.where(adv < 0, capped, pg)
        if isw is not None:
            w = isw.detach()
            if is_mode == "tis":
                w = torch.clamp(w, max=is_bounds[1])
            elif is_mode == "icepop":
                w = w * ((w >= is_bounds[0]) & (w <= is_bounds[1])).double()
            pg = pg * w
        kl = torch.zeros_like(lp)
        if ref_logp is not None:
            d = lp - ref
            if kl_clamp == "log-ratio":
                d = torch.clamp(d, -kl_clamp_value, kl_clamp_value)
            if kl_estimator == "k1":
                kl = d
            elif kl_estimator == "k2":
                kl = 0.5 * d**2
            else:
                kl = torch.exp(-d) - 1 + d
            if kl_clamp == "output":
                kl = torch.clamp(kl, -kl_clamp_value, kl_clamp_value)
        seq_pg.append((pg * m).sum())
        seq_kl.append((kl * m).sum())
        counts.append(float(m.sum()))
        with torch.no_grad():
            tot["low"] += float((((adv < 0) & (ratio < lo)).double() * m).sum())
            tot["high"] += float((((adv > 0) & (ratio > hi)).double() * m).sum())
            tot["akl"] += float(((old - lp) * m).sum())
            tot["kl"] += float((kl * m).sum())
            tot["ratio"] += float((ratio * m).sum())
    n_tok = sum(counts)
    n_seq = sum(c > 0 for c in counts)
    if normalizer is not None:
        denom = float(normalizer)
    else:
        denom = {"token-mean": n_tok, "constant": float(padded_numel)}.get(agg, n_seq)
    denom = denom if denom > 0 else 1.0
    if agg == "seq-mean-token-mean":
        pg_l = sum(p / max(c, 1.0) for p, c in zip(seq_pg, counts)) / denom
        kl_l = sum(k / max(c, 1.0) for k, c in zip(seq_kl, counts)) / denom
    else:
        pg_l, kl_l = sum(seq_pg) / denom, sum(seq_kl) / denom
    if not torch.is_tensor(pg_l):  # no sequence at all: keep a graph to differentiate
        pg_l = pg_l + 0.0 * logp.double().sum()
    loss = pg_l + kl_coef * kl_l
    nn = max(n_tok, 1.0)
    metrics = {
        "pg_loss": pg_l.detach(),
        "kl_loss": torch.as_tensor(kl_l).detach(),
        "num_tokens": n_tok,
    }
    metrics.update(
        {
            f"{k}": tot[v] / nn
            for k, v in (
                ("clipfrac_low", "low"),
                ("clipfrac_high", "high"),
                ("dualclip_frac", "dual"),
                ("approx_kl", "akl"),
                ("kl_mean", "kl"),
                ("ratio_mean", "ratio"),
            )
        }
    )
    return loss, metrics


def group_advantages_reference(
    rewards,
    group_index,
    *,
    mode="reinforce++-baseline",
    std_unbiased=False,
    eps=1e-6,
    lengths=None,
    weighting="token",
    whiten_eps=1e-8,
):
    """Per-group Python loop in float64 (for tests and benchmarks); finite rewards only, single
    process."""
    r = rewards.double().tolist()
    ids = group_index.tolist()
    lens = (
        [1.0] * len(r)
        if lengths is None or weighting == "sequence"
        else [float(n) for n in lengths.tolist()]
    )
    centred, adv = [0.0] * len(r), [0.0] * len(r)
    for g in set(ids):
        members = [i for i, k in enumerate(ids) if k == g]
        mu = sum(r[i] for i in members) / len(members)
        dev = [r[i] - mu for i in members]
        ddof = 1 if std_unbiased and len(members) > 1 else 0
        std = (sum(d * d for d in dev) / (len(members) - ddof)) ** 0.5
        for i, d in zip(members, dev):
            centred[i] = d
            adv[i] = d / (std + eps) if mode == "grpo" else d
    if mode == "reinforce++-baseline":
        w = sum(lens)
        mu = sum(n * c for n, c in zip(lens, centred)) / w
        var = sum(n * (c - mu) ** 2 for n, c in zip(lens, centred)) / w
        adv = [(c - mu) / max(var, whiten_eps) ** 0.5 for c in centred]
    return torch.tensor(adv, dtype=torch.float64)
