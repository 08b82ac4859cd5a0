"""On a GPU, the rules the CPU suite enforces with stand-ins (benchmarks/gpu_check.sh runs these):

- CUDA's `torch._scaled_mm` refuses and accepts exactly what tests/helpers/scaled_mm_standin.py
  does, case by case (the stand-in is only as good as this agreement);
- torchao FP8 forward + backward with the real CUDA GEMMs: 50 tokens fail in the backward, as the
  stand-in says, and the trainer's padding to `FP8Training.token_multiple` trains any count;
- FSDP2 with CPU offload: the vLLM weight probe (`reference_probe_logprobs`) computes on the GPU
  from shards on the CPU, and gives the unsharded model's log-probs;
- `rollout.gpu_memory_utilization=auto` reads this GPU's memory.

Each test takes seconds. Skipped without CUDA (and without torchao where it is needed), with the
reason.
"""

import copy
import dataclasses
import types

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _fp8(rows, cols, dtype=torch.float8_e4m3fn, col_major=False):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)).cuda()
    return (x.t().contiguous().t() if col_major else x).to(dtype)


ONE = 1.0
CASES = {  # name: (mat1, mat2, scale_a, scale_b, out_dtype, bias) built on the GPU
    "ok tensorwise": lambda: (_fp8(32, 48), _fp8(48, 16, col_major=True), ONE, ONE),
    "ok rowwise": lambda: (
        _fp8(32, 48),
        _fp8(48, 16, col_major=True),
        torch.ones(32, 1),
        torch.ones(1, 16),
    ),
    "ok e4m3 x e5m2": lambda: (_fp8(32, 48), _fp8(48, 16, torch.float8_e5m2, True), ONE, ONE),
    "ok M not aligned": lambda: (_fp8(33, 48), _fp8(48, 16, col_major=True), ONE, ONE),
    "K not aligned": lambda: (_fp8(32, 50), _fp8(50, 16, col_major=True), ONE, ONE),
    "N not aligned": lambda: (_fp8(32, 48), _fp8(48, 20, col_major=True), ONE, ONE),
    "e5m2 x e5m2": lambda: (
        _fp8(32, 48, torch.float8_e5m2),
        _fp8(48, 16, torch.float8_e5m2, True),
        ONE,
        ONE,
    ),
    "mat2 row-major": lambda: (_fp8(32, 48), _fp8(48, 16), ONE, ONE),
    "scale_a of M elements": lambda: (
        _fp8(32, 48),
        _fp8(48, 16, col_major=True),
        torch.ones(32),
        ONE,
    ),
}


@pytest.mark.skipif(not FP8_GPU, reason="FP8 GEMMs need compute capability 8.9+")
@pytest.mark.parametrize("name", list(CASES))
def test_the_cpu_stand_in_agrees_with_cudas_scaled_mm(name):
    import scaled_mm_standin

    a, b, sa, sb = CASES[name]()
    sa, sb = (torch.tensor(s) if isinstance(s, float) else s for s in (sa, sb))
    sa, sb = sa.cuda(), sb.cuda()
    try:
        scaled_mm_standin.check(a, b, sa, sb, out_dtype=torch.bfloat16)
        standin_ok = True
    except scaled_mm_standin.CudaRuleError:
        standin_ok = False
    try:
        torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        cuda_ok = True
    except (RuntimeError, ValueError):
        cuda_ok = False
    assert standin_ok == cuda_ok == name.startswith("ok"), (name, standin_ok, cuda_ok)


def _block():
    from dist_helpers import TINY_QWEN2, random_decoder

    return (
        random_decoder(0, dataclasses.replace(TINY_QWEN2, num_layers=1)).cuda().to(torch.bfloat16)
    )


def _train_pass(model, tokens: int, pad_multiple: int = 1):
    from prorl.kernels import linear_logprob_entropy

    from prorl import packing

    ids = torch.randint(
        0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)
    )
    seqs = ids[: tokens // 3].tolist(), ids[tokens // 3 :].tolist()
    batch = packing.pack([(s[:1], [s[1:]]) for s in seqs], share=False, device="cuda")
    hidden = packing.hidden_states(model, batch, pad_multiple=pad_multiple)
    logp, _ = linear_logprob_entropy(
        hidden, model.lm_head_weight, batch.labels, return_entropy=False
    )
    logp.sum().backward()
    torch.cuda.synchronize()
    return logp.detach().float()


@pytest.mark.skipif(not FP8_GPU, reason="FP8 GEMMs need compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_fp8_backward_on_odd_token_counts(recipe):
    pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'prorl[fp8]'")
    from prorl.engine.fp8 import FP8Training, fp8_layers

    spec = FP8Training("torchao", recipe)  # auto on CUDA: the real FP8 GEMMs
    model = spec.convert(_block())
    assert fp8_layers(model) and not any(m.config.emulate for m in fp8_layers(model))
    _train_pass(copy.deepcopy(model), 48)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        _train_pass(copy.deepcopy(model), 50)
    bf16 = _block()
    for tokens in (50, 37, 17):
        logp = _train_pass(copy.deepcopy(model), tokens, pad_multiple=spec.token_multiple)
        want = _train_pass(copy.deepcopy(bf16), tokens)
        # nats; e4m3 ~5% per GEMM (tests/engine/test_fp8.py)
        assert float((logp - want).abs().max()) < 0.1


def _offload_worker(rank, world, init_file):
    import torch.distributed as dist
    from dist_helpers import random_decoder
    from prorl.engine.parallel import parallelize
    from prorl.engine.rollout.vllm import VLLMGenerator

    torch.cuda.set_device(0)
    dist.init_process_group(
        "cuda:nccl,cpu:gloo", init_method=f"file://{init_file}", rank=0, world_size=1
    )
    plain = random_decoder(0).cuda()
    sharded = parallelize(random_decoder(0), cpu_offload=True)
    stored = sharded.lm_head_weight.device.type
    engine = types.SimpleNamespace(probe_ids=list(range(3, 35)))
    got = VLLMGenerator.reference_probe_logprobs(engine, sharded)
    want = VLLMGenerator.reference_probe_logprobs(engine, plain)
    return stored, float((got - want).abs().max())


def test_cpu_offload_and_the_weight_probe(tmp_path):
    """Before the fix the probe built its labels beside the CPU shards while FSDP2 computed on the
    GPU."""
    from dist_helpers import run_ranks

    stored, gap = run_ranks(_offload_worker, tmp_path, str(tmp_path / "pg"), world=1, init=False)[0]
    assert stored == "cpu"  # the shards really are offloaded
    assert gap < 1e-5  # fp32: the unsharded model's log-probs


def test_auto_gpu_fraction_reads_this_gpu():
    from prorl import rollout_budget
    from prorl.config import load_config

    cfg = load_config("prorl_v2_1.5b", ["model.path=/models/unused"])
    policy = torch.nn.Linear(1024, 1024).cuda()
    free, total = torch.cuda.mem_get_info()
    fraction = rollout_budget.gpu_fraction(cfg, policy, "vllm")
    want = rollout_budget.fraction_that_fits(total, free, 3 * 4 * (1024 * 1024 + 1024))
    # other allocations may move meanwhile
    assert fraction == pytest.approx(min(want, 0.9), abs=0.01)
