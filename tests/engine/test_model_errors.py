"""Clear errors for what the decoder cannot load: unknown architectures, unsupported options,
checkpoints whose tensors do not match their config.json."""

import json
import os
import shutil

import pytest
import torch
from prorl.engine.model import ModelConfig, load_hf
from safetensors.torch import load_file, save_file

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path: str, **changes) -> None:
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "changes",
    [
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
        {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
        {"architectures": ["Qwen2ForSequenceClassification"]},
    ],
)
def test_unknown_architecture_names_the_supported_ones(changes):
    with pytest.raises(ValueError, match="unsupported architecture") as err:
        ModelConfig.from_hf({**QWEN2, **changes})
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in str(err.value)


@pytest.mark.tally("bad_inputs")
def test_unknown_architecture_from_a_directory(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen2"), tmp_path / "ckpt")
    _edit_config(path, model_type="phi3", architectures=["Phi3ForCausalLM"])
    with pytest.raises(ValueError, match=r"Phi3ForCausalLM.*supported: LlamaForCausalLM"):
        load_hf(path)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [1.0],
                }
            },
            "longrope",
        ),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e6}}, "mrope"),
        ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_options_are_refused(changes, message):
    with pytest.raises(ValueError, match=message) as err:
        ModelConfig.from_hf({**QWEN2, **changes})
    if "rope" in str(changes):
        assert "default, linear, dynamic, llama3, yarn" in str(err.value)


def test_v4_style_rope_fields_are_read():
    cfg = ModelConfig.from_hf(
        {
            **QWEN2,
            "rope_theta": 1e6,
            "rope_scaling": {"type": "yarn", "factor": 4.0},
            "max_position_embeddings": 128,
        }
    )
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("yarn", 1e6, 4.0)
    assert cfg.rope.original_max_position_embeddings == 128
    assert cfg.qkv_bias and not cfg.o_bias and cfg.head_dim == 16
    written = cfg.to_hf(dtype="bfloat16")
    # 4.x readers
    assert written["rope_theta"] == 1e6 and written["rope_scaling"]["rope_type"] == "yarn"
    assert ModelConfig.from_hf(written) == cfg


@pytest.mark.tally("bad_inputs")
def test_missing_tensor(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen2"), tmp_path / "ckpt")
    state = load_file(f"{path}/model.safetensors")
    del state["model.layers.1.self_attn.q_proj.bias"]
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"does not match its config.json.*missing model.layers.1.self_attn.q_proj.bias",
    ):
        load_hf(path)


@pytest.mark.tally("bad_inputs")
def test_unexpected_tensors_when_config_has_fewer_layers(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("llama"), tmp_path / "ckpt")
    _edit_config(path, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"unexpected model.layers.1.input_layernorm.weight"):
        load_hf(path)


@pytest.mark.tally("bad_inputs")
def test_untied_config_needs_lm_head(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen2"), tmp_path / "ckpt")  # tied: no lm_head.weight stored
    _edit_config(path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"missing lm_head.weight"):
        load_hf(path)


@pytest.mark.tally("bad_inputs")
def test_wrong_shape(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("qwen3"), tmp_path / "ckpt")
    _edit_config(path, intermediate_size=96)
    expected = (
        r"wrong shape model.layers.0.mlp.down_proj.weight: checkpoint \(64, 128\), "
        r"config expects \(64, 96\)"
    )
    with pytest.raises(ValueError, match=expected):
        load_hf(path)


@pytest.mark.tally("bad_inputs")
def test_missing_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(str(tmp_path))


def test_tied_checkpoint_with_a_stored_head_loads(hf_checkpoint, tmp_path):
    """Some tied checkpoints also store lm_head.weight; it is ignored as transformers does."""
    path = _copy(hf_checkpoint("qwen2"), tmp_path / "ckpt")
    state = load_file(f"{path}/model.safetensors")
    state["lm_head.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    model = load_hf(path)
    assert torch.equal(model.lm_head_weight, state["model.embed_tokens.weight"])


def _truncate_file(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) * 2 // 3)


def _zero_fill_file(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(bytes(size))


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "file, damage, message",
    [
        ("model.safetensors", _truncate_file, "truncated or damaged safetensors"),
        ("model.safetensors", _zero_fill_file, "truncated, zero-filled or not safetensors"),
        (
            "model.safetensors",
            lambda p: open(p, "wb").close(),
            "truncated, zero-filled or not safetensors",
        ),
        ("config.json", _truncate_file, "is not valid JSON"),
        ("config.json", _zero_fill_file, "is not valid JSON"),
        ("config.json", lambda p: open(p, "w").write("[1, 2]"), "must hold a JSON object"),
    ],
)
def test_a_damaged_file_is_named(hf_checkpoint, tmp_path, file, damage, message):
    """The safetensors library's own errors ("HeaderTooLarge", "MetadataIncompleteBuffer") and
    json's name neither the file nor the cause."""
    path = _copy(hf_checkpoint("qwen2"), tmp_path / "ckpt")
    damage(os.path.join(path, file))
    with pytest.raises(ValueError, match=message) as err:
        load_hf(path)
    assert os.path.join(path, file) in str(err.value)


def _transpose(state):
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = state[name].t().contiguous()


def _drop(state):
    del state["model.layers.1.mlp.down_proj.weight"]


def _extra(state):
    state["model.layers.0.mlp.surprise.weight"] = torch.zeros(2, 2)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "edit, message",
    [
        (_transpose, r"wrong shape model.layers.0.mlp.up_proj.weight: checkpoint \(64, 128\)"),
        (_drop, "missing model.layers.1.mlp.down_proj.weight"),
        (_extra, "unexpected model.layers.0.mlp.surprise.weight"),
    ],
    ids=["transposed", "missing", "extra"],
)
def test_the_start_up_check_names_a_tensor_that_does_not_fit(
    hf_checkpoint, tmp_path, edit, message
):
    """check_hf_dir (train.py's check before anything loads: exit 2) reads the headers' names and
    shapes; before, these surfaced only at load, as a traceback (exit 1)."""
    from prorl.engine.model.hf_io import check_hf_dir

    path = _copy(hf_checkpoint("qwen2"), tmp_path / "ckpt")
    state = load_file(f"{path}/model.safetensors")
    edit(state)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        check_hf_dir(path)


@pytest.mark.tally("bad_inputs")
def test_a_nan_weight_in_the_input_model_is_named(hf_checkpoint, tmp_path):
    """Before, it loaded silently and ended up in checkpoints/final."""
    from prorl.engine.model import NonFiniteWeights

    path = _copy(hf_checkpoint("qwen2"), tmp_path / "ckpt")
    state = load_file(f"{path}/model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeights, match="tensor model.layers.1.self_attn.k_proj.weight"):
        load_hf(path)
