"""Outcome advantages from per-response rewards: group baselines, global whitening (recipe §2).

    adv = group_advantages(rewards [B], group_index [B], mode="reinforce++-baseline", lengths=...)
    adv = batch_whiten(values, mask, process_group=torch.distributed.group.WORLD)

Modes, for response i of group g (the n responses to one prompt):

    reinforce++-baseline (ProRL v2)  c_i = R_i - mean_g R,
                                     A_i = (c_i - mu) / sqrt(max(sigma^2, 1e-8))
    grpo (ProRL v1)                  A_i = (R_i - mean_g R) / (std_g R + eps)  (population or
                                     unbiased std)
    dr-grpo                          A_i = R_i - mean_g R

where mu and sigma^2 are the mean and POPULATION variance of c over the whole batch, weighted by
each response's token count (`weighting="token"`, what NeMo-RL and OpenRLHF do) or one weight per
response ("sequence"). A group of size 1 is centred to 0 (with a warning on CPU, and a count in the
metrics). Rewards that are not finite (NaN, inf: a crashed verifier) give advantage 0, take no part
in any statistic, and are counted.

Group statistics are segment sums (`index_add_`) over all groups at once: no Python loop over
groups. `group_index` holds any integer ids (a prompt's index in the dataset, say): they are
remapped with `torch.unique`, which costs one host sync on CUDA; pass `num_groups` when the ids
already lie in [0, num_groups) to skip it. Each group must be complete in the call (all n responses
on one rank; the trainer computes advantages before sharding the batch); only the whitening of
reinforce++-baseline merges statistics across ranks.

Whitening across ranks (`batch_whiten`). Each rank reduces its values to (W, mean, M2) — total
weight, weighted mean, and weighted sum of squared deviations from its OWN mean — and the ranks
exchange these triples with ONE all-reduce of a [world, 3] float64 tensor in which each rank fills
its own row (an all-gather built from an all-reduce; gloo and NCCL both support it, and 24 bytes per
rank is nothing). Every rank then merges the rows locally with Chan et al.'s parallel formula

    W = sum_r W_r,   mean = sum_r W_r mean_r / W,   M2 = sum_r M2_r + sum_r W_r (mean_r - mean)^2

whose terms are all non-negative: no sum(x^2) - (sum x)^2 / n cancellation. (Reducing [W, sum, sum
x^2] would also be one all-reduce, but loses every digit of the variance when |mean| >> std;
reducing the count and sum first to get a shared shift would be two collectives.) All statistics are
float64.
"""

from __future__ import annotations

import warnings

import torch

from .options import ADVANTAGE_MODES, WHITEN_WEIGHTINGS
from .reference import group_advantages_reference

__all__ = [
    "ADVANTAGE_MODES",
    "WHITEN_WEIGHTINGS",
    "batch_whiten",
    "group_advantages",
    "group_advantages_reference",
]


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    mode: str = "reinforce++-baseline",
    std_unbiased: bool = False,
    eps: float = 1e-6,
    lengths: torch.Tensor | None = None,
    weighting: str = "token",
    whiten_eps: float = 1e-8,
    num_groups: int | None = None,
    process_group=None,
    return_metrics: bool = False,
):
    """One advantage per response from its scalar reward and its group (module docstring for the
    math).

    Args:
        rewards: [B] float rewards (after shaping, after dynamic-sampling filtering).
        group_index: [B] int64 group (prompt) id of each response; any values, any order.
        mode: "reinforce++-baseline" | "grpo" | "dr-grpo".
        std_unbiased: grpo only: unbiased (n - 1) group std instead of the population std.
        eps: grpo only: added to the group std.
        lengths: [B] response token counts: the whitening weights of reinforce++-baseline under
            weighting="token" (None: equal lengths). A response of length 0 gets advantage 0.
        weighting: "token" | "sequence": how reinforce++-baseline weighs responses in mu and sigma.
        whiten_eps: floor on the whitening variance.
        num_groups: if given, group_index must lie in [0, num_groups) (skips a host sync on CUDA).
        process_group: reinforce++-baseline only: merge the whitening statistics over this group of
            ranks (e.g. torch.distributed.group.WORLD); None: this call's batch only.
        return_metrics: also return a dict of 0-d tensors: num_singleton_groups,
            num_invalid_rewards, whiten_mean, whiten_std (the last two 0 for grpo and dr-grpo).

    Returns:
        adv [B] in the rewards' dtype (float32 for integer rewards), or (adv, metrics).
    """
    _check_group_inputs(rewards, group_index, lengths, mode, weighting)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(torch.float64)
    valid = torch.isfinite(r)
    r = torch.where(valid, r, torch.zeros_like(r))
    gid, n_groups = _group_ids(group_index, num_groups)

    # Per-group count, mean and (two-pass) sum of squared deviations: [G] segment sums.
    count = r.new_zeros(n_groups).index_add_(0, gid, valid.to(r.dtype))
    mean = r.new_zeros(n_groups).index_add_(0, gid, r) / count.clamp_min(1.0)
    centred = torch.where(valid, r - mean[gid], torch.zeros_like(r))  # exactly 0 in a group of one

    singletons = (count == 1).sum()
    invalid = (~valid).sum()
    if r.device.type == "cpu":  # free here; on CUDA the counts are in the metrics instead
        _warn_degenerate(int(singletons), int(invalid))

    zero = r.new_zeros(())
    w_mean, w_std = zero, zero
    if mode == "dr-grpo":
        adv = centred
    elif mode == "grpo":
        m2 = r.new_zeros(n_groups).index_add_(0, gid, centred * centred)
        dof = (count - 1.0) if std_unbiased else count
        std = torch.sqrt(m2 / dof.clamp_min(1.0))  # a group of one: 0 / 1 -> std 0, advantage 0
        adv = centred / (std[gid] + eps)
    else:
        weight = valid.to(torch.float64)
        # token weighting: each response weighs its length; a length of 0 drops it
        if lengths is not None:
            n = lengths.to(torch.float64)
            weight = weight * (n if weighting == "token" else (n > 0).to(n.dtype))
        adv, w_mean, w_std = _whiten(centred, weight, weighting, whiten_eps, process_group)
    adv = torch.where(valid, adv, torch.zeros_like(adv)).to(out_dtype)
    if not return_metrics:
        return adv
    metrics = dict(num_singleton_groups=singletons, num_invalid_rewards=invalid)
    return adv, metrics | dict(whiten_mean=w_mean, whiten_std=w_std)


def _check_group_inputs(rewards, group_index, lengths, mode: str, weighting: str) -> None:
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(ADVANTAGE_MODES)}")
    if weighting not in WHITEN_WEIGHTINGS:
        raise ValueError(
            f"unknown weighting {weighting!r}; choose one of {', '.join(WHITEN_WEIGHTINGS)}"
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if (
        group_index.shape != rewards.shape
        or group_index.dtype.is_floating_point
        or group_index.is_complex()
    ):
        raise ValueError(
            f"group_index must be an integer tensor of rewards' shape {tuple(rewards.shape)}"
        )
    if lengths is not None and lengths.shape != rewards.shape:
        raise ValueError(
            f"lengths {tuple(lengths.shape)} must have rewards' shape {tuple(rewards.shape)}"
        )


def _warn_degenerate(singletons: int, invalid: int) -> None:
    """Warn, from group_advantages' caller, of groups of one and of non-finite rewards (advantage
    0)."""
    if singletons > 0:
        warnings.warn(
            f"{singletons} group(s) of size 1: their centred reward is 0",
            RuntimeWarning,
            stacklevel=3,
        )
    if invalid > 0:
        warnings.warn(f"{invalid} non-finite reward(s): advantage 0", RuntimeWarning, stacklevel=3)


def batch_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    weighting: str = "token",
    eps: float = 1e-8,
    process_group=None,
) -> torch.Tensor:
    """(values - mu) / sqrt(max(sigma^2, eps)) with mu, sigma^2 the weighted POPULATION mean and
    variance.

    Args:
        values: [B] (one value per sequence) or [B, T] / any shape (per token) floats.
        mask: values' shape; bool (valid or not) or a non-negative count per element, e.g. response
            lengths when values holds one value per sequence. Under weighting="token" each element
            weighs its count (1 for a bool mask); under "sequence" each sequence weighs 1: for 1-D
            values every element with a nonzero mask, for [B, T] values each row with a valid token,
            split over its valid tokens.
        eps: variance floor (1e-8).
        process_group: merge the statistics over these ranks with one all-reduce (module docstring),
            e.g. torch.distributed.group.WORLD; None: this call's values only.

    Returns:
        whitened values, values' shape and dtype (float32 for integer values), 0 where mask == 0.
    """
    if weighting not in WHITEN_WEIGHTINGS:
        raise ValueError(
            f"unknown weighting {weighting!r}; choose one of {', '.join(WHITEN_WEIGHTINGS)}"
        )
    if mask.shape != values.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have values' shape {tuple(values.shape)}")
    out_dtype = values.dtype if values.is_floating_point() else torch.float32
    out, _, _ = _whiten(
        values.to(torch.float64), mask.to(torch.float64), weighting, eps, process_group
    )
    return out.to(out_dtype)


def _whiten(x, weight, weighting, eps, process_group):
    """x, weight: float64, same shape. Returns (whitened x, mu, sigma)."""
    present = weight > 0
    if weighting == "sequence":
        if x.dim() <= 1:
            weight = present.to(x.dtype)
        else:  # each row weighs 1 in total, spread over its valid tokens
            rows = present.reshape(x.shape[0], -1)
            per_row = 1.0 / rows.sum(-1).clamp_min(1).to(x.dtype)
            weight = (rows.to(x.dtype) * per_row[:, None]).view(x.shape)
    x = torch.where(present, x, torch.zeros_like(x))  # masked elements may hold NaN
    w_tot = weight.sum()
    mean = (weight * x).sum() / w_tot.clamp_min(torch.finfo(x.dtype).tiny)
    m2 = (weight * (x - mean) ** 2).sum()
    if process_group is not None:
        w_tot, mean, m2 = _merge_across_ranks(w_tot, mean, m2, process_group)
    var = m2 / w_tot.clamp_min(torch.finfo(x.dtype).tiny)
    std = torch.sqrt(var.clamp_min(eps))
    out = torch.where(present, (x - mean) / std, torch.zeros_like(x))
    return out, mean, std


def _merge_across_ranks(w_tot, mean, m2, process_group):
    """One all-reduce of a [world, 3] table of per-rank (W, mean, M2), then Chan's merge on every
    rank."""
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    table = w_tot.new_zeros(world, 3)
    table[dist.get_rank(process_group)] = torch.stack([w_tot, mean, m2])
    dist.all_reduce(table, group=process_group)
    w_r, mean_r, m2_r = table.unbind(1)
    w_tot = w_r.sum()
    mean = (w_r * mean_r).sum() / w_tot.clamp_min(torch.finfo(w_tot.dtype).tiny)
    m2 = m2_r.sum() + (w_r * (mean_r - mean) ** 2).sum()
    return w_tot, mean, m2


def _group_ids(group_index, num_groups):
    """Dense ids in [0, G) and G."""
    if num_groups is None:
        ids, gid = torch.unique(group_index, return_inverse=True)
        return gid.reshape(-1), ids.numel()
    if group_index.device.type == "cpu" and group_index.numel():
        if group_index.min() < 0 or group_index.max() >= num_groups:
            raise IndexError(f"group_index must lie in [0, num_groups={num_groups})")
    return group_index.long(), int(num_groups)
