"""prorl.engine.model: one decoder for the Llama / Qwen2 / Qwen3 family and its Hugging Face I/O.

model = load_hf("path/to/checkpoint", dtype=torch.bfloat16, device="cuda")
hidden = model(input_ids, cu_seqlens=cu_seqlens)        # [N] packed tokens -> [N, D]
logp, entropy = linear_logprob_entropy(hidden, model.lm_head_weight, labels)
save_hf(model, "path/to/export")                        # transformers loads it
"""

from .config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig, RopeConfig
from .decoder import Decoder, packed_position_ids
from .hf_io import NonFiniteWeights, load_hf, save_hf

__all__ = [
    "NonFiniteWeights",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "Decoder",
    "ModelConfig",
    "RopeConfig",
    "load_hf",
    "packed_position_ids",
    "save_hf",
]
