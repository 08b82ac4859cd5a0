"""Benchmark of `prorl.kernels.group_advantages` against a per-group Python loop (naive trainers).

    python -m benchmarks advantages [--quick] [--threads N] [--groups G1,G2] [--n 16] [--algos a,b]

The `shape` column names the algorithm (`reinforce++-baseline`, `grpo`); mode `forward` only.
Providers: `prorl`, `prorl-dense` (num_groups=G), `python-loop` (verl's). Details:
docs/benchmarks.md.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from benchmarks import harness

NAME = "advantages"
PROVIDERS = ("prorl", "prorl-dense", "python-loop")
ALGOS = ("reinforce++-baseline", "grpo")
GROUPS = (256, 4096)
QUICK_GROUPS = (32,)
MAX_LEN = 1024
EPS = 1e-6


def verl_loop(scores, index, epsilon=None):
    """verl's compute_grpo_outcome_advantage (with `epsilon`: divided by the group std + epsilon) or
    compute_reinforce_plus_plus_baseline_outcome_advantage (without), on [B] scores, a list of
    ids."""
    scores = scores.clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        single = len(group) == 1
        id2mean[idx] = torch.tensor(0.0) if single else torch.mean(torch.tensor(group))
        if epsilon is not None:
            id2std[idx] = torch.tensor(1.0) if single else torch.std(torch.tensor([group]))
    for i in range(scores.shape[0]):
        centred = scores[i] - id2mean[index[i]]
        scores[i] = centred if epsilon is None else centred / (id2std[index[i]] + epsilon)
    return scores


def loop_grpo(scores, index):
    """GRPO's advantages as verl loops over them (norm_adv_by_std_in_grpo=True)."""
    return verl_loop(scores, index, EPS)


def loop_reinforce_pp_baseline(scores, index, lengths, eps=1e-8):
    """verl's reinforce++-baseline loop (group means subtracted), then token-weighted whitening."""
    scores = verl_loop(scores, index)
    w = lengths.to(scores.dtype)
    mean = (w * scores).sum() / w.sum()
    var = (w * (scores - mean) ** 2).sum() / w.sum()
    return (scores - mean) * torch.rsqrt(var.clamp_min(eps))


def make_shape(groups: int, n: int, algo: str) -> dict:
    return dict(G=groups, n=n, algo=algo, label=f"G={groups} n={n} B={groups * n} {algo}")


def _inputs(shape: dict, device):
    b = shape["G"] * shape["n"]
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(b, generator=g) < 0.5).float().to(device)
    lengths = torch.randint(1, MAX_LEN + 1, (b,), generator=g).to(device)
    group_ids = (torch.arange(b) // shape["n"]).to(device)
    return rewards, group_ids, lengths


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` on `shape` (mode `forward` only)."""
    rewards, group_ids, lengths = _inputs(shape, device)
    algo = shape["algo"]
    if provider == "python-loop":
        ids = group_ids.tolist()  # verl: a numpy array of uid strings, already on the host
        run = lambda: loop_reinforce_pp_baseline(rewards, ids, lengths)
        if algo == "grpo":
            run = lambda: loop_grpo(rewards, ids)
        return harness.Step(run=run, note="verl_style_loop")
    from prorl.kernels import group_advantages

    kw = dict(mode=algo, std_unbiased=True) if algo == "grpo" else dict(mode=algo, lengths=lengths)
    if provider == "prorl-dense":
        kw["num_groups"] = shape["G"]
    return harness.Step(run=lambda: group_advantages(rewards, group_ids, **kw), note=f"algo={algo}")


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"G in {QUICK_GROUPS}, 2 reps (seconds)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--groups", type=harness.ints, help=f"group counts G (default {GROUPS})")
    p.add_argument("--n", type=int, default=16, help="responses per group")
    p.add_argument("--algos", type=harness.subset_of(ALGOS), default=",".join(ALGOS))


def _shapes(args) -> list[dict]:
    groups = args.groups or (QUICK_GROUPS if args.quick else GROUPS)
    return [make_shape(g, args.n, a) for g in groups for a in args.algos]


BENCHMARK = harness.Benchmark(NAME, PROVIDERS, _shapes, _options, modes=("forward",), reps=(10, 2))
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
