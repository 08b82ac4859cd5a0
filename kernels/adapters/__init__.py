"""Drop-in fused loss ops for other trainers, called the way those trainers call their own loss.

    verl 0.9.1       verl_policy_loss        a registered policy loss (verl's keyword call, (loss, metrics))
    OpenRLHF 0.11.2  OpenRLHFPolicyLoss      an nn.Module with PolicyLoss's constructor, forward and outputs
    TRL 1.16         trl_compute_loss        GRPOTrainer._compute_loss, metrics included
                     trl_grpo_loss           the same loss from tensors

Each takes the trainer's own argument names and conventions (normalisers, clipping, IS correction), runs one
fused `ppo_loss` call and returns what the trainer's own code returns. kernels/ADAPTERS.md has the snippets
to paste and the tested versions; importing this package warns (PeerVersionWarning) when an installed peer
is outside its tested range. No peer is imported here: each adapter imports its peer, if at all, when used.
"""

from ._openrlhf import OpenRLHFPolicyLoss
from ._trl import trl_compute_loss, trl_grpo_loss
from ._verl import verl_policy_loss
from ._versions import TESTED, PeerVersionWarning, check_peer_version, check_peer_versions

__all__ = [
    "TESTED",
    "OpenRLHFPolicyLoss",
    "PeerVersionWarning",
    "check_peer_version",
    "trl_compute_loss",
    "trl_grpo_loss",
    "verl_policy_loss",
]

check_peer_versions()
