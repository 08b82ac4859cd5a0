"""Importing this module registers `verl_policy_loss` as verl's policy loss "prorl".

Name it in verl's `actor_rollout_ref.model.external_lib` (verl's HFModelConfig imports that module
when the config is built, verl/workers/config/model.py) or in `VERL_USE_EXTERNAL_MODULES` (imported
by `import verl`); `actor_rollout_ref.actor.policy_loss.loss_mode=prorl` then selects the loss. It
imports verl, so only verl imports it: nothing in prorl does.
"""

from prorl.kernels.adapters import verl_policy_loss
from verl.trainer.ppo.core_algos import register_policy_loss

register_policy_loss("prorl")(verl_policy_loss)
