"""The values the engine's string settings accept, and the optimizer's settings: torch-free, so a
trainer's config can check a command line (and answer `--help`) before torch is loaded. The modules
that implement each choice read their names from here."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION = ("sdpa", "flex", "flash")  # engine/attention.py, in the order of its BACKENDS
ROLLOUT = ("native", "vllm")  # engine/rollout/
SCHEDULES = ("constant", "cosine")  # engine/optim.py's learning-rate schedules
FP8_BACKENDS = ("none", "torchao", "te")  # engine/fp8.py
FP8_RECIPES = {
    "none": ("auto",),
    "torchao": ("auto", "tensorwise", "rowwise"),
    "te": ("auto", "delayed", "current", "mxfp8"),
}


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    # None or <= 0: no clipping (the norm is still computed and reported)
    max_grad_norm: float | None = 1.0
    schedule: str = "constant"  # one of SCHEDULES
    warmup_steps: int = 0
    total_steps: int | None = None  # required by "cosine"
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    decay_1d: bool = False  # weight decay on 1-D parameters (biases, norm weights) too
