"""End-to-end RL step: prorl's Trainer vs TRL's GRPOTrainer at equal work, per phase, with ablations.

    python -m benchmarks rl_step [--quick] [--threads 1] [--models tiny,random] [--providers prorl,trl,...]
    python -m benchmarks rl_step --scaling [--quick]    # prorl only: prompts, group size, length doubled
    python -m benchmarks rl_step --gpu                  # UNVERIFIED: vLLM rollouts in both, bf16, big model
    python -m benchmarks rl_step --gpu --gpu-gen native --models tiny,random  # ran on an H200

Equal work. Both trainers get the same checkpoint, the same prompts (the built-in digit_sums task, the
tiny reasoner's chat template), P prompts x n samples per optimizer step, the same response cap L,
temperature 1 over the whole vocabulary, the same verifier (`prorl.rewards.score("math", ...)`), a
token-level loss with clip-higher (0.2 / 0.28), KL coefficient 1e-4 against a reference model, AdamW at
the same learning rate (no weight decay, grad clip 1.0), one optimizer step per RL step, fp32, one
process, the same torch/OMP thread count (`--threads`, default 1), `warmup` untimed steps then `reps`
timed ones, each provider in a fresh worker process (harness.py). Settings:
- prorl: a `prorl.trainer.Trainer` built in-process from the default preset with overrides: dynamic
  sampling off (every group is trained on, as in TRL), length penalty off, 1 mini-batch, reference
  resets off; its RewardPool has 1 worker process.
- trl: `GRPOTrainer` (loss_type="dapo", epsilon 0.2, epsilon_high 0.28, beta 1e-4, num_generations=n,
  max_completion_length=L, per_device_train_batch_size = P x n, use_vllm=False, bf16 off, use_cpu,
  gradient_checkpointing off: TRL turns it on by default, which would cost it an extra forward).
What is NOT identical, and why it does not favour prorl: neither makes an old-policy log-prob pass (one
update per generation: old_logp = logp.detach() in both; prorl then measures sampler drift from the
update's own forward). TRL scores in-process; prorl ships responses to a worker process.
The advantage estimators (TRL: group-normalised GRPO; prorl: REINFORCE++-baseline) and KL estimators
(k3 / k2) differ in a few element-wise ops. Response lengths are sampled, so tokens per step differ a
little between runs: compare `tokens_per_s` as well as time per step (`response_tokens` is recorded).

Phases (mode column, ms per optimizer step, p50/p20/p80 over the timed steps): `gen` (sampling),
`reward` (verification), `old_logp` (no-grad log-prob passes: reference, and old policy where made),
`update` (loss forward + backward + clip + optimizer step), `other` (step minus those: advantages,
padding/packing, bookkeeping, the loop itself), `step` (wall time of the whole step; for TRL from one
`on_step_end` to the next). Mode `step` also carries `tokens_per_s` (response tokens / step time),
`response_tokens`, `peak_memory` (MB: the process's resident-set high-water mark during the step, reset
through /proc/self/clear_refs as in harness.py; RewardPool workers are other processes and not counted;
on CUDA max_memory_allocated) and `peak_extra_memory` (the same minus the resident set at step start).
How TRL's phases are taken: `_rl_step_peers.TRLPhases`.

Providers: `prorl`, `trl`, and ablations of prorl named by what they switch off, combinable with `-`:
`prorl-nofused` (unfused logits -> log_softmax instead of the fused op), `prorl-noshare` (each response
packed with its own copy of the prompt instead of one copy per group, prorl/packing.py), `prorl-nopack`
(right-padded [S, Lmax] batches, one per prompt + response, instead of packed sequences), `prorl-hfgen`
(`transformers.generate` with output_scores instead of prorl's sampler), `prorl-nofused-nopack-hfgen`
(all three); and `prorl-compile`, the native sampler's decode step under torch.compile
(`rollout.compile=true`; its compilation, ~25 s, falls in the untimed warm-up steps: a start-up cost).
Models: `tiny` = the shipped tiny reasoner (prorl/assets/tiny-reasoner, ~0.5M parameters, it answers
and stops); `random` = a random-weight Qwen2 (hidden 256, 4 layers, ~3M parameters) with the same
tokenizer (it rarely samples the stop token, so most responses run to the cap).
`--scaling` (prorl only, tiny model, stop tokens ignored so that every response is exactly L tokens):
from P=8, n=8, L=32, each of P, n and L doubled twice on its own; plotted as time per step against
the work multiple (cost should grow no faster than the work).
`--gpu` (UNVERIFIED: no GPU was available when it was written): model `large` (random Qwen2, hidden
1024, 12 layers, same tokenizer), bf16 in both, prorl with `VLLMGenerator` (weights pushed after every
step, phase `sync`) and the policy on CUDA; TRL with colocated vLLM (which then makes the old-policy
pass for its importance-sampling correction).
`--gpu --gpu-gen native` (for a GPU without vLLM; ran on an H200, benchmarks/results/gpu): the same,
except that prorl samples with its native sampler on the CUDA policy (rollout.backend=native forced,
so no `sync` phase) and TRL with `transformers.generate` on CUDA (use_vllm=False, so no old-policy pass
either: on-policy as on CPU); `--gpu-gen vllm` is the default. The note of every row says which
(`gen=...`). `--models`, `--prompts`, `--n`, `--max-new`, `--warmup` and `--reps` apply with `--gpu`
as without it (e.g. `--models tiny,random` for small checkpoints).

Results: benchmarks/results/rl_step.csv (harness.COLUMNS), rl_step.png (phases stacked per provider)
and rl_step_scaling.png. On a shared machine timings vary (MACHINE-NOTES: up to 30x with 2 threads on 2
busy cores): compare ratios within one invocation and look at the p20-p80 spread.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

NAME = "rl_step"
PROVIDERS = (
    "prorl",
    "trl",
    "prorl-nofused",
    "prorl-noshare",
    "prorl-nopack",
    "prorl-hfgen",
    "prorl-nofused-nopack-hfgen",
    "prorl-compile",
)
PHASES = ("gen", "reward", "old_logp", "update", "sync", "other", "step")
TINY = Path(__file__).resolve().parent.parent / "prorl" / "assets" / "tiny-reasoner"
RANDOM_MODELS = {  # random-weight Qwen2 checkpoints with the tiny reasoner's tokenizer (vocab 100)
    "random": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
    ),
    "large": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        max_position_embeddings=4096,
    ),
}
LR = 3e-5
GPU_GENS = ("vllm", "native")  # --gpu-gen: the samplers of the --gpu run


def work(model: str, prompts: int, n: int, max_new: int, no_stop: bool = False) -> dict:
    label = f"{model} P={prompts} n={n} L={max_new}" + (" nostop" if no_stop else "")
    return dict(model=model, prompts=prompts, n=n, max_new=max_new, no_stop=no_stop, lr=LR, label=label)


def model_path(name: str) -> str:
    """The checkpoint directory of model `name` (random ones built once per machine under $TMPDIR)."""
    if name == "tiny":
        return str(TINY)
    import hashlib

    import torch
    import transformers

    tag = hashlib.sha1(json.dumps(RANDOM_MODELS[name], sort_keys=True).encode()).hexdigest()[:8]
    path = os.path.join(tempfile.gettempdir(), "prorl-bench-rl_step", f"{name}-{tag}")  # new shape, new dir
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    with open(TINY / "config.json") as f:
        base = json.load(f)
    cfg = transformers.Qwen2Config(
        vocab_size=base["vocab_size"],
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        **RANDOM_MODELS[name],
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / f, tmp)
    os.replace(tmp, path)  # atomic: a concurrent worker sees a whole checkpoint or none
    return path


# --------------------------------------------------------------------------------------------------
# The worker (one provider, every shape, in a fresh process)
# --------------------------------------------------------------------------------------------------


class Memory:
    """Peak memory of one step: the RSS high-water mark (CPU) or max_memory_allocated (CUDA), in MB."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
            return
        gc.collect()
        harness._malloc_trim()
        self.ok = harness._reset_rss_peak()
        self.base = harness._proc_status_mb("VmHWM")  # = VmRSS right after the reset

    def stop(self) -> tuple[float, float]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**20
        elif not self.ok:
            return math.nan, math.nan
        else:
            peak = harness._proc_status_mb("VmHWM")
        return peak, peak - self.base


def prorl_overrides(w: dict, path: str, gpu: bool, gen: str = "vllm") -> list[str]:
    """The Trainer's config overrides; on `gpu`, `gen` is the sampler (vllm | native; CPU: the default
    backend, which resolves to native there)."""
    if gpu and gen not in GPU_GENS:
        raise ValueError(f"gen must be one of {GPU_GENS}, got {gen!r}")
    backend = []
    if gpu:
        backend = ["rollout.backend=native"]
        if gen == "vllm":
            backend = ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.3"]
    return [
        f"model.path={path}",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        "seed=0",
        f"rollout.n={w['n']}",
        f"rollout.max_response_tokens={w['max_new']}",
        "rollout.temperature=1.0",
        f"trainer.prompts_per_step={w['prompts']}",
        "trainer.mini_batches=1",
        "algorithm.dynamic_sampling=false",
        "algorithm.eps_low=0.2",
        "algorithm.eps_high=0.28",
        "algorithm.kl_coef=1e-4",
        "algorithm.agg=token-mean",
        "algorithm.reset.interval=0",
        "algorithm.reset.kl_spike_factor=0",
        "reward.length_penalty=false",
        "reward.num_workers=1",
        f"optim.lr={w['lr']}",
        "optim.weight_decay=0.0",
        "optim.max_grad_norm=1.0",
        "data.max_prompt_tokens=64",
        *backend,
    ]


def run_prorl(
    provider: str, w: dict, path: str, warmup: int, reps: int, memory, gpu: bool, gen: str = "vllm"
):
    """prorl's Trainer.step() warmup + reps times; returns (per-step records, note). `gen`: the sampler
    on `gpu` (vllm | native), ignored on CPU."""

    import torch
    from transformers import PreTrainedTokenizerFast

    from benchmarks._rl_step_peers import apply_ablations
    from prorl.config import load_config
    from prorl.data import builtin
    from prorl.rewards.pool import RewardPool
    from prorl.trainer import Trainer

    cfg = load_config("default", prorl_overrides(w, path, gpu, gen))
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    train = builtin("digit_sums", seed=0, split="train")
    val = builtin("digit_sums", n=4, seed=0, split="val")
    records = []
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = Trainer(cfg, path, tok, train, val, pool)
        if w["no_stop"]:
            trainer.sampler.stop_ids = []
        apply_ablations(trainer, provider.split("-")[1:], path, tok)
        for _ in range(warmup + reps):
            memory.start()
            t0 = time.perf_counter()
            m = trainer.step()
            if gpu:
                torch.cuda.synchronize()
            step = time.perf_counter() - t0
            rss, extra = memory.stop()
            records.append(
                dict(
                    gen=m["timing_s/gen"],
                    reward=m["timing_s/reward"],
                    old_logp=m["timing_s/old_logp"],
                    update=m["timing_s/update"],
                    sync=m.get("timing_s/sync", 0.0),  # weights to the sampler, where it is a copy
                    step=step,
                    tokens=m["response_length/mean"] * w["prompts"] * w["n"],
                    peak_rss=rss,
                    peak_extra_memory=extra,
                )
            )
    flags = provider.split("-")[1:]
    if "hfgen" in flags:
        gen_note = "transformers.generate"
    elif gpu:
        gen_note = type(trainer.generator).__name__  # what actually sampled: VLLMGenerator | NativeGenerator
        gen_note = {"VLLMGenerator": "vllm", "NativeGenerator": "native"}.get(gen_note, gen_note)
    else:
        gen_note = "native"
    note = (
        "loss=token-mean kl=k2 old_logp=skipped (on-policy: logp.detach()) reward=RewardPool(1 worker)"
        + f" gen={gen_note}"
        + (" logp=naive" if "nofused" in flags else " logp=fused")
        + (" padded" if "nopack" in flags else " packed")
        + ("" if {"nopack", "noshare"} & set(flags) else " shared-prompts")
        + (" sampler=compiled" if "compile" in flags else "")
        + (" dtype=bfloat16" if gpu else "")
    )
    return records, note


def _rows(records: list[dict], note: str) -> list[dict]:
    """Quantile rows of the timed steps (module docstring)."""

    def row(mode, metric, unit, values):
        values = [v for v in values if not math.isnan(v)]
        if not values:
            return None
        q = {k: harness.quantile(values, f) for k, f in (("p50", 0.5), ("p20", 0.2), ("p80", 0.8))}
        return dict(mode=mode, metric=metric, unit=unit, note=note, **q)

    for r in records:
        r["other"] = r["step"] - sum(r.get(k, 0.0) for k in ("gen", "reward", "old_logp", "update", "sync"))
    rows = [row(p, "time", "ms", [r.get(p, 0.0) * 1e3 for r in records]) for p in PHASES]
    rows.append(row("step", "tokens_per_s", "tok/s", [r["tokens"] / r["step"] for r in records]))
    rows.append(row("step", "response_tokens", "tokens", [r["tokens"] for r in records]))
    rows.append(row("step", "peak_memory", "MB", [r["peak_rss"] for r in records]))
    rows.append(row("step", "peak_extra_memory", "MB", [r["peak_extra_memory"] for r in records]))
    noop_sync = lambda r: r["mode"] == "sync" and r["p80"] < 0.5  # ms: the sampler is the policy itself
    return [r for r in rows if r is not None and not noop_sync(r)]


def worker_main(argv) -> None:
    """Worker entry (harness.run_provider with entry=...): argv = [spec JSON, result path]."""
    import torch

    spec, result_path = json.loads(argv[0]), argv[1]
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    gpu = device.type == "cuda"
    gen = spec.get("gpu_gen", "vllm")
    provider = spec["provider"]
    res = harness.Result(
        provider, device=harness.device_name(device), versions=harness.versions_string(spec["threads"])
    )
    for w in spec["shapes"]:
        tag = f"{provider} {w['label']}"
        try:
            path = model_path(w["model"])
            memory = Memory(device)
            warmup, reps = spec["warmup"], spec["reps"]
            if provider == "trl":
                from benchmarks._rl_step_peers import run_trl

                if w["no_stop"]:
                    raise ValueError("the nostop (scaling) settings are prorl-only")
                records, note = run_trl(w, path, warmup, reps, memory, gpu, gen)
            elif provider.split("-")[0] == "prorl":
                records, note = run_prorl(provider, w, path, warmup, reps, memory, gpu, gen)
            else:
                raise ValueError(f"unknown provider {provider!r}")
            if len(records) != warmup + reps:
                raise RuntimeError(f"{len(records)} steps recorded, expected {warmup + reps}")
            note += f" threads={torch.get_num_threads()}"
            rows = _rows(records[warmup:], note)
            for r in rows:
                r["shape"] = w["label"]
            res.rows.extend(rows)
            step = next(r for r in rows if r["mode"] == "step" and r["metric"] == "time")
            print(
                f"  {tag}: step {step['p50']:.1f} ms (p20 {step['p20']:.1f}, p80 {step['p80']:.1f})",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - one failing shape must not lose the others
            res.errors.append(f"{tag}: {type(exc).__name__}: {exc}")
            print(f"  {tag}: FAILED {type(exc).__name__}: {exc}", flush=True)
        gc.collect()
        with open(result_path, "w") as f:
            json.dump(res.__dict__, f)


# --------------------------------------------------------------------------------------------------
# Summary and plots (the parent)
# --------------------------------------------------------------------------------------------------


def summary(rows: list[dict], reference: str = "trl") -> str:
    by = {(r["shape"], r["provider"], r["mode"], r["metric"]): r for r in rows}
    head = (
        f"{'provider':<28} {'step ms':>9} {'(p20-p80)':>17} "
        + " ".join(f"{p:>8}" for p in PHASES[:-1])
        + f" {'tok/s':>8} {'tokens':>7} {'peak MB':>8} {'x ' + reference:>8}"
    )
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        lines += ["", f"== {shape}  (ms per optimizer step, p50)", head, "-" * len(head)]
        ref = by.get((shape, reference, "step", "time"))
        for p in dict.fromkeys(r["provider"] for r in rows if r["shape"] == shape):
            t = by.get((shape, p, "step", "time"))
            if t is None:
                continue
            cells = []
            for phase in PHASES[:-1]:
                v = by.get((shape, p, phase, "time"))
                cells.append(f"{v['p50']:>8.1f}" if v else f"{'-':>8}")
            rate = by.get((shape, p, "step", "tokens_per_s"))
            toks = by.get((shape, p, "step", "response_tokens"))
            mem = by.get((shape, p, "step", "peak_memory"))
            spread = f"({t['p20']:.1f}-{t['p80']:.1f})"
            speed = f"{ref['p50'] / t['p50']:.2f}" if ref else "-"
            lines.append(
                f"{p:<28} {t['p50']:>9.1f} {spread:>17} "
                + " ".join(cells)
                + f" {rate['p50'] if rate else 0:>8.0f} {toks['p50'] if toks else 0:>7.0f}"
                + f" {mem['p50'] if mem else 0:>8.0f} {speed:>8}"
            )
    if any(r["provider"] == reference for r in rows):
        lines.append(f"\nx {reference} = {reference}'s step time / the provider's (higher is faster)")
    return "\n".join(lines)


def _machine(row: dict) -> str:
    threads = next((v for v in row.get("versions", "").split() if v.startswith("threads=")), "")
    return f"{row.get('device', '')}, {threads}, {row.get('timestamp', '')[:10]}"


def newest_runs(path: Path, device: str | None, scaling: bool) -> list[dict]:
    """Rows of the CSV for the plots: per shape, only the newest invocation that measured it (providers
    are compared within one invocation, never across), on `device` (None: the newest row's device)."""
    import csv

    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if ("nostop" in r["shape"]) == scaling]
    if not rows:
        return []
    device = device or max(rows, key=lambda r: r["timestamp"])["device"]
    rows = [r for r in rows if r["device"] == device]
    newest = {}
    for r in rows:
        newest[r["shape"]] = max(newest.get(r["shape"], ""), r["timestamp"])
    out = [dict(r) for r in rows if r["timestamp"] == newest[r["shape"]]]
    for r in out:
        for k in ("p50", "p20", "p80"):
            r[k] = float(r[k])
    return out


def plot_phases(rows: list[dict], path: Path) -> Path | None:
    """One panel per shape: a stacked bar of the phases per provider (p50 ms), p20-p80 whisker on step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["mode"] == "step" and r["metric"] == "time"))
    if not shapes:
        return None
    by = {(r["shape"], r["provider"], r["mode"], r["metric"]): r for r in rows}
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, shape in zip(axes[0], shapes):
        providers = [
            p for p in dict.fromkeys(r["provider"] for r in rows) if (shape, p, "step", "time") in by
        ]
        phases = [ph for ph in PHASES[:-1] if any((shape, p, ph, "time") in by for p in providers)]
        for i, p in enumerate(providers):
            bottom = 0.0
            for j, phase in enumerate(phases):
                v = by.get((shape, p, phase, "time"))
                height = max(v["p50"], 0.0) if v else 0.0  # `other` can be a hair below 0
                ax.bar(
                    i, height, bottom=bottom, color=colours[j % len(colours)], label=phase if i == 0 else None
                )
                bottom += height
            t = by[(shape, p, "step", "time")]
            ax.errorbar(
                i, t["p50"], yerr=[[t["p50"] - t["p20"]], [t["p80"] - t["p50"]]], color="k", capsize=3
            )
        ax.set_xticks(range(len(providers)), providers, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms per optimizer step (p50)")
        ax.set_title(shape, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"RL step by phase - {_machine(rows[0])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_scaling(rows: list[dict], shapes: list[dict], path: Path) -> Path | None:
    """Time per step against the work multiple, one line per doubled quantity, with the linear ideal."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = {r["shape"]: r for r in rows if r["mode"] == "step" and r["metric"] == "time"}
    base = shapes[0]
    if base["label"] not in t:
        return None
    t0 = t[base["label"]]["p50"]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for key, name in (("prompts", "prompts P"), ("n", "group size n"), ("max_new", "response length L")):
        pts = [(1.0, t0)] + [
            (s[key] / base[key], t[s["label"]]["p50"])
            for s in shapes[1:]
            if s["label"] in t and s[key] != base[key]
        ]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    xs = [1, 2, 4]
    ax.plot(xs, [t0 * x for x in xs], "k--", lw=1, label="linear in work")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel(f"work multiple (from {base['label']})")
    ax.set_ylabel("ms per step (p50)")
    ax.legend(fontsize=8)
    ax.set_title(f"prorl step scaling - {_machine(rows[0])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def scaling_shapes(quick: bool) -> list[dict]:
    p, n, length = (4, 4, 16) if quick else (8, 8, 32)
    out = [work("tiny", p, n, length, no_stop=True)]
    for k in (2, 4):
        out += [
            work("tiny", p * k, n, length, no_stop=True),
            work("tiny", p, n * k, length, no_stop=True),
            work("tiny", p, n, length * k, no_stop=True),
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="P=4 n=4 L=16, tiny model, 1 warm-up + 2 timed steps")
    p.add_argument("--scaling", action="store_true", help="prorl only: P, n and L doubled (module docstring)")
    p.add_argument("--gpu", action="store_true", help="UNVERIFIED: CUDA, bf16, model large (see --gpu-gen)")
    p.add_argument(
        "--gpu-gen",
        default="vllm",
        choices=GPU_GENS,
        help="with --gpu: vllm (vLLM in both) or native (prorl's sampler; TRL transformers.generate)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads of every provider (default 1)")
    p.add_argument("--providers", default=None, help=f"comma-separated, default {','.join(PROVIDERS)}")
    p.add_argument(
        "--models",
        default=None,
        help="of tiny, random, large (default tiny,random; --quick tiny; --gpu large)",
    )
    p.add_argument(
        "--prompts", type=int, default=None, help="prompts per step (default 16; --quick 4; --gpu 64)"
    )
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 8; --quick 4)")
    p.add_argument(
        "--max-new", type=int, default=None, help="response cap L (default 48; --quick 16; --gpu 1024)"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; --quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed steps (default 5; --quick 2)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per provider worker")
    p.add_argument("--out", default=None, help=f"CSV to append to (default benchmarks/results/{NAME}.csv)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--plot-only", action="store_true", help="measure nothing: plot the CSV (newest runs)")
    args = p.parse_args(argv)

    q = args.quick
    if args.gpu and not args.plot_only:
        import torch

        if not torch.cuda.is_available():
            p.error("--gpu needs a visible CUDA device")
    out = Path(args.out) if args.out else harness.RESULTS_DIR / f"{NAME}.csv"
    if args.scaling:
        shapes = scaling_shapes(q)
        providers = ["prorl"]
    else:
        default_models = "large" if args.gpu else ("tiny" if q else "tiny,random")
        shapes = [
            work(
                m,
                args.prompts or (4 if q else 64 if args.gpu else 16),
                args.n or (4 if q else 8),
                args.max_new or (16 if q else 1024 if args.gpu else 48),
            )
            for m in (args.models or default_models).split(",")
        ]
        providers = args.providers.split(",") if args.providers else list(PROVIDERS)
    if args.plot_only:
        rows, errors = [], []
    else:
        rows, errors = harness.run_benchmark(
            NAME,
            "benchmarks.rl_step",
            providers,
            ["step"],
            shapes,
            device="cuda" if args.gpu else "cpu",
            threads=args.threads,
            warmup=args.warmup if args.warmup is not None else (1 if q else 2),
            reps=args.reps or (2 if q else 5),
            out=out,
            timeout=args.timeout,
            entry="benchmarks.rl_step:worker_main",
            extra=dict(gpu_gen=args.gpu_gen) if args.gpu else None,
        )
        print(summary(rows, reference="trl"))
    if (rows or args.plot_only) and not args.no_plot:
        stem = out.with_suffix("")
        device = rows[0]["device"] if rows else None
        if args.scaling:
            png = plot_scaling(newest_runs(out, device, scaling=True), shapes, Path(f"{stem}_scaling.png"))
        else:
            png = plot_phases(newest_runs(out, device, scaling=False), Path(f"{stem}.png"))
        if png:
            print(f"plot: {png}")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
