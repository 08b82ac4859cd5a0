"""Test-session set-up shared by every test module."""

import os

import torch

# The reliability report (tests/helpers/tally.py): cases marked @pytest.mark.tally(kind), counted
# per kind.
from tally import (  # noqa: F401
    pytest_collection_finish,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)

# A module-scoped fixture: the tiny reasoner's tokenizer, data and reward pool (in-process
# Trainers).
from tiny_trainer import tiny_setup  # noqa: F401

# Triton kernels run on the CPU only under its interpreter, which must be switched on before triton
# is first imported (by our Triton backend, or by a peer such as liger-kernel). On a CUDA machine
# the real compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The sandbox's `none` backend refuses to run code as root when the interpreter is hidden from other
# users (as under /root/.pyenv): the suite still tests what `none` does provide there, and
# tests/rewards/test_sandbox_root.py tests the refusal itself.
os.environ.setdefault("PRORL_SANDBOX_ROOT_OK", "1")
