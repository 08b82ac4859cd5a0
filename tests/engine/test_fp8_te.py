"""engine/fp8.py's Transformer Engine path against tests/helpers/te_standin.py, a stand-in that
enforces TE's documented rules (shapes, autocast names, recipes, checkpointing under the FP8 state,
parameter attributes under FSDP2, `_extra_state`). The real TE runs on a GPU only
(benchmarks/gpu_check.sh)."""

import dataclasses
import sys

import pytest
import scaled_mm_standin
import te_standin
import torch
from dist_helpers import TINY_QWEN2, packed_batch, random_decoder, run_ranks
from prorl.engine import fp8, parallel
from prorl.engine.fp8 import FP8Training
from prorl.engine.model import Decoder
from prorl.kernels import linear_logprob_entropy
from torch import nn

from prorl import packing

BLOCK_LINEARS = [
    f"layers.{i}.{name}"
    for i in range(TINY_QWEN2.num_layers)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
]


@pytest.fixture(autouse=True)
def cuda_scaled_mm_rules(monkeypatch):
    """TE runs its own GEMMs; a `torch._scaled_mm` call from here must still be one CUDA accepts."""
    scaled_mm_standin.patch(monkeypatch)


@pytest.fixture
def te(monkeypatch):
    return te_standin.install(monkeypatch)


def _te_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, te_standin.Linear)]


def test_conversion_swaps_the_aligned_block_linears_and_copies_weights(te):
    model = random_decoder()
    ids, cu, _ = packed_batch(0)  # 32 tokens: a multiple of 16
    with torch.no_grad():
        want = model(ids, cu_seqlens=cu)
    names = [n for n, _ in model.named_parameters()]
    FP8Training("te").convert(model)
    assert _te_names(model) == BLOCK_LINEARS and fp8.has_te_layers(model)
    assert [n for n, _ in model.named_parameters()] == names
    with torch.no_grad():
        # outside autocast
        torch.testing.assert_close(model(ids, cu_seqlens=cu), want, rtol=0, atol=0)
        with FP8Training("te").autocast():
            got = model(ids, cu_seqlens=cu)
    assert te.fp8_gemms == len(BLOCK_LINEARS)
    assert 0.005 < float((got - want).norm() / want.norm()) < 0.2  # quantised, not garbage


def test_unaligned_layers_and_the_lm_head_stay(te):
    cfg = dataclasses.replace(TINY_QWEN2, intermediate_size=72, tie_word_embeddings=False)
    model = FP8Training("te").convert(Decoder(cfg))  # 72 % 16 != 0: gate/up/down stay
    assert [n.split(".")[-1] for n in _te_names(model)] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ] * 2
    assert type(model.lm_head) is nn.Linear and type(model.layers[0].mlp.up_proj) is nn.Linear


def test_mxfp8_needs_its_gpu_and_32_aligned_layers(monkeypatch):
    te_standin.install(monkeypatch, capability=(9, 0))
    with pytest.raises(RuntimeError, match="no MXFP8 support"):
        FP8Training("te", "mxfp8").convert(random_decoder())
    te_standin.install(monkeypatch, capability=(10, 0))
    model = FP8Training("te", "mxfp8").convert(random_decoder())
    # k/v projections are 2 heads x 8 = 16 wide: not a multiple of 32
    names = [n.split(".")[-1] for n in _te_names(model)]
    assert names == ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * 2
    assert FP8Training("te", "mxfp8").token_multiple == 32


def test_unavailable_te_names_the_extra_and_old_gpus_are_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(RuntimeError, match=r"pip install 'prorl\[gpu\]'"):
        FP8Training("te").convert(random_decoder())
    te_standin.install(monkeypatch, capability=(8, 0))
    with pytest.raises(RuntimeError, match=r"capability 8\.0 < 9\.0"):
        FP8Training("te").convert(random_decoder())


@pytest.mark.parametrize(
    "recipe,kind,fields",
    [
        ("current", "Float8CurrentScaling", {"fp8_format": "HYBRID"}),
        (
            "delayed",
            "DelayedScaling",
            {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"},
        ),
    ],
)
def test_autocast_uses_te_2_9_names_and_the_recipe(te, recipe, kind, fields):
    with FP8Training("te", recipe).autocast():
        assert te_standin.state().enabled
    (enabled, got, group), = te.autocasts  # fmt: skip
    assert enabled and type(got).__name__ == kind and group is None
    assert {
        k: getattr(got, k).value if k == "fp8_format" else getattr(got, k) for k in fields
    } == fields
    assert not te_standin.state().enabled  # left on exit
    assert FP8Training("torchao").autocast().__class__.__name__ == "nullcontext"


@pytest.mark.parametrize("share", [True, False])
def test_packed_batches_are_padded_to_te_shapes_without_changing_results(te, share):
    """14 packed tokens break TE's rule (TE raises); padded to 16 with a dummy sequence they run,
    and the response rows' hidden states are those of the unpadded batch."""
    model = FP8Training("te").convert(random_decoder())
    batch = packing.pack([([3, 4, 5], [[6, 7, 8], [9, 10]]), ([11, 12], [[13, 14, 15, 16]])], share)
    assert batch.num_tokens % 16
    with torch.no_grad():
        want = packing.hidden_states(model, batch)  # no autocast: high precision, any shape
        got = packing.hidden_states(model, batch, pad_multiple=16)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        with FP8Training("te").autocast():
            with pytest.raises(AssertionError, match="divisible by 8"):
                packing.hidden_states(model, batch)
            assert packing.hidden_states(model, batch, pad_multiple=16).shape == want.shape
    # 14 or 17 tokens before
    assert packing.padded(batch, 16).num_tokens == {True: 16, False: 32}[share]


def test_activation_checkpointing_recomputes_under_the_fp8_state(te):
    ids, cu, labels = packed_batch(0)
    model = parallel.parallelize(
        FP8Training("te").convert(random_decoder()), activation_checkpointing=True
    )
    with FP8Training("te").autocast():
        hidden = model(ids, cu_seqlens=cu)
    logp, _ = linear_logprob_entropy(hidden, model.lm_head_weight, labels, return_entropy=False)
    forward_gemms = te.fp8_gemms
    # outside the autocast; the stand-in raises if a recomputation runs in bf16
    logp.sum().backward()
    assert te.checkpoints == TINY_QWEN2.num_layers and te.fp8_gemms == 2 * forward_gemms
    assert all(p.grad is not None for p in model.parameters())


def _fsdp_te_worker(rank, world):
    with pytest.MonkeyPatch.context() as monkeypatch:
        te_standin.install(monkeypatch)
        spec = FP8Training("te", fsdp=True)
        model = parallel.parallelize(spec.convert(random_decoder()), activation_checkpointing=True)
        missing = te_standin.missing_attributes(model)
        ids, cu, labels = packed_batch(0)
        with spec.autocast():
            hidden = model(ids, cu_seqlens=cu)
        linear_logprob_entropy(hidden, model.lm_head_weight, labels, return_entropy=False)[
            0
        ].sum().backward()
        keys = list(model.state_dict())
        full = parallel.full_state_dict(model)
        pushed = [name for name, _ in parallel.iter_full_tensors(model, torch.bfloat16)]
        group = te_standin.state().autocasts[0][2] is not None
        return (
            missing,
            type(model.layers[0].mlp.up_proj.weight).__name__,
            keys,
            sorted(full),
            pushed,
            group,
        )


def test_fsdp2_keeps_te_parameter_attributes_and_drops_extra_state(tmp_path):
    missing, param_type, keys, full, pushed, group = run_ranks(_fsdp_te_worker, tmp_path, world=1)[
        0
    ]
    assert param_type == "DTensor" and missing == []
    extra = [k for k in keys if k.endswith("_extra_state")]
    assert len(extra) == len(BLOCK_LINEARS)  # TE's metadata is in the state dict ...
    plain = sorted(random_decoder().state_dict())
    assert full == plain and sorted(pushed) == plain  # ... and never in exports or weight pushes
    assert group  # amaxes reduced over the default process group


def test_trainer_dummy_pass_meets_te_rules():
    from prorl.update import Updater

    assert (
        Updater.DUMMY_TOKENS % FP8Training("te").token_multiple == 0 and Updater.DUMMY_TOKENS >= 16
    )


def _bucketed(model):
    """What `VLLMGenerator.update_weights` would send for `model`: its buckets of (HF name,
    tensor)."""
    import types

    from prorl.engine.rollout.vllm import VLLMGenerator

    fake = types.SimpleNamespace(bucket_bytes=1 << 30)
    items = parallel.iter_full_tensors(model, torch.bfloat16)
    return [pair for bucket in VLLMGenerator._buckets(fake, items) for pair in bucket]


def test_vllm_weight_push_sends_plain_tensors_only(te):
    """TE layers (their `_extra_state`) and torchao's FP8 all-gather weights (a tensor subclass):
    the vLLM push sends exactly the tensors of an unconverted model, plain bf16, under HF names."""
    pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'prorl[fp8]'")
    want = [(f"model.{k}", v.to(torch.bfloat16)) for k, v in random_decoder().state_dict().items()]
    for model in (
        FP8Training("te").convert(random_decoder()),
        FP8Training("torchao", fsdp=True).convert(random_decoder()),
    ):
        assert any(k.endswith("_extra_state") for k in model.state_dict()) or any(
            type(p) is not nn.Parameter for p in model.parameters()
        )
        sent = _bucketed(model)
        assert [k for k, _ in sent] == [k for k, _ in want]
        for (name, tensor), (_, value) in zip(sent, want):
            assert type(tensor) is torch.Tensor and tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, value), name


def test_te_checkpoint_resumes_into_te_and_exports_into_a_plain_decoder(te, tmp_path, monkeypatch):
    """A DCP checkpoint of a TE-converted model holds what an unconverted one does (not TE's
    `_extra_state`) under the same model identity: it reloads into a fresh converted model and into
    a plain Decoder (prorl.export's path), and a plain model's checkpoint reloads into a converted
    one."""
    from prorl.engine.checkpoint import Checkpointer, model_identity

    model = FP8Training("te").convert(random_decoder(seed=1))
    fresh_te = FP8Training("te").convert(random_decoder(seed=2))
    # the checkpoint runs on the CPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_identity(model) == model_identity(random_decoder())
    Checkpointer(str(tmp_path)).save(1, {"model": model})
    want = parallel.full_state_dict(model)
    for fresh in (fresh_te, random_decoder(seed=2)):
        Checkpointer(str(tmp_path)).load({"model": fresh})
        got = parallel.full_state_dict(fresh)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    plain = random_decoder(seed=3)
    Checkpointer(str(tmp_path / "plain")).save(1, {"model": plain})
    Checkpointer(str(tmp_path / "plain")).load({"model": fresh_te})
    assert all(
        torch.equal(v, plain.state_dict()[k]) for k, v in parallel.full_state_dict(fresh_te).items()
    )


def test_trainer_log_prob_passes_run_te_layers_in_fp8_on_padded_batches(te):
    """`Updater.logprobs` (every log-prob pass and the update's forward): under TE's autocast, on
    the batch padded to TE's multiple; the log-probs are those of the same pass done by hand."""
    import types

    from prorl.update import Updater

    model = FP8Training("te").convert(random_decoder())
    batch = packing.pack([([3, 4, 5], [[6, 7, 8], [9, 10]]), ([11, 12], [[13, 14, 15, 16]])], True)
    trainer = types.SimpleNamespace(fp8=FP8Training("te"), logprob_temperature=1.0)
    logp, _ = Updater.logprobs(trainer, model, batch, grad=False)
    assert te.fp8_gemms == len(BLOCK_LINEARS) and te.autocasts[0][0]
    with torch.no_grad(), FP8Training("te").autocast():
        hidden = packing.hidden_states(model, packing.padded(batch, 16))
    want, _ = linear_logprob_entropy(
        hidden, model.lm_head_weight, batch.labels, return_entropy=False
    )
    assert torch.equal(logp, want)
