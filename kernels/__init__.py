"""prorl.kernels: fused ops for RL training of LLMs (no imports from prorl.engine or prorl).

    from prorl.kernels import linear_logprob_entropy, ppo_loss, linear_ppo_loss
    from prorl.kernels import group_advantages, batch_whiten

Each op runs on one of three backends, chosen by the device of its inputs (see `_backend.py`).
"""

from ._backend import native_available
from ._backend import resolve as resolve_backend
from .advantages import batch_whiten, group_advantages, group_advantages_reference
from .linear_logprob_entropy import linear_logprob_entropy, linear_logprob_entropy_reference
from .linear_ppo_loss import linear_ppo_loss
from .ppo_loss import ppo_loss, ppo_loss_reference

__all__ = [
    "batch_whiten",
    "group_advantages",
    "group_advantages_reference",
    "linear_logprob_entropy",
    "linear_logprob_entropy_reference",
    "linear_ppo_loss",
    "native_available",
    "ppo_loss",
    "ppo_loss_reference",
    "resolve_backend",
]
