"""Tiny random checkpoints of each supported family, written by `transformers` (the reference).

Every parameter is randomised - norms around 1, non-zero biases, weights large enough (std 0.15)
that attention is far from uniform - so that a wrong norm, bias, RoPE variant or mask shows in the
logits.
"""

import torch

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
# name -> (transformers config class, overrides). The RoPE variants use short original contexts
# (16-32) so that their scaling changes positions 0..24 of the test sequences measurably.
VARIANTS = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "llama": ("LlamaConfig", {}),
    "llama-bias": (
        "LlamaConfig",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "llama-llama3": (
        "LlamaConfig",
        dict(rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 32}),
    ),
    "llama-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-dynamic": (
        "LlamaConfig",
        dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    ),
    "llama-yarn": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
}
# Packed test batch: three sequences; only the middle one passes llama-dynamic's 16 positions.
LENGTHS = [7, 25, 12]


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.2 * noise)
        else:
            p.copy_(0.15 * noise)


def hf_logits_per_sequence(hf_model, ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """transformers' logits for each packed sequence run alone (batch of one, no padding) -> [N,
    V]."""
    bounds = cu.tolist()
    with torch.no_grad():
        return torch.cat(
            [hf_model(ids[a:b][None]).logits[0] for a, b in zip(bounds[:-1], bounds[1:])]
        )
