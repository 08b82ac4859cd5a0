"""FP8 training as a model converter (`model.fp8: none | torchao | te`), applied before FSDP2.

Like torchtitan's Float8 converter this is not an `if fp8:` inside layers: `FP8Training.convert`
swaps the `nn.Linear` projections of every decoder Block (q/k/v/o, gate/up/down) for an FP8 Linear
in a model that is otherwise unchanged, then `parallelize` applies checkpointing / compile / FSDP2
as for any model:

    fp8 = FP8Training("torchao", "tensorwise", fsdp=True)
    model = fp8.convert(load_hf(path, dtype=torch.float32))   # fp32 masters stay fp32
    model = parallelize(model, param_dtype=torch.bfloat16, activation_checkpointing=True)
    with fp8.autocast():                                      # TE: its autocast; torchao: nothing
        hidden = model(ids, cu_seqlens=cu)                    # TE: N a multiple of token_multiple
    loss.backward()                                           # outside the autocast (TE's rule)
    optimizer.step(); fp8.after_optimizer_step(model)         # torchao FP8 all-gather: scales

Backends:
- torchao (`torchao.float8.convert_to_float8_training`, torchao 0.18): dynamic scaling, `tensorwise`
  (one scale per tensor, e4m3 forward, e5m2 gradients; FSDP2 all-gathers the weights in FP8) or
  `rowwise` (a scale per row, e4m3 throughout, power-of-2 scales). Runs on the CPU too: the tests
  run the real `torch._scaled_mm` of torch 2.13's CPU build at small shapes under CUDA's shape and
  dtype rules (tests/helpers/scaled_mm_standin.py), training runs emulate it (`emulate` below,
  `model.fp8_emulate`). CUDA's FP8 GEMM needs mat1's inner dim and both dims of mat2 divisible by
  16: only such layers are converted, and the trainer pads packed batches to `token_multiple` tokens
  (the weight-gradient GEMM has the token count as its inner dim). No global state: torch's
  activation checkpointing and `torch.compile` compose with it.
- te (Transformer Engine >= 2.9, H100/H200): `te.pytorch.Linear` under
  `te.pytorch.autocast(enabled=, recipe=)` with `delayed` (DelayedScaling, HYBRID), `current`
  (Float8CurrentScaling, HYBRID) or `mxfp8` (MXFP8BlockScaling, Blackwell only: TE refuses it on
  sm_90). TE's FP8 GEMMs need the product of an input's leading dimensions to be a multiple of 8 and
  its last dimension a multiple of 16 (32 for MXFP8's 32-element blocks): only layers whose in and
  out features are multiples of `weight_multiple` are converted, and the trainer pads each packed
  batch to `token_multiple` tokens with an ignored dummy sequence (prorl/packing.py `padded`).
  Activation checkpointing uses `te.distributed.checkpoint`, which recomputes under the FP8 state of
  the forward; `parallelize` also restores TE's parameter attributes after `fully_shard` (which
  replaces every parameter by a DTensor), as TE's FSDP2 tests do. TE cannot be imported without
  CUDA: the tests run this path against a stand-in that enforces these rules
  (tests/helpers/te_standin.py).

What is not converted, and why: the embedding and the LM head (the fused log-prob op reads
`lm_head_weight` in full precision: FP8 logits would cost accuracy exactly where the policy gradient
and the KL are computed, and the head's [V, D] GEMM is done by the fused op, not by a Linear), norms
and attention.

Which models run in FP8 (decided in prorl/trainer.py, documented in docs/architecture.md):
- the reference policy gets the same conversion as the policy. The KL term compares the two; with a
  bf16 reference the FP8 quantisation error of the policy (~5% relative on a block's output) would
  show up as a KL that is never zero, even right after a reference reset, and its gradient would
  pull the policy towards the bf16 function rather than the reference. With the same conversion and
  dynamic (per-call) scales the two compute identically when their weights are equal: after a reset
  the KL and its gradient are exactly zero, as without FP8. (TE's delayed scaling keeps per-module
  amax histories, which differ between the two models: use `current` when exactness after a reset
  matters.)
- the sampler samples in bf16: the native sampler under FSDP is an unconverted copy, vLLM gets plain
  weights. FP8 is a training-throughput tool; decode GEMMs of a few rows gain nothing from it. The
  sampler/trainer log-prob mismatch this adds is logged every step (`rollout/logprob_mismatch`) and
  `algorithm.is_mode=tis|icepop` corrects for it.

Weights stay plain. Converted layers keep the parameter names and shapes of `nn.Linear` (`weight`,
`bias`) and hold high-precision master weights: checkpoints, the model identity, HF export and
weight pushes see the same tensors as without FP8. torchao's FP8 all-gather wraps each weight in a
tensor subclass and TE adds `_extra_state` (its scaling metadata) to the state dict: `plain` unwraps
the former and `engine.parallel.full_state_dict` / `iter_full_tensors` and the checkpoints
(`engine.checkpoint_state.ModelState`) drop the latter, so no FP8 tensor subclass, scale or
`_extra_state` leaves the trainer, and FP8 and bf16 runs resume each other's checkpoints (TE's
delayed-scaling amax history restarts then).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from .choices import FP8_BACKENDS, FP8_RECIPES

logger = logging.getLogger(__name__)

BACKENDS, RECIPES = FP8_BACKENDS, FP8_RECIPES
DEFAULT_RECIPE = {"none": "auto", "torchao": "tensorwise", "te": "current"}
MIN_CAPABILITY = (9, 0)
TE_HINT = "install the GPU extra: pip install 'prorl[gpu]' (transformer-engine[pytorch] >= 2.9)"
TORCHAO_HINT = "install the fp8 extra: pip install 'prorl[fp8]' (torchao >= 0.18)"
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _import_te():
    import transformer_engine.pytorch as te

    return te


def _import_torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise RuntimeError(f"model.fp8=torchao needs torchao ({exc}); {TORCHAO_HINT}") from None
    return float8


def resolve_recipe(backend: str, recipe: str = "auto") -> str:
    """The recipe a backend runs: `recipe`, or the backend's default for "auto". Raises ValueError
    for an unknown backend or a recipe the backend does not have."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown FP8 backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if recipe not in RECIPES[backend]:
        raise ValueError(
            f"FP8 recipe {recipe!r} is not one of {backend}'s: {', '.join(RECIPES[backend])}"
        )
    return DEFAULT_RECIPE[backend] if recipe == "auto" else recipe


# --------------------------------------------------------------------------------------------------
# Transformer Engine availability


def fp8_support(
    device: torch.device | int | None = None, recipe: str = "current"
) -> tuple[bool, str]:
    """(available, reason) of Transformer Engine FP8: CUDA device of capability >= 9.0, TE
    importable, TE reports support for the recipe (MXFP8: `is_mxfp8_available`). `reason` lists what
    is missing."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device in this process")
    else:
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            reasons.append(
                f"GPU compute capability {capability[0]}.{capability[1]} < 9.0 (needs H100/H200)"
            )
    try:
        te = _import_te()
    except ImportError as exc:
        reasons.append(f"transformer_engine is not importable ({exc}); {TE_HINT}")
        te = None
    if te is not None and not reasons:
        check = "is_mxfp8_available" if recipe == "mxfp8" else "is_fp8_available"
        available, why = _te_available(getattr(te, check))
        if not available:
            reasons.append(
                "Transformer Engine reports no "
                f"{'MXFP8' if recipe == 'mxfp8' else 'FP8'} support: {why}"
            )
    return not reasons, "; ".join(reasons)


def _te_available(check) -> tuple[bool, str]:
    result = check(return_reason=True)
    return (bool(result[0]), result[1] or "") if isinstance(result, tuple) else (bool(result), "")


def make_te_recipe(recipe: str = "current", **kwargs) -> Any:
    """A `transformer_engine.common.recipe` object: "delayed" (DelayedScaling, HYBRID format: E4M3
    forward, E5M2 gradients; amax history of 16 steps, max), "current" (Float8CurrentScaling,
    HYBRID) or "mxfp8" (MXFP8BlockScaling, its defaults). kwargs override the recipe's fields."""
    from transformer_engine.common.recipe import (
        DelayedScaling,
        Float8CurrentScaling,
        Format,
        MXFP8BlockScaling,
    )

    if recipe == "delayed":
        defaults = {"fp8_format": Format.HYBRID, "amax_history_len": 16, "amax_compute_algo": "max"}
        return DelayedScaling(**{**defaults, **kwargs})
    if recipe == "current":
        return Float8CurrentScaling(**{"fp8_format": Format.HYBRID, **kwargs})
    if recipe == "mxfp8":
        return MXFP8BlockScaling(**kwargs)
    raise ValueError(
        f"unknown Transformer Engine recipe {recipe!r}; choose delayed, current or mxfp8"
    )


# --------------------------------------------------------------------------------------------------
# The converter


@dataclasses.dataclass
class FP8Training:
    """What `model.fp8` / `model.fp8_recipe` ask for, and the few hooks the trainer calls.

    Args:
        backend: "none" | "torchao" | "te".
        recipe: "auto" (torchao: tensorwise; TE: current) or one of `RECIPES[backend]`.
        fsdp: the model will be sharded with FSDP2: torchao's tensorwise recipe then all-gathers the
            weights in FP8 (`enable_fsdp_float8_all_gather`, half the bytes of bf16).
        emulate: torchao only (`model.fp8_emulate`): quantise as FP8 training does, then run the
            GEMM on the dequantised operands in high precision instead of `torch._scaled_mm`. None
            or "auto": on CPU models. torch 2.13's CPU `_scaled_mm` is a slow reference kernel
            (docs/notes.md: seconds for a GEMM bf16 does in a millisecond), and the emulation gives
            the same outputs and input gradients and weight gradients within one bf16 ulp
            (tests/engine/test_fp8.py), so CPU runs emulate and the tests run the real kernel at
            small shapes. On CUDA the real FP8 GEMMs run.
    """

    backend: str = "none"
    recipe: str = "auto"
    fsdp: bool = False
    emulate: bool | str | None = None

    def __post_init__(self):
        self.recipe = resolve_recipe(self.backend, self.recipe)
        if self.emulate == "auto":  # model.fp8_emulate
            self.emulate = None
        if self.emulate not in (None, True, False):
            raise ValueError(f"FP8 emulate must be auto, true or false, got {self.emulate!r}")

    @classmethod
    def of(cls, model_config, fsdp: bool = False) -> FP8Training:
        """From a model config's `fp8`, `fp8_recipe` and `fp8_emulate`
        (prorl.config.ModelConfig)."""
        m = model_config
        return cls(m.fp8, m.fp8_recipe, fsdp=fsdp, emulate=getattr(m, "fp8_emulate", None))

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    @property
    def fsdp_float8_all_gather(self) -> bool:
        return self.backend == "torchao" and self.recipe == "tensorwise" and self.fsdp

    @property
    def weight_multiple(self) -> int:
        """Both dims of a converted layer's weight must be multiples of this (TE: 16, MXFP8: 32;
        torchao: 16, CUDA's `torch._scaled_mm` rule on mat2, which is the weight in the forward)."""
        return {"te": 32 if self.recipe == "mxfp8" else 16, "torchao": 16}.get(self.backend, 1)

    @property
    def token_multiple(self) -> int:
        """Packed token counts are padded to a multiple of this. TE: its rule on the GEMM's leading
        dims, 16 rather than 8 so that the backward's transposed GEMMs, where N is the last dim,
        qualify too. torchao: CUDA's `_scaled_mm` needs mat1's trailing dim and both dims of mat2
        divisible by 16, and the weight-gradient GEMM `grad_out.t() @ input` has the token count as
        its inner dim. Padding the packed batch (at most 15 ignored tokens per pass) is cheaper than
        torchao's `pad_inner_dim`, which copies both FP8 operands of every GEMM whose inner dim is
        not aligned (three GEMMs per Linear)."""
        return self.weight_multiple

    def linear_names(self, model: nn.Module) -> list[str]:
        """Names of the Linear layers `convert` swaps: the Block projections whose dims qualify."""
        names, m = [], self.weight_multiple
        for name, module in model.named_modules():
            if not name.startswith("layers.") or type(module) is not nn.Linear:
                continue
            if name.rpartition(".")[2] not in BLOCK_LINEARS:
                continue
            if module.in_features % m or module.out_features % m:
                logger.info(
                    "fp8: keeping %s in high precision (%d x %d is not a multiple of %d)",
                    name,
                    module.out_features,
                    module.in_features,
                    m,
                )
                continue
            names.append(name)
        return names

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap the qualifying Block Linear layers of `model` for FP8 ones (in place; before
        `parallelize`). Parameter names, shapes, dtypes and values are unchanged. Returns the model.
        Raises RuntimeError naming the extra to install when the backend is unavailable."""
        if not self.enabled:
            return model
        names = self.linear_names(model)
        if self.backend == "torchao":
            _convert_torchao(model, names, self)
        else:
            available, reason = fp8_support(recipe=self.recipe)
            if not available:
                raise RuntimeError(f"model.fp8=te (engine/fp8.py) is unavailable: {reason}")
            te = _import_te()
            for name in names:
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                setattr(parent, child, _te_linear(te, getattr(parent, child)))
        logger.info(
            "fp8: converted %d Linear layers (%s, %s)", len(names), self.backend, self.recipe
        )
        return model

    def autocast(self):
        """The context to run a converted model's forward in (TE: `te.pytorch.autocast` with the
        recipe, amaxes reduced over the default group; the backward runs outside it). torchao, none:
        a no-op."""
        if self.backend != "te":
            return contextlib.nullcontext()
        import torch.distributed as dist

        te = _import_te()
        group = dist.group.WORLD if dist.is_initialized() else None
        return te.autocast(
            enabled=True, recipe=make_te_recipe(self.recipe), amax_reduction_group=group
        )

    def after_optimizer_step(self, model: nn.Module) -> None:
        """torchao's FP8 all-gather: the weights' scales for the next all-gather, in one all-reduce
        (`precompute_float8_dynamic_scale_for_fsdp`); without it each FP8 weight computes its
        own."""
        if self.fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)


def _convert_torchao(model: nn.Module, names: list[str], spec: FP8Training) -> None:
    float8 = _import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(spec.recipe)
    config = dataclasses.replace(
        config,
        emulate=bool(spec.emulate),
        enable_fsdp_float8_all_gather=spec.fsdp_float8_all_gather,
    )
    chosen = set(names)
    if spec.emulate is None:
        config = dataclasses.replace(config, emulate=_on_cpu(model))
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen
    )


def _on_cpu(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


def _te_linear(te, linear: nn.Linear) -> nn.Module:
    weight = linear.weight
    new = te.Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=weight.dtype,
        device=weight.device,
    )
    if weight.device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
    return new


# --------------------------------------------------------------------------------------------------
# Helpers for parallelize and the state-dict paths


def has_te_layers(model: nn.Module) -> bool:
    """Whether any module of `model` comes from Transformer Engine."""
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


def fp8_layers(model: nn.Module) -> list[nn.Module]:
    """The FP8 Linear modules of `model` (Transformer Engine or torchao)."""
    prefixes = ("transformer_engine", "torchao.float8")
    return [m for m in model.modules() if type(m).__module__.startswith(prefixes)]


def te_checkpoint_fn():
    """`te.distributed.checkpoint` (for `checkpoint_wrapper(checkpoint_fn=...)`): recomputes under
    the FP8 state of the forward, which torch's checkpoint (called from backward, outside the
    autocast) would not."""
    import transformer_engine.pytorch as te

    return te.distributed.checkpoint


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` without an FP8 weight wrapper: torchao's FP8 all-gather keeps the high-precision
    weight of a `WeightWithDynamicFloat8CastTensor` in `_tensor` (returned detached); anything else
    is returned as is. A DTensor's local shard is unwrapped and the DTensor rebuilt around it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        inner = plain(local)
        if inner is local:
            return tensor
        return DTensor.from_local(
            inner, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
        )
    inner = getattr(tensor, "_tensor", None)
    if type(tensor) not in (torch.Tensor, nn.Parameter) and isinstance(inner, torch.Tensor):
        return plain(inner.detach())  # the weight's values, not the live Parameter
    return tensor
