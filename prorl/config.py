"""Typed configuration: one small dataclass per component, YAML presets, dotted command-line overrides.

    cfg = load_config("prorl_v2_1.5b", ["trainer.total_steps=10", "rollout.n=8"])

Built on OmegaConf structured configs: a key that no dataclass declares, or a value of the wrong type,
is rejected with a message naming the key (`ConfigError`). Presets live in `prorl/configs/<name>.yaml`
and hold only what differs from the dataclass defaults; `--config FILE` takes any YAML of the same shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


class ConfigError(ValueError):
    """A bad config file, key or value; the message names it."""


@dataclass
class ModelConfig:
    path: str = MISSING  # Hugging Face-format directory (config.json + *.safetensors + tokenizer)
    dtype: str = "float32"  # float32 | bfloat16
    attention: str = "auto"  # auto | sdpa | flex | flash
    fsdp: bool = False  # shard policy and reference with FSDP2 (under torchrun); replicate when False
    activation_checkpointing: bool = False
    compile: bool = False
    # FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state in host memory (on CUDA
    # the process group then pairs NCCL with gloo for the CPU tensors)
    cpu_offload: bool = False


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # verl parquet / JSONL; empty: built-in task
    val_files: list[str] = field(default_factory=list)
    builtin_task: str = "digit_sums"  # used when train_files is empty
    train_size: int = 0  # built-in task size; 0: the whole split (digit_sums) or the generator default
    val_size: int = 200  # 0: the whole split
    prompt_key: str = "prompt"
    max_prompt_tokens: int = 1024
    shuffle: bool = True


@dataclass
class RolloutConfig:
    # native | vllm | auto (engine.rollout.resolve_backend: native on CPU, where it measured fastest;
    # vllm on CUDA when installed)
    backend: str = "auto"
    # native sampler: torch.compile its decode step (dynamic shapes; ~25 s once per process on a 2-core
    # CPU, then ~1.3-2x faster decoding of small models: benchmarks/rollout.py)
    compile: bool = False
    n: int = 16  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_tokens: int = 8192
    # step -> max response tokens (context-length schedule); empty: constant
    max_response_schedule: dict[int, int] = field(default_factory=dict)
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1


@dataclass
class RewardConfig:
    # modules imported at start (and by every reward worker) that call prorl.rewards.register(...):
    # how users add verifiers without editing the package
    plugins: list[str] = field(default_factory=list)
    num_workers: int = 2
    timeout_s: float = 10.0
    c_stop: float = 0.0  # reward multiplier of responses cut at the length limit
    # cosine length penalty (RECIPE §5): on for k_on steps, off for k_off, repeating
    length_penalty: bool = True
    length_k_on: int = 100
    length_k_off: int = 500
    length_lam: float = 0.5
    length_eta_min: float = -1.0
    length_eta_max: float = 0.0
    wrong_eta_min: float | None = None
    wrong_eta_max: float | None = None


@dataclass
class AlgorithmConfig:
    advantage: str = "reinforce++-baseline"  # reinforce++-baseline | grpo | dr-grpo
    whiten_weighting: str = "token"  # token | sequence
    grpo_std_unbiased: bool = False
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 1e-4
    kl_estimator: str = "k2"  # k1 | k2 | k3
    kl_clamp: str = "log-ratio"  # log-ratio | output
    entropy_coef: float = 0.0
    agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | constant
    is_mode: str = "none"  # none | tis | icepop (sampler vs trainer log-prob correction)
    is_low: float = 0.5
    is_high: float = 5.0
    # dynamic sampling (RECIPE §6)
    dynamic_sampling: bool = True
    oversample: float = 1.5
    max_rounds: int = 10
    # reference reset (RECIPE §7)
    reset_interval: int = 300
    reset_kl_spike_factor: float = 5.0
    reset_window: int = 20
    reset_patience: int = 0
    reset_optimizer: bool = False


@dataclass
class OptimConfig:
    lr: float = 2e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.1


@dataclass
class TrainerConfig:
    total_steps: int = 3000
    prompts_per_step: int = 256
    mini_batches: int = 4  # optimizer updates per RL step
    micro_batch_tokens: int = (
        16384  # tokens per forward/backward (a longer sequence goes alone); <=0: no limit
    )
    # with mini_batches=1 old_logp = logp.detach() exactly and its no-grad pass is skipped; true forces it
    recompute_old_logp: bool = False
    # each prompt through the model once per group, its n responses attending to it (prorl/packing.py)
    share_prompts: bool = True
    save_every: int = 50  # 0: no checkpoints (the final HF export is always written)
    keep_last: int = 2
    val_every: int = 25
    val_temperature: float = 0.0  # 0: greedy
    val_top_p: float = 0.95  # with val_temperature > 0 (the papers' evaluation: T 0.6, top-p 0.95)
    val_samples: int = 1
    log_every: int = 1
    max_consecutive_skips: int = 5
    deterministic: bool = False
    # collective timeout of the process group; 0: sized from this config (`collective_timeout_s`)
    collective_timeout_s: float = 0.0
    # a rank that has waited this long in one collective says so, naming it (0: never)
    wait_warning_s: float = 300.0
    tensorboard: bool = True
    wandb_project: str | None = None


@dataclass
class Config:
    output_dir: str = ""  # empty: runs/<timestamp>, chosen at start (see resolve_output_dir)
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


_CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.attention": ("auto", "sdpa", "flex", "flash"),
    "rollout.backend": ("auto", "native", "vllm"),
    "algorithm.advantage": ("reinforce++-baseline", "grpo", "dr-grpo"),
    "algorithm.whiten_weighting": ("token", "sequence"),
    "algorithm.kl_estimator": ("k1", "k2", "k3"),
    "algorithm.kl_clamp": ("log-ratio", "output"),
    "algorithm.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"),
    "algorithm.is_mode": ("none", "tis", "icepop"),
    "optim.schedule": ("constant", "cosine"),
}


def preset_path(name: str) -> str:
    path = name if name.endswith((".yaml", ".yml")) else os.path.join(PRESET_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml"))
        raise ConfigError(f"config {name!r} not found; presets: {', '.join(known)}, or a path to a YAML file")
    return path


def load_config(preset: str | None = "default", overrides: list[str] | None = None) -> Config:
    """Defaults <- preset or YAML file <- dotted overrides ("a.b=c"); validated. Returns a typed Config."""
    cfg = OmegaConf.structured(Config)
    try:
        if preset:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(preset_path(preset)))
        bad = [o for o in overrides or [] if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides or [])))
        OmegaConf.resolve(cfg)
        obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    validate(obj)
    return obj


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        return f"unknown config key {key!r}: {msg}"
    if "missing mandatory value" in msg.lower():
        return f"{key} is required (set it in the config file or as {key}=...)"
    return f"bad config value for {key!r}: {msg}" if key else msg


def validate(cfg: Config) -> None:
    """Value checks that types alone cannot express."""
    for dotted, allowed in _CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{dotted}={value!r} is not one of {', '.join(allowed)}")
    checks = [
        (cfg.rollout.n >= 1, "rollout.n must be >= 1"),
        (cfg.rollout.temperature >= 0, "rollout.temperature must be >= 0"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (cfg.rollout.max_response_tokens >= 1, "rollout.max_response_tokens must be >= 1"),
        (cfg.algorithm.eps_low >= 0 and cfg.algorithm.eps_high >= 0, "algorithm.eps_low/high must be >= 0"),
        (cfg.algorithm.dual_clip is None or cfg.algorithm.dual_clip > 1, "algorithm.dual_clip must be > 1"),
        (cfg.algorithm.kl_coef >= 0, "algorithm.kl_coef must be >= 0"),
        (cfg.algorithm.max_rounds >= 1, "algorithm.max_rounds must be >= 1"),
        (cfg.algorithm.oversample >= 1, "algorithm.oversample must be >= 1"),
        (cfg.optim.lr > 0, "optim.lr must be > 0"),
        (len(cfg.optim.betas) == 2, "optim.betas must have two values"),
        (cfg.trainer.total_steps >= 0, "trainer.total_steps must be >= 0"),
        (cfg.trainer.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1"),
        (cfg.trainer.mini_batches >= 1, "trainer.mini_batches must be >= 1"),
        (
            cfg.trainer.prompts_per_step % cfg.trainer.mini_batches == 0,
            "trainer.prompts_per_step must be a multiple of trainer.mini_batches",
        ),
        (cfg.reward.timeout_s > 0, "reward.timeout_s must be > 0"),
        (cfg.seed >= 0, "seed must be >= 0"),
        (
            cfg.trainer.collective_timeout_s >= 0,
            "trainer.collective_timeout_s must be >= 0 (0: from the config)",
        ),
        (cfg.trainer.wait_warning_s >= 0, "trainer.wait_warning_s must be >= 0 (0: never warn)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def collective_timeout_s(cfg: Config, world: int | None = None) -> float:
    """The process group's collective timeout: `trainer.collective_timeout_s`, or when that is 0 one sized
    from the config. The longest legitimate wait in one collective is a sampling round of another rank:
    generating up to the longest response budget, then verifying the round's samples, at worst every one
    at `reward.timeout_s` (sampling rounds are collective: trainer.collect). Hence 600 s (engine start,
    checkpoint writes) + 0.1 s per response token + ceil(round samples / reward workers) x reward.timeout_s,
    with a round of ceil(prompts per rank x oversample) prompts x rollout.n samples."""
    if cfg.trainer.collective_timeout_s > 0:
        return cfg.trainer.collective_timeout_s
    import math

    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    r = cfg.rollout
    max_new = max([r.max_response_tokens, *r.max_response_schedule.values()])
    prompts = math.ceil(max(cfg.trainer.prompts_per_step // world, 1) * cfg.algorithm.oversample)
    verify = math.ceil(prompts * r.n / max(cfg.reward.num_workers, 1)) * cfg.reward.timeout_s
    return 600.0 + 0.1 * max_new + verify


def check_world(cfg: Config, world: int) -> None:
    """Checks that need the number of ranks: each rank trains prompts_per_step / world prompts."""
    pps = cfg.trainer.prompts_per_step
    if pps % world:
        raise ConfigError(
            f"trainer.prompts_per_step={pps} is not a multiple of the {world} ranks: each rank takes "
            f"prompts_per_step / world prompts (use {pps - pps % world or world} or "
            f"{pps + world - pps % world})"
        )


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
