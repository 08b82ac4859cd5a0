"""Training step throughput: our Decoder + fused loss on packed sequences vs transformers' Qwen2.

    python -m benchmarks train_step [--quick] [--threads N] [--model small] [--seqs 16]
        [--lengths 64,512] [--providers a,b] [--reps R] [--warmup W] [--out CSV]
    python -m benchmarks train_step --gpu     # CUDA: bf16, Qwen2-0.5B shape
    python -m benchmarks train_step --gpu --model qwen2-1.5b \\
        --providers prorl,prorl-fp8,prorl-fp8-te

One call = forward, the mean next-token NLL over the real tokens, backward, on the same weights and
batch for every provider (each row's note carries `loss=...`). Details: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import random

import torch

from benchmarks import harness
from benchmarks._checkpoints import CHECKPOINT_DIR, qwen2_shape, random_checkpoint
from benchmarks.report.readme import View

NAME = "train_step"
PROVIDERS = ("prorl", "prorl-unfused", "transformers-padded", "transformers-packed", "prorl-fp8")
GPU_PROVIDERS = PROVIDERS + ("prorl-fp8-te",)  # Transformer Engine: CUDA sm_90+ only
FP8_PROVIDERS = {"prorl-fp8": "torchao", "prorl-fp8-te": "te"}
REFERENCE = "transformers-padded"
MODELS = {  # Qwen2, 2 KV heads, tied embeddings
    "tiny": qwen2_shape(64, 128, 2, 4, vocab_size=512),
    "small": qwen2_shape(512, 1536, 4, 8, vocab_size=32000),
    "qwen2-0.5b": qwen2_shape(896, 4864, 24, 14, vocab_size=151936),
    # the ProRL v2 model (Nemotron-Research-Reasoning-Qwen-1.5B: DeepSeek-R1-Distill-Qwen-1.5B)
    "qwen2-1.5b": qwen2_shape(1536, 8960, 28, 12, vocab_size=151936, tie_word_embeddings=False),
    # one decoder layer of Qwen2-7B (28 heads, 4 KV heads): where FP8 GEMMs pay off most
    "qwen2-7b-layer": qwen2_shape(
        3584, 18944, 1, 28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False
    ),
}
CPU_BATCH = (8, 64, 512)  # sequences, min length, max length
QUICK_BATCH = (4, 16, 64)
GPU_BATCH = (16, 128, 1024)
SEED = 0


def make_shape(model: str, seqs: int, min_len: int, max_len: int, dtype: str, ckpt_dir: str):
    """A shape dict (harness.py) with the sequence lengths drawn here: the parent knows the
    counts."""
    rng = random.Random(SEED)
    lengths = [rng.randint(min_len, max_len) for _ in range(seqs)]
    label = f"{model} B={seqs} len={min_len}-{max_len} {dtype}"
    return dict(model=model, lengths=lengths, dtype=dtype, ckpt_dir=ckpt_dir, label=label)


def padding_fraction(lengths: list[int]) -> float:
    """Share of the [B, max(lengths)] positions of the right-padded batch that are padding."""
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))


def checkpoint_path(model: str, ckpt_dir: str) -> str:
    """The directory of the random (normal(0, 0.02)) Qwen2 checkpoint of shape `model`."""
    return random_checkpoint(dict(MODELS[model], max_position_embeddings=4096), folder=ckpt_dir)


def make_batch(lengths: list[int], vocab: int, device):
    """Random tokens of the given lengths, packed and right-padded, next-token labels (-100: none):
    dict(ids [N], cu_seqlens [B+1] int32, position_ids [N], labels [N], padded_ids [B, T],
    attention_mask [B, T], padded_labels [B, T])."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(SEED)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    labels = [torch.cat([s[1:], torch.tensor([-100])]) for s in seqs]  # last token: no target
    t = max(lengths)
    b = dict(
        ids=torch.cat(seqs),
        cu_seqlens=F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        labels=torch.cat(labels),
        padded_ids=torch.stack([F.pad(s, (0, t - len(s))) for s in seqs]),
        attention_mask=torch.stack([(torch.arange(t) < n).long() for n in lengths]),
        padded_labels=torch.stack([F.pad(y, (0, t - len(y)), value=-100) for y in labels]),
    )
    return {k: v.to(device) for k, v in b.items()}


def pad_batch(b: dict, multiple: int) -> dict:
    """The packed batch with a dummy sequence (labels -100) appended so that N is a multiple of
    `multiple` (Transformer Engine's FP8 shapes); the padded rows count in no loss."""
    pad = -b["ids"].numel() % multiple
    if pad == 0:
        return b
    dev = b["ids"].device
    zeros = torch.zeros(pad, dtype=b["ids"].dtype, device=dev)
    last = (b["cu_seqlens"][-1] + pad).view(1).to(torch.int32)
    ids, labels = (
        torch.cat([b["ids"], zeros]),
        torch.cat([b["labels"], torch.full_like(zeros, -100)]),
    )
    positions = torch.cat([b["position_ids"], torch.arange(pad, device=dev)])
    cu_seqlens = torch.cat([b["cu_seqlens"], last])
    return dict(b, ids=ids, labels=labels, position_ids=positions, cu_seqlens=cu_seqlens)


def nll_from_logits(logits, labels):
    """Mean NLL of `labels` (-100 ignored) under logits [..., V] (upcast to fp32) -> scalar."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [..., V] fp32
    valid = labels != -100
    picked = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return -(picked * valid).sum() / valid.sum()


def matmul_params(model) -> int:
    """Parameters that take part in matmuls: every Linear weight and the LM head (tied: once; our
    Decoder's `lm_head` is then None, transformers' a Linear sharing the embedding's weight)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return linear + (model.lm_head_weight.numel() if model.lm_head is None else 0)


def _model(provider: str, shape: dict, device):
    """(model, its FP8 converter or None, transformers' attn_implementation or None)."""
    from prorl.engine.model import load_hf

    dtype = getattr(torch, shape["dtype"])
    path = checkpoint_path(shape["model"], shape["ckpt_dir"])
    fp8 = impl = None
    if provider in FP8_PROVIDERS:
        from prorl.engine.fp8 import FP8Training, fp8_support

        available, reason = fp8_support(device) if provider == "prorl-fp8-te" else (True, "")
        if not available:
            raise RuntimeError(
                f"{provider} needs Transformer Engine on a CUDA sm_90+ device: {reason}"
            )
        fp8 = FP8Training(FP8_PROVIDERS[provider])
    if provider.startswith("prorl"):
        model = load_hf(path, dtype=dtype, device=device)
        model = fp8.convert(model) if fp8 is not None else model
    else:
        import transformers
        from prorl.engine.attention import flash_attn_available

        impl = "flash_attention_2" if device.type == "cuda" and flash_attn_available() else "sdpa"
        auto = transformers.AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation=impl).to(device)
    model.train()  # no dropout in Qwen2; train mode as a trainer runs it
    return model, fp8, impl


def _prorl_loss(provider: str, model, b: dict, fp8, device, max_len: int):
    """(loss function, note) of our Decoder on the packed batch: fused op, or [N, V] logits."""
    attention = f"attention={model.attention_backend(device).name}"
    hidden = lambda: model(
        b["ids"], b["position_ids"], b["cu_seqlens"], max_seqlen=max_len
    )  # [N, D]
    if provider == "prorl-unfused":  # [N, V] logits
        unfused = lambda: nll_from_logits(model.logits(hidden()), b["labels"])
        return unfused, f"loss_path=logits+log_softmax {attention}"
    from prorl.kernels import linear_logprob_entropy

    backend = "triton" if device.type == "cuda" else "native"
    autocast = fp8.autocast if fp8 is not None else contextlib.nullcontext

    def fused():
        with autocast():  # TE: FP8 forward; torchao: no context
            h = hidden()
        kw = dict(return_entropy=False, backend=backend)
        logp, _ = linear_logprob_entropy(h, model.lm_head_weight, b["labels"], **kw)
        valid = b["labels"] != -100
        return -(logp * valid).sum() / valid.sum()

    note = f"loss_backend={backend} {attention}"
    if fp8 is not None:
        configs = (getattr(m, "config", None) for m in model.modules())
        emulated = any(getattr(c, "emulate", False) for c in configs)
        note += f" fp8={fp8.backend}:{fp8.recipe}" + (" emulated_gemm" if emulated else "")
    return fused, note


def _transformers_loss(provider: str, model, b: dict, impl: str):
    """(loss function, note) of transformers' model on the right-padded or the packed batch."""
    if provider == "transformers-padded":
        inputs = dict(
            input_ids=b["padded_ids"], attention_mask=b["attention_mask"], use_cache=False
        )
        padded = lambda: nll_from_logits(model(**inputs).logits, b["padded_labels"])  # [B, T, V]
        lengths = b["attention_mask"].sum(1).tolist()
        return padded, f"padding={100 * padding_fraction(lengths):.1f}%"

    inputs = dict(input_ids=b["ids"][None], position_ids=b["position_ids"][None], use_cache=False)
    packed = lambda: nll_from_logits(model(**inputs).logits[0], b["labels"])  # [N, V] logits

    mask = "NxN_block_causal_mask" if impl == "sdpa" else "varlen"
    return packed, f"packed_via_position_ids {mask}"


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` on `shape` (mode `full`)."""
    if provider not in GPU_PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}")
    model, fp8, impl = _model(provider, shape, device)
    b = make_batch(shape["lengths"], model.config.vocab_size, device)
    if provider.startswith("prorl"):
        b = pad_batch(b, fp8.token_multiple) if fp8 is not None else b
        loss_fn, note = _prorl_loss(provider, model, b, fp8, device, max(shape["lengths"]))
    else:
        loss_fn, note = _transformers_loss(provider, model, b, impl)
        version = harness.dist_version("transformers")
        note = f"transformers={version} attn_implementation={impl} {note}"
    with torch.no_grad():
        loss = float(loss_fn())
    p_matmul, tokens = matmul_params(model), sum(shape["lengths"])
    note = f"{note} loss={loss:.6f} matmul_params={p_matmul} tokens={tokens}"
    clear = lambda: model.zero_grad(set_to_none=True)
    return harness.Step(lambda: loss_fn().backward(), clear, 6.0 * p_matmul * tokens, note=note)


def derived_rows(rows: list[dict], args) -> list[dict]:
    """`tokens_per_s` (real tokens) and `padding_fraction` rows for every `time` row."""
    by_label = {s["label"]: s for s in _shapes(args)}
    out = []
    for r in rows:
        if r["metric"] == "time":
            lengths = by_label[r["shape"]]["lengths"]
            pad = 100 * padding_fraction(lengths) if r["provider"] == "transformers-padded" else 0.0
            out.append(harness.rate_row(r, sum(lengths), "tokens_per_s", "tok/s"))
            out.append(dict(r, **harness.row("padding_fraction", "%", [pad])))
    return out


VIEW = View(  # the console's table
    extras=("tokens_per_s", "peak_extra_memory", "padding_fraction", "gflops", "peak_fraction"),
    ratios=((REFERENCE, "speedup"),),
)


def _options(p) -> None:
    p.add_argument("--quick", action="store_true", help=f"model tiny, batch {QUICK_BATCH}, 2 reps")
    p.add_argument("--gpu", action="store_true", help=f"cuda, bf16, qwen2-0.5b, batch {GPU_BATCH}")
    p.add_argument("--model", choices=sorted(MODELS), help="model shape (default small)")
    p.add_argument("--seqs", type=int, default=None, help="sequences per batch")
    p.add_argument("--lengths", default=None, help="MIN,MAX sequence length")
    p.add_argument("--ckpt-dir", default=CHECKPOINT_DIR, help="where the random checkpoints live")


def _shapes(args) -> list[dict]:
    seqs, min_len, max_len = GPU_BATCH if args.gpu else QUICK_BATCH if args.quick else CPU_BATCH
    if args.lengths:
        min_len, max_len = (int(x) for x in args.lengths.split(","))
    model = args.model or ("qwen2-0.5b" if args.gpu else "tiny" if args.quick else "small")
    dtype = "bfloat16" if args.gpu else "float32"
    return [make_shape(model, args.seqs or seqs, min_len, max_len, dtype, args.ckpt_dir)]


providers = lambda args: GPU_PROVIDERS if args.gpu else PROVIDERS
BENCHMARK = harness.Benchmark(
    NAME, providers, _shapes, _options, GPU_PROVIDERS, derive=derived_rows, view=VIEW
)
main = BENCHMARK.main


if __name__ == "__main__":
    raise SystemExit(main())
