"""Backend selection for the fused ops, and loading of the native (CMake-built) library.

Every op has three backends: `triton` (CUDA tensors; under `TRITON_INTERPRET=1` also CPU tensors,
for tests), `native` (CPU, C++/OpenMP, built by setup.py through CMake) and `torch` (chunked, runs
anywhere). Dispatch is by the device of the inputs; `backend=` on each op, or the environment
variable `PRORL_KERNEL_BACKEND`, overrides it.
"""

from __future__ import annotations

import glob
import os
import warnings

import torch

BACKENDS = ("triton", "native", "torch")

_native_state: dict[str, object] = {}


def native_available() -> bool:
    """True when the CMake-built library is present and registered its ops under
    `torch.ops.prorl`."""
    if "ok" not in _native_state:
        here = os.path.dirname(os.path.abspath(__file__))
        paths = sorted(glob.glob(os.path.join(here, "_C*.so")))
        error = None
        if not paths:
            error = (
                "the native library was not built (see the pip/CMake output, or set "
                "PRORL_TARGET_DEVICE)"
            )
        else:
            try:
                torch.ops.load_library(paths[0])
            except (OSError, RuntimeError) as exc:
                error = f"loading {paths[0]} failed: {exc}"
        _native_state["ok"] = error is None
        _native_state["error"] = error
    return bool(_native_state["ok"])


def native_error() -> str | None:
    native_available()
    return _native_state.get("error")  # type: ignore[return-value]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def resolve(device: torch.device, requested: str | None = None) -> str:
    """The backend that runs an op on `device`: `requested`, else $PRORL_KERNEL_BACKEND, else by
    device."""
    name = requested or os.environ.get("PRORL_KERNEL_BACKEND") or None
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(
                f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}"
            )
        if name == "native":
            if device.type != "cpu":
                raise ValueError(f"the native backend runs on CPU tensors, got {device}")
            if not native_available():
                raise RuntimeError(f"native backend requested but unavailable: {native_error()}")
        if name == "triton":
            if not triton_available():
                raise RuntimeError(
                    "triton backend requested but triton is not installed (pip install triton)"
                )
            if device.type == "cpu" and not interpreting():
                raise RuntimeError(
                    "triton on CPU tensors needs TRITON_INTERPRET=1 set before import"
                )
        return name
    if device.type == "cuda":
        if triton_available():
            return "triton"
        _warn_once(
            "triton is not installed: prorl's fused ops use the chunked torch backend on CUDA"
        )
        return "torch"
    if device.type == "cpu" and native_available():
        return "native"
    if device.type == "cpu":
        _warn_once(f"prorl native kernels unavailable ({native_error()}); using the torch backend")
    return "torch"
