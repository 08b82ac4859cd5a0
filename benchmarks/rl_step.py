"""End-to-end RL step: prorl's Trainer vs TRL's GRPOTrainer at equal work, per phase, ablations.

    python -m benchmarks rl_step [--quick] [--threads 1] [--models tiny,random]
        [--providers prorl,trl,...]
    python -m benchmarks rl_step --scaling [--quick]  # prorl only: P, n and L doubled
    python -m benchmarks rl_step --gpu                # vLLM rollouts in both, bf16, big model
    python -m benchmarks rl_step --gpu --gpu-gen native --models tiny,random

The mode column names the phase (`PHASES`); prorl's ablations are named by what they switch off
(`ABLATIONS`, combinable). Details: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks import harness, plot
from benchmarks._checkpoints import qwen2_shape, random_checkpoint
from benchmarks.report.readme import View

NAME = "rl_step"
PROVIDERS = ("prorl", "trl", "prorl-nofused", "prorl-noshare", "prorl-nopack", "prorl-hfgen")
PROVIDERS += ("prorl-nofused-nopack-hfgen", "prorl-compile")
PHASES = ("gen", "reward", "old_logp", "update", "sync", "other", "step")  # in this order
# the trainer's metric (timing_s/<name>, verl's names) behind each phase of this benchmark's CSV
METRIC_OF_PHASE = {"old_logp": "old_log_prob", "update": "update_actor", "sync": "update_weights"}
SUMMARY = ("tokens_per_s", "response_tokens", "peak_memory")  # the console's columns after phases
TINY = Path(__file__).resolve().parent.parent / "prorl" / "assets" / "tiny-reasoner"
RANDOM_MODELS = {  # random-weight Qwen2 checkpoints with the tiny reasoner's tokenizer (vocab 100)
    "random": qwen2_shape(256, 768, 4, 4, max_position_embeddings=512),
    "large": qwen2_shape(1024, 2816, 12, 16, max_position_embeddings=4096),
}
LR = 3e-5
KL = 1e-4  # the KL coefficient against the reference (TRL's beta)
MEASURE = "benchmarks.rl_step:measure"  # worker_main's measure: whole trainer steps
GPU_GENS = ("vllm", "native")  # --gpu-gen: the samplers of the --gpu run
ABLATIONS = ("nofused", "nopack", "noshare", "hfgen", "compile")  # the flags of prorl-<flag>-<flag>


def work(model: str, prompts: int, n: int, max_new: int, no_stop: bool = False) -> dict:
    label = f"{model} P={prompts} n={n} L={max_new}" + (" nostop" if no_stop else "")
    shape = dict(model=model, prompts=prompts, n=n, max_new=max_new, no_stop=no_stop, lr=LR)
    return dict(shape, label=label)


def model_path(name: str) -> str:
    """The checkpoint directory of model `name`: the tiny reasoner, or a random one built once."""
    if name == "tiny":
        return str(TINY)
    with open(TINY / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    config = dict(RANDOM_MODELS[name], vocab_size=vocab, rms_norm_eps=1e-6)
    return random_checkpoint(config, tokenizer=TINY)


EQUAL_WORK = (  # the Trainer's fixed overrides (module docstring)
    "seed=0 rollout.temperature=1.0 trainer.mini_batches=1 data.max_prompt_tokens=64",
    "algorithm.dynamic_sampling=false algorithm.eps_low=0.2 algorithm.eps_high=0.28",
    "algorithm.agg=token-mean algorithm.reset.interval=0 algorithm.reset.kl_spike_factor=0",
    "reward.length_penalty=false reward.num_workers=1",
    "optim.weight_decay=0.0 optim.max_grad_norm=1.0",
)


def prorl_overrides(w: dict, path: str, gpu: bool, gen: str = "vllm") -> list[str]:
    """The Trainer's config overrides; on `gpu`, `gen` is the sampler (vllm | native; CPU: the
    default backend, which resolves to native there)."""
    if gpu and gen not in GPU_GENS:
        raise ValueError(f"gen must be one of {GPU_GENS}, got {gen!r}")
    backend = []
    if gpu:
        backend = ["rollout.backend=native"]
        if gen == "vllm":
            backend = ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.3"]
    work = [f"rollout.n={w['n']}", f"rollout.max_response_tokens={w['max_new']}"]
    work += [f"optim.lr={w['lr']}", f"trainer.prompts_per_step={w['prompts']}"]
    work += [f"algorithm.kl_coef={w.get('kl', KL)}"]
    model = [f"model.path={path}", f"model.dtype={'bfloat16' if gpu else 'float32'}"]
    return model + work + " ".join(EQUAL_WORK).split() + backend


def prorl_trainer(w: dict, path: str, *, gpu: bool, gen: str = "vllm", flags=(), pool=None):
    """prorl's Trainer with the benchmark's settings and the ablations `flags` (ABLATIONS) applied.

    The one place that uses the Trainer's API: its constructor, `step()` and its metrics, and the
    attributes the ablations swap. Returns trainer; step() -> the step's phase seconds (gen, reward,
    old_logp, update, sync) and response tokens; sampler (what samples: vllm | native |
    transformers.generate); attention() (the name of the policy's attention backend)."""
    from prorl.engine.rollout import NativeGenerator
    from transformers import PreTrainedTokenizerFast

    import prorl.trainer
    import prorl.update
    from benchmarks._rl_step_peers import HFGenerator, naive_lle, padded_logprobs
    from prorl.config import load_config
    from prorl.data import builtin

    unknown = set(flags) - set(ABLATIONS)
    if unknown:
        raise ValueError(f"unknown prorl variant(s) {sorted(unknown)}; known: {sorted(ABLATIONS)}")
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    task = w.get("task", "digit_sums")  # a built-in task set (prorl.data.builtin)
    train = builtin(task, seed=0, split="train")
    val = builtin(task, n=w.get("val_n", 4), seed=0, split="val")
    cfg = load_config("default", prorl_overrides(w, path, gpu, gen) + w.get("overrides", []))
    trainer = prorl.trainer.Trainer(cfg, path, tok, train, val, pool)
    if w["no_stop"]:
        trainer.sampler.stop_ids = []
    if "compile" in flags:  # the native sampler's decode step under torch.compile (rollout.compile)
        models = trainer.models
        compiled = NativeGenerator(models.sampler_model, compile=True)
        models.generator = trainer.sampler.generator = compiled
    if "noshare" in flags or "nopack" in flags:
        trainer.updater.share = False  # every response packed with its own copy of the prompt
    if "nofused" in flags:
        prorl.update.linear_logprob_entropy = naive_lle  # the module global Updater.logprobs calls
    if "nopack" in flags:  # one sequence per prompt + response, each padded to the longest
        lle = naive_lle if "nofused" in flags else None
        t = trainer.updater.logprob_temperature
        trainer.updater.logprobs = lambda model, batch, grad, entropy=False: padded_logprobs(
            model, batch, t, grad, entropy, lle
        )
    if "hfgen" in flags:
        hf = HFGenerator(trainer.policy, path, tok.pad_token_id or 0)
        trainer.models.generator = trainer.sampler.generator = hf
    names = dict(
        VLLMGenerator="vllm", NativeGenerator="native", HFGenerator="transformers.generate"
    )
    kind = type(trainer.models.generator).__name__
    sampler = names.get(kind, kind)

    def step() -> dict:
        m = trainer.step()
        phases = {p: m[f"timing_s/{METRIC_OF_PHASE.get(p, p)}"] for p in PHASES[:4]}
        phases["old_logp"] += m["timing_s/ref"]  # the no-grad passes: old policy and reference
        sync = m.get("timing_s/update_weights", 0.0)  # weights to the sampler, where it is a copy
        samples = w["prompts"] * w["n"]
        tokens = dict(tokens=m["response_length/mean"] * samples)
        return dict(phases, sync=sync, prompt_tokens=m["prompt_length/mean"] * samples, **tokens)

    attention = lambda: trainer.policy.attention_backend(trainer.device).name
    return SimpleNamespace(trainer=trainer, step=step, sampler=sampler, attention=attention)


def run_prorl(provider: str, w: dict, path: str, steps: int, memory, gpu: bool, gen: str):
    """`steps` prorl steps; returns (per-step records, note). `gen`: the sampler on `gpu`."""
    from prorl.rewards.pool import RewardPool

    flags = provider.split("-")[1:]
    records = []
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        run = prorl_trainer(w, path, gpu=gpu, gen=gen, flags=flags, pool=pool)
        for _ in range(steps):
            memory.start()
            t0 = time.perf_counter()
            rec = run.step()
            if gpu:
                torch.cuda.synchronize()
            rec["step"] = time.perf_counter() - t0
            rec["peak_rss"], rec["peak_extra_memory"] = memory.stop() or (math.nan, math.nan)
            records.append(rec)
    note = "loss=token-mean kl=k2 old_logp=skipped (on-policy: logp.detach())"
    note += f" reward=RewardPool(1 worker) gen={run.sampler}"
    note += " logp=naive" if "nofused" in flags else " logp=fused"
    note += " padded" if "nopack" in flags else " packed"
    note += "" if {"nopack", "noshare"} & set(flags) else " shared-prompts"
    note += (" sampler=compiled" if "compile" in flags else "") + (" dtype=bfloat16" if gpu else "")
    return records, note


def _rows(records: list[dict], note: str) -> list[dict]:
    """Quantile rows of the timed steps (module docstring)."""

    def row(mode, metric, unit, values):
        values = [v for v in values if not math.isnan(v)]
        return harness.row(metric, unit, values, mode=mode, note=note) if values else None

    for r in records:
        r["other"] = r["step"] - sum(r.get(k, 0.0) for k in PHASES[:5])
    rows = [row(p, "time", "ms", [r.get(p, 0.0) * 1e3 for r in records]) for p in PHASES]
    rows.append(row("step", "tokens_per_s", "tok/s", [r["tokens"] / r["step"] for r in records]))
    rows.append(row("step", "response_tokens", "tokens", [r["tokens"] for r in records]))
    rows.append(row("step", "peak_memory", "MB", [r["peak_rss"] for r in records]))
    rows.append(row("step", "peak_extra_memory", "MB", [r["peak_extra_memory"] for r in records]))
    # a sync under 0.5 ms copies nothing: the sampler is the policy itself
    noop_sync = lambda r: r["mode"] == "sync" and r["p80"] < 0.5
    return [r for r in rows if r is not None and not noop_sync(r)]


def measure(spec: dict, provider: str, mode: str, w: dict, device) -> list[dict]:
    """harness.worker_main's measure: `warmup` + `reps` steps of one provider on one shape, the rows
    of the timed ones."""
    gpu, gen = device.type == "cuda", spec["options"]["gpu_gen"]
    path, memory = model_path(w["model"]), harness.PeakMemory(device)
    steps = spec["warmup"] + spec["reps"]
    if provider == "trl":
        from benchmarks._rl_step_peers import run_trl

        if w["no_stop"]:
            raise ValueError("the nostop (scaling) settings are prorl-only")
        records, note = run_trl(w, path, steps, memory, gpu, gen)
    elif provider.split("-")[0] == "prorl":
        records, note = run_prorl(provider, w, path, steps, memory, gpu, gen)
    else:
        raise ValueError(f"unknown provider {provider!r}")
    if len(records) != steps:
        raise RuntimeError(f"{len(records)} steps recorded, expected {steps}")
    return _rows(records[spec["warmup"] :], f"{note} threads={torch.get_num_threads()}")


# --- Summary and plots (the parent) ---------------------------------------------------------------


def newest_runs(path: Path, device: str | None, scaling: bool) -> list[dict]:
    """Rows of the CSV for the plots: per shape, only the newest invocation that measured it
    (providers are compared within one invocation, never across), on `device` (None: the newest
    row's device)."""
    rows = [r for r in harness.read_csv(path) if ("nostop" in r["shape"]) == scaling]
    device = device or max(rows, key=lambda r: r["timestamp"], default={}).get("device")
    rows = [r for r in rows if r["device"] == device]
    last = {}
    for r in rows:
        last[r["shape"]] = max(last.get(r["shape"], ""), r["timestamp"])
    return [r for r in rows if r["timestamp"] == last[r["shape"]]]


def scaling_shapes(quick: bool) -> list[dict]:
    """The tiny model at (P, n, L), then each of the three doubled and quadrupled on its own."""
    p, n, length = (4, 4, 16) if quick else (8, 8, 32)
    grow = lambda k: ((p * k, n, length), (p, n * k, length), (p, n, length * k))
    grown = [size for k in (2, 4) for size in grow(k)]
    return [work("tiny", *size, no_stop=True) for size in [(p, n, length), *grown]]


def _plot(csv_path: Path, rows: list[dict], args) -> list[Path]:
    """rl_step.png (phases stacked per provider) or, with --scaling, rl_step_scaling.png."""
    newest = newest_runs(csv_path, rows[0]["device"] if rows else None, scaling=args.scaling)
    if args.scaling:
        keys = {"prompts": "prompts P", "n": "group size n", "max_new": "response length L"}
        png = csv_path.with_name(f"{csv_path.stem}_scaling.png")
        png = plot.scaling(newest, scaling_shapes(args.quick), png, keys)
    else:
        png = plot.phases(newest, csv_path.with_suffix(".png"), list(PHASES[:-1]))
    return [png] if png else []


def _options(p) -> None:
    add = p.add_argument
    add("--quick", action="store_true", help="P=4 n=4 L=16, tiny, 1 warm-up + 2 timed steps")
    add("--scaling", action="store_true", help="prorl only: P, n and L doubled, quadrupled")
    add("--gpu", action="store_true", help="CUDA, bf16, model large (see --gpu-gen)")
    add(
        "--gpu-gen",
        default="vllm",
        choices=GPU_GENS,
        help="the --gpu samplers (docs/benchmarks.md)",
    )
    add("--models", help="tiny,random,large (default tiny,random; --quick tiny; --gpu large)")
    add("--prompts", type=int, help="prompts per step (default 16; --quick 4; --gpu 64)")
    add("--n", type=int, help="samples per prompt (default 8; --quick 4)")
    add("--max-new", type=int, help="response cap L (default 48; --quick 16; --gpu 1024)")


def _shapes(args) -> list[dict]:
    if args.scaling:
        return scaling_shapes(args.quick)
    q, gpu = args.quick, args.gpu
    models = args.models or ("large" if gpu else "tiny" if q else "tiny,random")
    prompts = args.prompts or (4 if q else 64 if gpu else 16)
    max_new = args.max_new or (16 if q else 1024 if gpu else 48)
    return [work(m, prompts, args.n or (4 if q else 8), max_new) for m in models.split(",")]


VIEW = View(extras=SUMMARY, ratios=(("trl", "speedup"),), phases=PHASES[:-1])
providers = lambda args: ["prorl"] if args.scaling else PROVIDERS
settings = dict(modes=("step",), warmup=(2, 1), threads=1, view=VIEW, plot=_plot)
BENCHMARK = harness.Benchmark(NAME, providers, _shapes, _options, measure=MEASURE, **settings)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
