"""Smoke test of the advantages benchmark (tiny shapes, temp CSV; never asserts speed), and a check
that its Python-loop baseline computes what the op computes (else the speed ratio would compare
different math)."""

from __future__ import annotations

import pytest
import torch
from prorl.kernels import group_advantages

from benchmarks import advantages


def test_advantages_benchmark_smoke(tmp_path, run_main):
    out = tmp_path / "adv.csv"
    args = [*"--groups 4 --n 4 --reps 2 --warmup 0 --threads 1 --out".split(), str(out)]
    rows = run_main(advantages.main, args, out, "speed-up vs python-loop")
    seen = {(r["provider"], r["shape"].split()[-1], r["metric"]) for r in rows}
    for provider in advantages.PROVIDERS:
        for algo in advantages.ALGOS:
            assert (provider, algo, "time") in seen
    assert all(r["mode"] == "forward" for r in rows)


@pytest.mark.parametrize("algo", advantages.ALGOS)
def test_loop_baseline_matches_op(algo):
    shape = advantages.make_shape(8, 16, algo)
    rewards, group_ids, lengths = advantages._inputs(shape, torch.device("cpu"))
    rewards = rewards + 0.1 * torch.arange(rewards.numel()) % 0.7  # not only 0/1
    ids = group_ids.tolist()
    if algo == "grpo":
        loop = advantages.loop_grpo(rewards.double(), ids)
        op = group_advantages(rewards.double(), group_ids, mode="grpo", std_unbiased=True)
    else:
        loop = advantages.loop_reinforce_pp_baseline(rewards.double(), ids, lengths)
        op = group_advantages(rewards.double(), group_ids, mode=algo, lengths=lengths)
    # an independent float64 answer: groups are contiguous blocks of 16
    r = rewards.double().view(8, 16)
    centred = r - r.mean(1, keepdim=True)
    if algo == "grpo":
        want = (centred / (r.std(1, keepdim=True) + advantages.EPS)).reshape(-1)
    else:
        c, w = centred.reshape(-1), lengths.double()
        mu = (w * c).sum() / w.sum()
        want = (c - mu) / ((w * (c - mu) ** 2).sum() / w.sum()).sqrt()
    torch.testing.assert_close(loop, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(op, want, rtol=1e-10, atol=1e-10)
