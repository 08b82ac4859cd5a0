"""Entry point of the ProRL v2 trainer.

    torchrun --standalone --nproc_per_node=2 prorl/train.py                      # the embedded default
    torchrun --nproc_per_node=8 prorl/train.py --config prorl_v2_1.5b model.path=/models/x \\
        data.train_files=[/data/train.parquet] data.val_files=[/data/val.parquet]

With no arguments it runs the embedded default on the CPU: the shipped tiny reasoner
(prorl/assets/tiny-reasoner, made by `python -m prorl.warmstart`) trained with the full recipe on the
built-in digit-sum task, held-out accuracy printed before and after, metrics, a checkpoint and a PNG of
the training curves written to the run directory.

Lifecycle (issue 8):
- Re-running the same command on the same `output_dir` resumes from its latest complete checkpoint;
  `metrics.jsonl` is cut back to that step, so the resumed run's rows follow on as if never stopped.
  With `trainer.deterministic=true` on the CPU the result is bit-identical to an uninterrupted run
  (tests/prorl/test_resume.py kills runs with SIGKILL mid-step and mid-save to check it).
- SIGTERM or Ctrl-C: the current step is finished, a checkpoint saved (if `trainer.save_every` > 0), and
  the process exits 0. All ranks agree on the step to stop after. Under torchrun the agent forwards the
  signal and kills workers that are still alive after `--shutdown-timeout` (default 30 s) - raise it
  when a step plus a save takes longer. A second signal, 2 s or more after the first, aborts at once.
- A dead rank: collectives have a timeout (engine.parallel.init_distributed), so the others fail with
  an error instead of hanging; the last complete checkpoint is untouched.
- An unwritable output directory, or too little disk for one checkpoint: a clear error and exit code 5
  before the first step.

Exit codes: 0 done (or stopped cleanly by a signal), 2 config error, 3 reward self-test failed,
4 checkpoint cannot be resumed, 5 output directory unusable, 7 another rank stopped answering (a collective
timed out or lost its peer: a rank died, was frozen or hangs), 6 training stalled (steps without a group to
train on, or non-finite gradients, `trainer.max_consecutive_skips` times in a row; the last complete
checkpoint is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import random
import signal
import sys
import time

# `torchrun prorl/train.py` puts prorl/ itself first on sys.path; drop it so that files in this folder
# never shadow top-level modules. The package is imported through the installation (README).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


class Fatal(Exception):
    """Stop before (or instead of) training with a message and an exit code; raised on every rank."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def resolve_model_path(path: str) -> str:
    if path.startswith("builtin:"):
        path = os.path.join(ASSETS, path.split(":", 1)[1])
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"prorl: model.path={path!r} is not a Hugging Face model directory (no config.json)")
    return path


def load_examples(cfg, split: str):
    from prorl import data

    files = cfg.data.train_files if split == "train" else cfg.data.val_files
    if files:  # "path" or "path:weight" (weighted mixing, see prorl.data)
        return data.load_mixture(list(files), seed=cfg.seed)
    size = (cfg.data.train_size if split == "train" else cfg.data.val_size) or None
    return data.builtin(cfg.data.builtin_task, n=size, seed=cfg.seed, split=split)


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python, numpy and torch; with `deterministic`, also forbid nondeterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def on_every_rank(code: int, fn, *args):
    """fn(*args) on every rank; if it fails with an OSError or CheckpointError anywhere, every rank raises
    Fatal (the failing rank with its own message) instead of the others waiting in the next collective."""
    from prorl.engine import parallel
    from prorl.engine.checkpoint import CheckpointError

    error, result = None, None
    try:
        result = fn(*args)
    except (OSError, CheckpointError) as exc:
        error = str(exc)
    if parallel.all_reduce_max(1.0 if error else 0.0) > 0:
        raise Fatal(code, error or "")  # ranks that did not fail exit quietly
    return result


class StopRequest:
    """SIGTERM / SIGINT set a flag; the training loop asks `requested()` after each step (collective, so
    that every rank stops after the same step). A second signal 2 s or more after the first raises
    KeyboardInterrupt (one request can arrive twice: a scheduler such as Slurm signals every process of
    the job, and torchrun forwards the signal to its workers as well).

    Under torchrun a worker whose agent has died (`kill -9` of torchrun: the workers run in sessions of
    their own and would train on, unseen) stops the same way once it notices its new parent."""

    def __init__(self):
        self.reason: str | None = None
        self.first_at = 0.0
        self.parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.reason is None:
            self.reason, self.first_at = signal.Signals(signum).name, time.monotonic()
        elif time.monotonic() - self.first_at >= 2.0:
            raise KeyboardInterrupt

    def requested(self) -> bool:
        from prorl.engine import parallel

        if self.reason is None and self.parent is not None and os.getppid() != self.parent:
            self.reason = "the loss of torchrun (its agent process died)"
        return parallel.all_reduce_max(1.0 if self.reason is not None else 0.0) > 0

    @property
    def name(self) -> str:
        return self.reason or "a stop request on another rank"


def lock_output_dir(path: str):
    """An exclusive lock on `path` held for this process's lifetime (released by the kernel however it
    ends): a second run on the same directory, or workers left over from a killed torchrun, would
    interleave checkpoints and metrics with this one. Returns the open lock file; raises OSError."""
    import fcntl
    import socket

    f = open(os.path.join(path, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "an unknown process"
        f.close()
        msg = f"{path} is in use by another run ({owner}): stop it, or use another output_dir"
        raise OSError(msg) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


# Settings that fix what a resumed run trains on and how its batch is built: changing them between a
# checkpoint and its resume would silently make a different run, so resuming refuses. Anything else (log
# and eval intervals, total steps, learning rate, timeouts, worker counts) is allowed and reported.
INCOMPATIBLE_ON_RESUME = (
    "seed",
    "model.path",
    "model.dtype",
    "data.",
    "rollout.n",
    "trainer.prompts_per_step",
    "trainer.mini_batches",
)


def peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that timed out or lost a peer (gloo and NCCL word it so)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        s in text for s in ("timed out", "timeout", "connection closed by peer", "connection reset by peer")
    )


def config_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted keys whose values differ between two config dicts -> (old, new)."""
    out: dict[str, tuple] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, f"{prefix}{key}."))
        elif a != b and f"{prefix}{key}" != "output_dir":
            out[f"{prefix}{key}"] = (a, b)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ProRL v2 trainer", allow_abbrev=False)
    ap.add_argument("--config", default="default", help="preset name in prorl/configs or a YAML path")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=10")
    args = ap.parse_args(argv)

    from prorl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"prorl: config error: {exc}", file=sys.stderr)
        return 2

    from prorl.config import check_world, collective_timeout_s
    from prorl.engine import parallel
    from prorl.engine.watchdog import Watchdog

    # gloo on the CPU, NCCL on GPUs; collectives time out, so a dead or stuck rank ends the job, and a rank
    # that waits long in one says which (engine/watchdog.py)
    backend = parallel.process_group_backend(torch.cuda.is_available(), cfg.model.cpu_offload)
    info = parallel.init_distributed(timeout_s=collective_timeout_s(cfg), backend=backend)
    parallel.set_watchdog(Watchdog(cfg.trainer.wait_warning_s, info.rank))
    try:
        check_world(cfg, info.world_size)
    except ConfigError as exc:
        print(f"prorl: config error: {exc}", file=sys.stderr)
        parallel.destroy_distributed()
        return 2
    try:
        return run(cfg, info.rank)
    except Fatal as exc:
        if str(exc):
            print(f"prorl: {exc}", file=sys.stderr)
        return exc.code
    except RuntimeError as exc:  # a collective timed out, or a peer's connection broke: say so plainly
        if not peer_failure(exc):
            raise
        first = str(exc).strip().splitlines()[0][:300]
        print(
            f"prorl: rank {info.rank}: the other ranks stopped answering ({first}). A rank died, was "
            f"stopped or hangs; collectives time out after {collective_timeout_s(cfg):.0f} s "
            "(trainer.collective_timeout_s). The last complete checkpoint is kept: re-run the same command "
            "to resume.",
            file=sys.stderr,
        )
        return 7
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(cfg, rank: int) -> int:
    from prorl.config import resolve_output_dir, to_dict, to_yaml
    from prorl.engine.checkpoint import Checkpointer, CheckpointError, config_hash

    seed_everything(cfg.seed + rank, cfg.trainer.deterministic)
    if rank == 0:
        resolve_output_dir(cfg)
    if dist.is_initialized():  # every rank writes to rank 0's directory
        box = [cfg.output_dir]
        dist.broadcast_object_list(box, src=0)
        cfg.output_dir = box[0]
    # an unwritable or busy output directory fails here, before the model is even loaded
    ckpt = on_every_rank(5, Checkpointer, os.path.join(cfg.output_dir, "checkpoints"), cfg.trainer.keep_last)
    # held until this process ends
    _lock = on_every_rank(5, lambda: lock_output_dir(cfg.output_dir) if rank == 0 else None)
    from transformers import PreTrainedTokenizerFast

    from prorl.report import Reporter
    from prorl.rewards import builtin_keys
    from prorl.rewards.pool import RewardPool
    from prorl.rewards.selftest import self_test
    from prorl.trainer import Trainer, TrainingStalled

    for module in cfg.reward.plugins:  # user verifiers: each module calls prorl.rewards.register(...)
        importlib.import_module(module)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    train, val = load_examples(cfg, "train"), load_examples(cfg, "val")
    sources = tuple(sorted({e.data_source for e in train + val}))
    reporter = Reporter(cfg, rank)
    if rank == 0:
        print(to_yaml(cfg), flush=True)
        reporter.save_config(to_yaml(cfg))
    # Reward workers start with SIGINT / SIGTERM ignored (inherited through exec): a Ctrl-C in the terminal
    # (without torchrun) or a scheduler's signal reaches them too, and the step being finished still
    # needs its verifiers; the pool kills them itself. Then this process takes the signals as a stop request.
    stop = StopRequest()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        pool = RewardPool(
            num_workers=cfg.reward.num_workers,
            timeout_s=cfg.reward.timeout_s,
            preload=builtin_keys(sources),
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stop.install()
    with pool, contextlib.ExitStack() as stack:
        try:  # a verifier that silently scores everything 0 would waste the whole run
            status = self_test(sources, pool)
        except RuntimeError as exc:
            print(f"prorl: {exc}", file=sys.stderr)
            return 3
        reporter.say("prorl: reward self-test: " + ", ".join(f"{k} {v}" for k, v in status.items()))
        trainer = Trainer(cfg, model_path, tokenizer, train, val, pool)
        stack.callback(trainer.close)  # the sampler's engine goes before the process group
        # resume from the latest complete checkpoint of this output_dir, if any (RECIPE §7, issue 8)
        chash = config_hash(to_yaml(cfg))  # changed settings are reported on resume
        holder: dict = {}
        state = {
            "model": trainer.policy,
            "reference": trainer.reference,
            "optimizer": trainer.optimizer,
            "trainer": holder,
        }
        if cfg.trainer.save_every:  # disk space for one save, before spending time on training
            on_every_rank(5, ckpt.preflight, state)
        try:
            resumed = ckpt.load(state, config_hash=chash)
        except CheckpointError as exc:
            print(f"prorl: cannot resume: {exc}", file=sys.stderr)
            return 4
        t_start = time.time()
        if resumed is not None:
            saved_cfg = (resumed.meta.get("extra") or {}).get("config")
            changed = config_changes(saved_cfg, to_dict(cfg)) if saved_cfg else {}
            bad = sorted(k for k in changed if k.startswith(INCOMPATIBLE_ON_RESUME))
            if bad:
                if rank != 0:
                    return 4
                print(
                    f"prorl: cannot resume {resumed.path}: settings that fix the run's data and batch "
                    "changed: "
                    + "; ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in bad)
                    + " (use a new output_dir, or restore them)",
                    file=sys.stderr,
                )
                return 4
            if changed:
                reporter.say(
                    "prorl: resuming with changed settings: "
                    + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
                )
            trainer.restore(holder)
            reporter.resume(trainer.step_count)
            reporter.say(
                f"prorl: resumed from {resumed.path} (step {trainer.step_count})"
                + (" - the config changed since that save" if resumed.config_changed else "")
            )
        else:
            dropped = reporter.start()
            if dropped:
                reporter.say(f"prorl: dropped {dropped} metrics rows of an attempt that saved nothing")
            t0 = time.perf_counter()
            val0 = trainer.validate()
            reporter.validation(0, val0, time.perf_counter() - t0)
            mode = "greedy" if cfg.trainer.val_temperature == 0 else f"T={cfg.trainer.val_temperature}"
            acc0 = val0["val/accuracy"]
            reporter.say(f"prorl: held-out accuracy before RL: {acc0:.1%} ({len(val)} problems, {mode})")

        def save(step: int) -> None:
            state["trainer"] = trainer.checkpoint_state()
            ckpt.save(step, state, config_hash=chash, extra={"config": to_dict(cfg)})

        saved_at, stopped = trainer.step_count, False
        total, every = cfg.trainer.total_steps, cfg.trainer.save_every
        while trainer.step_count < total:
            if stop.requested():
                stopped = True
                break
            try:
                metrics = trainer.step()
            except TrainingStalled as exc:
                reporter.say(f"prorl: stopped at step {trainer.step_count}: {exc}")
                reporter.close()
                return 6
            step = trainer.step_count
            if cfg.trainer.val_every and (step % cfg.trainer.val_every == 0 or step == total):
                t0 = time.perf_counter()
                metrics.update(trainer.validate())
                metrics["timing_s/val"] = time.perf_counter() - t0
            reporter.log(metrics)  # before the save: a checkpoint's step always has its metrics row
            if every and (step % every == 0 or step == total):
                save(step)
                saved_at = step
        if every and saved_at != trainer.step_count:
            save(trainer.step_count)
            saved_at = trainer.step_count
        if stopped:
            if not every:
                where = "not saved (trainer.save_every=0)"
            else:
                where = f"checkpoint {ckpt.step_dir(saved_at)}" if saved_at else "nothing to save yet"
            reporter.say(
                f"prorl: stopped by {stop.name} after step {trainer.step_count} of {total}; {where}; "
                "re-run the same command to resume"
            )
            reporter.close()
            return 0
        reporter.say(f"prorl: trained to step {trainer.step_count} in {time.time() - t_start:.0f} s")
        out = reporter.finish(trainer)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0 and out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
