"""AdamW with a learning-rate schedule, global-norm gradient clipping, non-finite-gradient skips.

`Optimizer` is one stateful object (`state_dict` / `load_state_dict`) holding the torch AdamW, its
LambdaLR schedule and the skip counter, so a checkpoint stores it as one entry. `step()` does, in
order: global grad norm -> if not finite: skip (weights, moments and schedule untouched, counter +
1) -> else clip to `max_grad_norm` and take the AdamW step -> advance the schedule -> zero the
grads. It costs one host sync per step (reading the norm), which also returns the norm for logging.
Under FSDP2 the norm of DTensor gradients is already the global one, so every rank takes the same
skip decision.

Schedules (factor multiplying `lr`, as a function of the number of optimizer steps already taken,
s):
- warmup: (s + 1) / warmup_steps while s < warmup_steps - the first step uses lr / warmup_steps, not
  0.
- `constant`: 1 after warmup.
- `cosine`: min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2, p = (s - warmup) / (total -
  warmup) clipped to [0, 1]: the factor falls from 1 at the end of warmup to min_lr_ratio at
  `total_steps`.
A skipped step does not advance the schedule (as in Hugging Face's Trainer).

Weight decay applies to matrices (embeddings, projections), not to 1-D parameters (biases, norms),
unless `decay_1d` (every parameter, as torch's AdamW over `module.parameters()` does: verl's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .choices import SCHEDULES, OptimizerConfig  # noqa: F401 - re-exported
from .parallel import reshard


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global L2 norm of the gradients before clipping (inf/nan when skipped)
    lr: float  # learning rate used by this step (or that would have been, when skipped)
    skipped: bool
    skipped_total: int


def lr_factor(step: int, cfg: OptimizerConfig) -> float:
    """Multiplier of cfg.lr for the optimizer step taken after `step` completed steps (see module
    doc)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(cfg.total_steps - cfg.warmup_steps, 1)
        progress = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {cfg.schedule!r}; choose 'constant' or 'cosine'")


def param_groups(
    model: nn.Module, weight_decay: float, decay_1d: bool = False
) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed matrices, undecayed 1-D parameters (biases, norm weights); with
    `decay_1d` every parameter is decayed (the second group is empty)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 or decay_1d]
    no_decay = [p for p in params if p.dim() < 2 and not decay_1d]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fusable(params: list) -> bool:
    """Whether torch's fused AdamW kernel takes `params` (floating point, on the CPU or CUDA): one
    pass over each parameter and its moments instead of the ~8 element-wise passes of the
    per-tensor loop torch otherwise picks on the CPU (SmolLM2-135M: docs/real-model.md)."""
    return bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )


class Optimizer:
    """AdamW + schedule + clipping + non-finite skip for one model. See the module docstring."""

    def __init__(self, model: nn.Module, cfg: OptimizerConfig):
        if cfg.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {cfg.schedule!r}; choose 'constant' or 'cosine'")
        if cfg.schedule == "cosine" and not cfg.total_steps:
            raise ValueError("the cosine schedule needs total_steps")
        self.cfg = cfg
        # the registered (sharded) parameters: after a forward FSDP2 leaves the root and the last
        # block unsharded, and their .parameters() are then temporaries it frees on resharding

        reshard(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay, cfg.decay_1d),
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            fused=fusable(self.params),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg)
        )
        self.skipped_total = 0

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> StepResult:
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if hasattr(norm, "full_tensor"):  # DTensor gradients (FSDP2): the norm is already global
            norm = norm.full_tensor()
        norm_value = float(norm)  # the one host sync of the step
        lr = self.lr
        if not math.isfinite(norm_value):
            self.skipped_total += 1
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(norm_value, lr, True, self.skipped_total)
        if self.cfg.max_grad_norm and self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(
                self.params, self.cfg.max_grad_norm, norm, foreach=True
            )
        self.optimizer.step()
        # torch's fused kernel writes the parameters without bumping their version counters, which
        # is how a sampler on this model learns that its cached copies are stale
        torch.autograd.graph.increment_version(self.params)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(norm_value, lr, False, self.skipped_total)

    def reset_state(self) -> None:
        """Forget the AdamW moments and step counts (ProRL v1's reset with the reference policy).
        The learning-rate schedule and the skip counter go on: a reset is not a restart of the
        run."""
        self.optimizer.state.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "skipped_total": self.skipped_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_total = state["skipped_total"]
        self._use_own_kernel()

    def _use_own_kernel(self) -> None:
        """A loaded state carries its param groups' `fused` flag (False in checkpoints written
        before the fused kernel was used): the kernel is this process's choice, and the fused one
        keeps each `step` as a float32 tensor on its parameter's device."""
        fused = fusable(self.params)
        for group in self.optimizer.param_groups:
            group["fused"] = fused
            for p in group["params"] if fused else ():
                step = self.optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    self.optimizer.state[p]["step"] = step.to(p.device, torch.float32)
