"""The evaluation behind prorl/eval.py's command line (its docstring says what is computed):
`evaluate(examples, EvalInputs(...), EvalSettings(...))` and the trainer's `validate`. Loaded once
the command line was checked: it brings torch and the engine."""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prorl import data
from prorl.config import Config
from prorl.engine.distributed import dist_info, watchdog
from prorl.engine.model import load_hf
from prorl.engine.rollout import NativeGenerator, SamplingParams
from prorl.engine.rollout.base import host_available_bytes
from prorl.eval_metrics import source_val_metrics, summarize
from prorl.eval_results import append_samples, format_table, write_results
from prorl.export_run import export_checkpoint, is_checkpoint
from prorl.rewards import builtin_keys, use_function
from prorl.rewards.function import RewardFunctionError, numeric_extras
from prorl.rewards.pool import RewardPool
from prorl.rollout_budget import validation_kv_gib

PROGRESS_EVERY_S = 10.0  # a progress line at most this often, counted in finished samples


# -- generation and scoring ------------------------------------------------------------------------


def _chunk_size(model, k: int, seq_len: int, kv_cache_gib: float) -> int:
    """Prompts per generate call so that the KV cache (k rows per prompt, seq_len slots each)
    fits."""
    cfg = model.config
    elem = model.embed_tokens.weight.element_size()
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem  # K and V, every layer
    return max(1, int(kv_cache_gib * 2**30 // (k * seq_len * per_token)))


# Host memory per sampled token while a call's results are held: a finished vLLM request keeps the
# token id, a {token: Logprob} dict and the Logprob (~650 bytes in CPython 3.11 by sys.getsizeof),
# plus the Sample's own lists; rounded up.
HOST_BYTES_PER_TOKEN = 1024


def host_chunk_size(k: int, max_new: int, host_memory_gib: float | None = None) -> int:
    """Prompts per generate call for an engine that schedules its own batch (vLLM,
    `schedules_batch`): as many as the host can hold the k samples of, at most `max_new` tokens
    each. host_memory_gib None: a quarter of the memory available now, shared by this node's ranks
    (torchrun's LOCAL_WORLD_SIZE)."""
    if host_memory_gib is None:
        budget = host_available_bytes() / 4 / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    else:
        budget = host_memory_gib * 2**30
    return max(1, int(budget // (k * max_new * HOST_BYTES_PER_TOKEN)))


@dataclass
class EvalSettings:
    """How `evaluate` samples, batches and scores.

    dtype: "float32" | "bfloat16" | None (None: float32 on the CPU, the checkpoint's dtype on CUDA);
    device and dtype apply to a model loaded from `EvalInputs.model_path`. A generate call takes at
    most `prompts_per_generate` prompts (None: 64), fewer when their KV cache would pass
    `kv_cache_gib`; scoring overlaps the next call. A generator that schedules its own batch (vLLM:
    `schedules_batch`) manages its KV cache: it is given every prompt the host can hold the samples
    of (`host_chunk_size`, `host_memory_gib`; `prompts_per_generate` still caps it when given) and
    logs progress per finished request. A reward pool made here has `num_workers` workers,
    `timeout_s` per item. partial_on_interrupt: a KeyboardInterrupt during generation stops it and
    returns what was generated, scored (`interrupted` True); else it propagates.
    """

    k: int = 16
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 32768
    max_prompt_tokens: int | None = 1024
    seed: int = 0
    correct_threshold: float = 1.0
    backend: str = "native"
    device: str | None = None
    dtype: str | None = None
    kv_cache_gib: float = 2.0
    prompts_per_generate: int | None = None
    host_memory_gib: float | None = None
    num_workers: int = 2
    timeout_s: float = 10.0
    partial_on_interrupt: bool = False


@dataclass
class EvalInputs:
    """What `evaluate` runs on. model_path: a Hugging Face-format directory (weights via `load_hf`,
    tokenizer via `PreTrainedTokenizerFast`), or None when `model` and `tokenizer` are given. model,
    tokenizer, pool: already loaded objects (the trainer passes its policy, tokenizer and
    `RewardPool`). generator: a `prorl.engine.rollout.Generator` (the trainer's, native or vLLM);
    None: a `NativeGenerator` over the model."""

    model_path: str | None = None
    model: Any = None
    tokenizer: Any = None
    pool: Any = None
    generator: Any = None


@dataclass
class _Prompts:
    """The encoded prompts and how they are cut into generate calls."""

    token_ids: list[list[int]]
    kept: list[int]  # example index of each prompt
    filtered: dict[str, int]  # per data source, prompts over max_prompt_tokens
    max_new: int
    chunk: int


class _Progress:
    """`on_finished` for the generator: a log line per finished samples, at most every
    PROGRESS_EVERY_S."""

    def __init__(self, total: int, start: float, log):
        self.total, self.start, self.log = total, start, log
        self.finished, self.reported = 0, time.time()

    def __call__(self, n: int) -> None:
        self.finished += n
        if time.time() - self.reported >= PROGRESS_EVERY_S:
            self.reported = time.time()
            elapsed = time.time() - self.start
            self.log(f"eval: {self.finished}/{self.total} samples finished, {elapsed:.0f} s")


def evaluate(
    examples: list[data.Example],
    inputs: EvalInputs,
    settings: EvalSettings | None = None,
    log=print,
) -> dict:
    """Generate `settings.k` samples per example, score them, and summarise (module docstring).

    Args:
        examples: `prorl.data.Example`s (any mix of data sources with registered verifiers).
        inputs: the model (a directory or loaded objects), tokenizer, reward pool, generator.
        settings: sampling, batching and scoring (None: the defaults, the papers').
        log: called with progress lines (None: silent).
    Returns: {"settings", "by_source", "all", "samples" (per-sample records), "elapsed_s", ...}.
    """
    s = settings or EvalSettings()
    if s.backend != "native":
        raise NotImplementedError(
            f"eval backend {s.backend!r} is not implemented "
            "yet; use backend='native' (prorl's own generator)"
        )
    if s.k < 1:
        raise ValueError(f"k must be >= 1, got {s.k}")
    log = log or (lambda *a, **kw: None)
    start = time.time()
    model, tokenizer = _load(inputs, s)
    prompts = _encode(
        examples, model, tokenizer, s, getattr(inputs.generator, "schedules_batch", False)
    )
    n_filtered = len(examples) - len(prompts.kept)
    log(
        f"eval: {len(prompts.kept)} prompts x {s.k} samples ({n_filtered} filtered: prompt > "
        f"{s.max_prompt_tokens} tokens), max {prompts.max_new} new tokens (context "
        f"{model.config.max_position_embeddings}), T={s.temperature}, top-p={s.top_p}, "
        f"{prompts.chunk} prompts per generate call"
    )
    generator = inputs.generator or NativeGenerator(model)
    pool = inputs.pool
    if pool is None:
        keys = builtin_keys(ex.data_source for ex in examples)
        pool = RewardPool(num_workers=s.num_workers, timeout_s=s.timeout_s, preload=keys)
    was_training = model.training
    model.eval()
    try:
        stops = data.stop_token_ids(tokenizer, inputs.model_path)
        records, generated, interrupted = _generate_and_score(
            _Run(examples, prompts, s, tokenizer, generator, pool, log, start), stops
        )
    finally:
        if inputs.pool is None:
            pool.close()
        model.train(was_training)
    results = {"settings": _settings_record(inputs.model_path, model, prompts, s)}
    results |= {"n_examples": len(examples), "n_filtered": n_filtered, "interrupted": interrupted}
    results |= {"n_evaluated": len({r["index"] for r in records})}
    results |= summarize(records, s.k, dict(prompts.filtered))
    results |= {"generated_tokens": generated, "elapsed_s": time.time() - start, "samples": records}
    return results


def _load(inputs: EvalInputs, s: EvalSettings):
    """The model and tokenizer: the ones given, else loaded from `inputs.model_path`."""

    tokenizer, model = inputs.tokenizer, inputs.model
    if tokenizer is None:
        from transformers import PreTrainedTokenizerFast  # not AutoTokenizer: docs/notes.md

        tokenizer = PreTrainedTokenizerFast.from_pretrained(inputs.model_path)
    if model is None:
        device = s.device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[s.dtype]
        if torch_dtype is None and torch.device(device).type == "cpu":
            torch_dtype = torch.float32
        model = load_hf(inputs.model_path, dtype=torch_dtype, device=device)
    return model, tokenizer


def _encode(examples, model, tokenizer, s: EvalSettings, engine_batches: bool) -> _Prompts:
    """Chat-templated prompts (over-long ones filtered and counted), the new-token cap the model's
    context leaves, and the prompts per generate call."""
    prompts, kept, _ = data.encode_prompts(examples, tokenizer, s.max_prompt_tokens)
    kept_set = set(kept)
    filtered: dict[str, int] = defaultdict(int)
    for i, ex in enumerate(examples):
        if i not in kept_set:
            filtered[ex.data_source] += 1
    context = model.config.max_position_embeddings
    longest = max((len(p) for p in prompts), default=0)
    max_new = min(s.max_tokens, context - longest)
    if prompts and max_new < 1:
        raise ValueError(
            f"the longest prompt ({longest} tokens) fills the model's context ({context})"
        )
    if engine_batches:
        host = host_chunk_size(s.k, max_new, s.host_memory_gib)
        chunk = min(s.prompts_per_generate or len(prompts) or 1, host)
    else:
        kv = _chunk_size(model, s.k, longest + max_new, s.kv_cache_gib)
        chunk = min(s.prompts_per_generate or 64, kv)
    return _Prompts(prompts, kept, filtered, max_new, chunk)


def _settings_record(model_path, model, prompts: _Prompts, s: EvalSettings) -> dict:
    """The settings written to results.json."""
    weight = model.embed_tokens.weight
    return dict(
        model=model_path,
        backend=s.backend,
        k=s.k,
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        max_new_tokens=prompts.max_new,
        max_prompt_tokens=s.max_prompt_tokens,
        seed=s.seed,
        device=str(weight.device),
        dtype=str(weight.dtype).removeprefix("torch."),
        correct_threshold=s.correct_threshold,
        prompts_per_generate=prompts.chunk,
    )


@dataclass
class _Run:
    """What one evaluation's generate-and-score loop works with."""

    examples: list
    prompts: _Prompts
    settings: EvalSettings
    tokenizer: Any
    generator: Any
    pool: Any
    log: Any
    start: float


def _generate_and_score(run: _Run, stops) -> tuple[list[dict], int, bool]:
    """Generate chunk by chunk, each chunk scored in the pool while the next generates; returns the
    scored per-sample records, the generated token count and whether a KeyboardInterrupt stopped
    it."""
    s, ids = run.settings, run.prompts.token_ids
    chunk = run.prompts.chunk
    pending = []  # (Future of BatchResult, records of that chunk)
    generated, interrupted = 0, False
    progress = _Progress(len(ids) * s.k, run.start, run.log)
    try:
        for lo in range(0, len(ids), chunk):
            params = SamplingParams(
                n=s.k,
                temperature=s.temperature,
                top_p=s.top_p,
                max_new_tokens=run.prompts.max_new,
                stop_token_ids=stops,
                seed=s.seed + lo,
            )
            out = run.generator.generate(ids[lo : lo + chunk], params, on_finished=progress)
            records = _chunk_records(run, lo, out.samples)
            generated += sum(r["response_tokens"] for r in records)
            exs = [run.examples[r["index"]] for r in records]
            future = run.pool.score_batch_async(
                [e.data_source for e in exs],
                [r["response"] for r in records],
                [e.ground_truth for e in exs],
                [e.extra for e in exs],
            )
            pending.append((future, records))
            done, rate = min(lo + chunk, len(ids)), generated / (time.time() - run.start)
            run.log(f"eval: generated {done}/{len(ids)} prompts, {rate:.0f} tok/s")
    except KeyboardInterrupt:  # stop generating; what was generated is still scored and reported
        if not s.partial_on_interrupt:
            raise
        interrupted = True
        run.log(f"eval: stopped after {len(pending)} of {-(-len(ids) // chunk)} generate calls")
    scored = []
    for future, records in pending:
        res = future.result()
        for r, sc, t, e, x in zip(records, res.scores, res.timed_out, res.errored, res.extras):
            r.update(score=sc, correct=sc >= s.correct_threshold, timed_out=t, errored=e)
            r["extras"] = numeric_extras(x)
        scored += records
    return scored, generated, interrupted


def _chunk_records(run: _Run, lo: int, samples) -> list[dict]:
    """One record per generated sample of the chunk starting at prompt `lo` (unscored yet)."""
    records = []
    for s in samples:
        i = run.prompts.kept[lo + s.prompt_index]
        records.append(
            dict(
                index=i,
                data_source=run.examples[i].data_source,
                file=getattr(run.examples[i], "source", None),
                sample=s.sample_index,
                finish_reason=s.finish_reason,
                response_tokens=len(s.token_ids),
                response=run.tokenizer.decode(s.token_ids, skip_special_tokens=True),
            )
        )
    return records


# -- the trainer's validation ----------------------------------------------------------------------


def validate(
    cfg: Config, examples: list, model, tokenizer, pool, generator, log=None, step: int = 0
) -> dict[str, float]:
    """The trainer's held-out evaluation: `evaluate` on this rank's share of `examples` with the
    trainer's sampler (`generator` over `model`; `trainer.val_samples` per prompt at
    `trainer.val_temperature` / `val_top_p`), the per-sample records gathered from every rank and
    summarised together.

    Returns `val/accuracy` (mean verifier score over every sample; for binary verifiers the mean
    pass@1), `val/pass@j`, and per data source `val-core/<source>/reward/mean@k` (verl's name) and
    `val-core/<source>/pass@j` and a reward function's extras (`source_val_metrics`). Collective:
    every rank calls it. With `trainer.val_save_samples` rank 0 appends the records, responses
    included and tagged with `step`, to <output_dir>/val_samples.jsonl."""
    info, k, t = dist_info(), cfg.trainer.val_samples, cfg.trainer
    mine = list(range(info.rank, len(examples), info.world_size))
    settings = EvalSettings(
        k=k,
        temperature=t.val_temperature,
        top_p=t.val_top_p if t.val_temperature > 0 else 1.0,
        max_tokens=cfg.rollout.max_response_tokens,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        seed=cfg.seed,
        kv_cache_gib=validation_kv_gib(next(model.parameters()).device),
    )
    inputs = EvalInputs(model=model, tokenizer=tokenizer, pool=pool, generator=generator)
    results = evaluate([examples[i] for i in mine], inputs, settings, log=log)
    fields = "data_source score correct timed_out errored finish_reason response_tokens extras"
    fields = fields.split() + (["sample", "response"] if t.val_save_samples else [])
    records = [{"index": mine[r["index"]], **{f: r[f] for f in fields}} for r in results["samples"]]
    if info.world_size > 1:
        gathered = [None] * info.world_size
        with watchdog().waiting("all-gather of the validation records"):
            dist.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    if t.val_save_samples and info.rank == 0:
        append_samples(os.path.join(cfg.output_dir, "val_samples.jsonl"), records, step)
    summary = summarize(records, k)
    out = {"val/accuracy": summary["all"]["mean_score"] or 0.0}
    failed = sum(bool(r["errored"] or r["timed_out"]) for r in records)
    out["val/verify_failed_frac"] = failed / max(len(records), 1)
    out.update({f"val/{m}": v for m, v in summary["all"].items() if m.startswith("pass@")})
    for source, m in summary["by_source"].items():
        out.update(source_val_metrics(source, m, k))
    return out


# -- command line ----------------------------------------------------------------------------------


def _examples(args, ap) -> list[data.Example] | None:
    """The --data files' and --builtin task's examples (None: a file could not be read, said on
    stderr)."""
    examples = []
    try:
        for path in args.data:
            examples += data.load_file(path)[: args.limit]
    except (data.DataError, FileNotFoundError) as exc:
        print(f"prorl.eval: {exc}", file=sys.stderr)
        return None
    if args.builtin:
        examples += data.builtin(args.builtin, n=args.limit, split="val")
    if not examples:
        ap.error("no examples to evaluate")
    return examples


def _settings(args) -> EvalSettings:
    return EvalSettings(
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        prompts_per_generate=args.prompts_per_generate,
        num_workers=args.num_workers,
        timeout_s=args.timeout,
        partial_on_interrupt=True,
    )


def _model_dir(args, ap):
    """(the Hugging Face directory to evaluate, the temporary directory holding it or None): a
    training checkpoint's policy is exported to a temporary directory first."""
    import tempfile

    model_dir, exported = args.model, None
    if is_checkpoint(args.model):
        exported = tempfile.TemporaryDirectory(prefix="prorl-eval-")
        model_dir = export_checkpoint(args.model, exported.name)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        ap.error(
            f"--model {args.model!r} is neither a Hugging Face model directory nor a checkpoint "
            "step"
        )
    return model_dir, exported


def run(args, ap) -> int:
    """prorl/eval.py's command line after its arguments were checked: verifiers, model, data, the
    evaluation, the results written and printed; the exit code."""
    import importlib
    import signal

    for module in args.plugins:  # user verifiers: each module calls prorl.rewards.register(...)
        importlib.import_module(module)

    try:
        # before the data: every row's data_source resolves to it
        use_function(args.reward_function)
    except RewardFunctionError as exc:
        print(f"prorl.eval: --reward-function: {exc}", file=sys.stderr)
        return 2
    model_dir, exported = _model_dir(args, ap)
    examples = _examples(args, ap)
    if examples is None:
        return 2
    # SIGTERM (a scheduler's stop) like Ctrl-C: what was generated so far is scored and written
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results = evaluate(examples, EvalInputs(model_path=model_dir), _settings(args))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or os.path.join("runs", f"eval-{stamp}")
    results["settings"]["data"] = list(args.data) + (
        [f"builtin:{args.builtin}"] if args.builtin else []
    )
    results["settings"]["model"] = args.model
    paths = write_results(results, out_dir)
    if exported is not None:
        exported.cleanup()
    print(format_table(results))
    if results.get("interrupted"):
        print(
            "prorl.eval: stopped early: "
            f"{results['n_evaluated']} of {len(examples)} prompts evaluated"
        )
    print(
        f"{results['generated_tokens']} tokens in "
        f"{results['elapsed_s']:.1f} s; wrote {', '.join(paths)}"
    )
    return 0
