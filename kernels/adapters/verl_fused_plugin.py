"""Importing this module makes prorl's `linear_logprob_entropy` the fused LM head of verl's
`use_fused_kernels=True` (both of verl's fused_kernels_backend choices; `_verl_fused.py`).

Name it in `actor_rollout_ref.model.external_lib` (imported when verl builds the model config in
each worker) or in `VERL_USE_EXTERNAL_MODULES`. It imports verl, so only verl imports it: nothing in
prorl does.
"""

from prorl.kernels.adapters import install_verl_fused_linear

install_verl_fused_linear()
