"""prorl's op as the fused LM head of verl 0.9.1's `use_fused_kernels=True`, at verl's call site.

verl's `patch_forward_with_backends` patches a tiny Qwen2ForCausalLM's forward (the path verl's
engine takes when `actor_rollout_ref.model.use_fused_kernels=True`); its output's log_probs and
entropy, and the parameter gradients through them, are computed once by verl's own
`FusedLinearForPPO` (fused_kernels_backend "torch") and once after the ADAPTERS.md config snippet's
plugin went through verl's `import_external_libs`. verl's Triton kernel (fused_kernels_backend
"triton") needs CUDA: its call site is run with prorl's op and compared with verl's torch numbers,
which verl's own tests hold its Triton kernel to. Float32 round-off.
"""

import sys

import pytest
import torch
from peer_stubs import VERL_STUBS, adapters_snippet, stub_missing

stub_missing("verl", VERL_STUBS)
monkey_patch = pytest.importorskip(
    "verl.models.transformers.monkey_patch",
    reason="verl is not installed (.ci/peers.sh installs 0.9.1)",
)
from prorl.kernels.adapters import _verl_fused  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from verl.utils.experimental import torch_functional  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.utils.kernel import linear_cross_entropy  # noqa: E402

TEMPERATURE = 0.7


@pytest.fixture
def restore(monkeypatch):
    """verl patches the model class and the plugin patches verl's modules: undone after each
    test."""
    monkeypatch.setattr(Qwen2ForCausalLM, "forward", Qwen2ForCausalLM.forward)
    # flash_attn may be a stand-in (OpenRLHF's tests stub it): take verl's own path for its absence
    monkeypatch.setattr(torch_functional, "_FLASH_ATTN_CROSS_ENTROPY_AVAILABLE", False)
    # re-imported
    monkeypatch.delitem(sys.modules, "prorl.kernels.adapters.verl_fused_plugin", raising=False)
    monkeypatch.setattr(torch_functional, "FusedLinearForPPO", torch_functional.FusedLinearForPPO)
    monkeypatch.setattr(
        linear_cross_entropy, "linear_cross_entropy", linear_cross_entropy.linear_cross_entropy
    )
    calls = []
    op = _verl_fused.linear_logprob_entropy
    monkeypatch.setattr(
        _verl_fused, "linear_logprob_entropy", lambda *a, **k: calls.append(1) or op(*a, **k)
    )
    return calls


def _model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def _run(model, backend):
    """verl's patched forward on a padded batch: (log_probs, entropy, parameter gradients of a
    random weighting of both)."""
    model.zero_grad()
    monkey_patch.patch_forward_with_backends(
        model, use_fused_kernels=True, fused_kernels_backend=backend
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 11), generator=g)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 8:] = 0
    out = model(
        input_ids=ids, attention_mask=attention_mask, return_dict=True, temperature=TEMPERATURE
    )
    logp, ent = out.log_probs, out.entropy
    w_lp, w_ent = torch.randn(logp.shape, generator=g), torch.randn(ent.shape, generator=g)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return logp.detach().reshape(3, 11), ent.detach().reshape(3, 11), grads


def _assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    for name, g in theirs[2].items():
        torch.testing.assert_close(
            ours[2][name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(), msg=name
        )


def test_plugin_replaces_verls_fused_linear_at_its_call_site(restore):
    model = _model()
    theirs = _run(model, "torch")
    assert restore == []  # verl's own FusedLinearForPPO
    assert theirs[0].dtype == torch.float32 and (theirs[0] < 0).all()
    import_external_libs(adapters_snippet("verl-fused-config").split("=", 1)[1].strip())
    assert torch_functional.FusedLinearForPPO is _verl_fused.VerlFusedLinearForPPO
    ours = _run(model, "torch")
    assert restore  # prorl's op ran
    _assert_same(ours, theirs)


def test_triton_call_site_with_prorls_op(restore):
    model = _model()
    theirs = _run(model, "torch")
    import_external_libs("prorl.kernels.adapters.verl_fused_plugin")
    ours = _run(model, "triton")
    assert restore
    _assert_same(ours, theirs)


def test_vocabulary_parallel_and_reductions_are_refused():
    h, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="reduction='none' only"):
        _verl_fused.verl_linear_cross_entropy(h, w, y, 1.0, "mean")
    with pytest.raises(ValueError, match="dist_process_group"):
        _verl_fused.verl_linear_cross_entropy(h, w, y, 1.0, "none", object())


def _error(run, ref):
    """||grad - grad_ref|| / ||grad_ref|| over all parameters."""
    flat = lambda r: torch.cat([g.reshape(-1) for g in r[2].values()])
    return float((flat(run) - flat(ref)).norm() / flat(ref).norm())


def test_bf16_autocast_gradient_error_no_larger_than_verls(restore):
    """Under bf16 autocast (verl's FSDP actor), against verl in fp32: prorl's head runs in the
    weight's dtype (fp32 here) where verl's multiplies in bf16, so its error is at most verl's."""
    model = _model()
    ref = _run(model, "torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = _run(model, "torch")
        import_external_libs("prorl.kernels.adapters.verl_fused_plugin")
        ours = _run(model, "torch")
    assert restore
    errors = {"verl": _error(theirs, ref), "prorl": _error(ours, ref)}
    print("bf16 autocast gradient error against verl fp32:", errors)
    assert errors["verl"] > 1e-4  # autocast does perturb verl's gradient: the comparison can fail
    assert errors["prorl"] <= errors["verl"]
