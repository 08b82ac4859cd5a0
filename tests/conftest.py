"""Test-session set-up shared by every test module."""

import os

import torch

# The reliability report (tests/helpers/tally.py): cases marked @pytest.mark.tally(kind), counted per kind.
from tally import pytest_collection_finish, pytest_runtest_logreport, pytest_sessionfinish  # noqa: F401

# Triton kernels run on the CPU only under its interpreter, which must be switched on before triton is
# first imported (by our Triton backend, or by a peer such as liger-kernel). On a CUDA machine the real
# compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
