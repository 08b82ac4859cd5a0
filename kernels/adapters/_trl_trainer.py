"""`FusedGRPOTrainer`: TRL 1.16's GRPOTrainer whose log-prob passes never form logits.

    from prorl.kernels.adapters import FusedGRPOTrainer  # GRPOTrainer's constructor and GRPOConfig

TRL's own passes run the backbone, then its LM head in [4096, 32768] tiles
(trl/kernels/chunked_logprob.py: the tile recomputed in backward, 8NDV matmul FLOPs). Here the
model's forward gains a `prorl_hidden=True` mode that returns the backbone's output before the LM
head (the way TRL adds `fused_lm_head=True`, so DDP, FSDP and DeepSpeed wrappers pass it through),
and

    training forward   hidden [B, C, D] -> linear_ppo_loss (loss, entropy, metrics; 6NDV, one
                       [R, V] block) or, for beta != 0 with use_bias_correction_kl (TRL's default:
                       k3 times the ratio is not a linear_ppo_loss term), linear_logprob_entropy +
                       trl_compute_loss's loss
    old / ref passes   hidden -> linear_logprob_entropy (no grad: 2NDV, one tile at a time)

The LM head runs in the weight's dtype with autocast off: fp32 master weights under TRL's
`bf16=True` give an fp32 head (as `cast_lm_head_to_fp32=True` does; TRL's own head multiplies in
bf16 then). The loss, its normalisers, IS correction and logged metrics are trl_compute_loss's
(_trl.py: every loss_type it fuses, beta with and without use_bias_correction_kl, tool_mask,
evaluation). Generation is TRL's, untouched. Refused when the trainer is built, with a ValueError
naming the setting: what trl_compute_loss refuses, vision-language models, an LM head with a bias,
logit scaling or soft-capping.
"""

from __future__ import annotations

import functools
import types

import torch
from trl import GRPOTrainer

from ..linear_logprob_entropy import linear_logprob_entropy
from ..linear_ppo_loss import linear_ppo_loss
from ._trl import (
    TRLLossSettings,
    _check_supported,
    _is_weights,
    _loss_and_metrics,
    _normaliser,
    log_trl_metrics,
    row_clip_fractions,
    trl_loss_tensors,
)

__all__ = ["FusedGRPOTrainer"]

# config attributes whose presence means TRL's head does more than hidden @ W.T / T
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
)


class FusedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer (TRL 1.16) with the update and the old/reference log-prob passes on prorl's fused
    LM head; arguments and config as GRPOTrainer's (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_supported(self, "FusedGRPOTrainer")
        for model in (self.model, self.ref_model):
            if model is not None:
                _check_head(self.accelerator.unwrap_model(model))
                _add_hidden_forward(self.accelerator.unwrap_model(model))

    # ---- the shared pieces: hidden states before the LM head, the head's weight, the labels ------

    def _completion_hidden(self, model, input_ids, attention_mask, logits_to_keep):
        """[B, C, D] backbone outputs at the positions that predict the last C tokens, in the
        weight's dtype, and the [V, D] LM-head weight."""
        with self.accelerator.autocast():
            hidden = model(input_ids=input_ids, attention_mask=attention_mask, prorl_hidden=True)
        weight = self.accelerator.unwrap_model(model).get_output_embeddings().weight
        # FSDP2 shards the head; the op takes it whole, as TRL's does
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        return hidden[:, -logits_to_keep - 1 : -1].to(weight.dtype), weight

    @staticmethod
    def _labels(input_ids, attention_mask, logits_to_keep):
        labels = input_ids[:, -logits_to_keep:]
        return labels.masked_fill(attention_mask[:, -logits_to_keep:] == 0, -100)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's per-token log-probs (and entropies) [B, C] in row chunks of `batch_size`, fused."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if compute_aux_loss or given:
            raise ValueError(f"FusedGRPOTrainer takes text only, without aux loss; got {given}")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, att = (
                input_ids[start : start + batch_size],
                attention_mask[start : start + batch_size],
            )
            hidden, weight = self._completion_hidden(model, ids, att, logits_to_keep)
            with torch.autocast(hidden.device.type, enabled=False):
                logp, ent = linear_logprob_entropy(
                    hidden,
                    weight,
                    self._labels(ids, att, logits_to_keep),
                    self.temperature,
                    return_entropy=compute_entropy,
                )
            logps.append(logp)
            entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    # ---- the training forward --------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        c = completion_ids.size(1)
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        train = self.model.training
        settings = TRLLossSettings.of(self, inputs)
        hidden, weight = self._completion_hidden(model, input_ids, attention_mask, c)
        labels = self._labels(input_ids, attention_mask, c)
        with torch.autocast(hidden.device.type, enabled=False):
            if self.beta != 0.0 and self.args.use_bias_correction_kl:
                logp, entropy = linear_logprob_entropy(hidden, weight, labels, self.temperature)
                tensors = trl_loss_tensors(self, inputs, logp, mask)
                loss, m = _loss_and_metrics(tensors, settings, per_row_clip=True)
                entropy_sum = (entropy.detach() * mask).sum()
            else:
                tensors = trl_loss_tensors(self, inputs, None, mask)
                loss, m = self._fused_loss(hidden, weight, labels, tensors, settings)
                entropy_sum = m["entropy_mean"] * m["num_tokens"]
        log_trl_metrics(self, m, entropy_sum, train)
        return loss

    def _fused_loss(self, hidden, weight, labels, tensors: dict, s: TRLLossSettings):
        """linear_ppo_loss with TRL's arguments: the loss and trl_compute_loss's metrics."""
        old, advantages, mask = (
            tensors["old_per_token_logps"],
            tensors["advantages"],
            tensors["mask"],
        )
        agg, normalizer = _normaliser(s, mask)
        with_kl = s.beta != 0.0
        loss, m = linear_ppo_loss(
            hidden,
            weight,
            labels,
            old,
            advantages,
            mask,
            temperature=self.temperature,
            eps_low=s.epsilon_low,
            eps_high=s.epsilon_high,
            ref_logp=tensors["ref_per_token_logps"] if with_kl else None,
            kl_coef=s.beta,
            kl_estimator="k3",
            kl_clamp="none",
            is_weights=_is_weights(tensors["importance_sampling_ratio"], mask),
            agg=agg,
            normalizer=normalizer,
        )
        m = dict(m)
        if with_kl:
            m["kl_sum"] = m["kl_mean"] * m["num_tokens"]
        old = m["logp"] if old is None else old
        m.update(
            row_clip_fractions(m["logp"], old, advantages, mask, s.epsilon_low, s.epsilon_high)
        )
        return loss, m


def _check_head(model) -> None:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    bad = []
    if text is not config:
        bad.append(f"a vision-language model ({type(model).__name__})")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        bad.append("an LM head with a bias")
    for name in _LOGIT_TRANSFORMS:
        value = getattr(text, name, None)
        if value is not None and value != 1.0:
            bad.append(f"{name}={value!r}")
    if getattr(text, "logits_scaling", None) not in (None, 1.0):
        bad.append(f"logits_scaling={text.logits_scaling!r}")
    if bad:
        raise ValueError(
            "FusedGRPOTrainer computes log-probs as softmax(hidden @ lm_head.weight.T / T); it "
            f"does not support {', '.join(bad)}: use GRPOTrainer"
        )


def _add_hidden_forward(model) -> None:
    """model(..., prorl_hidden=True) returns the backbone's last hidden state [B, L, D]; other calls
    are the model's own forward (generation included)."""
    # PEFT: the base model
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(target, "_prorl_hidden_forward", False):
        return
    inner = target.forward

    @functools.wraps(type(target).forward)  # `generate` checks its kwargs against this signature
    def forward(self, *args, prorl_hidden=False, **kwargs):
        if not prorl_hidden:
            return inner(*args, **kwargs)
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs).last_hidden_state

    target.forward = types.MethodType(forward, target)
    target._prorl_hidden_forward = True
