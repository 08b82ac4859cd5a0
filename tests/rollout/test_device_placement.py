"""Tensors the trainer's helpers build go to the device the model computes on, not where its weights
are stored: under FSDP2 with CPU offload (`model.cpu_offload`) the registered shards live on the CPU
while FSDP2 moves the inputs to the GPU and computes there. The offload policy needs CUDA, so the
case is built from a stand-in whose weights are on the CPU and whose forward runs on another device
("meta"); tests/gpu/test_gpu_rules.py runs the real FSDP2 offload on a GPU."""

import types

import prorl.kernels
import torch
from torch import nn

V, D = 11, 4


class OffloadedModel(nn.Module):
    """FSDP2 + CPUOffloadPolicy in miniature: parameters (the shards) on the CPU; the forward on
    `compute`; after a forward the root's weights are unsharded on `compute` (FSDP2 leaves the root
    unsharded)."""

    def __init__(self, compute: str = "meta"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(V, D))
        self.compute, self.unsharded = torch.device(compute), False

    @property
    def lm_head_weight(self):
        return self.weight.to(self.compute) if self.unsharded else self.weight

    def forward(self, ids):
        self.unsharded = True
        return torch.zeros(ids.shape[0], D, device=self.compute)


def same_device_op(calls):
    """A linear_logprob_entropy that records its arguments' devices and refuses mixed ones, as the
    fused op's CUDA kernels do; returns CPU zeros."""

    def op(hidden, weight, labels, **kwargs):
        devices = {t.device.type for t in (hidden, weight, labels)}
        calls.append(devices)
        if len(devices) > 1:
            raise RuntimeError(f"tensors on different devices: {devices}")
        return torch.zeros(labels.shape[0]), None

    return op


def test_weight_probe_builds_its_labels_where_the_model_computes(monkeypatch):
    from prorl.engine.rollout.vllm import VLLMGenerator

    calls = []
    monkeypatch.setattr(prorl.kernels, "linear_logprob_entropy", same_device_op(calls))
    # what the probe reads of the engine
    engine = types.SimpleNamespace(probe_ids=[3, 1, 4, 1, 5, 9, 2, 6])
    logp = VLLMGenerator.reference_probe_logprobs(engine, OffloadedModel())
    assert calls == [{"meta"}] and logp.shape == (7,) and logp.device.type == "cpu"
