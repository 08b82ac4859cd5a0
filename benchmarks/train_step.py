"""Training step throughput: our Decoder + fused loss on packed sequences vs transformers' Qwen2 (fwd+bwd).

    python -m benchmarks train_step [--quick] [--threads N] [--model small] [--seqs 16] [--lengths 64,512]
                                    [--providers a,b] [--reps R] [--warmup W] [--out CSV]
    python -m benchmarks train_step --gpu     # H200: bf16, Qwen2-0.5B shape (see below)

One timed call = one training step's compute: forward, the loss, backward (parameter gradients are
cleared untimed before each call; no optimizer step). Every provider runs on the same random weights (a
Qwen2 built with `transformers` from a config, seed 0, saved once under --ckpt-dir, default
$TMPDIR/prorl-bench-train_step/<model>-<hash of its config>) and the same batch: `seqs` sequences of
random token ids whose lengths are drawn uniformly from [min, max] (Python `random`, seed 0). The loss is
the mean next-token NLL over the REAL tokens (each sequence's last token has no target), so every
provider gets the same gradient; the loss value, computed once untimed, is written in the `versions`
note (`loss=...`) as a check that the providers compute the same thing.

Providers:
- `prorl`: `prorl.engine.model.load_hf` -> Decoder on the packed [N] tokens with `cu_seqlens` (attention:
  SDPA once per sequence on the CPU, flash-attn varlen on CUDA when installed), loss from
  `prorl.kernels.linear_logprob_entropy` (native backend on the CPU, Triton on CUDA; no [N, V] logits).
- `prorl-unfused`: the same decoder; loss via `Decoder.logits` -> fp32 log_softmax -> gather (the
  difference to `prorl` is the fused op's share).
- `transformers-padded`: `AutoModelForCausalLM` (SDPA; flash_attention_2 on CUDA when installed) on the
  right-padded [B, T_max] batch with `attention_mask`, logits -> fp32 log_softmax, NLL masked to the
  real tokens: what a trainer does without packing.
- `transformers-packed`: the same model on one row [1, N] of the packed tokens with `position_ids`
  restarting at each sequence and no attention mask. transformers 5 detects the packing from the
  position_ids (`masking_utils.find_packed_sequence_indices`); with SDPA (CPU) it then builds a
  block-diagonal causal [1, 1, N, N] mask, so attention pays for all N^2 token pairs; with
  flash_attention_2 (CUDA) it calls the varlen kernel. No padding either way. Checked on the CPU: its
  loss equals the padded one (tests/test_benchmarks_train_step.py).

Rows (benchmarks/results/train_step.csv, one mode `full`): the harness's `time` (ms), `gflops` (CPU) or
`tflops` and `peak_fraction` (CUDA), `peak_extra_memory` (MB, resident-set high-water mark above the
baseline on the CPU); then `tokens_per_s` (REAL tokens / time; its p20 is the rate at the p80 time) and
`padding_fraction` (% of the processed positions that are padding). FLOPs are the nominal 6 * P * N for
every provider, N = real tokens and P = the parameters that take part in matmuls (all Linear weights and
the LM head; the embedding lookup is not a matmul, the tied head is counted once); attention's own
FLOPs are not counted. So on CUDA `peak_fraction` (against harness.H200_BF16_DENSE_TFLOPS = 989, the
H100/H200 dense bf16 peak) is the MFU; the CPU has no known peak and no MFU.

Model shapes (`--model`): `small` (CPU default) = hidden 512, intermediate 1536, 4 layers, 8 heads / 2 KV
heads (head_dim 64), vocab 32000, tied embeddings: 28.44M parameters in matmuls, 16.4M of them the head;
`tiny` (--quick and tests) = hidden 64, intermediate 128, 2 layers, 4/2 heads, vocab 512; `qwen2-0.5b` =
Qwen2-0.5B's shape (hidden 896, intermediate 4864, 24 layers, 14/2 heads, vocab 151936, tied). Batches:
CPU 8 sequences of 64-512 tokens; --quick 4 of 16-64; --gpu 16 of 128-1024.

Measured (2026-11-29, AMD EPYC, 2 threads, OMP_WAIT_POLICY=PASSIVE, small, 8 sequences = 2405 real tokens,
39% padding; the 2 cores were shared with other benchmarks, so absolute numbers are low and noisy): p50
prorl 9.4 s (257 tok/s, 721 MB), prorl-unfused 10.0 s (1428 MB), transformers-packed 10.8 s (1492 MB),
transformers-padded 19.4 s (124 tok/s, 2313 MB); the four losses agreed to 1e-6. A one-rep probe on 16
sequences (4940 tokens, quieter machine): prorl 9.8 s, transformers-padded 33.5 s.

`--gpu`: device cuda, bf16 parameters and activations (the losses in fp32), the `qwen2-0.5b` shape. It
ran on an H200 (2026-11-30) for prorl, prorl-unfused and transformers-padded; transformers-packed did not
finish within that run's time. Timings on a shared 2-core CPU vary a lot:
compare providers within one invocation, and look at the p20-p80 spread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile

from benchmarks import harness

NAME = "train_step"
PROVIDERS = ("prorl", "prorl-unfused", "transformers-padded", "transformers-packed")
REFERENCE = "transformers-padded"
MODELS = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, vocab_size=32000
    ),
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        vocab_size=151936,
    ),
}
CPU_BATCH = (8, 64, 512)  # sequences, min length, max length
QUICK_BATCH = (4, 16, 64)
GPU_BATCH = (16, 128, 1024)
SEED = 0


def make_shape(model: str, seqs: int, min_len: int, max_len: int, dtype: str, ckpt_dir: str) -> dict:
    """A shape dict (harness.py) with the sequence lengths drawn here, so the parent knows the counts."""
    rng = random.Random(SEED)
    lengths = [rng.randint(min_len, max_len) for _ in range(seqs)]
    label = f"{model} B={seqs} len={min_len}-{max_len} {dtype}"
    return dict(model=model, lengths=lengths, dtype=dtype, ckpt_dir=ckpt_dir, label=label)


def padding_fraction(lengths: list[int]) -> float:
    """Share of the [B, max(lengths)] positions of the right-padded batch that are padding."""
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))


def checkpoint_path(model: str, ckpt_dir: str) -> str:
    """Build (once per config) and return the directory of a randomly initialised Qwen2 checkpoint."""
    kwargs = dict(
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, **MODELS[model]
    )
    key = hashlib.sha1(json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:8]
    path = os.path.join(ckpt_dir, f"{model}-{key}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    torch.manual_seed(SEED)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))  # normal(0, 0.02) init
    tmp = f"{path}.tmp{os.getpid()}"
    hf.save_pretrained(tmp)
    os.replace(tmp, path)  # atomic: a concurrent worker sees a whole checkpoint or none
    return path


def make_batch(lengths: list[int], vocab: int, device):
    """Random tokens of the given lengths, packed and right-padded, with next-token labels (-100: none).

    Returns dict(ids [N], cu_seqlens [B+1] int32, position_ids [N], labels [N],
                 padded_ids [B, T], attention_mask [B, T], padded_labels [B, T]).
    """
    import torch
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


def nll_from_logits(logits, labels):
    """Mean NLL of `labels` (-100 ignored) under logits [..., V] (upcast to fp32) -> scalar."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)  # [..., V] fp32
    valid = labels != -100
    picked = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return -(picked * valid).sum() / valid.sum()


def matmul_params(model) -> int:
    """Parameters that take part in matmuls: every Linear weight plus the LM head (tied: counted once).

    Works for our Decoder (tied: `lm_head` is None, the head is the embedding) and for transformers'
    models (tied: `lm_head` is a Linear sharing the embedding's weight).
    """
    import torch

    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return linear + (model.lm_head_weight.numel() if model.lm_head is None else 0)


def build(provider: str, mode: str, shape: dict, device) -> harness.Step | None:
    """The Step that measures `provider` on `shape` (mode `full` only)."""
    import torch

    if mode != "full":
        return None
    from prorl.engine.model import load_hf

    dtype = getattr(torch, shape["dtype"])
    path = checkpoint_path(shape["model"], shape["ckpt_dir"])
    if provider in ("prorl", "prorl-unfused"):
        model = load_hf(path, dtype=dtype, device=device)
        p_matmul = matmul_params(model)
    else:
        import transformers
        from prorl.engine.attention import flash_attn_available

        impl = "flash_attention_2" if device.type == "cuda" and flash_attn_available() else "sdpa"
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl)
        model.to(device)
        p_matmul = matmul_params(model)
    model.train()  # no dropout in Qwen2; train mode as a trainer runs it
    b = make_batch(shape["lengths"], model.config.vocab_size, device)
    max_len = max(shape["lengths"])

    if provider == "prorl":
        from prorl.kernels import linear_logprob_entropy

        backend = "triton" if device.type == "cuda" else "native"

        def loss_fn():
            hidden = model(b["ids"], b["position_ids"], b["cu_seqlens"], max_seqlen=max_len)  # [N, D]
            logp, _ = linear_logprob_entropy(
                hidden, model.lm_head_weight, b["labels"], return_entropy=False, backend=backend
            )
            valid = b["labels"] != -100
            return -(logp * valid).sum() / valid.sum()

        note = f"loss_backend={backend} attention={model.attention_backend(device).name}"
    elif provider == "prorl-unfused":

        def loss_fn():
            hidden = model(b["ids"], b["position_ids"], b["cu_seqlens"], max_seqlen=max_len)  # [N, D]
            return nll_from_logits(model.logits(hidden), b["labels"])  # [N, V] logits

        note = f"loss_path=logits+log_softmax attention={model.attention_backend(device).name}"
    elif provider == "transformers-padded":

        def loss_fn():
            out = model(input_ids=b["padded_ids"], attention_mask=b["attention_mask"], use_cache=False)
            return nll_from_logits(out.logits, b["padded_labels"])  # [B, T, V] logits

        note = f"attn_implementation={impl} padding={100 * padding_fraction(shape['lengths']):.1f}%"
    elif provider == "transformers-packed":

        def loss_fn():
            out = model(input_ids=b["ids"][None], position_ids=b["position_ids"][None], use_cache=False)
            return nll_from_logits(out.logits[0], b["labels"])  # [N, V] logits

        mask = "NxN_block_causal_mask" if impl == "sdpa" else "varlen"
        note = f"attn_implementation={impl} packed_via_position_ids {mask}"
    else:
        raise ValueError(f"unknown provider {provider!r}")

    with torch.no_grad():
        loss = float(loss_fn())
    if provider.startswith("transformers"):
        import importlib.metadata

        note = f"transformers={importlib.metadata.version('transformers')} {note}"

    def clear_grads():
        model.zero_grad(set_to_none=True)

    flops = 6.0 * p_matmul * sum(shape["lengths"])
    note = f"{note} loss={loss:.6f} matmul_params={p_matmul} tokens={sum(shape['lengths'])}"
    return harness.Step(run=lambda: loss_fn().backward(), prepare=clear_grads, flops=flops, note=note)


def derived_rows(rows: list[dict], shapes: list[dict]) -> list[dict]:
    """`tokens_per_s` (real tokens) and `padding_fraction` rows for every `time` row."""
    by_label = {s["label"]: s for s in shapes}
    out = []
    for r in rows:
        if r["metric"] != "time":
            continue
        lengths = by_label[r["shape"]]["lengths"]
        n = sum(lengths)
        rate = {q: n / (r[t] / 1e3) for q, t in (("p50", "p50"), ("p20", "p80"), ("p80", "p20"))}
        out.append(dict(r, metric="tokens_per_s", unit="tok/s", **rate))
        pad = 100 * padding_fraction(lengths) if r["provider"] == "transformers-padded" else 0.0
        out.append(dict(r, metric="padding_fraction", unit="%", p50=pad, p20=pad, p80=pad))
    return out


def summary(rows: list[dict]) -> str:
    """Per shape: time, real tokens/s, speed-up over transformers-padded, memory, padding, rate/MFU."""
    by = {(r["shape"], r["provider"], r["metric"]): r for r in rows}
    cuda = any(r["metric"] == "peak_fraction" for r in rows)
    rate_metric, rate_head = ("peak_fraction", "MFU %") if cuda else ("gflops", "GFLOPS")
    head = (
        f"{'provider':<20} {'ms p50':>10} {'(p20-p80)':>22} {'tok/s p50':>10} {'speedup':>8} "
        f"{'peak MB':>9} {'pad %':>6} {rate_head:>8}"
    )
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        lines += ["", f"== full (fwd+loss+bwd)  {shape}", head, "-" * len(head)]
        ref = by.get((shape, REFERENCE, "time"))
        for p in dict.fromkeys(r["provider"] for r in rows):
            t = by.get((shape, p, "time"))
            if t is None:
                continue

            def get(metric, fmt, shape=shape, p=p):
                r = by.get((shape, p, metric))
                return format(r["p50"], fmt) if r else "-"

            speedup = f"{ref['p50'] / t['p50']:.2f}" if ref else "-"
            spread = f"({t['p20']:.1f}-{t['p80']:.1f})"
            lines.append(
                f"{p:<20} {t['p50']:>10.1f} {spread:>22} "
                f"{get('tokens_per_s', '.0f'):>10} {speedup:>8} {get('peak_extra_memory', '.0f'):>9} "
                f"{get('padding_fraction', '.1f'):>6} {get(rate_metric, '.1f'):>8}"
            )
    lines.append(f"speedup = {REFERENCE} time / provider time; tok/s counts real (unpadded) tokens")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"model tiny, batch {QUICK_BATCH}, 2 reps")
    p.add_argument("--gpu", action="store_true", help=f"cuda, bf16, qwen2-0.5b, batch {GPU_BATCH}")
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="model shape (default small)")
    p.add_argument("--seqs", type=int, default=None, help="sequences per batch")
    p.add_argument("--lengths", default=None, help="MIN,MAX sequence length")
    p.add_argument("--threads", type=int, default=None, help="torch/OMP threads (default: all cores)")
    p.add_argument("--providers", default=None, help=f"comma-separated, default {','.join(PROVIDERS)}")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 5, --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--timeout", type=float, default=None, help="seconds per provider worker")
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "prorl-bench-train_step"))
    p.add_argument("--out", default=None, help=f"CSV to append to (default benchmarks/results/{NAME}.csv)")
    args = p.parse_args(argv)

    seqs, min_len, max_len = GPU_BATCH if args.gpu else QUICK_BATCH if args.quick else CPU_BATCH
    if args.lengths:
        min_len, max_len = (int(x) for x in args.lengths.split(","))
    model = args.model or ("qwen2-0.5b" if args.gpu else "tiny" if args.quick else "small")
    os.makedirs(args.ckpt_dir, exist_ok=True)
    shape = make_shape(
        model, args.seqs or seqs, min_len, max_len, "bfloat16" if args.gpu else "float32", args.ckpt_dir
    )
    providers = args.providers.split(",") if args.providers else list(PROVIDERS)
    unknown = [x for x in providers if x not in PROVIDERS]
    if unknown:
        p.error(f"unknown providers {unknown}; choose from {PROVIDERS}")
    out = args.out or harness.RESULTS_DIR / f"{NAME}.csv"
    rows, errors = harness.run_benchmark(
        NAME,
        "benchmarks.train_step",
        providers,
        ["full"],
        [shape],
        device="cuda" if args.gpu else "cpu",
        threads=args.threads,
        warmup=args.warmup,
        reps=args.reps or (2 if args.quick else 5),
        out=out,
        peak_tflops=harness.H200_BF16_DENSE_TFLOPS,
        timeout=args.timeout,
    )
    extra = derived_rows(rows, [shape])
    harness.append_csv(out, extra)
    print(summary(rows + extra))
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
