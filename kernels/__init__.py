"""prorl.kernels: fused ops for RL training of LLMs (no imports from prorl.engine or prorl).

    from prorl.kernels import linear_logprob_entropy

Each op runs on one of three backends, chosen by the device of its inputs (see `_backend.py`).
"""

from ._backend import native_available
from ._backend import resolve as resolve_backend
from .linear_logprob_entropy import linear_logprob_entropy, linear_logprob_entropy_reference

__all__ = [
    "linear_logprob_entropy",
    "linear_logprob_entropy_reference",
    "native_available",
    "resolve_backend",
]
