"""What makes a checkpoint trustworthy before a load: a manifest of its files, and model identity.

The manifest (`manifest.json`, written by `engine.checkpoint.Checkpointer.save` after every other
file of the save and before the commit marker) holds the size and SHA-256 of every file of the
checkpoint. `verify` checks them before a load, so a truncated or zero-filled shard, a truncated
`meta.json` or a missing `objects.pt` is named file by file instead of surfacing as a
deserialisation traceback deep in DCP or pickle - and the checkpointer can fall back to the previous
checkpoint. Hashing is split over the ranks (rank r takes every world-th file), so a save or a load
pays about 1/world of the reading, at about a second per GB per core (docs/notes.md).

The per-rank RNG files (`rng/rank_XXXXX.pt`) are optional for a load: one that is missing or damaged
costs the bit-exact continuation of the run, not the run; `verify` reports them apart (`rng`) so the
caller warns, naming the file, and loads the rest.

Model identity: the architecture (the model's own class, not the FSDP2 wrapper class `fully_shard`
swaps in, and its config) with every parameter's clean name and global shape, hashed. Replicated and
FSDP2 runs of one model have one identity, so switching `model.fsdp` resumes (DCP reshards);
checkpoints saved before the wrapper was looked through hold the wrapper's class name, and
`identity_matches` accepts that spelling too.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import distributed, parallel

logger = logging.getLogger("prorl.engine.checkpoint")  # one logger for saving and loading

MANIFEST = "manifest.json"
_CHUNK = 8 * 2**20


MAX_SMALL_FILE = 64 * 2**20  # manifest.json and meta.json: larger is damage, not read


def open_regular(path: str, max_bytes: int | None = None):
    """`path` opened for binary reading, refusing (OSError naming why) anything but a regular file:
    a symbolic link (to /dev/zero, say: read forever) or a FIFO (blocks its reader forever) is not
    followed or read; with `max_bytes`, neither is a larger file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, "a symbolic link, refused: only regular files", path
            ) from None
        raise
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file (a FIFO, device or directory), refused"
    elif max_bytes is not None and st.st_size > max_bytes:
        why = f"{st.st_size} bytes, over the {max_bytes} a file of its kind may have"
    if why:
        os.close(fd)
        raise OSError(errno.EINVAL, why, path)
    return os.fdopen(fd, "rb")


def _size_and_sha256(path: str, want_size: int | None) -> dict[str, Any]:
    """{"size", "sha256"} of regular file `path`; a file whose size is not `want_size` (the
    manifest's) is not read, its sha256 left empty."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if want_size is not None and size != want_size:
            return {"size": size, "sha256": ""}
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def _files(directory: str, skip: tuple[str, ...]) -> list[str]:
    """Paths of every file under `directory`, relative and sorted, but those named in `skip`;
    symbolic links to directories are listed (as files: refused when read), not followed."""
    out = []
    for root, dirs, names in os.walk(directory):
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        for name in names + links:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in skip:
                out.append(rel)
    return sorted(out)


def _gather(local: dict) -> dict:
    """Merge every rank's dict (collective under torchrun)."""
    if not dist.is_initialized():
        return local
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _shared_list(items: list[str]) -> list[str]:
    """Rank 0's list on every rank: they share the filesystem, not necessarily its listing order."""
    if not dist.is_initialized():
        return items
    box = [items]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def hash_files(
    directory: str, skip: tuple[str, ...], sizes: dict[str, int] | None = None
) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file under `directory` but `skip`; collective,
    the same dict on every rank. A file that cannot be read, or is not a regular file, is recorded
    with its error and no hash; one whose size differs from `sizes` (the manifest's) is not read."""
    sizes = sizes or {}
    info = distributed.dist_info()
    names = _shared_list(_files(directory, skip) if info.is_main else [])
    local: dict[str, dict[str, Any]] = {}
    for name in names[info.rank :: info.world_size]:
        path = os.path.join(directory, name)
        try:
            local[name] = _size_and_sha256(path, sizes.get(name))
        except OSError as exc:
            local[name] = {"error": str(exc)}
    return _gather(local)


@dataclass
class Verdict:
    """What `verify` found: `damage` (files a load cannot do without, one line each naming the
    file), `rng` (RNG files missing or damaged: path -> problem), `checked` (False: no manifest to
    check)."""

    damage: list[str] = field(default_factory=list)
    rng: dict[str, str] = field(default_factory=dict)
    checked: bool = True


def _is_rng(name: str, rng_dir: str) -> bool:
    return name.startswith(rng_dir + os.sep)


def verify(path: str, *, required: tuple[str, ...], rng_dir: str, skip: tuple[str, ...]) -> Verdict:
    """Check checkpoint directory `path` against its manifest; collective, the same Verdict on every
    rank.

    Without a manifest (saved by an older prorl) only the presence of `required` files and a
    readable `meta.json` are checked. `skip`: files outside the manifest (the manifest itself, the
    commit marker).
    """
    verdict = Verdict()
    manifest_path = os.path.join(path, MANIFEST)
    manifest, problem = _read_manifest(manifest_path)
    if problem:
        verdict.damage.append(problem)
        return verdict
    if manifest is None:
        verdict.checked = False
        for name in required:
            if not os.path.isfile(os.path.join(path, name)):
                verdict.damage.append(f"{os.path.join(path, name)}: missing")
        if not verdict.damage:
            verdict.damage += _meta_problems(os.path.join(path, "meta.json"), manifest_path)
        return verdict
    found = hash_files(path, skip, {k: v["size"] for k, v in manifest.items()})
    for name, want in sorted(manifest.items()):
        what = _file_problem(found.get(name), want)
        if what is None:
            continue
        full = os.path.join(path, name)
        if _is_rng(name, rng_dir):
            verdict.rng[full] = f"is {what}" if what == "missing" else f"has {what}"
        else:
            verdict.damage.append(f"{full}: {what}")
    # every file is covered: DCP or pickle would read it
    for name in sorted(set(found) - set(manifest)):
        what = (
            f"not listed in {MANIFEST} (added or replaced after the save, or the manifest was "
            "edited)"
        )
        if _is_rng(name, rng_dir):
            verdict.rng[os.path.join(path, name)] = f"is {what}"
        else:
            verdict.damage.append(f"{os.path.join(path, name)}: {what}")
    for name in required:
        if name not in manifest:
            verdict.damage.append(f"{os.path.join(path, name)}: not in {MANIFEST}")
    return verdict


def _read_manifest(manifest_path: str) -> tuple[dict | None, str | None]:
    """(the manifest's files, None), (None, None) when there is no manifest, or (None, the problem):
    read on rank 0, broadcast to every rank."""
    manifest, problem = None, None
    if distributed.dist_info().is_main:
        try:
            with open_regular(manifest_path, MAX_SMALL_FILE) as f:
                manifest = json.loads(f.read().decode("utf-8"))
            problem = manifest_problem(manifest)
            manifest = None if problem else manifest["files"]
            problem = f"{manifest_path}: {problem}" if problem else None
        except FileNotFoundError:
            pass
        # UnicodeDecodeError and JSONDecodeError are ValueErrors
        except (OSError, ValueError) as exc:
            problem = f"{manifest_path}: unreadable ({type(exc).__name__}: {exc})"
    if dist.is_initialized():
        box = [(manifest, problem)]
        dist.broadcast_object_list(box, src=0)
        manifest, problem = box[0]
    return manifest, problem


def _file_problem(got: dict | None, want: dict) -> str | None:
    """What is wrong with a file hashed now (`got`) against its manifest entry (`want`); None:
    nothing."""
    if got is None:
        return "missing"
    if "error" in got:
        return f"unreadable ({got['error']})"
    if got["size"] != want["size"]:
        return f"{got['size']} bytes, {want['size']} when saved (truncated or overwritten)"
    if got["sha256"] != want["sha256"]:
        return (
            "contents differ from the checksum written at save (overwritten, zero-filled or bit "
            "rot)"
        )
    return None


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def manifest_problem(manifest: Any) -> str | None:
    """What makes a parsed manifest unusable, or None: it must be {"files": {relative path: {"size":
    int >= 0, "sha256": 64 hex digits}}}, the paths inside the checkpoint directory. Checked before
    any use, so a damaged or edited manifest is a named damage (fall back, or exit 4), never a
    TypeError mid-resume."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        got = type(manifest.get("files") if isinstance(manifest, dict) else manifest).__name__
        return f"not a manifest: 'files' must be an object of file entries, got {got}"
    for name, entry in manifest["files"].items():
        norm = os.path.normpath(name)
        if os.path.isabs(name) or norm != name or norm.startswith(".." + os.sep) or norm == "..":
            return f"entry {name!r}: not a relative path inside the checkpoint"
        if not isinstance(entry, dict):
            got = type(entry).__name__
            return f"entry {name!r}: must be an object with 'size' and 'sha256', got {got}"
        size, sha = entry.get("size"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return (
                f"entry {name!r}: 'size' must be a byte count (an integer >= 0), got {size!r:.60}"
            )
        if not isinstance(sha, str) or not _SHA256.match(sha):
            return f"entry {name!r}: 'sha256' must be 64 hexadecimal digits, got {sha!r:.80}"
    return None


def _meta_problems(meta_path: str, manifest_path: str) -> list[str]:
    """A checkpoint without a manifest: its meta.json must be readable and older than manifests."""
    try:
        with open_regular(meta_path, MAX_SMALL_FILE) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or "keys" not in meta:
            return [f"{meta_path}: not a checkpoint's meta.json (no 'keys')"]
    except (OSError, ValueError) as exc:
        return [f"{meta_path}: unreadable ({type(exc).__name__}: {exc})"]
    if meta.get("format", 1) >= 2:  # saved with a manifest, which is gone
        return [f"{manifest_path}: missing"]
    return []


# --------------------------------------------------------------------------------------------------
# Model identity


def model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps in a subclass `FSDP<Name>` of
    FSDPModule."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return type(model)
    cls = type(model)
    if issubclass(cls, FSDPModule):
        return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls


def _identity_hash(class_name: str, config: Any, shapes: list) -> str:
    identity = {"class": class_name, "config": config, "shapes": shapes}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


def _parts(model: nn.Module) -> tuple[Any, list]:
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config):
        config = {
            k: v
            for k, v in dataclasses.asdict(config).items()
            if k not in ("hf", "initializer_range")
        }
    shapes = sorted((parallel.clean_name(n), list(p.shape)) for n, p in model.named_parameters())
    return config, shapes


def model_identity(model: nn.Module) -> dict[str, Any]:
    """{"hash", "summary"}: the architecture (the model's own class, config without init-only
    fields) and every parameter's clean name and global shape. Dtypes and wrappers are not part of
    it (a bf16 export of an fp32 model, or an FSDP2-sharded one, is the same model)."""
    config, shapes = _parts(model)
    name = model_class(model).__name__
    summary = {
        "class": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": len(shapes),
    }
    if isinstance(config, dict):
        keys = (
            "model_type",
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "vocab_size",
        )
        summary.update({k: config[k] for k in keys if k in config})
    return {"hash": _identity_hash(name, config, shapes), "summary": summary}


def identity_matches(saved_hash: str, model: nn.Module) -> bool:
    """Whether a saved identity hash is `model`'s: this spelling, or that of checkpoints written
    before wrappers were looked through (the FSDP2 class name `FSDP<Name>` in the identity)."""
    config, shapes = _parts(model)
    name = model_class(model).__name__
    return saved_hash in {_identity_hash(n, config, shapes) for n in (name, f"FSDP{name}")}


# --------------------------------------------------------------------------------------------------
# RNG states


def incompatibility(
    path: str, meta: dict, keys: set[str], models: dict[str, nn.Module]
) -> str | None:
    """Why checkpoint `path` (its meta.json `meta`) cannot restore a state of `keys` holding
    `models`: keys it lacks, or a model of another identity under a key; None when it can."""
    missing = sorted(keys - set(meta["keys"]))
    if missing:
        return f"checkpoint {path} has no {missing} (it holds {meta['keys']})"
    for key, model in models.items():
        saved, current = meta["models"].get(key), model_identity(model)
        if saved is None or not identity_matches(saved["hash"], model):
            return (
                f"checkpoint {path} holds a different model under {key!r}: saved "
                f"{saved['summary'] if saved else 'no model'}, this run's {current['summary']} "
                "(architecture or parameter shapes differ); refusing to load it"
            )
    return None


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy (if installed), torch CPU, CUDA (if initialised)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_globals() -> list:
    """What a pickled numpy array (numpy's RNG state) needs beside torch's weights-only list."""
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core
    return [
        core.multiarray._reconstruct,
        numpy.ndarray,
        numpy.dtype,
        type(numpy.dtype(numpy.uint32)),
    ]


def load_plain(path: str) -> Any:
    """A checkpoint's pickled file (objects.pt, an RNG file) read with torch's weights-only
    unpickler: tensors, numbers, strings, containers and numpy arrays, never a class or function
    it names (a crafted pickle would otherwise run code at resume). pickle.UnpicklingError for
    anything else."""
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(path, weights_only=True)


def restore_rng(path: str, rng_file: str, saved_world: int, problem: str | None) -> None:
    """This rank's RNG states from `rng_file` of checkpoint `path`, when the world size is unchanged
    and the file is whole (`problem`: what `verify` found wrong with it); else a warning that names
    the file and says the run is no longer bit-identical to an uninterrupted one."""
    info = distributed.dist_info()
    if saved_world != info.world_size:
        if info.is_main:
            logger.warning(
                "checkpoint %s was saved by %d ranks, this run has %d: RNG states not restored",
                path,
                saved_world,
                info.world_size,
            )
        return
    problem = problem or (None if os.path.isfile(rng_file) else "is missing")
    if problem is None:
        try:
            set_rng_state(load_plain(rng_file))
            return
        except (OSError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError) as exc:
            problem = f"is unreadable ({type(exc).__name__})"
    logger.warning(
        "rank %d: RNG file %s %s: RNG states not restored, so the run resumes but is no longer "
        "bit-identical to an uninterrupted one",
        info.rank,
        rng_file,
        problem,
    )
