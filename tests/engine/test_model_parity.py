"""The decoder against `transformers` on the same checkpoint directory.

fp32 criterion: max abs logit error <= 1e-4 (logits here are O(5)).
bf16 criterion (flash-attention's habit, STYLE.md): with transformers' fp32 logits as the reference,
our bf16 error (max and mean abs) is at most 2x transformers' own bf16 error on the same bf16
weights.
"""

import dataclasses

import pytest
import torch
import transformers
from prorl.engine.model import Decoder, ModelConfig, load_hf, save_hf
from tiny_hf import LENGTHS, VARIANTS, hf_logits_per_sequence

FP32_ATOL = 1e-4


def _hf(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def _ours(model, ids, cu):
    return model.logits(model(ids, cu_seqlens=cu)).float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_logits_match_transformers(variant, hf_checkpoint, packed_batch):
    path = hf_checkpoint(variant)
    ids, cu = packed_batch
    ref = hf_logits_per_sequence(_hf(path), ids, cu)
    ours = _ours(load_hf(path), ids, cu)
    err = (ours - ref).abs().max().item()
    print(
        f"{variant}: fp32 max abs logit error {err:.2e} (max |logit| {ref.abs().max().item():.2f})"
    )
    assert err <= FP32_ATOL


@pytest.mark.parametrize("variant", ["llama-llama3", "llama-linear", "llama-dynamic", "llama-yarn"])
def test_rope_scaling_is_visible_in_this_test(variant, hf_checkpoint, packed_batch):
    """Power check of the parity test above: ignoring the scaling changes the logits by far more
    than 1e-4."""
    model = load_hf(hf_checkpoint(variant))
    ids, cu = packed_batch
    plain = Decoder(
        dataclasses.replace(
            model.config, rope=dataclasses.replace(model.config.rope, rope_type="default")
        )
    )
    plain.load_state_dict(model.state_dict())
    assert (_ours(plain, ids, cu) - _ours(model, ids, cu)).abs().max().item() > 1e-2


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "llama-llama3"])
def test_bf16_error_within_transformers_own(variant, hf_checkpoint, packed_batch):
    path = hf_checkpoint(variant)
    ids, cu = packed_batch
    ref = hf_logits_per_sequence(_hf(path), ids, cu)
    hf_err = (hf_logits_per_sequence(_hf(path, torch.bfloat16), ids, cu).float() - ref).abs()
    model = load_hf(path, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    our_err = (_ours(model, ids, cu) - ref).abs()
    print(
        f"{variant}: bf16 max/mean abs error ours {our_err.max():.3e}/{our_err.mean():.3e}, "
        f"transformers {hf_err.max():.3e}/{hf_err.mean():.3e}"
    )
    assert our_err.max() <= 2 * hf_err.max()
    assert our_err.mean() <= 2 * hf_err.mean()


@pytest.mark.parametrize("variant", ["qwen2", "llama-dynamic"])
def test_packed_and_padded_agree(variant, hf_checkpoint, packed_batch):
    """Right-padded [B, T] through our model and transformers, and packed [N], give the same
    logits."""
    path = hf_checkpoint(variant)
    ids, cu = packed_batch
    model = load_hf(path)
    packed = _ours(model, ids, cu)  # [N, V]

    b, t = len(LENGTHS), max(LENGTHS)
    padded_ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    for row, (start, n) in enumerate(zip(cu[:-1].tolist(), LENGTHS)):
        padded_ids[row, :n] = ids[start : start + n]
        mask[row, :n] = 1
    with torch.no_grad():
        ours_padded = model.logits(model(padded_ids, attention_mask=mask))  # [B, T, V]
    assert ours_padded.shape == (b, t, model.config.vocab_size)
    assert (ours_padded[mask.bool()] - packed).abs().max().item() <= 1e-5
    assert (
        ours_padded[~mask.bool()].abs().max().item() == 0.0
    )  # padding rows are zeros (hidden 0 -> logits 0)

    # Left padding: the same tokens, positions still counted from each sequence's first token.
    left_ids, left_mask = padded_ids.clone(), mask.clone()
    for row, n in enumerate(LENGTHS):
        left_ids[row] = torch.roll(padded_ids[row], t - n)
        left_mask[row] = torch.roll(mask[row], t - n)
    with torch.no_grad():
        ours_left = model.logits(model(left_ids, attention_mask=left_mask))
    assert (ours_left[left_mask.bool()] - packed).abs().max().item() <= 1e-5

    # transformers scales dynamic RoPE by the batch's longest sequence
    if variant != "llama-dynamic":
        with torch.no_grad():
            hf_padded = _hf(path)(padded_ids, attention_mask=mask).logits
        assert (hf_padded[mask.bool()] - packed).abs().max().item() <= FP32_ATOL


def test_default_position_ids_restart_per_sequence(hf_checkpoint, packed_batch):
    model = load_hf(hf_checkpoint("qwen3"))
    ids, cu = packed_batch
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.no_grad():
        assert torch.equal(model(ids, positions, cu), model(ids, cu_seqlens=cu))
        whole = model(ids)  # no cu_seqlens: one sequence
        first = model(ids[: LENGTHS[0]])
    assert whole.shape == (sum(LENGTHS), model.config.hidden_size)
    # causal: a prefix does not see the rest
    assert (whole[: LENGTHS[0]] - first).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "llama-bias", "llama-yarn"])
@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_save_hf_round_trip(variant, max_shard_bytes, hf_checkpoint, packed_batch, tmp_path):
    """load_hf -> save_hf (single file or shards) -> transformers loads identical weights and
    logits."""
    path = hf_checkpoint(variant)
    ids, cu = packed_batch
    model = load_hf(path)
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    save_hf(model, str(tmp_path), **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_bytes is not None)

    original, exported = _hf(path), _hf(str(tmp_path))
    assert type(exported) is type(original)
    for name, tensor in original.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    assert torch.equal(
        hf_logits_per_sequence(exported, ids, cu), hf_logits_per_sequence(original, ids, cu)
    )
    assert torch.equal(_ours(load_hf(str(tmp_path)), ids, cu), _ours(model, ids, cu))


def test_load_sharded_transformers_checkpoint(hf_checkpoint, packed_batch, tmp_path):
    path = hf_checkpoint("llama-llama3")
    _hf(path).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids, cu = packed_batch
    assert torch.equal(_ours(load_hf(str(tmp_path)), ids, cu), _ours(load_hf(path), ids, cu))


def test_model_from_config_on_meta_exports_to_transformers(tmp_path, packed_batch):
    """The from-scratch path: build on meta, materialise, init, save as bf16; transformers
    agrees."""
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        qkv_bias=True,
        initializer_range=0.1,
    )
    with torch.device("meta"):
        model = Decoder(cfg)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.lm_head_weight is model.embed_tokens.weight
    save_hf(model.to(torch.bfloat16), str(tmp_path))
    ids, cu = packed_batch
    hf = _hf(str(tmp_path), dtype=torch.float32)
    ours = load_hf(str(tmp_path), dtype=torch.float32)
    assert ours.config == cfg
    assert (
        _ours(ours, ids, cu) - hf_logits_per_sequence(hf, ids, cu)
    ).abs().max().item() <= FP32_ATOL
    # dtype=None: config's dtype
    assert load_hf(str(tmp_path)).embed_tokens.weight.dtype == torch.bfloat16


def test_gradients_match_transformers(hf_checkpoint, packed_batch):
    """Training needs the backward too: parameter gradients of the same loss agree with
    transformers'."""
    path = hf_checkpoint("qwen3")
    ids, cu = packed_batch
    hf, ours = _hf(path), load_hf(path)
    weights = torch.randn(
        sum(LENGTHS), ours.config.vocab_size, generator=torch.Generator().manual_seed(2)
    )
    bounds = cu.tolist()
    hf_logits = torch.cat([hf(ids[a:b][None]).logits[0] for a, b in zip(bounds[:-1], bounds[1:])])
    (hf_logits * weights).sum().backward()
    (ours.logits(ours(ids, cu_seqlens=cu)) * weights).sum().backward()
    hf_grads = {n.removeprefix("model."): p.grad for n, p in hf.named_parameters()}
    worst = 0.0
    for name, p in ours.named_parameters():
        ref = hf_grads[name]
        worst = max(worst, ((p.grad - ref).abs().max() / ref.abs().max()).item())
    print(f"gradients: worst max-abs error relative to the tensor's max |grad|: {worst:.2e}")
    assert worst <= 1e-4
