"""resolve_backend, the `rollout.backend: auto` rule: native on the CPU, vLLM on CUDA if present."""

import importlib.util

import pytest
import torch
from prorl.engine.rollout import resolve_backend


def test_explicit_names_pass_through():
    for device in ("cpu", torch.device("cpu"), "cuda:0"):
        assert resolve_backend("native", device) == "native"
        assert resolve_backend("vllm", device) == "vllm"


def test_auto_on_cpu_is_native(monkeypatch):
    # even with vLLM installed: the native sampler measured fastest on the CPU
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert resolve_backend("auto", torch.device("cpu")) == "native"
    assert resolve_backend("auto", "cpu") == "native"


@pytest.mark.parametrize("installed,expected", [(True, "vllm"), (False, "native")])
def test_auto_on_cuda_depends_on_vllm(monkeypatch, installed, expected):
    real = importlib.util.find_spec
    asked = []

    def fake(name, *args):
        if name == "vllm":
            asked.append(name)
            return object() if installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    assert resolve_backend("auto", torch.device("cuda", 1)) == expected
    assert resolve_backend("auto", "cuda") == expected
    assert asked  # it looked the package up instead of assuming


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="auto"):
        resolve_backend("sglang", "cpu")


def test_torchrun_engines_are_independent():
    """One vLLM engine per rank, independent (vLLM's ExternalDP dimension): no data_parallel_size,
    whose generate calls are collectives across the engines; tensor parallelism refused under
    torchrun."""
    from prorl.engine.rollout.vllm import torchrun_engine_kwargs

    assert torchrun_engine_kwargs(1) == {}
    assert torchrun_engine_kwargs(8) == {"distributed_executor_backend": "external_launcher"}
    with pytest.raises(NotImplementedError, match="tensor_parallel_size > 1 under torchrun"):
        torchrun_engine_kwargs(8, tensor_parallel_size=2)
