"""A stand-in for Transformer Engine (TE, not importable without CUDA), for testing engine/fp8.py.

It has the names and signatures of TE >= 2.9 that prorl uses and ENFORCES the rules TE documents,
raising where TE would raise or silently compute something else:

- `transformer_engine.pytorch.Linear(in_features, out_features, bias=True, *, params_dtype=None,
  device="cuda", ...)`: unknown keywords are a TypeError. Inside `autocast(enabled=True)` an input
  whose leading dims' product is not a multiple of 8, or whose last dim is not a multiple of 16 (32
  and 32 for MXFP8), raises AssertionError as TE's `assert_dim_for_fp8_exec` does. The FP8 GEMM is
  emulated: input and weight are quantised to e4m3 with a per-tensor scale (current scaling), the
  product computed in the input's dtype. Called during a backward pass (a recomputation) without the
  FP8 state of its forward it raises: torch's checkpoint does that, TE's `distributed.checkpoint`
  restores the state.
- Parameters carry TE's tensor-parallel attributes (`tensor_model_parallel`, `partition_dim`,
  `partition_stride`); `missing_attributes(model)` lists the registered parameters that lost them
  (`fully_shard` replaces each parameter by a DTensor without them; TE's FSDP2 tests put them back).
- `get_extra_state` returns a uint8 tensor (TE serialises its FP8 metadata into `_extra_state`).
- `autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False)`:
  no other names (TE < 2.9's `fp8_autocast(fp8_recipe=, fp8_group=)` is absent); the recipe must be
  one of `transformer_engine.common.recipe`'s; MXFP8 is refused unless the stand-in GPU has it
  (sm_100).
- `is_fp8_available(return_reason=False)`, `is_mxfp8_available(return_reason=False)`.
- `distributed.checkpoint(function, *args, distribute_saved_activations=False,
  get_rng_state_tracker=None, tp_group=None, use_reentrant=True, **kwargs)`; this stand-in
  implements use_reentrant=False only.

`install(monkeypatch, capability=(9, 0))` puts it into sys.modules on a pretend CUDA device and
returns the module's `State` (calls recorded for assertions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0


@dataclasses.dataclass
class State:
    capability: tuple[int, int] = (9, 0)
    enabled: bool = False
    recipe: object = None
    # (enabled, recipe, amax_reduction_group)
    autocasts: list = dataclasses.field(default_factory=list)
    fp8_gemms: int = 0
    checkpoints: int = 0


STATE = State()


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclasses.dataclass(kw_only=True)
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True


@dataclasses.dataclass(kw_only=True)
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


@dataclasses.dataclass(kw_only=True)
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3
    margin: int = 0


RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling)


def _mxfp8(recipe) -> bool:
    return isinstance(recipe, MXFP8BlockScaling)


def is_fp8_available(return_reason: bool = False):
    ok = STATE.capability >= (8, 9)
    reason = "" if ok else "Device compute capability 8.9 or higher required for FP8 execution."
    return (ok, reason) if return_reason else ok


def is_mxfp8_available(return_reason: bool = False):
    ok = STATE.capability >= (10, 0)
    reason = "" if ok else "Device compute capability 10.0 or higher required for MXFP8 execution."
    return (ok, reason) if return_reason else ok


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe=None,
    amax_reduction_group=None,
    _graph: bool = False,
):
    if enabled:
        if recipe is not None and not isinstance(recipe, RECIPES):
            raise TypeError(
                f"recipe must be a transformer_engine.common.recipe object, got {recipe!r}"
            )
        if _mxfp8(recipe) and not is_mxfp8_available():
            raise AssertionError(is_mxfp8_available(return_reason=True)[1])
        if not is_fp8_available():
            raise AssertionError(is_fp8_available(return_reason=True)[1])
    STATE.autocasts.append((enabled, recipe, amax_reduction_group))
    previous = (STATE.enabled, STATE.recipe)
    STATE.enabled, STATE.recipe = enabled, recipe if recipe is not None else DelayedScaling()
    try:
        yield
    finally:
        STATE.enabled, STATE.recipe = previous


def _quantise(t: torch.Tensor) -> torch.Tensor:
    """t rounded to e4m3 with a per-tensor scale (amax -> 448), back in t's dtype."""
    scale = E4M3_MAX / t.detach().abs().amax().float().clamp(min=1e-12)
    return ((t.float() * scale).to(torch.float8_e4m3fn).float() / scale).to(t.dtype)


class _Fp8Linear(torch.autograd.Function):
    """Quantised forward; straight-through backward (the gradient of the unquantised GEMM)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(_quantise(x), _quantise(weight))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), (
            grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        )


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        init_method=None,
        params_dtype: torch.dtype | None = None,
        device="cuda",
        sequence_parallel: bool = False,
        tp_group=None,
        tp_size: int = 1,
        parallel_mode=None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        name: str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )
        for p in self.parameters():
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = False, -1, 1

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([1, 2, 3], dtype=torch.uint8)  # stands for TE's serialised FP8 metadata

    def set_extra_state(self, state) -> None:
        pass

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and not STATE.enabled:
            raise RuntimeError(
                "TE stand-in: an FP8 Linear recomputed in backward outside the FP8 state of its "
                "forward (use te.distributed.checkpoint, not torch's checkpoint)"
            )
        if not STATE.enabled:
            return F.linear(
                inp,
                self.weight.to(inp.dtype),
                None if self.bias is None else self.bias.to(inp.dtype),
            )
        m, k = (32, 32) if _mxfp8(STATE.recipe) else (8, 16)
        rows = 1
        for d in inp.shape[:-1]:
            rows *= d
        assert rows % m == 0 and inp.shape[-1] % k == 0, (
            "FP8 execution requires the product of all dimensions except the last to be divisible "
            f"by {m} and the last dimension to be divisible by {k}, but got tensor with "
            f"dims={list(inp.shape)}"
        )
        STATE.fp8_gemms += 1
        out = _Fp8Linear.apply(inp, self.weight.to(inp.dtype))
        return out if self.bias is None else out + self.bias.to(inp.dtype)


def checkpoint(
    function,
    *args,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker=None,
    tp_group=None,
    use_reentrant: bool = True,
    **kwargs,
):
    if use_reentrant:
        raise NotImplementedError("the TE stand-in implements use_reentrant=False only")
    STATE.checkpoints += 1
    forward_state = (STATE.enabled, STATE.recipe)

    @contextlib.contextmanager
    def recompute_state():
        previous = (STATE.enabled, STATE.recipe)
        STATE.enabled, STATE.recipe = forward_state
        try:
            yield
        finally:
            STATE.enabled, STATE.recipe = previous

    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), recompute_state()),
        **kwargs,
    )


def install(monkeypatch, capability: tuple[int, int] = (9, 0)) -> State:
    """Put the stand-in into sys.modules (transformer_engine, .pytorch, .pytorch.distributed,
    .common, .common.recipe) on a pretend CUDA device of `capability`; returns the fresh call
    record."""
    global STATE
    STATE = State(capability=capability)
    root = types.ModuleType("transformer_engine")
    te = types.ModuleType("transformer_engine.pytorch")
    te_distributed = types.ModuleType("transformer_engine.pytorch.distributed")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    te.Linear, te.autocast = Linear, autocast
    te.is_fp8_available, te.is_mxfp8_available = is_fp8_available, is_mxfp8_available
    te_distributed.checkpoint = checkpoint
    te.distributed = te_distributed
    for cls in (Format, DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling):
        setattr(recipe, cls.__name__, cls)
    root.pytorch, root.common, common.recipe = te, common, recipe
    Linear.__module__ = "transformer_engine.pytorch.module.linear"
    modules = {
        "transformer_engine": root,
        "transformer_engine.pytorch": te,
        "transformer_engine.pytorch.distributed": te_distributed,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe,
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return STATE


TE_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def missing_attributes(model: nn.Module) -> list[str]:
    """Names of the parameters of stand-in Linear layers that lack TE's attributes."""
    return [
        f"{name}.{pname}"
        for name, module in model.named_modules()
        if isinstance(module, Linear)
        for pname, p in module.named_parameters(recurse=False)
        if not all(hasattr(p, a) for a in TE_PARAM_ATTRIBUTES)
    ]


def state() -> State:
    return STATE
