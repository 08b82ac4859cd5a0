"""The ProRL v2 policy loss: token-level PPO-Clip with clip-higher, optional dual clip, a KL penalty
to the reference policy and an optional off-policy (sampler vs trainer) importance-sampling
correction.

    loss, metrics = ppo_loss(logp, old_logp, advantages, mask, ref_logp=ref, kl_coef=1e-4, ...)

Per valid token (docs/recipe.md §3-§4; A = advantage, v = kl_clamp_value):

    r   = exp(clamp(logp - old_logp, -20, 20))
    pg  = max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high))   PPO-Clip, clip-higher
                                                              (eps_high > eps_low)
    pg  = min(pg, -c A)  where A < 0, if dual_clip = c        dual clip, OFF by default
    d   = logp - ref_logp,  d = clamp(d, -v, v)               kl_clamp="log-ratio" (default)
    kl  = d (k1) | d^2 / 2 (k2) | exp(-d) - 1 + d (k3)
    kl  = clamp(kl, -v, v)                                    kl_clamp="output" (OpenRLHF's choice)
    w   = is_weights (detached): as given ("none") | min(w, hi) ("tis")
          | w 1[lo <= w <= hi] ("icepop")
    l   = w pg + kl_coef kl                                   (w scales the policy term only, as
                                                              TRL/verl)

and loss = sum_t s_t l_t, with the aggregation weight s_t of `agg` (m_t = 1 on valid tokens, n_j =
valid tokens of sequence j, D = `normalizer`):

    token-mean            s_t = m_t / D          D default: valid tokens of this call
    seq-mean-token-mean   s_t = m_t / (n_j D)    D default: sequences of this call with n_j > 0
    seq-mean-token-sum    s_t = m_t / D          D default: as seq-mean-token-mean
    constant (Dr.GRPO)    s_t = m_t / D          D default: B*T for padded input; required when
                                                 packed

The normaliser must be GLOBAL: when a mini-batch is split over micro-batches and data-parallel
ranks, each call sees only its share, and a local count makes the gradient scale depend on the split
(docs/ops.md). Compute it once per mini-batch, before the first micro-batch, without a host sync:

    n = sum(mb.mask.sum() for mb in micro_batches).float()  # this rank's valid tokens (token-mean)
    torch.distributed.all_reduce(n)                          # every rank's
    n = n / world_size  # if the gradients are AVERAGED over ranks (DDP, FSDP): undoes that average
    for mb in micro_batches:
        loss, metrics = ppo_loss(..., normalizer=n); loss.backward()

(for the seq-mean modes count sequences instead: `(mask.sum(-1) > 0).sum()` padded). Summed over all
micro-batches and ranks, `loss` is then exactly the global token-mean, and `metrics["pg_loss"]` and
`metrics["kl_loss"]` are this call's share of it.

Gradient. Only `logp` is differentiable (old_logp, ref_logp, advantages and is_weights are
constants). The loss is linear in the per-token terms, so its gradient is known in the forward pass,
in closed form:

    dloss/dlogp_t = s_t (w_t g_pg + kl_coef g_kl)
    g_pg = -A r   where the unclipped branch is taken (and the ratio and dual clips are inactive),
                  else 0
    g_kl = 1 | d | 1 - exp(-d)   (k1 | k2 | k3), 0 where a clamp is active

and NaN where logp, old_logp or the advantage is NaN at a valid token (the loss is NaN then too), as
autograd through the peers' formulas gives: a gradient-norm guard sees it. Masked tokens stay
ignored.

The forward pass stores it (4 bytes per token) and the backward pass is one multiply by the upstream
gradient: one elementwise launch (on triton also the cast to logp's dtype, and for a token-mean
without a normaliser the 1 / count that the one-launch forward learns only at its end).
`ppo_loss_reference` (kernels/reference.py) is the same math written the way verl and TRL write it,
in float64, differentiated by autograd; the tests hold every backend to it.

Backends. The option checks, layouts, aggregation weights and statistics slots are shared torch code
(kernels/_ppo_common.py, also used by linear_ppo_loss); a backend supplies one function, (logp,
per-token inputs, aggregation, options) -> (loss, statistics vector of sums, gradient, gradient
scale or None), registered in `FORWARDS` (dloss/dlogp = gradient * scale; only triton returns a
scale, see below). The aggregation reaches it as s_t = m_t u_t / D with u_t per token (only
seq-mean-token-mean has one; else 1) and D a number, a 0-d tensor, or "count the valid tokens"
(token-mean without a normaliser), so that the kernels compute s_t in their own pass:
    native  (CPU)   one OpenMP pass over the tokens, vectorised (kernels/csrc/ppo_loss.cpp)
    triton  (CUDA)  ONE launch: each program writes its block's partial sums to a workspace; the
                    last program to finish (an atomic completion counter) reduces them in a fixed
                    order (deterministic) into the loss, the statistics and the metric means.
                    Backward: ONE launch. No host sync either way (kernels/ppo_loss_triton.py).
                    Around it only allocations and views, for bool masks and padded [B] advantages
                    (read in place); a numeric mask (`!= 0`), the seq-mean weights and a normaliser
                    tensor of another dtype each cost one small torch op before the launch.
    torch           a dozen elementwise passes (the readable version of the same math)

Layouts. Padded: every per-token input [B, T], advantages [B] (one per sequence) or [B, T]. Packed:
every per-token input [N], advantages [N], or [S] together with `cu_seqlens` [S + 1] (the varlen
convention: sequence j holds tokens cu_seqlens[j]:cu_seqlens[j+1]); the seq-mean modes need
`cu_seqlens` when packed, tokens outside [cu_seqlens[0], cu_seqlens[-1]) count as masked. Masked
tokens may hold anything (NaN included): they give 0 and get exactly 0 gradient; a call with no
valid token gives loss 0.

Metrics (detached tensors on the input's device; nothing here syncs with the host):
    pg_loss, kl_loss        the policy and KL terms aggregated like `loss`
                            (loss = pg_loss + kl_coef kl_loss)
    num_tokens              valid tokens of this call
    clipfrac_low, clipfrac_high, clipfrac
                            fraction of valid tokens clipped (zero gradient): A < 0 and
                            r < 1 - eps_low; A > 0 and r > 1 + eps_high; either
                            (TRL's clip_ratio/{low,high,region}_mean)
    dualclip_frac           fraction capped by the dual clip (A < 0 and -A r > -c A)
    approx_kl               mean of old_logp - logp (verl's actor/ppo_kl)
    kl_mean                 mean per-token KL estimate (0 without ref_logp)
    ratio_mean, ratio_max   of r over valid tokens (max 0 when empty)
    is_mean, is_max, is_frac_modified
                            of the raw is_weights, and the fraction truncated (tis) or zeroed
                            (icepop); only when is_weights is given
Means are over this call's valid tokens: to combine calls weight them by num_tokens.
"""

from __future__ import annotations

import torch

from . import _backend
from ._ppo_common import (
    RATIO_LOG_CLAMP,
    PPOOptions,
    aggregation_weights,
    check_aggregation,
    flatten_inputs,
    metrics_from_stats,
    token_scale,
)
from .reference import ppo_loss_reference

__all__ = ["FORWARDS", "ppo_loss", "ppo_loss_reference"]


# --------------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------------


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k2",
    kl_clamp: str = "log-ratio",
    kl_clamp_value: float = 10.0,
    is_weights: torch.Tensor | None = None,
    is_mode: str = "none",
    is_bounds: tuple[float, float] = (0.5, 5.0),
    agg: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-Clip-Higher + KL loss, aggregated; see the module docstring for the math and the layouts.

    Args:
        logp: [B, T] or packed [N] log-probs of the sampled tokens under the current policy
            (fp32/bf16/ fp16/fp64), the only differentiable input.
        old_logp: like logp, under the policy that collected the batch (pi_old).
        advantages: [B] or [B, T] (padded); [N], or [S] with cu_seqlens (packed).
        mask: like logp, bool or numeric; nonzero marks a valid (response) token.
        eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] (v2: 0.2, 0.28).
        dual_clip: c > 1 caps the loss of A < 0 tokens at -c A; None (default) disables it.
        ref_logp: like logp, under the reference policy; None disables the KL term.
        kl_coef: beta, the weight of the KL term (docs/recipe.md default 1e-4 is the caller's to
            pass).
        kl_estimator: "k1" | "k2" | "k3" on d = logp - ref_logp.
        kl_clamp, kl_clamp_value: "log-ratio" clamps d to [-v, v] first; "output" clamps the
            estimate; "none"; v = kl_clamp_value (10.0).
        is_weights: like logp, sampler-vs-trainer importance weights exp(old_logp - sampler_logp);
            detached.
        is_mode, is_bounds: "none" (use as given) | "tis" (truncate at hi) | "icepop" (zero outside
            [lo, hi]); is_bounds = (lo, hi).
        agg: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum" | "constant".
        normalizer: the GLOBAL denominator D (Python number or 0-d tensor); None uses this call's
            count.
        cu_seqlens: [S + 1] int32/int64 sequence boundaries of a packed batch.
        backend: "native" | "triton" | "torch"; default by device (see `_backend.resolve`).
    Returns (loss, metrics): the 0-d fp32 (fp64 input: fp64) loss, and detached 0-d metric tensors.
    """
    opts = PPOOptions(
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, has_ref=ref_logp is not None,
        kl_coef=kl_coef, kl_estimator=kl_estimator, kl_clamp=kl_clamp,
        kl_clamp_value=kl_clamp_value, has_is=is_weights is not None, is_mode=is_mode,
        is_bounds=is_bounds,
    )  # fmt: skip
    check_aggregation(agg, normalizer)
    name = _backend.resolve(logp.device, backend)
    like = {"old_logp": old_logp, "mask": mask, "ref_logp": ref_logp, "is_weights": is_weights}
    # triton reads a padded batch's [B] advantages in place: row_advantages
    seq = agg.startswith("seq-")
    tok = flatten_inputs(
        logp, advantages, cu_seqlens, like, need_seq=seq, row_advantages=name == "triton"
    )
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    aggregation = aggregation_weights(tok, agg, normalizer, cdt)
    loss, stats = _PPOLoss.apply(logp, tok, aggregation, opts, name)
    return loss, metrics_from_stats(stats, opts)


class _PPOLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, tok, aggregation, opts, backend):
        forward = FORWARDS[backend]
        # the kernel also writes the metric means
        kw = {"with_means": True} if backend == "triton" else {}
        loss, stats, grad, grad_scale = forward(
            logp.reshape(-1), tok, aggregation, opts, need_grad=ctx.needs_input_grad[0], **kw
        )
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for `stats` (a launch on CUDA)
        ctx.save_for_backward(grad, grad_scale)
        ctx.shape, ctx.dtype, ctx.backend = logp.shape, logp.dtype, backend
        return loss, stats

    @staticmethod
    def backward(ctx, g_loss, g_stats):
        grad, grad_scale = ctx.saved_tensors
        if g_loss is None:  # materialize_grads is off: nothing flowed into the loss
            return None, None, None, None, None
        if ctx.backend == "triton":  # one launch: product, scale and cast to logp's dtype
            from . import ppo_loss_triton

            g = ppo_loss_triton.ppo_backward(grad, g_loss, grad_scale, ctx.dtype)
        else:
            g = grad * g_loss if grad_scale is None else grad * (g_loss * grad_scale)
            g = g.to(ctx.dtype)
        return g.view(ctx.shape), None, None, None, None


# --------------------------------------------------------------------------------------------------
# Backends: per-token terms, the weighted sum, the closed-form gradient and the statistics
# --------------------------------------------------------------------------------------------------


def _torch_forward(logp, tok, aggregation, opts, need_grad):
    """Returns (loss 0-d, stats [len(STATS)] sums and maxima, grad [N] or None, grad_scale) in the
    compute dtype; dloss/dlogp = grad * grad_scale, or grad itself when grad_scale is None (always,
    here)."""
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    scale = token_scale(tok, aggregation, cdt)
    valid = tok["valid"]
    zero = torch.zeros((), dtype=cdt, device=logp.device)
    # masked tokens may hold NaN/inf: never read them
    clean = lambda x: torch.where(valid, x.to(cdt), zero)
    lp, old, adv = clean(logp), clean(tok["old"]), clean(tok["adv"])
    vf = valid.to(cdt)
    t = _clipped_terms(lp, old, adv, valid, opts)
    if opts.has_is:
        t["w_raw"] = w_raw = clean(tok["isw"])
        t["w"] = w = _apply_is_mode(w_raw, opts)
        t["is_modified"] = valid & (w != w_raw)
    wpg = t["pg"] if t["w"] is None else t["w"] * t["pg"]
    kl = kl_grad = None
    if opts.has_ref:
        kl, kl_grad = _kl_and_grad(lp - clean(tok["ref"]), opts)
        kl = kl * vf
    t["kl"] = kl
    pg_sum = (scale * wpg).sum()
    kl_sum = (scale * kl).sum() if kl is not None else zero
    loss = pg_sum + opts.kl_coef * kl_sum if kl is not None else pg_sum
    grad = None
    if need_grad:
        g_pg = torch.where(t["live"], -adv * t["ratio"], zero)
        if t["w"] is not None:
            g_pg = t["w"] * g_pg
        if kl_grad is not None and opts.kl_coef != 0.0:
            g_pg = g_pg + opts.kl_coef * kl_grad
        grad = scale * g_pg
        # a NaN log-prob, old log-prob or advantage at a valid token reaches the gradient, as in
        # autograd (the selects above would turn it into 0, hiding it from a gradient-norm guard)
        probe = lp - old + adv
        grad = torch.where(torch.isnan(probe), probe, grad)
    return loss, _torch_stats(t, (pg_sum, kl_sum), (lp, old, vf), zero), grad, None


def _clipped_terms(lp, old, adv, valid, opts) -> dict:
    """The clipped policy-gradient term of each token [N] (`pg`), where its gradient flows (`live`:
    through -A r, not clipped, ratio in range), the ratio, and the clip and dual-clip indicators."""
    log_ratio = lp - old
    ratio_ok = log_ratio.abs() <= RATIO_LOG_CLAMP
    ratio = torch.exp(log_ratio.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
    lo, hi = 1.0 - opts.eps_low, 1.0 + opts.eps_high
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(lo, hi)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    live = (pg_unclipped >= pg_clipped) & ratio_ok
    clip_low = valid & (adv < 0) & (ratio < lo)
    clip_high = valid & (adv > 0) & (ratio > hi)
    if opts.dual_clip is not None:
        cap = -opts.dual_clip * adv
        capped = (adv < 0) & (pg > cap)
        pg = torch.where(capped, cap, pg)
        live = live & ~capped
        dual = valid & capped
    else:
        dual = torch.zeros_like(valid)
    return dict(
        pg=pg, live=live, ratio=ratio, clip_low=clip_low, clip_high=clip_high, dual=dual, w=None
    )


def _torch_stats(t: dict, sums, inputs, zero):
    """The statistics vector, in the slot order of _ppo_common.STATS."""
    (pg_sum, kl_sum), (lp, old, vf) = sums, inputs
    cdt = zero.dtype
    clip_low, clip_high, kl, w = t["clip_low"], t["clip_high"], t["kl"], t["w"]
    ratio_v = t["ratio"] * vf
    return torch.stack(
        [
            pg_sum,
            kl_sum,
            vf.sum(),
            clip_low.to(cdt).sum(),
            clip_high.to(cdt).sum(),
            (clip_low | clip_high).to(cdt).sum(),
            t["dual"].to(cdt).sum(),
            ((old - lp) * vf).sum(),
            ratio_v.sum(),
            ratio_v.amax() if ratio_v.numel() else zero,
            kl.sum() if kl is not None else zero,
            t["w_raw"].sum() if w is not None else zero,
            t["w_raw"].amax() if w is not None and t["w_raw"].numel() else zero,
            t["is_modified"].to(cdt).sum() if w is not None else zero,
        ]
    )


def _apply_is_mode(w, opts):
    lo, hi = opts.is_bounds
    if opts.is_mode == "tis":
        return w.clamp(max=hi)
    if opts.is_mode == "icepop":
        return torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
    return w


def _kl_and_grad(d, opts):
    """Per-token KL estimate on d = logp - ref_logp and its derivative in d (0 where a clamp is
    active)."""
    v = opts.kl_clamp_value
    one = torch.ones_like(d)
    if opts.kl_clamp == "log-ratio":
        inside = d.abs() <= v
        d = d.clamp(-v, v)
    if opts.kl_estimator == "k1":
        kl, g = d, one
    elif opts.kl_estimator == "k2":
        kl, g = 0.5 * d * d, d
    else:
        e = torch.exp(-d)
        kl, g = e - 1.0 + d, 1.0 - e
    if opts.kl_clamp == "log-ratio":
        g = torch.where(inside, g, torch.zeros_like(g))
    elif opts.kl_clamp == "output":
        g = torch.where(kl.abs() <= v, g, torch.zeros_like(g))
        kl = kl.clamp(-v, v)
    return kl, g


def _native_forward(logp, tok, aggregation, opts, need_grad):
    """The torch.ops.prorl.ppo_forward kernel (kernels/csrc/ppo_loss.cpp); same contract as
    _torch_forward."""
    denom = aggregation.denom
    loss, stats, grad = torch.ops.prorl.ppo_forward(
        logp,
        tok["old"],
        tok["adv"],
        tok["valid"],
        tok["ref"],
        tok["isw"],
        aggregation.weight,
        denom if torch.is_tensor(denom) else None,
        0.0 if denom is None or torch.is_tensor(denom) else denom,  # 0: count the valid tokens
        opts.eps_low,
        opts.eps_high,
        opts.dual_clip or 0.0,  # 0: off
        opts.kl_coef,
        opts.kl_estimator_code,
        opts.kl_clamp_code,
        opts.kl_clamp_value,
        opts.is_mode_code,
        *opts.is_bounds,
        need_grad,
    )
    return loss, stats, (grad if need_grad else None), None


def _triton_forward(logp, tok, aggregation, opts, need_grad, with_means=False):
    from . import ppo_loss_triton

    return ppo_loss_triton.ppo_forward(logp, tok, aggregation, opts, need_grad, with_means)


# backend name -> forward (module docstring, "Backends"); linear_ppo_loss runs them on each row
# block
FORWARDS = {"torch": _torch_forward, "native": _native_forward, "triton": _triton_forward}
