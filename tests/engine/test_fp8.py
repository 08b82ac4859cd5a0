"""engine/fp8.py: the unavailable path (this machine) and the layer selection / swap logic, the latter
against a stand-in `transformer_engine` module (a Linear with TE's constructor signature that computes in
full precision). The real FP8 path needs Transformer Engine on an sm_90 GPU and is skipped here."""

import contextlib
import dataclasses
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import TINY_QWEN2, packed_batch, random_decoder
from prorl.engine import fp8, parallel
from prorl.engine.model import Decoder
from torch import nn

BLOCK_LINEARS = [
    f"layers.{i}.{name}"
    for i in range(TINY_QWEN2.num_layers)
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def _real_te_usable():
    return fp8.fp8_support()[0]


@pytest.mark.skipif(_real_te_usable(), reason="FP8 is available here; the unavailable path cannot be shown")
def test_unavailable_is_a_clear_error_or_a_logged_no_op(caplog):
    available, reason = fp8.fp8_support()
    assert not available and reason
    model = random_decoder()
    with pytest.raises(
        RuntimeError, match=r"FP8 .* unavailable: .*pip install 'prorl\[gpu\]'|no CUDA device"
    ):
        fp8.convert_to_fp8(model)
    with caplog.at_level(logging.WARNING, logger="prorl.engine.fp8"):
        assert fp8.convert_to_fp8(model, required=False) is model
    assert "continuing without FP8" in caplog.text
    assert all(type(m) is nn.Linear for name, m in model.named_modules() if name in BLOCK_LINEARS)
    with pytest.raises(RuntimeError, match="unavailable"), fp8.fp8_autocast():
        pass


def test_message_names_the_gpu_extra_when_te_is_missing(monkeypatch):
    def missing():
        raise ImportError("No module named 'transformer_engine'")

    monkeypatch.setattr(fp8, "_import_te", missing)
    available, reason = fp8.fp8_support()
    assert not available and "pip install 'prorl[gpu]'" in reason and "transformer_engine" in reason


class FakeTELinear(nn.Module):
    """TE's constructor signature; full-precision math."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=params_dtype, device=device)) if bias else None
        )

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


FakeTELinear.__module__ = "transformer_engine.pytorch.module.linear"


@pytest.fixture
def fake_te(monkeypatch):
    """A stand-in transformer_engine on a pretend sm_90 GPU; records autocast calls."""
    calls = []
    te = types.ModuleType("transformer_engine.pytorch")
    te.Linear = FakeTELinear
    te.is_fp8_available = lambda return_reason=False: (True, "") if return_reason else True

    @contextlib.contextmanager
    def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        calls.append((enabled, recipe, amax_reduction_group))
        yield

    te.autocast = autocast
    recipe_mod = types.ModuleType("transformer_engine.common.recipe")
    recipe_mod.Format = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
    recipe_mod.DelayedScaling = lambda **kw: ("DelayedScaling", kw)
    recipe_mod.Float8CurrentScaling = lambda **kw: ("Float8CurrentScaling", kw)
    root = types.ModuleType("transformer_engine")
    common = types.ModuleType("transformer_engine.common")
    root.pytorch, root.common, common.recipe = te, common, recipe_mod
    for name, module in {
        "transformer_engine": root,
        "transformer_engine.pytorch": te,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe_mod,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return calls


def test_conversion_swaps_exactly_the_block_linears(fake_te):
    model = random_decoder()
    ids, cu, _ = packed_batch(0)
    with torch.no_grad():
        want = model(ids, cu_seqlens=cu)
    names_before = [n for n, _ in model.named_parameters()]
    assert fp8.fp8_linear_names(model) == BLOCK_LINEARS
    assert fp8.convert_to_fp8(model) is model
    swapped = [n for n, m in model.named_modules() if isinstance(m, FakeTELinear)]
    assert swapped == BLOCK_LINEARS and fp8.has_fp8_layers(model)
    assert type(model.embed_tokens) is nn.Embedding  # tied head: the embedding stays
    assert [n for n, _ in model.named_parameters()] == names_before  # HF loading / checkpoints unchanged
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cu_seqlens=cu), want, rtol=0, atol=0)  # weights copied


def test_unaligned_layers_and_the_lm_head_stay(fake_te):
    cfg = dataclasses.replace(TINY_QWEN2, intermediate_size=72, tie_word_embeddings=False)
    model = Decoder(cfg)  # 72 is not a multiple of 16: gate/up/down stay; the untied lm_head is never swapped
    names = fp8.fp8_linear_names(model)
    assert [n.split(".")[-1] for n in names] == ["q_proj", "k_proj", "v_proj", "o_proj"] * 2
    fp8.convert_to_fp8(model)
    assert type(model.lm_head) is nn.Linear and type(model.layers[0].mlp.up_proj) is nn.Linear


def test_meta_model_is_converted_without_copying(fake_te):
    model = fp8.convert_to_fp8(parallel.meta_decoder(TINY_QWEN2))
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, FakeTELinear) and q.weight.is_meta and q.weight.dtype == torch.float32


def test_autocast_and_recipes(fake_te):
    with fp8.fp8_autocast("current"):
        pass
    with fp8.fp8_autocast("delayed", enabled=False):
        pass
    assert fake_te == [
        (True, ("Float8CurrentScaling", {"fp8_format": "HYBRID"}), None),
        (
            False,
            ("DelayedScaling", {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}),
            None,
        ),
    ]
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        fp8.make_recipe("mxfp8")


def test_parallelize_refuses_activation_checkpointing_of_fp8_layers(fake_te):
    model = fp8.convert_to_fp8(random_decoder())
    with pytest.raises(ValueError, match="TE's own checkpoint"):
        parallel.parallelize(model, activation_checkpointing=True)


def test_old_gpu_is_refused(fake_te, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"capability 8\.0 < 9\.0"):
        fp8.convert_to_fp8(random_decoder())


@pytest.mark.skipif(
    not _real_te_usable(), reason=f"needs Transformer Engine on an sm_90 GPU: {fp8.fp8_support()[1]}"
)
def test_real_fp8_step_tracks_bf16():
    """On a Hopper GPU with TE: a converted model's loss and gradients track the bf16 model's (FP8 E4M3
    has a 3-bit mantissa: 5% on the loss and 25% on the gradient norm are loose bounds, not a tuned
    tolerance; unverified until this runs)."""
    cfg = dataclasses.replace(TINY_QWEN2, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=128)
    torch.manual_seed(0)
    ref = Decoder(cfg).cuda().to(torch.bfloat16)
    ref.init_weights()
    model = fp8.convert_to_fp8(Decoder(cfg).cuda().to(torch.bfloat16))
    model.load_state_dict(ref.state_dict(), strict=False)
    ids = torch.randint(0, cfg.vocab_size, (64,), device="cuda")  # 64 tokens: a multiple of 16
    cu = torch.tensor([0, 16, 48, 64], dtype=torch.int32, device="cuda")
    losses, norms = [], []
    for m, context in ((ref, contextlib.nullcontext()), (model, fp8.fp8_autocast("current"))):
        with context:
            hidden = m(ids, cu_seqlens=cu)
        loss = F.cross_entropy(m.logits(hidden).float()[:-1], ids[1:])
        loss.backward()
        losses.append(float(loss))
        norms.append(float(torch.norm(torch.stack([p.grad.float().norm() for p in m.parameters()]))))
    assert abs(losses[1] - losses[0]) < 0.05 * losses[0]
    assert abs(norms[1] - norms[0]) < 0.25 * norms[0]
