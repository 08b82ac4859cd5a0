"""Drop-in fused loss ops for other trainers, called the way those trainers call their own loss.

    verl 0.9.1       verl_policy_loss        a registered policy loss (verl's keyword call, returns
                                             (loss, metrics))
                     install_verl_fused_linear  prorl's op behind verl's use_fused_kernels=True
    OpenRLHF 0.11.2  OpenRLHFPolicyLoss      an nn.Module with PolicyLoss's constructor, forward and
                                             outputs
                     openrlhf_actor_forward  Actor.forward: log-probs and entropy from hidden states
    TRL 1.16         FusedGRPOTrainer        GRPOTrainer whose log-prob passes never form logits
                     trl_compute_loss        GRPOTrainer._compute_loss, metrics included
                     trl_grpo_loss           the same loss from tensors

Each takes the trainer's own argument names and conventions (normalisers, clipping, IS correction),
runs one fused `ppo_loss` call and returns what the trainer's own code returns. kernels/ADAPTERS.md
has the snippets to paste and the tested versions; importing this package warns (PeerVersionWarning)
when an installed peer is outside its tested range. No peer is imported here: each adapter imports
its peer, if at all, when used.
"""

from ._openrlhf import OpenRLHFPolicyLoss
from ._openrlhf_actor import openrlhf_actor_forward
from ._trl import trl_compute_loss, trl_grpo_loss
from ._verl import verl_policy_loss
from ._verl_fused import VerlFusedLinearForPPO, install_verl_fused_linear, verl_linear_cross_entropy
from ._versions import TESTED, PeerVersionWarning, check_peer_version, check_peer_versions

__all__ = [
    "TESTED",
    "FusedGRPOTrainer",
    "OpenRLHFPolicyLoss",
    "PeerVersionWarning",
    "VerlFusedLinearForPPO",
    "check_peer_version",
    "install_verl_fused_linear",
    "openrlhf_actor_forward",
    "trl_compute_loss",
    "trl_grpo_loss",
    "verl_linear_cross_entropy",
    "verl_policy_loss",
]

check_peer_versions()

_LAZY = {"FusedGRPOTrainer": "._trl_trainer"}  # these import their peer: loaded on first use


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
