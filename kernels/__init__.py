"""prorl.kernels: fused ops for RL training of LLMs (no imports from prorl.engine or prorl).

    from prorl.kernels import linear_logprob_entropy, ppo_loss, linear_ppo_loss
    from prorl.kernels import group_advantages, batch_whiten

Each op runs on one of three backends, chosen by the device of its inputs (see `_backend.py`). The
option tuples list the values each string option accepts (a trainer's config can check against
them):

    AGG_MODES, KL_ESTIMATORS, KL_CLAMPS, IS_MODES   ppo_loss / linear_ppo_loss: agg, kl_estimator,
                                                    kl_clamp, is_mode
    ADVANTAGE_MODES, WHITEN_WEIGHTINGS              group_advantages: mode, weighting (batch_whiten
                                                    too)
"""

if __name__ == "kernels":
    # Found by its folder name because the repository root is on sys.path (`python -m ...` or
    # pytest from the checkout): the name `kernels` belongs to whatever else provides it (Hugging
    # Face's `kernels`, which transformers imports). These ops are `prorl.kernels`.
    from ._toplevel import hand_over

    hand_over(__name__, __file__)
else:
    from ._backend import native_available
    from ._backend import resolve as resolve_backend
    from ._ppo_common import AGG_MODES, IS_MODES, KL_CLAMPS, KL_ESTIMATORS
    from .advantages import ADVANTAGE_MODES, WHITEN_WEIGHTINGS, batch_whiten, group_advantages
    from .linear_logprob_entropy import linear_logprob_entropy
    from .linear_ppo_loss import linear_ppo_loss
    from .ppo_loss import ppo_loss
    from .reference import (
        group_advantages_reference,
        linear_logprob_entropy_reference,
        ppo_loss_reference,
    )

    __all__ = [
        "ADVANTAGE_MODES",
        "AGG_MODES",
        "IS_MODES",
        "KL_CLAMPS",
        "KL_ESTIMATORS",
        "WHITEN_WEIGHTINGS",
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
