"""Typed configuration: one dataclass per component, YAML presets, dotted command-line overrides.

    cfg = load_config("prorl_v2_1.5b", ["trainer.total_steps=10", "rollout.n=8"])

Built on OmegaConf structured configs: a key that no dataclass declares, or a value of the wrong
type, is rejected with a message naming the key (and the key it was renamed to, or the nearest one).
The dataclass defaults are the ProRL v2 recipe's (docs/recipe.md; "recipe §N" in help texts is its
section N); presets in `prorl/configs/<name>.yaml` hold only what differs from them: `default` is
the embedded default (the tiny reasoner on the CPU), `prorl_v2_1.5b` the published recipe on GPUs;
`--config FILE` takes any YAML of the same shape. Each field's help text is its `metadata["help"]`
(`reference()` lists them: `python -m prorl.train --help`; docs/config.md is generated from it).

The allowed values of every choice come from the component that implements it (the kernels' modes,
the attention and rollout backends, the optimizer's schedules): one source per choice.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from prorl.async_rl.settings import AsyncConfig, rename_async_section, warn_async_name
from prorl.config_checks import (
    kernel_options,
    nonfinite_problems,
    range_problems,
    read_yaml,
    size_problems,
)
from prorl.engine import choices as engine
from prorl.prompt_schedule import MODES as SCHEDULER_MODES

KERNEL = kernel_options()  # the fused ops' option values (prorl.kernels.options)

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


class ConfigError(ValueError):
    """A bad config file, key or value; the message names it."""


def _f(default: Any = MISSING, help: str = "", choices: tuple | None = None, **kw):  # noqa: A002
    """A dataclass field with its help text (and allowed values) as metadata."""
    meta = {"help": help, "choices": choices}
    if callable(default) and not isinstance(default, (str, int, float, bool, type(None))):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class ModelConfig:
    path: str = _f(
        help="Hugging Face-format directory (config.json, *.safetensors, tokenizer); builtin:NAME; "
        "gguf:[FILE] (converted once into a cache; empty FILE: SmolLM2-135M-Instruct)"
    )
    dtype: str = _f(
        "float32",
        "compute dtype (bf16: over fp32 master weights under FSDP)",
        ("float32", "bfloat16"),
    )
    attention: str = _f("auto", "attention backend (auto: flash-attn for bf16 on CUDA, else SDPA)")
    fsdp: bool = _f(
        False, "shard policy and reference with FSDP2 (under torchrun; one rank is enough)"
    )
    activation_checkpointing: bool = _f(False, "recompute each block's activations in backward")
    compile: bool = _f(False, "torch.compile each decoder block")
    cpu_offload: bool = _f(
        False, "FSDP2 CPUOffloadPolicy (needs CUDA; the process group pairs NCCL with gloo)"
    )
    dp_replicate: int = _f(
        1,
        "HSDP: model copies, each FSDP2-sharded over "
        "world / dp_replicate ranks (the nodes; 1: one copy)",
    )
    fp8: str = _f(
        "none",
        "FP8 GEMMs in the decoder blocks of policy and "
        "reference (torchao: also on the CPU; te: Transformer "
        "Engine on H100/H200); needs model.fsdp=true; the sampler stays bf16 (engine/fp8.py)",
        engine.FP8_BACKENDS,
    )
    fp8_recipe: str = _f(
        "auto",
        "FP8 scaling: torchao tensorwise|rowwise; te "
        "delayed|current|mxfp8 (auto: tensorwise / current)",
        tuple(dict.fromkeys(r for rs in engine.FP8_RECIPES.values() for r in rs)),
    )
    fp8_emulate: bool | str = _f(
        "auto",
        "torchao: quantise as FP8 but multiply in high precision (auto: on the CPU only; false: "
        "the real torch._scaled_mm everywhere, slow on the CPU but what a GPU runs)",
        ("auto", True, False),
    )


@dataclass
class DataConfig:
    train_files: list[str] = _f(
        list, "verl-schema parquet / JSONL files, 'path' or 'path:weight'; empty: builtin"
    )
    val_files: list[str] = _f(
        list, "held-out files; empty: the builtin task's held-out split, or none"
    )
    builtin_task: str = _f(
        "digit_sums",
        "generated task used when train_files is empty (digit_sums, chain_sums, long_sums, "
        "boxed/<one of those>, reasoning_gym/<task>)",
    )
    train_size: int = _f(0, "builtin task size (0: the whole split or the generator's default)")
    val_size: int = _f(200, "builtin held-out size (0: the whole split)")
    prompt_key: str = _f("prompt", "the row field holding the prompt (chat messages or a string)")
    answer_key: str = _f(
        "",
        "a flat column holding the ground truth (e.g. answer; empty: reward_model.ground_truth, "
        "or a ground_truth column)",
    )
    default_source: str = _f(
        "",
        "the data_source (the verifier) of rows without one (e.g. math; empty: every row names "
        "its own)",
    )
    max_prompt_tokens: int = _f(
        1024, "prompts longer than this are dropped and counted, never truncated"
    )
    max_row_bytes: int = _f(
        16 * 2**20, "a data row larger than this is an error, found before it is read"
    )
    shuffle: bool = _f(True, "reshuffle the training prompts every epoch")


@dataclass
class RolloutConfig:
    backend: str = _f("auto", "sampler (auto: native on the CPU, vLLM on CUDA when installed)")
    compile: bool = _f(
        False, "native sampler: torch.compile its decode step (~25 s once, then faster)"
    )
    n: int = _f(16, "responses per prompt (a group)")
    temperature: float = _f(
        1.0, "sampling temperature; the trainer divides logits by it too (0: greedy)"
    )
    top_p: float = _f(1.0, "nucleus sampling")
    top_k: int = _f(-1, "top-k sampling (-1: off)")
    max_response_tokens: int = _f(8192, "response budget (recipe §1: 8192 in v2)")
    max_response_schedule: dict[int, int] = _f(
        dict,
        "step -> response budget (a context-length schedule), from that step on; on the command "
        "line rollout.max_response_schedule={100:16384,200:32768}",
    )
    gpu_memory_utilization: float | str = _f(
        "auto",
        "vLLM: fraction of GPU memory for its weights and KV cache (auto: what the colocated "
        "trainer leaves, or on an async rollout rank what is free beside its model copy, at most "
        "0.9; prorl/rollout_budget.py)",
    )
    tensor_parallel_size: int = _f(
        1, "vLLM tensor parallelism (one process only; not under torchrun)"
    )
    async_rl: AsyncConfig = _f(AsyncConfig)  # asynchronous RL (prorl/async_rl/)


@dataclass
class RewardConfig:
    plugins: list[str] = _f(
        list, "modules that call prorl.rewards.register(...) (imported by every worker)"
    )
    function: str = _f(
        "",
        "verl's compute_score for every data source: "
        "'path/to/file.py:name' (prorl/rewards/function.py)",
    )
    num_workers: int = _f(2, "verifier processes")
    timeout_s: float = _f(10.0, "per-item verifier timeout (a timed-out item scores 0)")
    worker_memory_gib: float = _f(4.0, "each verifier process's RLIMIT_DATA in GiB (0: none)")
    c_stop: float = _f(
        0.0, "reward multiplier of responses cut at the length limit (stop-properly)"
    )
    length_penalty: bool = _f(True, "the scheduled cosine length term (recipe §5)")
    length_k_on: int = _f(100, "steps with the length term on ...")
    length_k_off: int = _f(500, "... then off, repeating")
    length_lam: float = _f(0.5, "weight of the length term")
    length_eta_min: float = _f(-1.0, "cosine term at the response budget")
    length_eta_max: float = _f(0.0, "cosine term at length 0")
    wrong_eta_min: float | None = _f(None, "wrong answers' eta_min (None: as correct ones)")
    wrong_eta_max: float | None = _f(None, "wrong answers' eta_max (None: as correct ones)")
    overlong_buffer_len: int = _f(
        0, "DAPO's overlong buffer: linear penalty over the last N tokens (0: off)"
    )
    overlong_penalty: float = _f(1.0, "DAPO's overlong penalty at the budget")


@dataclass
class ResetConfig:
    interval: int = _f(300, "reset the reference every N completed steps (0: never on schedule)")
    kl_spike_factor: float = _f(
        5.0, "... or when a step's KL exceeds this x the median of the window"
    )
    kl_floor: float = _f(
        1e-6, "... and that KL is at least this (no resets on spikes of noise at ~0)"
    )
    window: int = _f(20, "steps in the KL median")
    patience: int = _f(0, "... or after this many validations without improvement (0: off)")
    reset_optimizer: bool = _f(False, "also reset AdamW's moments (ProRL v1); v2 keeps them")


@dataclass
class AlgorithmConfig:
    advantage: str = _f("reinforce++-baseline", "advantage estimator", KERNEL.ADVANTAGE_MODES)
    whiten_weighting: str = _f("token", "global whitening weights", KERNEL.WHITEN_WEIGHTINGS)
    grpo_std_unbiased: bool = _f(False, "GRPO: unbiased group std (verl, OpenRLHF)")
    eps_low: float = _f(0.2, "PPO clip below 1")
    eps_high: float = _f(0.28, "PPO clip above 1 (clip-higher)")
    dual_clip: float | None = _f(None, "dual-clip c > 1 for A < 0 (None: off; verl's default is 3)")
    kl_coef: float = _f(1e-4, "beta of the KL penalty in the loss")
    kl_estimator: str = _f("k2", "KL estimator", KERNEL.KL_ESTIMATORS)
    kl_clamp: str = _f(
        "log-ratio",
        "clamp the log-ratio (v2) or the estimator's output (OpenRLHF)",
        KERNEL.KL_CLAMPS,
    )
    entropy_coef: float = _f(0.0, "entropy bonus")
    agg: str = _f("token-mean", "loss aggregation over the global mini-batch", KERNEL.AGG_MODES)
    is_mode: str = _f(
        "none",
        "sampler-vs-trainer importance correction (tis: truncate, icepop: mask)",
        KERNEL.IS_MODES,
    )
    is_low: float = _f(0.5, "icepop lower bound")
    is_high: float = _f(5.0, "tis / icepop upper bound")
    dynamic_sampling: bool = _f(
        True, "drop groups whose raw rewards are all equal; refill (recipe §6)"
    )
    oversample: float = _f(1.5, "refill rounds sample this x the shortfall")
    max_rounds: int = _f(10, "sampling rounds per step at most")
    reset: ResetConfig = _f(ResetConfig, "reference-policy resets (recipe §7)")


@dataclass(frozen=True)
class OptimConfig(engine.OptimizerConfig):
    """engine.optim.OptimizerConfig itself (AdamW, schedule, clipping), with the recipe's defaults;
    `total_steps` (0/None) is the trainer's: total_steps x mini_batches optimizer steps."""

    lr: float = 2e-6
    min_lr_ratio: float = 0.1


@dataclass
class TrainerConfig:
    total_steps: int = _f(3000, "RL steps")
    total_epochs: int = _f(
        0,
        "> 0: total_steps = total_epochs x (training prompts // prompts_per_step), counted when "
        "the data is read (verl's trainer.total_epochs)",
    )
    prompts_per_step: int = _f(
        256, "prompts per step, all ranks together (a multiple of the world size)"
    )
    mini_batches: int = _f(4, "optimizer updates per RL step")
    micro_batch_tokens: int = _f(
        16384, "tokens per forward/backward (a longer sequence goes alone; <=0: no limit)"
    )
    recompute_old_logp: bool = _f(
        False, "first mini-batch: old_logp = logp.detach(); true recomputes it"
    )
    share_prompts: bool = _f(
        True, "each prompt through the model once per group (prorl/packing.py)"
    )
    save_every: int = _f(
        50, "checkpoint every N steps (0: none; the final HF export is always written)"
    )
    keep_last: int = _f(2, "complete checkpoints kept")
    val_every: int = _f(25, "validate every N steps (0: never during training)")
    val_before_train: bool = _f(True, "validate once before the first step")
    val_temperature: float = _f(0.0, "validation sampling temperature (0: greedy)")
    val_top_p: float = _f(
        0.95, "validation top-p, with val_temperature > 0 (the papers: T 0.6, top-p 0.95)"
    )
    val_samples: int = _f(1, "samples per validation prompt")
    val_save_samples: bool = _f(False, "append each validation sample to val_samples.jsonl")
    max_consecutive_skips: int = _f(
        5, "stop after this many skipped steps in a row (no group / non-finite grads)"
    )
    deterministic: bool = _f(
        False, "deterministic kernels and per-request seeds (bit-identical resume on CPU)"
    )
    collective_timeout_s: float = _f(0.0, "collective timeout (0: sized from this config)")
    wait_warning_s: float = _f(
        300.0, "a rank waiting this long in one collective says so (0: never)"
    )


@dataclass
class SchedulerConfig:
    mode: str = _f(
        "none", "prompt scheduling before generation (prorl/prompt_schedule.py)", SCHEDULER_MODES
    )
    prior_strength: float = _f(
        2.0, "pseudo-trials of a prompt's Beta prior, whose mean is the population's pass rate"
    )
    discount: float = _f(
        0.95, "evidence kept per step since a prompt's last update (the policy moves)"
    )
    reprobe_epochs: float = _f(
        2.0, "a prompt not probed for this many epochs is probed again first"
    )
    min_yield: float = _f(
        0.1,
        "a refill round runs only if its prompts' expected fraction of mixed groups reaches this",
    )
    solved_threshold: float = _f(
        1.0, "exclude-solved: a group's mean reward at which its prompt leaves"
    )


@dataclass
class LoggingConfig:
    tensorboard: bool = _f(True, "write TensorBoard events (needs the tensorboard package)")
    wandb_project: str | None = _f(None, "log to this W&B project (needs wandb)")
    log_every: int = _f(1, "a summary line every N steps")


@dataclass
class Config:
    output_dir: str = _f("", "run directory (empty: runs/<timestamp>); re-running on it resumes")
    seed: int = _f(1, "run seed")
    model: ModelConfig = _f(ModelConfig)
    data: DataConfig = _f(DataConfig)
    rollout: RolloutConfig = _f(RolloutConfig)
    reward: RewardConfig = _f(RewardConfig)
    algorithm: AlgorithmConfig = _f(AlgorithmConfig)
    optim: OptimConfig = _f(OptimConfig)
    trainer: TrainerConfig = _f(TrainerConfig)
    scheduler: SchedulerConfig = _f(SchedulerConfig)
    logging: LoggingConfig = _f(LoggingConfig)


def _engine_choices() -> dict[str, tuple]:
    return {
        "model.attention": ("auto", *engine.ATTENTION),
        "rollout.backend": ("auto", *engine.ROLLOUT),
        "optim.schedule": engine.SCHEDULES,
    }


# keys that moved: old dotted name -> new (an old key in a file or an override is named with its new
# one)
RENAMED = {
    "optim.grad_clip": "optim.max_grad_norm",
    "trainer.tensorboard": "logging.tensorboard",
    "trainer.wandb_project": "logging.wandb_project",
    "trainer.log_every": "logging.log_every",
    **{f"algorithm.reset_{k}": f"algorithm.reset.{k}" for k in ("interval", "window", "patience")},
    "algorithm.reset_kl_spike_factor": "algorithm.reset.kl_spike_factor",
    "algorithm.reset_optimizer": "algorithm.reset.reset_optimizer",
}


# help of the optimizer's keys (engine.optim.OptimizerConfig, whose fields carry none)
OPTIM_HELP = {
    "optim.lr": "AdamW learning rate (v1/v2: constant 2e-6)",
    "optim.betas": "AdamW betas",
    "optim.eps": "AdamW epsilon",
    "optim.weight_decay": "decoupled weight decay (matrices only, not biases or norms)",
    "optim.max_grad_norm": (
        "clip the global gradient norm to this (<= 0: no clipping; the norm is logged)"
    ),
    "optim.schedule": "learning-rate schedule after warmup",
    "optim.warmup_steps": "optimizer steps of linear warmup",
    "optim.total_steps": (
        "the cosine schedule's length (0/None: trainer.total_steps x mini_batches)"
    ),
    "optim.min_lr_ratio": "the cosine schedule's floor, as a fraction of lr",
    "optim.decay_1d": "weight decay on biases and norm weights too (verl's AdamW decays every "
    "parameter)",
}


def fields(cls=Config, prefix: str = ""):
    """(dotted key, dataclass field) of every leaf setting, in declaration order."""
    for f in dataclasses.fields(cls):
        if (
            dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None)
            or f.name in _SECTIONS
        ):
            yield from fields(_SECTIONS.get(f.name) or f.type, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig,
             "reward": RewardConfig, "algorithm": AlgorithmConfig, "reset": ResetConfig,
             "optim": OptimConfig, "trainer": TrainerConfig, "scheduler": SchedulerConfig,
             "logging": LoggingConfig, "async_rl": AsyncConfig}  # fmt: skip


def choices() -> dict[str, tuple]:
    out = {key: f.metadata.get("choices") for key, f in fields() if f.metadata.get("choices")}
    return out | _engine_choices()


def reference() -> str:
    """Every key with its default and help text (the configuration reference)."""
    defaults = to_dict(Config(model=ModelConfig(path="<required>")))
    lines, allowed = [], choices()
    for key, f in fields():
        value = defaults
        for part in key.split("."):
            value = value[part]
        text = (f.metadata.get("help") if f.metadata else None) or OPTIM_HELP.get(key, "")
        if key in allowed:
            text += f" [{' | '.join(map(str, allowed[key]))}]"
        lines.append(f"  {key} = {value!r}  {text}".rstrip())
    return "\n".join(lines)


def preset_path(name: str) -> str:
    path = name if name.endswith((".yaml", ".yml")) else os.path.join(PRESET_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml"))
        raise ConfigError(
            f"config {name!r} not found; presets: {', '.join(known)}, or a path to a YAML file"
        )
    return path


def _normalise_overrides(overrides: list[str]) -> list[str]:
    """key=value strings, with a bare value for a list-typed key taken as a one-element list
    (`data.train_files=/d/train.parquet`)."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    lists = {key for key, f in fields() if str(f.type).startswith("list")}
    dicts = {key for key, f in fields() if str(f.type).startswith("dict")}
    out = []
    for o in overrides:
        key, value = o.split("=", 1)
        if key in dicts and value.strip().startswith("{"):
            # {3:32} is YAML 1.1's sexagesimal 212 (a key without a value): {3: 32} is the mapping
            value = re.sub(r":(?=\S)", ": ", value)
        if key.startswith("rollout.async."):  # the old name (`async` is a Python keyword)
            key = key.replace("rollout.async.", "rollout.async_rl.", 1)
            warn_async_name(key)
        if RENAMED.get(key):
            raise ConfigError(f"config key {key!r} is now {RENAMED[key]!r}")
        if key in lists and value and not value.lstrip().startswith("["):
            value = f"[{value}]"
        out.append(f"{key}={value}")
    return out


def _listify(node, prefix: str = "") -> None:
    """A bare string where a list-typed key is expected in a YAML file becomes a one-element list,
    as on the command line (`data.train_files: /d/x.parquet`, as verl configs write it)."""
    lists = {key for key, f in fields() if str(f.type).startswith("list")}
    for key in list(node.keys()) if OmegaConf.is_dict(node) else []:
        value, dotted = node[key], f"{prefix}{key}"
        if OmegaConf.is_dict(value):
            _listify(value, f"{dotted}.")
        elif dotted in lists and isinstance(value, str):
            node[key] = [value] if value else []


def load_config(
    preset: str | None = "default", overrides: list[str] | None = None, values: dict | None = None
) -> Config:
    """Defaults <- preset or YAML file <- `values` ({dotted key: value}, e.g. translated from a verl
    config) <- dotted overrides ("a.b=c"); validated. Returns a typed Config."""
    cfg = OmegaConf.structured(Config)
    overrides = _normalise_overrides(list(overrides or []))
    try:
        if preset:
            loaded = read_yaml(preset_path(preset))
            rename_async_section(loaded)
            _listify(loaded)
            cfg = OmegaConf.merge(cfg, loaded)
        if values:
            nested: dict = {}
            for key, value in values.items():
                *parents, leaf = key.split(".")
                node = nested
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = value
            cfg = OmegaConf.merge(cfg, OmegaConf.create(nested))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        OmegaConf.resolve(cfg)
        obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    except ValueError as exc:  # the config file (prorl/config_checks.py)
        raise ConfigError(str(exc)) from None
    validate(obj)
    return obj


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        if key in RENAMED:
            return f"config key {key!r} is now {RENAMED[key]!r}"
        near = difflib.get_close_matches(str(key), [k for k, _ in fields()], n=1, cutoff=0.6)
        return (
            f"unknown config key {key!r}"
            + (f" (did you mean {near[0]!r}?)" if near else "")
            + f": {msg}"
        )
    if "missing mandatory value" in msg.lower():
        return f"{key} is required (set it in the config file or as {key}=...)"
    return f"bad config value for {key!r}: {msg}" if key else msg


def _get(cfg: Config, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> None:
    """Value checks that types alone cannot express: choices, ranges and sizes
    (prorl/config_checks.py), then the model's combinations."""
    for dotted, allowed in choices().items():
        value = _get(cfg, dotted)
        if value not in allowed:
            raise ConfigError(f"{dotted}={value!r} is not one of {', '.join(map(str, allowed))}")
    # a NaN passes every comparison below as false: named as not finite first
    problems = nonfinite_problems(cfg) or range_problems(cfg) + size_problems(cfg)
    if problems:
        raise ConfigError(problems[0])
    _check_model(cfg.model)


def _check_model(m: ModelConfig) -> None:
    """The model section's combinations: the FP8 recipe of the FP8 backend, what needs FSDP."""
    if m.fp8_recipe not in engine.FP8_RECIPES[m.fp8]:
        raise ConfigError(
            f"model.fp8_recipe={m.fp8_recipe!r} is not a recipe of model.fp8={m.fp8!r}: choose one "
            f"of {', '.join(engine.FP8_RECIPES[m.fp8])}"
        )
    if m.dp_replicate < 1 or (m.dp_replicate > 1 and not m.fsdp):
        raise ConfigError(
            f"model.dp_replicate={m.dp_replicate}: must be >= 1, and above 1 needs model.fsdp=true "
            "(HSDP: FSDP2 within each of dp_replicate groups of ranks, replicated across them)"
        )
    if m.fp8 != "none" and not m.fsdp:
        raise ConfigError(
            f"model.fp8={m.fp8} needs model.fsdp=true (under torchrun; one process is enough): FP8 "
            "layers train over fp32 master weights, and the sampler gets an unconverted bf16 copy"
        )


# -- output ----------------------------------------------------------------------------------------


def resolve_output_dir(cfg: Config) -> str:
    """`output_dir`, or runs/<timestamp> when it is empty."""
    if not cfg.output_dir:
        import datetime

        cfg.output_dir = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return cfg.output_dir


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def reference_markdown() -> str:
    """docs/config.md: every key, its default and its help (`python -m prorl.config >
    docs/config.md`)."""
    head = (
        "# Configuration reference\n\n"
        "Generated from the dataclasses in prorl/config.py by `python -m prorl.config > "
        "docs/config.md` (a test checks it is current). Set a key in a YAML file given with "
        "`--config FILE` or on the command line as `key=value`; the defaults below are the ProRL "
        "v2 recipe's (docs/recipe.md). "
        "Presets (prorl/configs/): `default` (the embedded default, for the no-argument run), "
        "`prorl_v2_1.5b`, `prolonged`, `smollm2_digit_sums` (SmolLM2-135M-Instruct on the CPU: "
        "docs/real-model.md).\n\n"
    )
    return head + "```\n" + reference() + "\n```\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
