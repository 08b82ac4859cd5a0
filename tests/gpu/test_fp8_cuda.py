"""FP8 on a real GPU (benchmarks/gpu_check.sh runs it): torchao float8 with the real
`torch._scaled_mm` and Transformer Engine's Linear under its autocast, each against float64, with
the bounds of tests/engine/test_fp8.py (e4m3: ~5% RMS per GEMM; forward 10%, gradients 20%, and
above 1%: an unconverted block would fail that). Skipped without CUDA sm_90+, torchao or TE; the CPU
suite covers the same code with torchao's CPU path and the TE stand-in."""

import contextlib
import copy
import dataclasses

import pytest
import torch
from prorl.engine import parallel
from prorl.engine.fp8 import FP8Training, fp8_layers, fp8_support

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs CUDA sm_90+",
)


def _decoder():
    from dist_helpers import TINY_QWEN2, random_decoder

    shape = dict(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4, head_dim=32)
    cfg = dataclasses.replace(TINY_QWEN2, num_layers=1, **shape)
    return random_decoder(0, cfg)


def _forward_backward(model, dtype, context=None):
    model = copy.deepcopy(model).to("cuda", dtype)
    ids = torch.randint(
        0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(3)
    ).cuda()
    # 64 tokens: TE's multiple of 16
    cu = torch.tensor([0, 16, 64], dtype=torch.int32, device="cuda")
    with (context or contextlib.nullcontext)():
        hidden = model(ids, cu_seqlens=cu)
    upstream = torch.randn(
        hidden.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    (hidden * upstream.cuda().to(dtype)).sum().backward()
    grads = {parallel.clean_name(n): p.grad.double().cpu() for n, p in model.named_parameters()}
    return hidden.detach().double().cpu(), grads, model


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _check_bounds(spec):
    model = _decoder()
    ref_out, ref_grads, _ = _forward_backward(model, torch.float64)
    converted = spec.convert(copy.deepcopy(model))
    assert len(fp8_layers(converted)) == 7
    out, grads, _ = _forward_backward(converted, torch.bfloat16, spec.autocast)
    assert 0.01 < _rel(out, ref_out) < 0.10
    for name in (n for n in ref_grads if "proj.weight" in n):
        assert 0.01 < _rel(grads[name], ref_grads[name]) < 0.20, name


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_real_fp8_gemms_track_float64(recipe):
    pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'prorl[fp8]'")
    _check_bounds(FP8Training("torchao", recipe, emulate=False))


@pytest.mark.parametrize("recipe", ["current", "delayed", "mxfp8"])
def test_transformer_engine_tracks_float64(recipe):
    available, reason = fp8_support(recipe=recipe)
    if not available:
        pytest.skip(reason)
    _check_bounds(FP8Training("te", recipe))


def test_transformer_engine_activation_checkpointing_matches_no_checkpointing():
    available, reason = fp8_support()
    if not available:
        pytest.skip(reason)
    spec = FP8Training("te", "current")
    model = spec.convert(_decoder().cuda().to(torch.bfloat16))
    _, want, _ = _forward_backward(model, torch.bfloat16, spec.autocast)
    ac = parallel.parallelize(copy.deepcopy(model), activation_checkpointing=True)
    _, got, _ = _forward_backward(ac, torch.bfloat16, spec.autocast)
    for name, g in want.items():
        assert _rel(got[name], g) < 1e-2, name  # recomputed under the same FP8 state
