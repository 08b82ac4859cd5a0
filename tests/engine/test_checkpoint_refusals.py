"""What a checkpoint save or load refuses (issue 41): weights or optimizer state holding a NaN or an
infinity are never saved (the tensor and the step named, the last good checkpoint kept)."""

import os

import pytest
import torch
from dist_helpers import random_decoder
from prorl.engine.checkpoint import Checkpointer, CheckpointError, NonFiniteState
from prorl.engine.optim import Optimizer, OptimizerConfig


def _trained(seed=1):
    """A tiny decoder and an AdamW that has taken one step (so it has moments)."""
    model = random_decoder(seed=seed)
    opt = Optimizer(model, OptimizerConfig(lr=1e-3))
    model(torch.tensor([[1, 2, 3]])).float().pow(2).mean().backward()
    opt.step()
    return model, opt


@pytest.mark.tally("faults")
@pytest.mark.parametrize("where", ["weight", "moment", "inf weight"])
def test_a_non_finite_weight_or_moment_is_not_saved(tmp_path, where):
    model, opt = _trained()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep_last=1)
    state = {"model": model, "optimizer": opt, "data": {"position": 1}}
    ckpt.save(1, state)
    name, param = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        if where == "moment":
            opt.optimizer.state[param]["exp_avg"].view(-1)[3] = float("nan")
        else:
            param.view(-1)[3] = float("nan") if where == "weight" else float("inf")
    with pytest.raises(NonFiniteState) as err:
        ckpt.save(2, state)
    message = str(err.value)
    assert message.startswith("step 2: ") and name in message, message
    assert ("exp_avg" in message) == (where == "moment"), message
    assert (
        message.split(":")[1]
        .strip()
        .split()[0]
        .startswith("optimizer" if where == "moment" else "model")
    )
    # nothing of step 2 on disk; step 1 kept (keep_last=1 would have deleted it)
    assert ckpt.complete_steps() == [1]
    assert sorted(os.listdir(ckpt.directory)) == ["step_00000001"]


def _fifo(path):
    os.remove(path)
    os.mkfifo(path)


def _link(target):
    def make(path):
        os.remove(path)
        os.symlink(target, path)

    return make


def _link_to_a_copy(path):
    """The same bytes, but behind a symbolic link: a checkpoint holds regular files only."""
    copy = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(path))), "elsewhere")
    os.rename(path, copy)
    os.symlink(copy, path)


def _rng_dir_linked(step_dir):
    rng, elsewhere = os.path.join(step_dir, "rng"), os.path.dirname(step_dir) + ".rng"
    os.rename(rng, elsewhere)
    os.symlink(elsewhere, rng)


def _sparse(path):
    with open(path, "r+b") as f:
        f.truncate(2**40)  # 1 TiB, no blocks: read in full it would take hours


class Hung(BaseException):
    """The load blocked or read on for 20 s."""


# (what is done to the newest checkpoint's directory, the name the warning must show)
REFUSED = {
    "shard a FIFO": (lambda d: _fifo(os.path.join(d, "__0_0.distcp")), "__0_0.distcp"),
    "shard a link to /dev/zero": (
        lambda d: _link("/dev/zero")(os.path.join(d, "__0_0.distcp")),
        "__0_0.distcp",
    ),
    "objects.pt a link to its own bytes": (
        lambda d: _link_to_a_copy(os.path.join(d, "objects.pt")),
        "objects.pt",
    ),
    "manifest.json a FIFO": (lambda d: _fifo(os.path.join(d, "manifest.json")), "manifest.json"),
    "manifest.json a link to /dev/zero": (
        lambda d: _link("/dev/zero")(os.path.join(d, "manifest.json")),
        "manifest.json",
    ),
    "an unlisted FIFO": (lambda d: os.mkfifo(os.path.join(d, "extra")), "extra"),
    "rng/ a link to a directory": (_rng_dir_linked, "rng"),
    "shard a sparse terabyte": (lambda d: _sparse(os.path.join(d, "__0_0.distcp")), "__0_0.distcp"),
}


@pytest.mark.tally("faults")
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_fifo_link_or_huge_file_in_the_newest_checkpoint_is_refused_not_read(tmp_path, case):
    """Before, the manifest check read every file: a FIFO blocked the resume forever, a link to
    /dev/zero read forever. Now the checkpoint falls back to the previous one, naming the file."""
    import signal

    damage, name = REFUSED[case]
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep_last=None)
    model = random_decoder(seed=1)
    ckpt.save(1, {"model": model, "data": {"position": 1}})
    ckpt.save(2, {"model": model, "data": {"position": 2}})
    damage(ckpt.step_dir(2))

    def hung(*_):
        raise Hung  # not an OSError, which the hashing records as an unreadable file

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        data = {}
        fresh = Checkpointer(ckpt.directory)
        info = fresh.load({"model": random_decoder(seed=9), "data": data})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert info.step == 1 and data == {"position": 1}
    with pytest.raises(Exception, match="is damaged") as err:
        fresh.load({"model": random_decoder(seed=9), "data": {}}, step=2)
    assert os.path.join(ckpt.step_dir(2), name) in str(err.value), str(err.value)


class _RunsCode:
    """Unpickled, calls os.system: what a crafted objects.pt or RNG file holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rehash(step_dir):
    """The manifest recomputed over the files as they are now (what an attacker would do)."""
    import hashlib
    import json

    path = os.path.join(step_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    for name in manifest["files"]:
        with open(os.path.join(step_dir, name), "rb") as f:
            blob = f.read()
        manifest["files"][name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    with open(path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("target", ["objects.pt", "rng/rank_00000.pt"])
def test_a_crafted_pickle_in_a_checkpoint_runs_no_code_at_resume(tmp_path, target):
    """Before: torch.load(weights_only=False) ran the pickle's code at resume, the manifest
    recomputed to match."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep_last=None)
    ckpt.save(1, {"model": random_decoder(seed=1), "data": {"position": 1}})
    marker = tmp_path / "pwned"
    torch.save({"data": _RunsCode(marker), "python": _RunsCode(marker)},
               os.path.join(ckpt.step_dir(1), target))  # fmt: skip
    _rehash(ckpt.step_dir(1))
    data = {}
    try:
        Checkpointer(ckpt.directory).load({"model": random_decoder(seed=9), "data": data})
    except CheckpointError as exc:  # objects.pt: the load is refused, naming the file's error
        assert target == "objects.pt" and "UnpicklingError" in str(exc), str(exc)
    else:  # an RNG file: a warning, the run goes on without its RNG states
        assert target != "objects.pt" and data == {"position": 1}
    assert not marker.exists()


def _step(model, opt, seed):
    torch.manual_seed(seed)
    ids = torch.randint(0, 50, (1, 6))
    model(ids).float().pow(2).mean().backward()
    opt.step()


@pytest.mark.tally("faults")
def test_a_resume_right_after_an_optimizer_reset_is_exact(tmp_path):
    """ProRL v1's reset (algorithm.reset.reset_optimizer=true) leaves AdamW without state; saved
    then, the checkpoint held a placeholder state with step 1, so the resumed run's next update
    used step 2's bias correction where the uninterrupted one used step 1's."""
    model, opt = _trained(seed=3)
    opt.reset_state()
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, {"model": model, "optimizer": opt})
    resumed = random_decoder(seed=9)
    resumed_opt = Optimizer(resumed, OptimizerConfig(lr=1e-3))
    ckpt.load({"model": resumed, "optimizer": resumed_opt})
    _step(model, opt, seed=5)
    _step(resumed, resumed_opt, seed=5)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
