"""verl's fused LM head (`use_fused_kernels=True`), served by prorl's `linear_logprob_entropy`.

With `actor_rollout_ref.model.use_fused_kernels=True` verl (0.9.1) patches the model's forward
(verl/models/transformers/monkey_patch.py, `patch_forward_with_backends`) so that it returns
per-token log-probs and entropies computed from the backbone's hidden states, through one of two
functions that the patched forward imports when it runs (verl/models/transformers/dense_common.py
and the VL variants):

    fused_kernels_backend "torch" (default)  FusedLinearForPPO(impl_backend=...).forward(
                                             hidden_states=, vocab_weights=, input_ids=,
                                             temperature=) -> log_probs fp32 and entropy in
                                             hidden's dtype, labels' shape
    fused_kernels_backend "triton"           linear_cross_entropy(hidden, weight, labels,
                                             temperature, "none") -> log_probs and entropy fp32,
                                             flattened [N]

`install_verl_fused_linear()` replaces both names in their verl modules (`FusedLinearForPPO` by
`VerlFusedLinearForPPO`, `linear_cross_entropy` by `verl_linear_cross_entropy`); because the call
sites import them at call time, every model verl patches afterwards, or has patched already, uses
prorl's op. `prorl.kernels.adapters.verl_fused_plugin` runs it on import (verl's `external_lib`).
The op runs with autocast off on the weight's dtype (as verl's kernel: bf16 parameters under FSDP
mixed precision stay bf16, with fp32 accumulation). Refused with a ValueError: reductions other than
"none" and a `dist_process_group` (verl's vocabulary-parallel mode).
"""

from __future__ import annotations

import torch

from ..linear_logprob_entropy import linear_logprob_entropy

__all__ = ["VerlFusedLinearForPPO", "install_verl_fused_linear", "verl_linear_cross_entropy"]


def _logprob_entropy(hidden, weight, labels, temperature):
    if torch.is_tensor(temperature):
        temperature = float(temperature)
    with torch.autocast(hidden.device.type, enabled=False):
        return linear_logprob_entropy(
            hidden.to(weight.dtype), weight, labels.long(), float(temperature)
        )


class VerlFusedLinearForPPO(torch.nn.Module):
    """Drop-in for `verl.utils.experimental.torch_functional.FusedLinearForPPO` (same
    constructor)."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(
                f"impl_backend must be 'torch' or 'liger' (verl's choices), got {impl_backend!r}"
            )
        # kept for verl's callers; unused
        self.chunk_size, self.impl_backend = chunk_size, impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        """hidden_states [..., D], vocab_weights [V, D], input_ids [...] -> (log_probs fp32, entropy
        in hidden_states' dtype), both input_ids' shape, as verl's."""
        logp, entropy = _logprob_entropy(hidden_states, vocab_weights, input_ids, temperature)
        return logp, entropy.to(hidden_states.dtype)


def verl_linear_cross_entropy(
    hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None
):
    """Drop-in for `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`: (log_probs,
    entropy), fp32, flattened to [N] as verl's Triton kernel returns them."""
    if reduction != "none":
        raise ValueError(
            f"verl_linear_cross_entropy supports reduction='none' only, got {reduction!r}"
        )
    if dist_process_group is not None:
        raise ValueError(
            "verl_linear_cross_entropy does not split the vocabulary (dist_process_group)"
        )
    logp, entropy = _logprob_entropy(hidden, weight, labels, temperature)
    return logp.reshape(-1), entropy.reshape(-1)


def install_verl_fused_linear() -> None:
    """Make prorl's op the fused linear behind verl's use_fused_kernels (both backends)."""
    from verl.utils.experimental import torch_functional
    from verl.utils.kernel import linear_cross_entropy

    torch_functional.FusedLinearForPPO = VerlFusedLinearForPPO
    linear_cross_entropy.linear_cross_entropy = verl_linear_cross_entropy
