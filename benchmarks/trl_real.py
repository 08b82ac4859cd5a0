"""SmolLM2-135M-Instruct, prorl vs TRL's GRPOTrainer on the CPU: phases, time to accuracy, MFU.

    python -m benchmarks trl_real [--quick] [--threads 1] [--task oneshot/digit_sums] [--steps 8]
        [--prorl-steps N] [--seeds 0] [--prompts 4] [--n 8] [--max-new 32] [--lr 3e-5] [--kl 1e-3]
        [--eval-every 2] [--eval-n 40]

Each provider trains the same real model in its own worker process with rl_step.py's equal-work
settings (`rl_step.prorl_trainer`, `_rl_step_peers.run_trl`), on a built-in task chosen by --task.
Every `--eval-every` steps (and before the first) the worker pauses its clock and scores the policy
with one evaluator for both: the weights copied into a fresh prorl decoder, `prorl.eval.validate`
greedy on `--eval-n` held-out problems (the same problems for every seed; a seed sets the trainers'
data order and sampling). Rows: per phase time (ms, steps after the warm-up), the
peak resident set (MB), the step's model FLOP/s against the sgemm peak measured in the same worker
(`mfu`), held-out pass@1 at each evaluation with the training wall time to it, and the 1-minute load
average at start and end. Details: docs/real-model.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import os
import re
import time
from pathlib import Path

import torch

from benchmarks import harness, plot, rl_step
from benchmarks.report.readme import VIEWS

NAME = "trl_real"
PROVIDERS = ("prorl", "trl")
MEASURE = "benchmarks.trl_real:measure"
MODEL = "gguf:"  # SmolLM2-135M-Instruct's conversion (prorl.model_dir)
PHASES = ("gen", "reward", "old_logp", "update", "other", "step")
# the real model's prompts (chat template and system prompt) are longer than the toy's 64
OVERRIDES = ["data.max_prompt_tokens=256", "trainer.val_samples=1", "trainer.val_temperature=0.0"]
# TRL trains on through steps whose groups all score alike (only its KL term moves the weights);
# prorl, which would stop a run after 5 such steps in a row, does the same here
OVERRIDES += ["trainer.max_consecutive_skips=1000000"]


def work(args, seed: int) -> dict:
    """One run's settings: the command line's, trained with `seed`."""
    q = args.quick
    w = dict(task=args.task, prompts=args.prompts or (2 if q else 4), n=args.n or (2 if q else 8))
    w.update(max_new=args.max_new or (16 if q else 32), lr=args.lr, kl=args.kl, no_stop=False)
    w.update(steps=args.steps or (2 if q else 8), eval_every=args.eval_every or 2)
    w.update(prorl_steps=args.prorl_steps or w["steps"], seed=seed)
    w.update(val_n=args.eval_n or (4 if q else 40))
    w.update(trl_micro=min(args.trl_micro, w["prompts"] * w["n"]))  # --quick's step is 4
    w.update(overrides=[*OVERRIDES, f"seed={seed}"])
    label = (
        f"{args.task} P={w['prompts']} n={w['n']} L={w['max_new']} lr={args.lr:g} kl={args.kl:g}"
    )
    steps = f"steps={w['steps']}" + (
        f"/{w['prorl_steps']}" if w["prorl_steps"] != w["steps"] else ""
    )
    return dict(w, label=f"{label} {steps} seed={seed}")


# --- What a worker measures besides the step ----------------------------------------------------


def sgemm_gflops(size: int = 1024, reps: int = 20) -> float:
    """The best fp32 matmul rate (GFLOP/s) of `reps` [size, size] @ [size, size] products on this
    process's torch threads: the peak the MFU is measured against."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = math.inf
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def model_flops(path: str, prompt_tokens: float, response_tokens: float, samples: int) -> float:
    """Model FLOPs of one RL step over the tokens a trainer processes: `prompt_tokens` (summed over
    the step's samples; once per group where prompts are shared) + `response_tokens`. Generation
    (a forward per token), the reference's forward and the update's forward + backward (2
    forwards): 5 forwards' worth per token. A forward is 2 FLOPs per matmul weight (the tied head
    counted as a matmul) plus attention's QK^T and PV, 4 * d per layer per token attended, at the
    mean attended length (roughly: half a sample's tokens)."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    d, layers, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = d // c["num_attention_heads"] * c.get("num_key_value_heads", c["num_attention_heads"])
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * c["intermediate_size"]
    tokens = prompt_tokens + response_tokens
    attended = tokens / samples / 2  # causal: half a sample's sequence, on average
    return 5 * tokens * (2 * (layers * per_layer + d * v) + 4 * d * layers * attended)


def descendants_hwm_mb() -> float:
    """The resident-set high-water marks (MB) of this process's live child processes (prorl's
    reward workers), summed."""
    total = 0.0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{task}/children") as f:
                for pid in f.read().split():
                    with contextlib.suppress(OSError, StopIteration):
                        with open(f"/proc/{pid}/status") as s:
                            line = next(x for x in s if x.startswith("VmHWM:"))
                        total += int(line.split()[1]) / 1024
    return total


class Evaluator:
    """Held-out pass@1 of a policy's weights, the same code for both providers: the named tensors
    (prorl's decoder names; transformers' `model.` prefix stripped) copied into a fresh prorl
    decoder, `prorl.eval.validate` greedy on the task's validation split, the decoder then freed."""

    def __init__(self, w: dict, path: str, pool):
        from transformers import PreTrainedTokenizerFast

        from prorl.config import load_config
        from prorl.data import builtin

        self.path, self.pool = path, pool
        self.tok = PreTrainedTokenizerFast.from_pretrained(path)
        self.val = builtin(w["task"], n=w["val_n"], seed=0, split="val")
        self.cfg = load_config("default", rl_step.prorl_overrides(w, path, False) + OVERRIDES)
        self.seconds = 0.0

    @torch.no_grad()
    def __call__(self, named: dict | None) -> float:
        """pass@1 of the weights `named` (None: the checkpoint's own)."""
        from prorl.engine.model import load_hf
        from prorl.engine.model.hf_io import our_name
        from prorl.engine.rollout import NativeGenerator

        from prorl.eval import validate

        t0 = time.perf_counter()
        model = load_hf(self.path, dtype=torch.float32)
        state = model.state_dict()
        for name, tensor in (named or {}).items():
            if our_name(name) in state:
                state[our_name(name)].copy_(tensor.detach())
        out = validate(self.cfg, self.val, model, self.tok, self.pool, NativeGenerator(model))
        del model, state
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # the decoder's pages back before the next step
        self.seconds += time.perf_counter() - t0
        return out["val/accuracy"]


# --- The two trainers ----------------------------------------------------------------------------


def evaluate_at(w: dict, k: int, last: int, rec: dict, trained_s: float, evaluate, weights):
    """After step `k` of `last`: at every `eval_every`-th and the last, `rec["val"]` and the
    training seconds before it (`trained_s`, evaluations excluded)."""
    if k % w["eval_every"] == 0 or k == last:
        rec.update(val=evaluate(weights()), trained_s=trained_s)


def train_prorl(w: dict, path: str, memory, pool, evaluate) -> tuple[list[dict], str]:
    """`w["prorl_steps"]` prorl steps (rl_step.prorl_trainer); per step the phases, its wall time,
    the tokens and the peak resident set (the reward worker's mark added)."""
    run = rl_step.prorl_trainer(w, path, gpu=False, pool=pool)
    records, trained = [], 0.0
    for k in range(1, w["prorl_steps"] + 1):
        memory.start()
        t0 = time.perf_counter()
        rec = run.step()
        rec["prompt_tokens"] /= w["n"]  # processed once per group: shared (prorl/packing.py)
        rec["step"] = time.perf_counter() - t0
        rec["peak_rss"] = (memory.stop() or (math.nan,))[0] + descendants_hwm_mb()
        trained += rec["step"]
        weights = run.trainer.policy.state_dict
        evaluate_at(w, k, w["prorl_steps"], rec, trained, evaluate, weights)
        records.append(rec)
    return records, f"gen={run.sampler} logp=fused packed shared-prompts kl=k2"


def train_trl(w: dict, path: str, memory, evaluate) -> tuple[list[dict], str]:
    """The same with TRL's GRPOTrainer (`_rl_step_peers.run_trl`), evaluated from its callback
    between one step's interval and the next."""
    from benchmarks._rl_step_peers import run_trl

    trained = []

    def on_step(model, rec):
        trained.append(rec["step"])
        evaluate_at(w, len(trained), w["steps"], rec, sum(trained), evaluate, model.state_dict)

    return run_trl(w, path, w["steps"], memory, False, on_step=on_step)


def measure(spec: dict, provider: str, mode: str, w: dict, device) -> list[dict]:
    """harness.worker_main's measure: one provider's training run, its rows (module docstring)."""
    from prorl.model_dir import resolve_model_path
    from prorl.rewards.pool import RewardPool

    path, memory = resolve_model_path(spec["options"]["model"]), harness.PeakMemory(device)
    w = dict(w, warmup=spec["warmup"])
    load = [os.getloadavg()[0]]
    peak = [sgemm_gflops()]
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        evaluate = Evaluator(w, path, pool)
        start = dict(step=0.0, val=evaluate(None), trained_s=0.0)
        if provider == "prorl":
            records, note = train_prorl(w, path, memory, pool, evaluate)
        elif provider == "trl":
            records, note = train_trl(w, path, memory, evaluate)
        else:
            raise ValueError(f"unknown provider {provider!r}; known: {PROVIDERS}")
    peak.append(sgemm_gflops())
    load.append(os.getloadavg()[0])
    note += f" threads={torch.get_num_threads()} eval_s={evaluate.seconds:.0f}"
    return rows(w, path, [start, *records], max(peak), load, note)


def rows(w: dict, path: str, records: list[dict], peak: float, load: list, note: str) -> list:
    """The CSV rows of one run: phases and rates over the steps after the warm-up, the curve."""
    timed = records[1 + w["warmup"] :] or records[1:]
    row = lambda mode, metric, unit, xs: harness.row(metric, unit, xs, mode=mode, note=note)
    for r in timed:
        r["other"] = r["step"] - sum(r[p] for p in PHASES[:4])
    out = [row(p, "time", "ms", [r[p] * 1e3 for r in timed]) for p in PHASES]
    samples = w["prompts"] * w["n"]
    flops = [model_flops(path, r["prompt_tokens"], r["tokens"], samples) for r in timed]
    flops = [f / r["step"] / 1e9 for f, r in zip(flops, timed)]
    out.append(row("step", "gflops", "GFLOP/s", flops))
    out.append(row("step", "mfu", "%", [100 * f / peak for f in flops]))
    out.append(row("step", "sgemm_peak", "GFLOP/s", [peak]))
    out.append(row("step", "response_tokens", "tokens", [r["tokens"] for r in timed]))
    out.append(row("step", "peak_memory", "MB", [max(r["peak_rss"] for r in records[1:])]))
    out.append(row("step", "load_1min", "load", load))
    for k, r in enumerate(records):
        if "val" in r:
            out.append(row(f"eval@{k}", "pass@1", "%", [100 * r["val"]]))
            out.append(row(f"eval@{k}", "train_wall", "s", [r["trained_s"]]))
    return out


# --- The parent: time to accuracy, the plot -------------------------------------------------------


def race_key(shape: str) -> str:
    """A run's label without prorl's own step count (`steps=12/36` -> `steps=12`): the runs that
    race the same TRL run."""
    return re.sub(r"(steps=\d+)/\d+", r"\1", shape)


def curve(rows: list[dict], provider: str, shape: str) -> list[tuple[float, float]]:
    """(training seconds, pass@1) of `provider`'s evaluations in run `shape` (or one that races
    the same TRL run), in step order."""
    key = race_key(shape)
    at = lambda metric: {
        r["mode"]: r["p50"]
        for r in rows
        if (r["provider"], race_key(r["shape"]), r["metric"]) == (provider, key, metric)
    }
    acc, wall = at("pass@1"), at("train_wall")
    steps = sorted(acc, key=lambda mode: int(mode.split("@")[1]))
    return [(wall[m], acc[m] / 100) for m in steps]


def mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The seeds' curves averaged point by point (their k-th evaluations are after the same
    step), as long as the shortest."""
    points = list(zip(*curves))
    return [tuple(sum(x) / len(p) for x in zip(*p)) for p in points]


def race(trl: list, ours: list) -> tuple[float, float, float, float]:
    """(target pass@1, TRL's budget in seconds, prorl's seconds to the target, their ratio): the
    target is where TRL's curve ends, prorl's time its first evaluation at or above it. NaN when
    TRL ends at or below its start (there is no accuracy to race to) or prorl never gets there."""
    target, budget = trl[-1][1], trl[-1][0]
    hit = next((t for t, a in ours if a >= target > trl[0][1]), math.nan)
    return target, budget, hit, hit / budget if budget else math.nan


def earlier_trl(rows: list[dict], out: Path) -> list[dict]:
    """When this command ran prorl alone: TRL's evaluations of the same runs (`race_key`) from the
    results CSV `out`, the newest of each, so that a longer prorl run races TRL's earlier one."""
    if any(r["provider"] == "trl" and r["mode"].startswith("eval@") for r in rows):
        return []  # this command ran TRL (its derived `tta` rows do not count)
    if not out.exists():
        return []
    keys, device = {race_key(r["shape"]) for r in rows}, rows[0]["device"]
    found: dict[tuple, dict] = {}
    for r in harness.read_csv(out):
        key = (race_key(r["shape"]), r["mode"], r["metric"])
        if r["provider"] != "trl" or r["device"] != device or key[0] not in keys:
            continue
        newer = key not in found or r["timestamp"] >= found[key]["timestamp"]
        if r["mode"].startswith("eval@") and newer:
            found[key] = r
    return list(found.values())


def time_to_accuracy(rows: list[dict], args) -> list[dict]:
    """Per seed, and on the seeds' mean curves when there are several: TRL's training budget,
    prorl's training seconds to the pass@1 TRL ends at (`race`), and its ratio to the budget.
    TRL's curves come from this command's rows, or from the results CSV (`earlier_trl`)."""
    out = Path(args.out) if args is not None and args.out else harness.RESULTS_DIR / f"{NAME}.csv"
    earlier = earlier_trl(rows, out) if args is not None else []
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["metric"] == "pass@1"))
    runs = {s: (curve(rows + earlier, "trl", s), curve(rows, "prorl", s)) for s in shapes}
    runs = {s: pair for s, pair in runs.items() if all(pair)}
    if len(runs) > 1:
        label = next(iter(runs)).rsplit(" seed=", 1)[0]
        seeds = ",".join(s.rsplit("seed=", 1)[1] for s in runs)
        pairs = list(runs.values())
        means = [mean_curve([pair[i] for pair in pairs]) for i in (0, 1)]
        runs[f"{label} seeds={seeds} mean"] = tuple(means)
    common = {k: rows[0][k] for k in ("name", "git_rev", "timestamp", "device")}
    common["versions"] = rows[0]["versions"].split(" note=")[0]  # not one provider's note
    source = f"; TRL's curve measured {earlier[0]['timestamp']}" if earlier else ""
    out = []
    for shape, (trl, ours) in runs.items():
        target, budget, hit, ratio = race(trl, ours)
        note = f"target pass@1 {100 * target:.1f}%{source}"
        tag = dict(common, shape=shape, mode="tta", note=note)
        out.append(dict(harness.row("time_to_accuracy", "s", [budget]), provider="trl", **tag))
        out.append(dict(harness.row("time_to_accuracy", "s", [hit]), provider="prorl", **tag))
        out.append(dict(harness.row("tta_ratio", "x", [ratio]), provider="prorl", **tag))
    return out


def _plot(csv_path, rows: list[dict], args) -> list:
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["metric"] == "pass@1"))
    rows = rows + earlier_trl(rows, csv_path)
    lines = {}
    for s in shapes:
        seed = f" seed {s.rsplit('seed=', 1)[1]}" if "seed=" in s else ""
        for p in PROVIDERS:
            if pts := curve(rows, p, s):
                lines[f"{p}{seed}"] = pts
    png = csv_path.with_name(f"{csv_path.stem}_pass1.png")
    return [plot.curves(lines, png, "training wall time (min)", "held-out pass@1")] if lines else []


def _options(p) -> None:
    add = p.add_argument
    add("--quick", action="store_true", help="P=2 n=2 L=16, 2 steps, 4 held-out problems")
    add("--model", default=MODEL, help="model directory or gguf:[FILE] (default SmolLM2-135M)")
    add("--task", default="oneshot/digit_sums", help="a built-in task set (prorl.data.builtin)")
    add("--prompts", type=int, help="prompts per step (default 4; --quick 2)")
    add("--n", type=int, help="samples per prompt (default 8; --quick 2)")
    add("--max-new", type=int, help="response budget L (default 32; --quick 16)")
    add("--lr", type=float, default=3e-5, help="learning rate (default 3e-5)")
    add("--kl", type=float, default=1e-3, help="KL coefficient, TRL's beta (default 1e-3)")
    add("--steps", type=int, help="RL steps per provider (default 8; --quick 2)")
    add("--prorl-steps", type=int, help="prorl's steps when not --steps (a longer race to TRL's)")
    seeds = lambda s: [int(x) for x in s.split(",")]
    add("--seeds", type=seeds, default=[0], help="one run per seed per provider (default 0)")
    add("--eval-every", type=int, help="steps between evaluations (default 2)")
    add("--eval-n", type=int, help="held-out problems (default 40; --quick 4)")
    add("--trl-micro", type=int, default=8, help="TRL's micro-batch, completions (default 8)")


settings = dict(modes=("step",), reps=(1, 1), warmup=(1, 1), threads=1, view=VIEWS[NAME])
settings.update(plot=_plot)
settings.update(derive=time_to_accuracy, measure=MEASURE)
shapes = lambda args: [work(args, seed) for seed in args.seeds]
BENCHMARK = harness.Benchmark(NAME, PROVIDERS, shapes, _options, **settings)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
