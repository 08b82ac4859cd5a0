"""The packer at the prorl_v2_1.5b preset's sizes: one rank's step of 32 groups x 16 responses.

    python -m benchmarks packing [--reps 3] [--seed 0] [--groups 32]

Prompts of 100-1024 tokens, responses of 800-8192 (2.2M response tokens), cut into passes of
`trainer.micro_batch_tokens` = 16384 with shared prompts, as `Updater.run` plans them once per step
(packing.plan_update). Prints the host seconds of the plan (median of --reps), the pass count and
the longest sequence the packer hands flash-attn. Nothing runs on a device.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from prorl import packing
from prorl.sampling import Group


def preset_batch(seed: int, num_groups: int = 32) -> packing.StepBatch:
    rng, groups = random.Random(seed), []
    for i in range(num_groups):
        prompt = [rng.randrange(151936) for _ in range(rng.randint(100, 1024))]
        responses = [
            [rng.randrange(151936) for _ in range(rng.randint(800, 8192))] for _ in range(16)
        ]
        logps = [[0.0] * len(r) for r in responses]
        groups.append(Group(i, prompt, responses, logps, [False] * 16, shaped=[0.0] * 16))
    return packing.StepBatch.of(groups, 16, torch.device("cpu"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks packing", description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--groups", type=int, default=32, help="groups of 16 (the preset: 32 a rank)")
    args = ap.parse_args(argv)
    batch = preset_batch(args.seed, args.groups)
    plan = dict(mini_batches=4, budget=16384, share=True, agg="token-mean", max_new=8192)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        minis = packing.plan_update(batch, **plan, lockstep=False)
        times.append(time.perf_counter() - t0)
    passes = [p for m in minis for p in m.passes]
    longest = max(p.packed.max_seqlen_k for p in passes)
    print(
        f"packing: {batch.resp_cu[-1]} response tokens, {len(passes)} passes, "
        f"{statistics.median(times):.2f} s per step's plan (median of {args.reps}), "
        f"longest key run {longest}"
    )
    return 0
