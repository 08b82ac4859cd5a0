"""Fixtures of the kernel tests: `backend` runs a test once per op backend, on CPU tensors.

A test that takes `backend` runs with "torch", "native" and "triton"; `@pytest.mark.backends(...)`
on the test or module narrows that. A backend that cannot run here skips with the reason: native
when the CMake library was not built (a failure under CI=true, as .ci/run and hosted CI set it: the
install never fails without the library, and CI must test the backend users get), triton unless it
is installed and interpreted
(tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA device; on a CUDA machine tests/gpu
runs the compiled kernels).
"""

import os

import pytest
from prorl.kernels import native_available
from prorl.kernels._backend import BACKENDS, native_error, triton_available


def in_ci() -> bool:
    """CI=true (or 1): set by .ci/run and by hosted CI services."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(backend: str) -> str | None:
    if backend == "native" and not native_available():
        return "native library not built (see pip output)"
    if backend == "triton" and not (
        triton_available() and os.environ.get("TRITON_INTERPRET") == "1"
    ):
        return "triton on CPU tensors needs triton installed and TRITON_INTERPRET=1"
    return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backends(*names): the backends a test taking `backend` runs on"
    )


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backends")
        names = marker.args if marker is not None else ("torch", "native", "triton")
        unknown = set(names) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown backends {sorted(unknown)}; choose among {BACKENDS}")
        metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request) -> str:
    """The backend name, for the ops' `backend=` argument; skips when it cannot run here."""
    reason = _skip_reason(request.param)
    if reason is not None and request.param == "native" and in_ci():
        pytest.fail(f"CI=true and the native backend cannot run: {native_error() or reason}")
    if reason is not None:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def triton_interpreted() -> None:
    """For tests that call the triton backend themselves: skips unless it can run on CPU tensors
    here."""
    reason = _skip_reason("triton")
    if reason is not None:
        pytest.skip(reason)
