"""Benchmark of `prorl.kernels.group_advantages` against a per-group Python loop, as naive trainers write it.

    python -m benchmarks advantages [--quick] [--threads N] [--groups G1,G2] [--n 16] [--algos a,b]

The op: one advantage per response from its scalar reward and its group (the n responses to one prompt),
for G groups of n = 16 responses (B = G n), float32 rewards in {0, 1}, response lengths uniform in
[1, 1024] tokens, groups contiguous and in order. Two algorithms (the `shape` column names it):
- `reinforce++-baseline` (ProRL v2): reward minus its group mean, then whitened over the whole batch with
  token weights (each response weighs its length);
- `grpo` (ProRL v1): (reward - group mean) / (group std + 1e-6), the UNBIASED std as verl computes it
  (our op with std_unbiased=True).
Only mode `forward` exists (nothing to differentiate); rows are time and peak extra memory.

Providers:
- `prorl`: `group_advantages(rewards, group_ids, ...)`; group ids of any value, remapped with torch.unique.
- `prorl-dense`: the same with `num_groups=G` (ids already dense in [0, G): no torch.unique).
- `python-loop`: verl's compute_grpo_outcome_advantage / compute_reinforce_plus_plus_baseline_outcome_
  advantage transcribed (a Python loop over the responses filling a dict of per-group score lists, torch
  mean/std per group, a loop writing each response's advantage), then for reinforce++-baseline a
  vectorised token-weighted whitening over the per-response values (verl whitens the [B, T] token
  tensor, which weighs each response by its length the same way; the per-response form is cheaper and
  is what is timed). Its group ids arrive as a Python list (verl's are a numpy array of uid strings),
  built outside the timed call.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from benchmarks import harness

NAME = "advantages"
PROVIDERS = ("prorl", "prorl-dense", "python-loop")
ALGOS = ("reinforce++-baseline", "grpo")
GROUPS = (256, 4096)
QUICK_GROUPS = (32,)
N_PER_GROUP = 16
MAX_LEN = 1024
EPS = 1e-6


def loop_grpo(scores, index, epsilon=EPS):
    """verl's compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo=True), on [B] scores, a list of ids."""
    import torch

    scores = scores.clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx] = torch.tensor(0.0)
            id2std[idx] = torch.tensor(1.0)
        else:
            id2mean[idx] = torch.mean(torch.tensor(id2score[idx]))
            id2std[idx] = torch.std(torch.tensor([id2score[idx]]))
    for i in range(bsz):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores


def loop_reinforce_pp_baseline(scores, index, lengths, eps=1e-8):
    """verl's reinforce++-baseline loop (group means subtracted), then token-weighted whitening."""
    import torch

    scores = scores.clone()
    id2score, id2mean = defaultdict(list), {}
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx] = torch.tensor(0.0)
        else:
            id2mean[idx] = torch.mean(torch.tensor(id2score[idx]))
    for i in range(bsz):
        scores[i] = scores[i] - id2mean[index[i]]
    w = lengths.to(scores.dtype)
    mean = (w * scores).sum() / w.sum()
    var = (w * (scores - mean) ** 2).sum() / w.sum()
    return (scores - mean) * torch.rsqrt(var.clamp_min(eps))


def make_shape(groups: int, n: int, algo: str) -> dict:
    return dict(G=groups, n=n, algo=algo, label=f"G={groups} n={n} B={groups * n} {algo}")


def _inputs(shape: dict, device):
    import torch

    b = shape["G"] * shape["n"]
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(b, generator=g) < 0.5).float().to(device)
    lengths = torch.randint(1, MAX_LEN + 1, (b,), generator=g).to(device)
    group_ids = (torch.arange(b) // shape["n"]).to(device)
    return rewards, group_ids, lengths


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` on `shape` (mode `forward` only)."""
    if mode != "forward":
        return None
    rewards, group_ids, lengths = _inputs(shape, device)
    algo = shape["algo"]
    if provider in ("prorl", "prorl-dense"):
        from prorl.kernels import group_advantages

        kw = dict(mode=algo, lengths=lengths) if algo != "grpo" else dict(mode=algo, std_unbiased=True)
        if provider == "prorl-dense":
            kw["num_groups"] = shape["G"]
        return harness.Step(run=lambda: group_advantages(rewards, group_ids, **kw), note=f"algo={algo}")
    if provider == "python-loop":
        ids = group_ids.tolist()  # verl: a numpy array of uid strings, already on the host
        if algo == "grpo":
            return harness.Step(run=lambda: loop_grpo(rewards, ids), note="verl_style_loop")
        return harness.Step(
            run=lambda: loop_reinforce_pp_baseline(rewards, ids, lengths), note="verl_style_loop"
        )
    raise ValueError(f"unknown provider {provider!r}")


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"G in {QUICK_GROUPS}, 2 reps (seconds)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--groups", default=None, help=f"comma-separated group counts G (default {GROUPS})")
    p.add_argument("--n", type=int, default=N_PER_GROUP, help="responses per group")
    p.add_argument("--algos", type=harness.subset_of(ALGOS), default=",".join(ALGOS), help="comma-separated")


def _shapes(args) -> list[dict]:
    groups = (
        [int(x) for x in args.groups.split(",")] if args.groups else QUICK_GROUPS if args.quick else GROUPS
    )
    return [make_shape(g, args.n, a) for g in groups for a in args.algos]


BENCHMARK = harness.Benchmark(NAME, PROVIDERS, _shapes, _options, modes=("forward",), reps=(10, 2))
main = BENCHMARK.main

if __name__ == "__main__":
    sys.exit(main())
