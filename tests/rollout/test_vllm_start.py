"""vLLM rollout ranks that start (an asynchronous run's rollout rank, prorl/async_rl/worker.py),
against a stand-in of vLLM 0.32's start rule and device choice (vLLM is not installed here; the
rules, read in its source, are written out in `FakeLLM`):

- device: the single-process executor takes cuda:0 whatever LOCAL_RANK is
  (vllm/executor/uniproc_executor.py), the external launcher cuda:LOCAL_RANK;
- start: refused when the free memory on that device is below gpu_memory_utilization x total
  (vllm/v1/worker/utils.py, "Free memory on device ... is less than desired GPU memory
  utilization").

The setting is a node of 80 GB GPUs: trainer rank 0 on GPU 0 (70 GB in use), the only rollout rank
at LOCAL_RANK 1 with its own copy of a 7B model resident (7.6e9 bf16 parameters + 1 GB of CUDA
context)."""

import types

import pytest
import torch
from prorl.engine.rollout import vllm as vllm_module

from prorl.async_rl import worker as worker_module
from prorl.config import ConfigError, load_config
from prorl.rollout_budget import HEADROOM_BYTES, GiB, rollout_rank_fraction

GB = 10**9
TOTAL = 80 * GB
COPY_7B = 2 * 7_600_000_000 + 1 * GB
FREE = {0: TOTAL - 70 * GB, 1: TOTAL - COPY_7B}  # device index -> free bytes


class FakeLLM:
    """vllm.LLM's start rule and device choice (module docstring); records its keywords."""

    started: list = []

    def __init__(self, **kwargs):
        import os

        if kwargs.get("distributed_executor_backend") == "external_launcher":
            index = int(os.environ["LOCAL_RANK"])
        else:
            index = 0
        util = kwargs["gpu_memory_utilization"]
        if FREE[index] < util * TOTAL:
            raise ValueError(
                f"Free memory on device cuda:{index} ({FREE[index] / GiB:.2f}/"
                f"{TOTAL / GiB:.2f} GiB) on startup is less than desired GPU memory utilization "
                f"({util}, {util * TOTAL / GiB:.2f} GiB)"
            )
        self.device = index
        FakeLLM.started.append((index, kwargs))


@pytest.fixture
def node(monkeypatch):
    """LOCAL_RANK 1 of a torchrun job whose rollout side is one rank; stubbed device memory."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (FREE[device.index], TOTAL))
    FakeLLM.started = []


def _engine(options_used, world_size):
    """vllm.LLM started as VLLMGenerator starts it, with what the worker chose."""
    fake = types.SimpleNamespace(LLM=FakeLLM)
    opts = vllm_module.VLLMOptions(
        dtype="bfloat16",
        fp32_head=False,
        gpu_memory_utilization=options_used["gpu_memory_utilization"],
    )
    extra = vllm_module.torchrun_engine_kwargs(world_size, opts.tensor_parallel_size)
    return FakeLLM(**vllm_module._engine_kwargs(fake, "/models/7b", opts, extra))


def _worker_options(monkeypatch, *overrides):
    """The keywords RolloutWorker._generator gives build_generator (recorded) on cuda:1."""
    seen = {}

    def build_generator(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        return types.SimpleNamespace(calibrate=lambda model: None)

    monkeypatch.setattr(worker_module, "build_generator", build_generator)
    monkeypatch.setattr(worker_module, "resolve_backend", lambda backend, device: "vllm")
    w = worker_module.RolloutWorker.__new__(worker_module.RolloutWorker)
    w.cfg = load_config("default", ["rollout.backend=vllm", *overrides])
    w.roles = types.SimpleNamespace(rollouts=1, rank=1)
    w.model = None
    w._generator("/models/7b", torch.bfloat16, torch.device("cuda", 1))
    return seen


def test_the_only_rollout_rank_at_local_rank_1_starts_on_its_own_gpu(monkeypatch, node):
    used = _worker_options(monkeypatch)  # gpu_memory_utilization=auto (the default)
    llm = _engine(used, used["world_size"])
    assert llm.device == 1  # not trainer 0's GPU
    # auto: what is free beside the copy, less the headroom, as a share of the device
    expected = min((FREE[1] - HEADROOM_BYTES) / TOTAL, 0.9)
    assert used["gpu_memory_utilization"] == pytest.approx(expected, rel=1e-12)
    assert 0.7 < expected < FREE[1] / TOTAL


def test_what_the_rollout_rank_asked_before_is_refused_by_vllms_rule(monkeypatch, node):
    """The stand-in is strict enough to tell: 0.9 with the copy resident, and no executor (cuda:0,
    where trainer 0 is), both fail to start."""
    with pytest.raises(ValueError, match="cuda:1 .* less than desired GPU memory utilization"):
        _engine({"gpu_memory_utilization": 0.9}, world_size=1)
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match="cuda:0 .* less than desired"):
        _engine({"gpu_memory_utilization": 0.5}, world_size=1)


@pytest.mark.tally("bad_inputs")
def test_a_fixed_share_vllm_would_refuse_is_refused_naming_the_key(node):
    cfg = load_config("default", ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.9"])
    with pytest.raises(
        ConfigError, match=r"gpu_memory_utilization=0.9: vLLM would refuse .*cuda:1"
    ):
        rollout_rank_fraction(cfg, torch.device("cuda", 1))
    cfg.rollout.gpu_memory_utilization = 0.6  # fits: kept as given
    assert rollout_rank_fraction(cfg, torch.device("cuda", 1)) == 0.6
    FREE[1], kept = 2 * GiB, FREE[1]  # nothing left beside the copy
    try:
        cfg.rollout.gpu_memory_utilization = "auto"
        with pytest.raises(ConfigError, match="auto: no room for the vLLM engine"):
            rollout_rank_fraction(cfg, torch.device("cuda", 1))
    finally:
        FREE[1] = kept


def test_outside_torchrun_one_engine_keeps_vllms_own_executor(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert vllm_module.torchrun_engine_kwargs(1) == {}
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert vllm_module.torchrun_engine_kwargs(1) == {
        "distributed_executor_backend": "external_launcher"
    }
