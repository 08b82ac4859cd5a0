"""Importing this module registers `verl_policy_loss` as verl's policy loss "prorl".

For verl's `actor_rollout_ref.model.external_lib=prorl.kernels.adapters.verl_plugin` (verl imports that
module in every worker that builds the model config) or `VERL_USE_EXTERNAL_MODULES` (imported by
`import verl`); then `actor_rollout_ref.actor.policy_loss.loss_mode=prorl` selects it. It imports verl, so
only verl imports it; nothing in prorl does.
"""

from prorl.kernels.adapters import verl_policy_loss
from verl.trainer.ppo.core_algos import register_policy_loss

register_policy_loss("prorl")(verl_policy_loss)
