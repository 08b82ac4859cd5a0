"""Two processes (gloo, CPU): a batch split over ranks gives the single-process result.

- batch_whiten / group_advantages with process_group: one all-reduce of per-rank (W, mean, M2),
  merged with Chan's formula, equals whitening the concatenated batch (also far from zero, where a
  naive sum-of-squares merge would fail);
- ppo_loss token-mean with normalizer = all_reduce(mask.sum()): the per-rank losses sum to the
  single-process loss, and each rank's gradient is its slice of the single-process gradient.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prorl.kernels import batch_whiten, group_advantages, ppo_loss

WORLD = 2


def _data():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g, dtype=torch.float64).round()
    groups = torch.arange(12) // 4  # 3 groups of 4: rank 0 gets group 0, rank 1 groups 1 and 2
    lengths = torch.randint(1, 300, (12,), generator=g)
    logp = -torch.rand(6, 10, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(6, 10, generator=g, dtype=torch.float64) * 0.5
    ref = logp + torch.randn(6, 10, generator=g, dtype=torch.float64) * 0.5
    mask = torch.arange(10)[None, :] < torch.tensor([10, 3, 7, 1, 9, 5])[:, None]
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    return rewards, groups, lengths, logp, old, ref, mask, adv


def _loss(logp, old, adv, mask, ref, normalizer=None):
    logp = logp.clone().requires_grad_()
    loss, _ = ppo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, normalizer=normalizer)
    loss.backward()
    return loss.detach(), logp.grad


def _worker(rank, init_file, queue):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
        )
        rewards, groups, lengths, logp, old, ref, mask, adv = _data()
        pg = dist.group.WORLD
        part = slice(0, 4) if rank == 0 else slice(4, 12)  # unequal shares, whole groups
        # at 1e8 the inputs themselves carry ~1e-8 rounding; sum(x^2) - (sum x)^2 / n would lose it
        # all
        for offset, tol in ((0.0, 1e-12), (1e8, 1e-6)):
            values = rewards + offset
            want = batch_whiten(values, lengths)
            got = batch_whiten(values[part], lengths[part], process_group=pg)
            torch.testing.assert_close(got, want[part], rtol=tol, atol=tol)
        for weighting in ("token", "sequence"):
            want = group_advantages(rewards, groups, lengths=lengths, weighting=weighting)
            got = group_advantages(
                rewards[part],
                groups[part],
                lengths=lengths[part],
                weighting=weighting,
                process_group=pg,
            )
            torch.testing.assert_close(got, want[part], rtol=1e-12, atol=1e-12)
        rows = slice(0, 2) if rank == 0 else slice(2, 6)
        want_loss, want_grad = _loss(logp, old, adv, mask, ref)
        n = mask[rows].sum().to(torch.float64)
        dist.all_reduce(n, group=pg)  # the global token count: a device tensor, no host sync
        loss, grad = _loss(logp[rows], old[rows], adv[rows], mask[rows], ref[rows], normalizer=n)
        total = loss.clone()
        dist.all_reduce(total, group=pg)
        torch.testing.assert_close(total, want_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, want_grad[rows], rtol=1e-12, atol=1e-12)
        queue.put((rank, None))
    except Exception as exc:  # report instead of hanging the other rank's collectives
        queue.put((rank, repr(exc)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="gloo backend unavailable"
)
def test_two_ranks_equal_single_process(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _worker, args=(str(tmp_path / "init"), queue), nprocs=WORLD, join=True, start_method="spawn"
    )
    results = dict(queue.get() for _ in range(WORLD))
    assert results == {0: None, 1: None}
