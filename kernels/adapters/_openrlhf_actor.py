"""OpenRLHF's `Actor.forward` (0.11.2) with the log-probs and entropy from the hidden states, fused.

    from openrlhf.models import Actor
    Actor.forward = openrlhf_actor_forward(Actor.forward)

OpenRLHF's actor runs the whole causal LM, casts the [B, L, V] logits to fp32, divides them by the
temperature, and takes log-probs of the next tokens and (with return_entropy) entropies from them.
Here the backbone's last hidden state [B, L, D] goes straight to `linear_logprob_entropy` with the
LM-head weight (autocast off, the weight's dtype, fp32 accumulation): the same outputs, positions
and masking as OpenRLHF's, without the logits. `output` (return_output=True) carries `entropy` as
OpenRLHF's does, but no `logits`; a call that asks only for the logits (no action_mask, no
return_logprobs) runs OpenRLHF's own forward. Refused with a ValueError: packed samples
(packing_samples=True, ring attention), vision-language inputs, MoE router logits (the aux loss), a
DeepSpeed ZeRO-3 partitioned LM head.
"""

from __future__ import annotations

import functools

import torch

from ..linear_logprob_entropy import linear_logprob_entropy

__all__ = ["openrlhf_actor_forward"]


def openrlhf_actor_forward(original_forward):
    """`openrlhf.models.Actor.forward`, fused, built on the original (which serves logits-only
    calls).

    The returned forward gives the action log-probs [B, A] (times action_mask), or with
    return_logprobs and no action_mask every next-token log-prob [B, L - 1]; `(..., output)` with
    return_output, output.entropy [B, L - 1] with return_entropy, as OpenRLHF's.
    """

    @functools.wraps(original_forward)
    def forward(
        self,
        sequences,
        action_mask=None,
        attention_mask=None,
        return_output=False,
        allgather_logits=False,
        return_logprobs=False,
        ring_attn_group=None,
        packed_seq_lens=None,
        return_entropy=False,
        **mm_inputs,
    ):
        if action_mask is None and not return_logprobs:  # the caller wants the logits
            return original_forward(
                self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs,
            )  # fmt: skip
        bad = [
            k for k, v in dict(mm_inputs=mm_inputs, ring_attn_group=ring_attn_group).items() if v
        ]
        return _fused(
            self, sequences, action_mask, attention_mask, return_output, return_entropy, bad
        )

    forward._prorl_fused = True
    return forward


def _fused(actor, sequences, action_mask, attention_mask, return_output, return_entropy, bad):
    if getattr(actor, "packing_samples", False):
        bad.append("packing_samples=True")
    model = actor.model.get_base_model() if hasattr(actor.model, "get_base_model") else actor.model
    if getattr(model.config, "output_router_logits", False):
        bad.append("output_router_logits (MoE aux loss)")
    weight = model.get_output_embeddings().weight
    if hasattr(weight, "ds_id") and weight.numel() == 0:
        bad.append("a ZeRO-3 partitioned LM head")
    if bad:
        raise ValueError(
            f"openrlhf_actor_forward does not support {', '.join(bad)}; use Actor.forward"
        )

    position_ids = attention_mask.long().cumsum(-1) - 1  # as OpenRLHF's padded (unpacked) path
    position_ids.masked_fill_(attention_mask == 0, 1)
    hidden = model.base_model(sequences, attention_mask=attention_mask, position_ids=position_ids)[
        0
    ]
    labels = sequences[:, 1:]  # OpenRLHF rolls the sequence and drops the last position
    with torch.autocast(hidden.device.type, enabled=False):
        log_probs, entropy = linear_logprob_entropy(
            hidden[:, :-1].to(weight.dtype),
            weight,
            labels,
            float(actor.temperature),
            -100,
            return_entropy,
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    output = CausalLMOutputWithPast()
    if return_entropy:
        output.entropy = entropy
    if action_mask is None:
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs
