"""FP8 training with NVIDIA Transformer Engine (TE), applied as a model converter.

UNVERIFIED: written against TE's documented PyTorch API (`transformer_engine.pytorch.Linear`,
`autocast` / the older `fp8_autocast`, `is_fp8_available`, and the `DelayedScaling` /
`Float8CurrentScaling` recipes of `transformer_engine.common.recipe`) and never run: the CPU machines
have neither a GPU nor TE, and no GPU check has run it yet. Only the availability checks and the layer
selection are tested (with a stand-in module). Treat FP8 results as unchecked until a Hopper run
compares a converted model's loss with the bf16 one.

Like torchtitan's Float8 converter, this is not an `if fp8:` inside layers: `convert_to_fp8` swaps
`nn.Linear` modules for `te.Linear` in a model that is otherwise unchanged, before `parallelize`:

    model = meta_decoder(cfg)
    model = convert_to_fp8(model)                     # or required=False: keep bf16 where FP8 is absent
    model = parallelize(model, param_dtype=torch.bfloat16)
    materialize(model, device, hf_path=path)
    with fp8_autocast("delayed"):                     # the forward only; backward runs outside it
        hidden = model(input_ids, cu_seqlens=cu_seqlens)

What is converted: the seven projections of every decoder Block (q/k/v/o, gate/up/down) whose in and
out features are multiples of 16 (TE's FP8 GEMMs need both dimensions divisible by 16). Not converted:
the embedding and the LM head (the fused loss ops read `lm_head_weight` in full precision; FP8 logits
would cost accuracy exactly where the policy-gradient signal is computed), norms, attention.

Constraints the caller owns (also unverified):
- The packed token count N must be a multiple of 16 as well (`FP8_ALIGN`): pad the packed batch (e.g.
  with a short dummy sequence whose labels are ignore_index).
- Activation checkpointing needs TE's own `te.distributed.checkpoint`, which re-enters the FP8 state
  for the recomputation; torch's checkpoint would recompute outside `fp8_autocast`. `parallelize`
  refuses the combination.
- With delayed scaling, the amax statistics are reduced over the default process group at the exit
  of `fp8_autocast`, so every rank uses the same scales.
- TE Linear layers carry FP8 metadata as `_extra_state` in their state dict: checkpoints saved from a
  converted model hold it, and `export_hf` / `full_state_dict` drop it.
- Hardware: CUDA compute capability 9.0+ (H100/H200) by this project's choice (TE also runs FP8 on
  sm_89), and TE must be importable: `pip install 'prorl[gpu]'`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8_ALIGN = 16  # TE FP8 GEMMs: both dimensions of every operand divisible by 16
MIN_CAPABILITY = (9, 0)
INSTALL_HINT = "install the GPU extra: pip install 'prorl[gpu]' (transformer-engine[pytorch])"


def _import_te():
    import transformer_engine.pytorch as te

    return te


def fp8_support(device: torch.device | int | None = None) -> tuple[bool, str]:
    """(available, reason): CUDA device of capability >= 9.0, TE importable, TE reports FP8 support.
    `reason` lists everything that is missing ("" when available)."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device in this process")
    else:
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            reasons.append(f"GPU compute capability {capability[0]}.{capability[1]} < 9.0 (needs H100/H200)")
    try:
        te = _import_te()
    except ImportError as exc:
        reasons.append(f"transformer_engine is not importable ({exc}); {INSTALL_HINT}")
        te = None
    if te is not None and not reasons:
        available, why = _te_fp8_available(te)
        if not available:
            reasons.append(f"Transformer Engine reports no FP8 support: {why}")
    return not reasons, "; ".join(reasons)


def _te_fp8_available(te) -> tuple[bool, str]:
    if hasattr(te, "is_fp8_available"):  # TE >= 2.x
        result = te.is_fp8_available(return_reason=True)
        return (result[0], result[1] or "") if isinstance(result, tuple) else (bool(result), "")
    from transformer_engine.pytorch.fp8 import check_fp8_support  # TE 1.x

    return check_fp8_support()


def fp8_linear_names(model: nn.Module) -> list[str]:
    """Names of the Linear layers `convert_to_fp8` swaps: inside `model.layers`, both dims % 16 == 0."""
    names = []
    for name, module in model.named_modules():
        if not name.startswith("layers.") or type(module) is not nn.Linear:
            continue
        if module.in_features % FP8_ALIGN or module.out_features % FP8_ALIGN:
            logger.info(
                "fp8: keeping %s in high precision (%d x %d is not a multiple of %d)",
                name,
                module.out_features,
                module.in_features,
                FP8_ALIGN,
            )
            continue
        names.append(name)
    return names


def convert_to_fp8(model: nn.Module, *, required: bool = True) -> nn.Module:
    """Swap the block Linear layers of `model` for `transformer_engine.pytorch.Linear` (in place).

    Weights and biases are copied (nothing to copy on the meta device: `materialize` fills them later);
    parameter names and shapes are unchanged, so HF loading and checkpoints address them as before.
    Args:
        required: True: raise RuntimeError when FP8 is unavailable; False: log why and return the model
            unchanged.
    Returns:
        the model.
    """
    available, reason = fp8_support()
    if not available:
        message = f"FP8 (engine/fp8.py) is unavailable: {reason}"
        if required:
            raise RuntimeError(message)
        logger.warning("%s; continuing without FP8", message)
        return model
    te = _import_te()
    names = fp8_linear_names(model)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _te_linear(te, getattr(parent, child)))
    logger.info("fp8: converted %d Linear layers to Transformer Engine", len(names))
    return model


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


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether any module of `model` comes from Transformer Engine."""
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


def make_recipe(recipe: str | Any = "delayed", **kwargs) -> Any:
    """A TE recipe: "delayed" (DelayedScaling, HYBRID format: E4M3 forward, E5M2 gradients; amax history
    of 16 steps, max) or "current" (Float8CurrentScaling, HYBRID); a recipe object is returned as is.
    kwargs override the recipe's fields."""
    if not isinstance(recipe, str):
        return recipe
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    if recipe == "delayed":
        defaults = {"fp8_format": Format.HYBRID, "amax_history_len": 16, "amax_compute_algo": "max"}
        return DelayedScaling(**{**defaults, **kwargs})
    if recipe == "current":
        return Float8CurrentScaling(**{"fp8_format": Format.HYBRID, **kwargs})
    raise ValueError(f"unknown FP8 recipe {recipe!r}; choose 'delayed' or 'current'")


@contextlib.contextmanager
def fp8_autocast(recipe: str | Any = "delayed", *, enabled: bool = True, amax_reduction_group=None):
    """Run the converted layers in FP8 inside this context (wrap the forward only).

    amax_reduction_group: group over which delayed-scaling amaxes are reduced; default: the default
    process group when one exists. Raises RuntimeError (naming the `[gpu]` extra) when unavailable.
    """
    available, reason = fp8_support()
    if not available:
        raise RuntimeError(f"FP8 (engine/fp8.py) is unavailable: {reason}")
    te = _import_te()
    import torch.distributed as dist

    if amax_reduction_group is None and dist.is_initialized():
        amax_reduction_group = dist.group.WORLD
    recipe = make_recipe(recipe)
    if hasattr(te, "autocast"):  # TE >= 2.8; fp8_autocast is deprecated there
        context = te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)
    else:
        context = te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)
    with context:
        yield
