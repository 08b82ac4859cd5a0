"""openrlhf_actor_forward against OpenRLHF 0.11.2's own `Actor.forward` on the same tiny Qwen2.

OpenRLHF's `Actor` wraps a tiny random Qwen2ForCausalLM (float32, temperature 0.7, left-padded
prompts, right-padded responses); its own forward computes the expected action log-probs, all
next-token log-probs and the entropies (from its logits; flash-attn's cross entropy is made
unavailable, so OpenRLHF takes its torch path), and the parameter gradients through them. The
ADAPTERS.md snippet then patches `Actor.forward` and the same calls must agree to float32 round-off.
"""

import sys

import pytest
import torch
from peer_stubs import OPENRLHF_STUBS, adapters_snippet, stub_missing

stub_missing("openrlhf", OPENRLHF_STUBS)
actor_module = pytest.importorskip(
    "openrlhf.models.actor",
    reason="openrlhf is not installed (.ci/peers.sh installs openrlhf 0.11.2)",
)
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402


@pytest.fixture
def actor(monkeypatch):
    monkeypatch.setattr(actor_module.Actor, "forward", actor_module.Actor.forward)  # restored after
    # flash_attn is a stand-in here (peer_stubs): make OpenRLHF's "flash-attn not installed" path
    # run
    monkeypatch.setitem(sys.modules, "flash_attn.ops.triton.cross_entropy", None)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    actor = actor_module.Actor(Qwen2ForCausalLM(config).float(), temperature=0.7)
    actor.packing_samples = False  # Actor sets it only when it loads the model from a path
    return actor


def _batch():
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, 300, (3, 12), generator=g)
    attention_mask = torch.ones_like(sequences)
    attention_mask[0, :2] = 0  # left-padded prompt
    attention_mask[2, 10:] = 0  # right-padded response
    action_mask = attention_mask[:, -5:].bool()
    return sequences, attention_mask, action_mask


def _run(actor):
    """(action log-probs, every log-prob, entropy, parameter gradients)."""
    sequences, attention_mask, action_mask = _batch()
    actor.zero_grad()
    action_lp, output = actor(
        sequences,
        action_mask,
        attention_mask=attention_mask,
        return_output=True,
        return_entropy=True,
    )
    all_lp = actor(sequences, attention_mask=attention_mask, return_logprobs=True)
    g = torch.Generator().manual_seed(2)
    loss = (action_lp * torch.randn(action_lp.shape, generator=g)).sum()
    loss = (
        loss
        + (output.entropy * torch.randn(output.entropy.shape, generator=g)).sum()
        + all_lp.sum()
    )
    loss.backward()
    grads = {k: p.grad.clone() for k, p in actor.named_parameters()}
    return action_lp.detach(), all_lp.detach(), output.entropy.detach(), grads


def test_fused_forward_matches_openrlhfs_actor(actor):
    theirs = _run(actor)
    assert theirs[0].shape == (3, 5) and theirs[1].shape == theirs[2].shape == (3, 11)
    exec(adapters_snippet("openrlhf-actor"), {})
    assert getattr(actor_module.Actor.forward, "_prorl_fused", False)
    ours = _run(actor)
    for name, a, b in zip(("action log-probs", "log-probs", "entropy"), ours[:3], theirs[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    for name, g in theirs[3].items():
        torch.testing.assert_close(
            ours[3][name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(), msg=name
        )


def test_logits_only_calls_run_openrlhfs_forward(actor):
    exec(adapters_snippet("openrlhf-actor"), {})
    sequences, attention_mask, _ = _batch()
    output = actor(sequences, attention_mask=attention_mask, return_output=True)
    assert output.logits.shape == (3, 12, 300)


def test_packed_samples_are_refused(actor):
    exec(adapters_snippet("openrlhf-actor"), {})
    actor.packing_samples = True
    sequences, attention_mask, action_mask = _batch()
    with pytest.raises(ValueError, match="packing_samples=True"):
        actor(sequences, action_mask, attention_mask=attention_mask)


def test_bf16_autocast_gradient_error_no_larger_than_openrlhfs(actor):
    """Under bf16 autocast, against OpenRLHF's actor in fp32: OpenRLHF's LM head multiplies in bf16
    (then casts the logits to fp32), prorl's runs in the weight's dtype (fp32): its error is at most
    OpenRLHF's."""
    flat = lambda r: torch.cat([g.reshape(-1) for g in r[3].values()])
    ref = _run(actor)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = _run(actor)
        exec(adapters_snippet("openrlhf-actor"), {})
        ours = _run(actor)
    errors = {
        k: float((flat(r) - flat(ref)).norm() / flat(ref).norm())
        for k, r in (("openrlhf", theirs), ("prorl", ours))
    }
    print("bf16 autocast gradient error against OpenRLHF fp32:", errors)
    # autocast does perturb OpenRLHF's gradient: the comparison can fail
    assert errors["openrlhf"] > 1e-4
    assert errors["prorl"] <= errors["openrlhf"]
