"""Hugging Face checkpoint directories (`config.json` + `*.safetensors`), without transformers.

Layout: a single `model.safetensors`, or shards named in `model.safetensors.index.json`
(`weight_map`: tensor name -> file). Tensor names are ours with a `model.` prefix, except
`lm_head.weight`. Loading builds the decoder on the meta device and assigns the tensors read
straight onto the target device, so no random init is paid for and nothing is held twice. Before any
assignment the names and shapes in the checkpoint are checked against the config, and a mismatch is
reported in one error listing what is missing, unexpected and of the wrong shape.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..attention import AttentionBackend
from .config import ModelConfig
from .decoder import Decoder

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default shard size


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def our_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def _ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model does not use."""
    if name.endswith("rotary_emb.inv_freq"):  # old transformers saved the RoPE buffer
        return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"  # tied: the embedding is the head


def _dtype_from_config(cfg: dict) -> torch.dtype | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return None


def _read_json(file: str, what: str) -> dict:
    """A JSON object from `file`; ValueError naming the file when it is damaged (truncated, not
    text)."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(
            f"{file} is not valid JSON ({exc}): a truncated or damaged {what}?"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object ({what}), not {type(value).__name__}")
    return value


def read_config(path: str) -> dict:
    """The config.json of checkpoint directory `path` as a dict (ValueError naming it when
    damaged)."""
    return _read_json(os.path.join(path, "config.json"), "config.json")


def check_safetensors(file: str) -> None:
    """ValueError naming `file` unless its layout adds up: an 8-byte little-endian header length, a
    JSON header, then exactly the tensor bytes the header describes. Catches truncated and
    zero-filled files (the safetensors library's own error names neither the file nor the cause);
    reads the header only."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if n == 0 or n > size - 8:
            raise ValueError(
                f"{file} is not a whole safetensors file ({size} bytes, header length field {n}): "
                "truncated, zero-filled or not safetensors"
            )
        try:
            header = json.loads(f.read(n))
            end = max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
            )
        except (
            ValueError,
            UnicodeDecodeError,
            KeyError,
            TypeError,
            IndexError,
            AttributeError,
        ) as exc:
            raise ValueError(
                f"{file}: damaged safetensors header ({type(exc).__name__}: {exc})"
            ) from None
    if 8 + n + end != size:
        raise ValueError(
            f"{file} is {size} bytes but its header describes "
            f"{8 + n + end}: truncated or damaged safetensors"
        )


def _tensor_files(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> safetensors file holding it; each file's layout checked."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        weight_map = _read_json(index, INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.exists(file):
                raise FileNotFoundError(f"{file} is named in {index} but missing")
            check_safetensors(file)
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    check_safetensors(single)
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class NonFiniteWeights(ValueError):
    """A checkpoint tensor holds NaN or infinite values (found while loading it)."""


def check_hf_dir(path: str) -> None:
    """Fail now, naming the file, if `path` cannot be loaded: a damaged or unsupported config.json,
    a missing, truncated or zero-filled safetensors file, a tensor missing, extra or of the wrong
    shape for the config (headers only are read: cheap for any size)."""
    _layout(path, read_config(path))


def _layout(path: str, hf_cfg: dict, attention=None):
    """(config, meta-device Decoder, {file: [tensor names]}) of checkpoint `path`; ValueError
    naming what does not match config.json."""
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        model = Decoder(cfg, attention=attention)
    expected = {hf_name(n): tuple(p.shape) for n, p in model.state_dict().items()}
    files = _tensor_files(path)
    by_file = defaultdict(list)
    for name in expected:
        if name in files:
            by_file[files[name]].append(name)
    _check_checkpoint(path, cfg, expected, files, by_file)
    return cfg, model, by_file


def load_hf(
    path: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attention: str | AttentionBackend | None = None,
) -> Decoder:
    """Load a Hugging Face checkpoint directory into a `Decoder`.

    Args:
        path: directory with config.json and model.safetensors (or sharded files + index).
        dtype: parameter dtype; None = the config's `dtype`/`torch_dtype`, else as stored.
        device: where the parameters go (default: cpu).
        attention: attention backend name or instance (default: per device, see
            engine/attention.py).
    Raises:
        ValueError: unsupported architecture/options, tensors that do not match the config or
            hold NaN or infinite values, a damaged config.json or safetensors file (named).
    """
    hf_cfg = read_config(path)
    device = torch.device(device or "cpu")
    dtype = dtype or _dtype_from_config(hf_cfg)
    _, model, by_file = _layout(path, hf_cfg, attention)

    state = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in names:
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise NonFiniteWeights(
                        f"{file}: tensor {name} holds NaN or infinite values: a damaged or "
                        "diverged model (training from it would train on NaN)"
                    )
                state[our_name(name)] = tensor.to(dtype) if dtype is not None else tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model


def _check_checkpoint(path, cfg: ModelConfig, expected: dict, files: dict, by_file: dict) -> None:
    """Names and shapes (read from the safetensors headers) against the config; one error listing
    all."""
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(n for n in set(files) - set(expected) if not _ignored(n, cfg))
    wrong_shape = []
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    wrong_shape.append(
                        f"{name}: checkpoint {shape}, config expects {expected[name]} (in {file})"
                    )
    if not (missing or unexpected or wrong_shape):
        return

    def show(items):
        return ", ".join(items[:6]) + (f" ... ({len(items)} in all)" if len(items) > 6 else "")

    parts = [f"missing {show(missing)}"] if missing else []
    parts += [f"unexpected {show(unexpected)}"] if unexpected else []
    parts += [f"wrong shape {show(sorted(wrong_shape))}"] if wrong_shape else []
    raise ValueError(
        f"checkpoint {path} does not match its config.json ({cfg.model_type}, {cfg.num_layers} "
        f"layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, vocab "
        f"{cfg.vocab_size}, tie_word_embeddings={cfg.tie_word_embeddings}): " + "; ".join(parts)
    )


def save_hf(model: Decoder, path: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write `model` as a Hugging Face directory: config.json + model.safetensors, or shards + index
    when larger than `max_shard_bytes`. `transformers.AutoModelForCausalLM.from_pretrained(path)`
    loads it. Tensors are written as they are (dtype kept; moved to the CPU). Full (unsharded)
    parameters only.
    """
    os.makedirs(path, exist_ok=True)
    state = {hf_name(n): t.detach().to("cpu").contiguous() for n, t in model.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            model.config.to_hf(dtype=str(dtype).removeprefix("torch.")), f, indent=2, sort_keys=True
        )

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    stale = [SINGLE_FILE, INDEX_FILE, *glob.glob("model-*-of-*.safetensors", root_dir=path)]
    for file in stale:  # a previous save with another layout would shadow or mix with this one
        if os.path.exists(os.path.join(path, file)):
            os.remove(os.path.join(path, file))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
