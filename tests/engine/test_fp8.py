"""engine/fp8.py with torchao float8 on the CPU (real FP8 GEMMs through `torch._scaled_mm`):
numerics of a converted decoder block against float64 and against the unconverted bf16 block, and
every piece of the trainer FP8 passes through - FSDP2 with FP8 weight all-gathers over gloo,
activation checkpointing, torch.compile, DCP checkpoints (save, resume, model identity), HF export
and the tensors of a weight push. The Transformer Engine path runs against
tests/helpers/te_standin.py (test_fp8_te.py)."""

import copy
import dataclasses

import pytest
import scaled_mm_standin
import torch
from dist_helpers import TINY_QWEN2, packed_batch, random_decoder, rank_slice, run_ranks, train_step
from prorl.engine import distributed, parallel
from prorl.engine.checkpoint import Checkpointer, model_identity
from prorl.engine.fp8 import FP8Training, resolve_recipe
from prorl.engine.optim import Optimizer, OptimizerConfig
from prorl.engine.parallel import export_hf
from prorl.kernels import linear_logprob_entropy
from torch import nn

pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'prorl[fp8]'")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

BLOCK_LINEARS = [
    f"layers.{i}.{name}"
    for i in range(TINY_QWEN2.num_layers)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
]
# one decoder block (a one-layer decoder: the embedding and final norm stay unconverted), large
# enough for the error statistics to settle: 128 wide, 256 MLP, 48 tokens in two sequences
BLOCK_CFG = dataclasses.replace(
    TINY_QWEN2,
    hidden_size=128,
    intermediate_size=256,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    num_layers=1,
)
OPT = OptimizerConfig(lr=1e-3)


@pytest.fixture(autouse=True)
def cuda_scaled_mm_rules(monkeypatch):
    """Every `torch._scaled_mm` call here must be one CUDA accepts
    (tests/helpers/scaled_mm_standin.py)."""
    scaled_mm_standin.patch(monkeypatch)


def _forward_backward(model, dtype):
    """Hidden states and parameter gradients (float64) of `model` in `dtype` for a fixed upstream
    gradient."""
    model = copy.deepcopy(model).to(dtype)
    ids = torch.randint(0, BLOCK_CFG.vocab_size, (48,), generator=torch.Generator().manual_seed(3))
    hidden = model(ids, cu_seqlens=torch.tensor([0, 20, 48], dtype=torch.int32))
    upstream = torch.randn(
        hidden.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    (hidden * upstream.to(dtype)).sum().backward()
    return hidden.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_block_forward_and_gradients_track_float64_within_e4m3_bounds(recipe):
    """e4m3 keeps 3 mantissa bits: relative rounding error up to 2^-4, RMS 2^-4/sqrt(3) = 3.6% per
    operand, so one GEMM of two quantised operands is off by ~sqrt(2) x 3.6% = 5.1% RMS; gradients
    use e5m2 for the upstream gradient under tensorwise (2 bits: 7.2% RMS), ~8% per GEMM. Bounds:
    forward 10%, gradients 20% (about twice those, the block chains several GEMMs). And each error
    must exceed 2%, several times bf16's own (~0.5-1% here): an unconverted block would pass the
    upper bounds but not this one."""
    model = random_decoder(0, BLOCK_CFG)
    ref_out, ref_grads = _forward_backward(model, torch.float64)
    bf16_out, bf16_grads = _forward_backward(model, torch.bfloat16)
    # _scaled_mm
    converted = FP8Training("torchao", recipe, emulate=False).convert(copy.deepcopy(model))
    assert [n for n, m in converted.named_modules() if isinstance(m, Float8Linear)] == [
        n for n in BLOCK_LINEARS if n.startswith("layers.0.")
    ]
    out, grads = _forward_backward(converted, torch.bfloat16)
    assert _rel(bf16_out, ref_out) < 0.01
    assert 0.02 < _rel(out, ref_out) < 0.10
    for name in (n for n in ref_grads if n.startswith("layers.0.") and "proj.weight" in n):
        assert _rel(bf16_grads[name], ref_grads[name]) < 0.02, name
        assert 0.02 < _rel(grads[name], ref_grads[name]) < 0.20, name
    # reached through FP8 GEMMs
    for name in ("embed_tokens.weight", "layers.0.input_layernorm.weight"):
        assert _rel(grads[name], ref_grads[name]) < 0.20, name


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulation_on_cpu_matches_the_real_fp8_gemm(recipe):
    """CPU runs emulate (torch's CPU `_scaled_mm` is a slow reference kernel): the same
    quantisation, the GEMM on dequantised operands. Against the real kernel: outputs and input
    gradients identical, weight gradients within one bf16 ulp of their magnitude (a different
    accumulation order)."""
    model = random_decoder(0, BLOCK_CFG)
    emulated = FP8Training("torchao", recipe).convert(copy.deepcopy(model))
    assert all(m.config.emulate for m in emulated.modules() if isinstance(m, Float8Linear))
    real = FP8Training("torchao", recipe, emulate=False).convert(copy.deepcopy(model))
    (out_e, grads_e), (out_r, grads_r) = (
        _forward_backward(m, torch.bfloat16) for m in (emulated, real)
    )
    assert torch.equal(out_e, out_r)
    for name, g in grads_r.items():
        assert float((grads_e[name] - g).abs().max()) <= 2**-7 * float(g.abs().max()), name


def test_conversion_keeps_names_shapes_values_and_the_lm_head():
    cfg = dataclasses.replace(TINY_QWEN2, tie_word_embeddings=False)
    model = random_decoder(0, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    FP8Training("torchao").convert(model)
    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == BLOCK_LINEARS
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
    # checkpoints still match
    assert model_identity(model) == model_identity(random_decoder(0, cfg))


def test_state_dicts_of_fp8_all_gather_weights_are_plain():
    """torchao's FP8 all-gather wraps each weight in a tensor subclass at conversion; what leaves
    the trainer (full_state_dict, iter_full_tensors; here without a process group) is the plain
    weight."""
    model = FP8Training("torchao", fsdp=True).convert(random_decoder())
    assert type(model.layers[0].mlp.up_proj.weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    want = random_decoder().state_dict()
    for state in (parallel.full_state_dict(model), dict(parallel.iter_full_tensors(model))):
        assert list(state) == list(want)
        for name, tensor in state.items():
            assert type(tensor) is torch.Tensor and torch.equal(tensor, want[name]), name


def test_none_is_a_no_op_and_recipes_are_checked():
    model = random_decoder()
    assert FP8Training("none").convert(model) is model
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in BLOCK_LINEARS)
    assert resolve_recipe("torchao") == "tensorwise" and resolve_recipe("te") == "current"
    with pytest.raises(ValueError, match="not one of torchao's"):
        FP8Training("torchao", "delayed")
    with pytest.raises(ValueError, match="unknown FP8 backend"):
        FP8Training("fp4")


def test_missing_torchao_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import -> ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'prorl\[fp8\]'"):
        FP8Training("torchao").convert(random_decoder())


def _loss_and_grads(model):
    ids, cu, labels = packed_batch(0)
    hidden = model(ids, cu_seqlens=cu)
    logp, _ = linear_logprob_entropy(hidden, model.lm_head_weight, labels, return_entropy=False)
    loss = -logp.sum()
    loss.backward()
    return float(loss.detach()), {
        parallel.clean_name(n): p.grad.clone() for n, p in model.named_parameters()
    }


def test_activation_checkpointing_recomputes_converted_blocks_exactly():
    """torchao keeps no FP8 state between calls (dynamic scales): torch's checkpoint recomputes the
    block bit for bit."""
    base = FP8Training("torchao", emulate=False).convert(random_decoder().to(torch.bfloat16))
    want_loss, want = _loss_and_grads(copy.deepcopy(base))
    loss, grads = _loss_and_grads(
        parallel.parallelize(copy.deepcopy(base), activation_checkpointing=True)
    )
    assert loss == want_loss and all(torch.equal(grads[k], want[k]) for k in want)


@pytest.mark.slow
def test_compiled_converted_blocks_match_eager():
    """model.compile on converted blocks (the emulated GEMMs CPU runs use; ~12-30 s of inductor
    here): graphs are compiled, and the compiled FP8 block is as close to the unconverted bf16 block
    as the eager FP8 block is (inductor rounds and fuses differently, so the two FP8 runs differ
    from each other by about their FP8 error: each error against bf16 must stay within 2x eager's +
    1%). With activation_checkpointing=True as well, dynamo captures no graph of the checkpointed
    block on torch 2.13 (bf16 too): the block then runs eagerly."""
    from torch._dynamo.utils import counters

    bf16 = random_decoder().to(torch.bfloat16)
    ref_loss, ref = _loss_and_grads(copy.deepcopy(bf16))
    base = FP8Training("torchao").convert(bf16)
    eager_loss, eager = _loss_and_grads(copy.deepcopy(base))
    torch._dynamo.reset()
    counters.clear()
    loss, grads = _loss_and_grads(parallel.parallelize(copy.deepcopy(base), compile=True))
    assert counters["stats"]["unique_graphs"] >= TINY_QWEN2.num_layers
    assert abs(loss - ref_loss) <= 2 * abs(eager_loss - ref_loss) + 0.01 * abs(ref_loss)
    for k in ref:
        eager_err = _rel(eager[k].double(), ref[k].double())
        assert _rel(grads[k].double(), ref[k].double()) < 2 * eager_err + 0.01, k


def _fsdp_worker(rank, world, tmp):
    """FSDP2 over gloo: bf16 against FP8 (all-gather in FP8 and not, with checkpointing); then a DCP
    checkpoint of the FP8 run, its resume into fresh models, a reset's exact copy, export and
    push."""
    scaled_mm_standin.install()  # a spawned process: the test's monkeypatch does not reach it
    out = {}
    models = {}
    for name, fp8_backend, all_gather, ac in (
        ("bf16", "none", False, False),
        ("fp8", "torchao", False, False),
        ("fp8_all_gather_ac", "torchao", True, True),
    ):
        fp8 = FP8Training(fp8_backend, fsdp=all_gather, emulate=False)  # the real FP8 GEMMs
        model = parallel.parallelize(
            fp8.convert(random_decoder()), param_dtype=torch.bfloat16, activation_checkpointing=ac
        )
        opt = Optimizer(model, OPT)
        losses = []
        # each rank's batch padded to 16 tokens, as the trainer pads (CUDA's rule)
        for step in range(3):
            loss = train_step(
                model, opt, step, rank_slice(rank, world), pad_multiple=fp8.token_multiple
            )
            losses.append(float(distributed.all_reduce_sum(loss)))
            fp8.after_optimizer_step(model)
        out[name] = losses
        models[name] = (model, opt, fp8)
    model, opt, fp8 = models["fp8_all_gather_ac"]
    local = model.layers[0].self_attn.q_proj.weight.to_local()
    out["all_gather_wrapped"] = type(local).__name__
    # both FSDP-wrapped
    out["identity"] = (model_identity(model), model_identity(models["bf16"][0]))

    ckpt = Checkpointer(str(tmp / "ckpt"))
    ckpt.save(3, {"model": model, "optimizer": opt})
    full = parallel.full_state_dict(model, cpu_offload=True)
    out["full_types"] = sorted({type(v).__name__ for v in full.values()})
    out["full_dtypes"] = sorted({str(v.dtype) for v in full.values()})
    pushed = list(parallel.iter_full_tensors(model, torch.bfloat16))
    out["push"] = sorted({(type(v).__name__, str(v.dtype)) for _, v in pushed})
    out["push_names"] = [k for k, _ in pushed]
    export_hf(model, str(tmp / "hf"), dtype=torch.bfloat16)

    # resume: a fresh converted model (and a fresh unconverted one: the identity is the same) reload
    # it
    for name, backend in (("resumed_fp8", "torchao"), ("resumed_plain", "none")):
        spec = FP8Training(backend, fsdp=True, emulate=False)
        fresh = parallel.parallelize(
            spec.convert(random_decoder(seed=9)), param_dtype=torch.bfloat16
        )
        fresh_opt = Optimizer(fresh, OPT)
        ckpt.load({"model": fresh, "optimizer": fresh_opt})
        again = parallel.full_state_dict(fresh, cpu_offload=True)
        out[name] = all(torch.equal(again[k], full[k]) for k in full) and set(again) == set(full)
        if backend == "torchao":
            batch = rank_slice(rank, world)
            next_loss = [float(distributed.all_reduce_sum(train_step(m, o, 3, batch, 16)))
                         for m, o in ((model, opt), (fresh, fresh_opt))]  # fmt: skip
            out["next_losses"] = next_loss
            # as the trainer does after every step: scales of the new weights
            fp8.after_optimizer_step(model)

    # reference reset: an exact copy into a converted reference gives identical log-probs (KL
    # exactly 0)
    spec = FP8Training("torchao", fsdp=True, emulate=False)
    reference = parallel.parallelize(
        spec.convert(random_decoder(seed=5)), param_dtype=torch.bfloat16
    )
    parallel.copy_parameters_(reference, model)
    ids, cu, labels = packed_batch(7, rank_slice(rank, world))
    with torch.no_grad():
        lp = [linear_logprob_entropy(m(ids, cu_seqlens=cu), m.lm_head_weight, labels,
                                     return_entropy=False)[0]
              for m in (model, reference)]  # fmt: skip
    out["reset_exact"] = torch.equal(lp[0], lp[1])
    return out


@pytest.mark.slow
def test_fsdp2_fp8_all_gather_checkpoint_export_and_push(tmp_path):
    res = run_ranks(_fsdp_worker, tmp_path, tmp_path)
    r0 = res[0]
    assert res[1]["bf16"] == r0["bf16"] and res[1]["fp8_all_gather_ac"] == r0["fp8_all_gather_ac"]
    bf16 = r0["bf16"]
    for name in ("fp8", "fp8_all_gather_ac"):
        # the same training up to quantisation: within 1% of bf16's loss (an e4m3 error of ~5% on
        # activations moves a log-likelihood of ~4.6 nats by far less), yet not bf16's numbers
        assert all(abs(a - b) < 0.01 * b for a, b in zip(r0[name], bf16)), (name, r0[name], bf16)
        assert r0[name] != bf16
    # FP8 all-gather: FSDP2 gathers FP8 bytes (torchao's weight wrapper is the shard) with matching
    # losses
    assert r0["all_gather_wrapped"] == "WeightWithDynamicFloat8CastTensor"
    assert all(abs(a - b) < 1e-3 * b for a, b in zip(r0["fp8_all_gather_ac"], r0["fp8"]))
    # checkpoints of FP8 and bf16 runs address each other
    assert r0["identity"][0] == r0["identity"][1]
    # what leaves the trainer is plain: no FP8 subclass, scale or _extra_state
    assert r0["full_types"] == ["Tensor"] and r0["full_dtypes"] == ["torch.float32"]
    assert r0["push"] == [("Tensor", "torch.bfloat16")]
    assert r0["push_names"] == list(random_decoder().state_dict())
    assert r0["resumed_fp8"] and r0["resumed_plain"]
    assert r0["next_losses"][0] == r0["next_losses"][1]  # exact resume
    assert r0["reset_exact"] and res[1]["reset_exact"]
    # the export loads in transformers, as plain bf16 weights equal to the trained ones (rounded)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16)
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert type(q) is nn.Parameter and torch.equal(
        q, tensors["model.layers.0.self_attn.q_proj.weight"]
    )
