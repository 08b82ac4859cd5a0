"""Checkpoints: a dict of stateful objects, saved with torch.distributed.checkpoint, atomically.

    ckpt = Checkpointer(f"{output_dir}/checkpoints", keep_last=3)  # checks it is writable
    ckpt.preflight(state)                       # enough disk for one save? (clear error)
    info = ckpt.load(state, config_hash=h)      # the latest complete one -> CheckpointInfo | None
    ...
    ckpt.save(step, state, config_hash=h)       # state = {"model": model, "optimizer": opt, ...}

What goes where. Models (`nn.Module`) and optimizers (a torch optimizer, or an object holding one as
`.optimizer` and its state under `state_dict()["optimizer"]`, like engine.optim.Optimizer) go
through DCP's sharded path: each rank writes only its shards (FSDP2 DTensors), names are the clean
parameter names (`get_model_state_dict` / `get_optimizer_state_dict`), so DCP can reshard a
checkpoint into another world size (tests/preset reads a 2-rank checkpoint into one process; the
adapters are engine/checkpoint_state.py). Everything else - anything with
`state_dict`/`load_state_dict`, or a plain dict - is pickled whole from rank 0 into `objects.pt` and
restored exactly, whatever its structure (lists that grew, new keys): such state must be the same on
every rank (`state_dict` is called on every rank, so it may gather per-rank parts itself). The RNG
states (python, numpy, torch CPU, CUDA) of every rank go to `rng/rank_XXXXX.pt` and are restored on
load (when the world size is unchanged).

Layout and commit protocol:

    step_00000100/          complete: has COMPLETE, written last
        .metadata, *.distcp     DCP files (every rank writes its shards)
        objects.pt              rank 0's non-tensor state
        rng/rank_00000.pt       one per rank
        meta.json               step, config hash, model identity per model key, world size, keys
        manifest.json           size and SHA-256 of every file above (engine/checkpoint_verify.py)
        COMPLETE
    step_00000150.tmp/      a save in progress or cut short: never loaded; removed by the next save

A save writes everything into `step_X.tmp/`, then rank 0 renames it to `step_X/` and only then
writes `COMPLETE` (via a temporary file and a rename, fsynced). `latest()` takes the highest step
whose directory has no `.tmp` suffix and holds `COMPLETE`, so a crash at any point (mid-write,
between rename and marker, a full disk) leaves nothing that looks complete. Retention deletes a
checkpoint's marker before its files for the same reason.

Checks. The constructor fails with a clear message if the directory cannot be created or written;
`preflight` / `save` compare the estimated size of one save (all ranks' shards) with the free space.
`save` refuses (NonFiniteState, naming the tensor and the step) weights or optimizer state holding a
NaN or an infinity: such a checkpoint would be resumed, and would push the last good one out.
`meta.json` records a model identity (architecture + parameter names and shapes, hashed) per model
key: loading a checkpoint of a different model raises `CheckpointError` naming both (replicated and
FSDP2 runs of one model are the same model: DCP reshards). A differing config hash is only reported
(`CheckpointInfo.config_changed`, and a warning): the caller decides.

Damage. Before a load every file is checked against `manifest.json` (sizes and checksums written at
save); only regular files are read (a FIFO or a symbolic link is damage, never opened as such), and
a file whose size differs is not read at all. `load()` without a path takes the newest checkpoint
that passes (`usable()`): a damaged newer one is skipped with a warning naming each damaged file;
when all are damaged, `CheckpointError` names them. A missing or damaged RNG file only costs
determinism: a warning names it and the rest is loaded."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import distributed
from .checkpoint_state import ModelState, OptimizerState, first_nonfinite
from .checkpoint_verify import (
    MANIFEST,
    Verdict,
    hash_files,
    incompatibility,
    load_plain,
    model_identity,
    restore_rng,
    rng_state,
    verify,
)

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
META = "meta.json"
OBJECTS = "objects.pt"
RNG_DIR = "rng"
FORMAT_VERSION = 2  # 2: manifest.json (sizes and SHA-256 of every file), identity without wrappers
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_UNLISTED = (MANIFEST, MARKER)  # the files a manifest does not list
_REQUIRED = (META, OBJECTS, ".metadata")  # what a load cannot do without, whatever the world size
# what reading a damaged or foreign checkpoint raises (DCP, torch.load, pickle)
_LOAD_ERRORS = (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or must not be loaded; the message says why and where."""


class NonFiniteState(CheckpointError):
    """A weight or optimizer state holds a NaN or an infinity: it is not saved (a resume would
    train on from it, and retention would delete the last good checkpoint)."""


def check_finite(state: dict[str, Any], step: int) -> None:
    """Raise NonFiniteState naming the tensor and `step` when a model or optimizer of `state` (a
    Checkpointer state dict) holds a non-finite value on any rank; collective under torchrun."""
    dcp_state, _, _ = _split(state)
    _refuse_nonfinite({k: v.state_dict() for k, v in dcp_state.items()}, step)


def _refuse_nonfinite(state_dicts: dict[str, Any], step: int) -> None:
    bad = first_nonfinite(state_dicts)
    if distributed.all_reduce_max(1.0 if bad else 0.0, what="the finite-state check") > 0:
        where = bad or "a tensor on another rank"
        raise NonFiniteState(
            f"step {step}: {where} holds NaN or infinite values; not saved (the last complete "
            "checkpoint is kept). Look for a learning rate, weight decay or loss coefficient that "
            "makes the update diverge"
        )


# --------------------------------------------------------------------------------------------------
# What goes through DCP (engine/checkpoint_state.py) and what is pickled


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or isinstance(
        getattr(obj, "optimizer", None), torch.optim.Optimizer
    )


def _owner_model(optimizer: Any, models: dict[str, nn.Module], key: str) -> nn.Module:
    torch_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    first = torch_opt.param_groups[0]["params"][0]
    for model in models.values():
        if any(p is first for p in model.parameters()):
            return model
    raise CheckpointError(f"state[{key!r}] is an optimizer of none of the models in the state dict")


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, nn.Module]]:
    """state -> (DCP statefuls, other objects, models by key)."""
    models = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    models.update({k: v.model for k, v in state.items() if isinstance(v, ModelState)})
    dcp_state: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            dcp_state[key] = ModelState(value)
        elif isinstance(value, (ModelState, OptimizerState)):
            dcp_state[key] = value
        elif _is_optimizer(value):
            dcp_state[key] = OptimizerState(_owner_model(value, models, key), value)
        elif isinstance(value, dict) or (
            hasattr(value, "state_dict") and hasattr(value, "load_state_dict")
        ):
            objects[key] = value
        else:
            raise CheckpointError(
                f"state[{key!r}] ({type(value).__name__}) is neither a module, an optimizer, a "
                "dict nor an object with state_dict/load_state_dict"
            )
    return dcp_state, objects, models


# --------------------------------------------------------------------------------------------------
# Identity, hashing, RNG


def config_hash(config: Any) -> str:
    """A short stable hash of a config (dataclass, dict, or anything JSON-able with default=str)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Files


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    """Write via a temporary name, fsync, rename: the file is either absent or whole."""
    tmp = f"{path}.partial"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _torch_save_file(obj: Any, path: str) -> None:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _write_file(path, buffer.getvalue())


def _all_ranks_ok(fn, main_only: bool = False) -> None:
    """Run fn (on rank 0 only if main_only), then agree: if it failed anywhere, every rank raises -
    the failing rank its own error, the others a CheckpointError - instead of waiting at a
    barrier."""
    error = None
    if not main_only or distributed.dist_info().is_main:
        try:
            fn()
        except Exception as exc:  # re-raised below, after the other ranks have heard of it
            error = exc
    failed = distributed.all_reduce_max(1.0 if error is not None else 0.0)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError("checkpoint: another rank failed writing its part (see its error)")


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group that it assumes a single process; so do
    we."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def _tensor_bytes(obj: Any) -> int:
    """This rank's share of what DCP writes: a shard replicated over a mesh dim (HSDP) is written
    once, so it counts only on the ranks at coordinate 0 of every replicated dim."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):
            coordinate = obj.device_mesh.get_coordinate() or []
            if any(c and p.is_replicate() for c, p in zip(coordinate, obj.placements)):
                return 0
            obj = obj.to_local()
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _write_manifest(tmp: str) -> None:
    """The size and SHA-256 of every file, written after them and before the marker: what load
    verifies. Collective (ranks share the hashing)."""
    files = hash_files(tmp, skip=_UNLISTED)
    unreadable = [f"{name}: {v['error']}" for name, v in files.items() if "error" in v]
    if unreadable:  # the same dict on every rank: all raise
        raise CheckpointError(
            f"checkpoint {tmp}: files unreadable right after writing: {unreadable}"
        )
    manifest = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
    _all_ranks_ok(lambda: _write_file(os.path.join(tmp, MANIFEST), manifest), main_only=True)


def _meta(step: int, config_hash, models: dict, keys: list, world_size: int, extra) -> dict:
    """meta.json: the step, the config hash, each model's identity, the state's keys, the world."""
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "config_hash": config_hash,
        "models": {k: model_identity(m) for k, m in models.items()},
        "keys": keys,
        "world_size": world_size,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "extra": extra or {},
    }


def verify_checkpoint(path: str) -> Verdict:
    """Checkpoint directory `path` against its manifest (engine/checkpoint_verify.py);
    collective."""
    return verify(path, required=_REQUIRED, rng_dir=RNG_DIR, skip=_UNLISTED)


@dataclass(frozen=True)
class CheckpointInfo:
    """What `load` restored."""

    step: int
    path: str
    meta: dict[str, Any]
    # the saved config hash differs from the one passed to load (None: not compared)
    config_changed: bool


class Checkpointer:
    """Saves and restores a dict of stateful objects under `directory` (see the module docstring).

    Args:
        directory: where `step_XXXXXXXX/` checkpoints live (shared by all ranks and nodes).
        keep_last: complete checkpoints to keep (older ones are deleted after each save); None =
            all.
        min_free_bytes: free space required beyond the estimated size of a save.
    Raises:
        CheckpointError: the directory cannot be created or written.
    """

    def __init__(self, directory: str, keep_last: int | None = 3, min_free_bytes: int = 64 * 2**20):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.directory = os.path.abspath(directory)
        self.keep_last = keep_last
        self.min_free_bytes = min_free_bytes
        # usable()'s answer, once asked
        self._usable: tuple[str | None, Verdict | None] | None = None
        self._check_writable()

    # -- discovery ---------------------------------------------------------------------------------

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        steps = []
        for name in os.listdir(self.directory):
            match = _STEP_DIR.match(name)
            if match and os.path.isfile(os.path.join(self.directory, name, MARKER)):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint, or None."""
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    # -- checks ------------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        probe = os.path.join(self.directory, f".write_probe.{os.getpid()}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.remove(probe)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint directory {self.directory} is not writable: {exc}"
            ) from exc

    def _check_space(self, local_bytes: int) -> None:
        """All ranks agree: the estimated total size of one save must fit in the free space."""
        needed = int(distributed.all_reduce_sum(local_bytes) * 1.05) + self.min_free_bytes
        free = shutil.disk_usage(self.directory).free
        ok = distributed.all_reduce_min(1.0 if free >= needed else 0.0)
        if ok < 1.0:
            raise CheckpointError(
                f"not enough free disk space for a checkpoint in {self.directory}: about "
                f"{_gib(needed)} needed (shards of all ranks + {_gib(self.min_free_bytes)} "
                f"margin), {_gib(free)} free"
                + ("" if free < needed else " here but less on another rank's filesystem")
            )

    def preflight(self, state: dict[str, Any]) -> int:
        """Fail now (CheckpointError) if a save of `state` would not fit; returns its estimated
        bytes. Collective under torchrun (every rank must call it)."""
        self._check_writable()
        dcp_state, objects, _ = _split(state)
        local = _tensor_bytes({k: v.state_dict() for k, v in dcp_state.items()})
        self._check_space(local)
        return local

    # -- save --------------------------------------------------------------------------------------

    def save(
        self, step: int, state: dict[str, Any], *, config_hash: str | None = None, extra=None
    ) -> str:
        """Save `state` as checkpoint `step`; collective under torchrun. Returns the committed path.

        extra: JSON-able dict stored in meta.json (e.g. the run's metrics at this step).
        """
        import torch.distributed.checkpoint as dcp

        info = distributed.dist_info()
        self._usable = None  # usable() looks again after a save
        dcp_state, objects, models = _split(state)
        state_dicts = {k: v.state_dict() for k, v in dcp_state.items()}
        _refuse_nonfinite(state_dicts, step)
        # on every rank: an object's state_dict may be a collective (gathering per-rank parts)
        saved_objects = {
            k: v if isinstance(v, dict) else v.state_dict() for k, v in objects.items()
        }
        self._check_space(_tensor_bytes(state_dicts))

        final, tmp = self.step_dir(step), self.step_dir(step) + ".tmp"

        def prepare():
            self._remove_stale()
            os.makedirs(os.path.join(tmp, RNG_DIR))

        _all_ranks_ok(prepare, main_only=True)
        with _single_process_quiet():  # DCP agrees on failures across ranks itself
            dcp.save(state_dicts, checkpoint_id=tmp, no_dist=not dist.is_initialized())

        def write_small_files():
            _torch_save_file(rng_state(), os.path.join(tmp, RNG_DIR, f"rank_{info.rank:05d}.pt"))
            if not info.is_main:
                return
            _torch_save_file(saved_objects, os.path.join(tmp, OBJECTS))
            meta = _meta(step, config_hash, models, sorted(state), info.world_size, extra)
            _write_file(os.path.join(tmp, META), json.dumps(meta, indent=2, default=str).encode())

        _all_ranks_ok(write_small_files)  # also the barrier: every rank's files are on disk
        _write_manifest(tmp)

        def commit():
            if os.path.exists(final):  # the same step saved again: retire the old one marker-first
                self._delete(final)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            _write_file(os.path.join(final, MARKER), json.dumps({"step": step}).encode())
            _fsync_dir(final)
            self._retain(step)
            logger.info("checkpoint saved: %s", final)

        _all_ranks_ok(commit, main_only=True)
        return final

    def _delete(self, path: str) -> None:
        marker = os.path.join(path, MARKER)
        if os.path.exists(marker):
            os.remove(marker)
            _fsync_dir(path)
        shutil.rmtree(path)

    def _remove_stale(self) -> None:
        """Interrupted saves: `.tmp` directories and step directories without a marker."""
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            stale_tmp = name.startswith("step_") and name.endswith(".tmp")
            incomplete = _STEP_DIR.match(name) and not os.path.exists(os.path.join(path, MARKER))
            if os.path.isdir(path) and (stale_tmp or incomplete):
                logger.warning("removing incomplete checkpoint %s", path)
                shutil.rmtree(path)

    def _retain(self, saved: int) -> None:
        """Keep the newest `keep_last` checkpoints up to the one just saved; a newer one (a damaged
        one the run fell back from) neither counts nor is deleted."""
        if self.keep_last is None:
            return
        for step in [s for s in self.complete_steps() if s <= saved][: -self.keep_last]:
            self._delete(self.step_dir(step))

    # -- load --------------------------------------------------------------------------------------

    def usable(self) -> str | None:
        """The newest complete checkpoint that passes `verify` (sizes and checksums of its
        manifest), or None when there is no complete checkpoint. A damaged one is skipped with a
        warning naming each damaged file; when every one is damaged, CheckpointError names them all.
        Collective under torchrun (every rank gets rank 0's answer); the answer is kept for the next
        call and `load`."""
        if self._usable is not None:
            return self._usable[0]
        steps = self.complete_steps()
        if dist.is_initialized():  # every rank checks what rank 0 found
            box = [steps]
            dist.broadcast_object_list(box, src=0)
            steps = box[0]
        damaged = []
        for step in reversed(steps):
            path = self.step_dir(step)
            verdict = verify_checkpoint(path)
            if not verdict.damage:
                if damaged and distributed.dist_info().is_main:
                    logger.warning("resuming from the previous checkpoint %s", path)
                self._usable = (path, verdict)
                return path
            damaged.append(f"{path}: " + "; ".join(verdict.damage))
            if distributed.dist_info().is_main:
                logger.warning(
                    "checkpoint %s is damaged, not loaded: %s", path, "; ".join(verdict.damage)
                )
        if damaged:
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}: every one is damaged: "
                + " | ".join(damaged)
            )
        self._usable = (None, None)
        return None

    def _source(self, path: str | None, step: int | None) -> tuple[str | None, Verdict | None]:
        """The checkpoint `load` reads and its verdict: `path`, `step`'s, or the newest usable
        one."""
        if path is None and step is not None:
            path = self.step_dir(step)
        if path is None:
            path = self.usable()
            return (path, self._usable[1]) if path is not None else (None, None)
        if path.rstrip("/").endswith(".tmp") or not os.path.isfile(os.path.join(path, MARKER)):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
        verdict = verify_checkpoint(path)
        if verdict.damage:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(verdict.damage))
        return path, verdict

    def load(
        self,
        state: dict[str, Any],
        *,
        path: str | None = None,
        step: int | None = None,
        config_hash: str | None = None,
    ) -> CheckpointInfo | None:
        """Restore `state` in place from `path`, checkpoint `step`, or the newest usable one
        (`usable`: a damaged newest checkpoint is skipped with a warning).

        Returns None when there is no complete checkpoint (and neither path nor step was given).
        Raises CheckpointError, naming the checkpoint and file: incomplete or damaged checkpoint, a
        model of another architecture, keys of `state` missing from the checkpoint, a failed load. A
        different `config_hash` is reported, not refused; a missing or damaged RNG file is a warning
        naming it (the run continues, no longer bit-identical). Collective under torchrun.
        """
        import torch.distributed.checkpoint as dcp

        info = distributed.dist_info()
        path, verdict = self._source(path, step)
        if path is None:
            return None
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        dcp_state, objects, models = _split(state)
        problem = incompatibility(path, meta, set(state), models)
        if problem:
            raise CheckpointError(problem)
        config_changed = config_hash is not None and meta.get("config_hash") != config_hash
        if config_changed and info.is_main:
            logger.warning(
                "checkpoint %s was saved with config hash %s, this run's is %s",
                path,
                meta.get("config_hash"),
                config_hash,
            )

        objects_file = os.path.join(path, OBJECTS)
        try:
            with _single_process_quiet():
                dcp.load(dcp_state, checkpoint_id=path, no_dist=not dist.is_initialized())
            saved_objects = load_plain(objects_file)
            for key, obj in objects.items():
                if isinstance(obj, dict):
                    obj.clear()
                    obj.update(saved_objects[key])
                else:
                    obj.load_state_dict(saved_objects[key])
        except _LOAD_ERRORS as exc:
            first = (
                str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            )
            raise CheckpointError(
                f"loading checkpoint {path} failed: {type(exc).__name__}: {first}"
            ) from exc
        rng_file = os.path.join(path, RNG_DIR, f"rank_{info.rank:05d}.pt")
        restore_rng(path, rng_file, meta["world_size"], verdict.rng.get(rng_file))
        return CheckpointInfo(meta["step"], path, meta, config_changed)
