"""What a config file and the command line may hold, checked before OmegaConf sees them.

- A YAML file (`--config FILE` or a preset) must be a mapping of sections: a list, an empty file
  (once taken silently as "no config": a truncated or wrong file would run the defaults), YAML that
  does not parse, a key given twice in one mapping and bytes that are not UTF-8 are errors naming
  the file and the line. A UTF-8 byte-order mark and CRLF line ends are accepted.
- A dotted key given twice on the command line with different values: the last wins, with a warning
  (prorl/train.py, rank 0) naming the key and both values. Not an error: appending an override to a
  base command is how this project's own CI and tests shorten a run, and how wrapper scripts pass
  "$@"; not silent either, since a mistyped repeat would otherwise go unseen. The same value twice
  says nothing.
- Sizes and counts that must be positive (`size_problems`): a zero or negative one is named, instead
  of surfacing as an empty validation set, a loop that never ends or an error deep in a component.
- Values that must lie in a range (`range_problems`): probabilities, clip ranges, coefficients.
- Every number anywhere in the config, lists and mappings included, must be finite
  (`nonfinite_problems`): a NaN weight decay, learning-rate floor or length weight once trained to
  the end on NaN weights and exited 0.

Each function raises ValueError or returns problems as text; prorl/config.py turns them into
ConfigError. `kernel_options` gives the fused ops' option values without loading torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf


def read_yaml(path: str) -> DictConfig:
    """The mapping in YAML file `path`; ValueError naming the file (and line) when it is not one."""
    import yaml

    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {path}: not UTF-8 text (byte {exc.start})") from None
    try:
        # OmegaConf's loader refuses duplicate keys
        cfg = OmegaConf.create(text) if text.strip() else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"config file {path}: not valid YAML{where}: {problem}") from None
    if cfg is None or (isinstance(cfg, DictConfig) and not cfg and not _has_mapping(text)):
        raise ValueError(
            f"config file {path} is empty: give its sections (model:, data:, ...) or leave it out"
        )
    if not isinstance(cfg, DictConfig):
        raise ValueError(
            f"config file {path} must be a mapping of sections (model:, data:, trainer:, ...), got "
            f"a {type(OmegaConf.to_container(cfg)).__name__}"
        )
    return cfg


def _has_mapping(text: str) -> bool:
    """An explicit empty mapping (`{}`): meant, not an empty file."""
    return any(line.split("#", 1)[0].strip() == "{}" for line in text.splitlines())


def repeated_overrides(overrides: list[str]) -> str | None:
    """The message for keys given twice, with different values, in `key=value` overrides, or
    None."""
    seen: dict[str, list[str]] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        seen.setdefault(key.strip(), []).append(value)
    # the same value again says nothing new
    twice = {k: v for k, v in seen.items() if len(set(v)) > 1}
    if not twice:
        return None
    shown = "; ".join(
        f"{k} = {' then '.join(map(repr, v))} ({v[-1]!r} is used)" for k, v in twice.items()
    )
    return f"config keys given more than once on the command line, the last wins: {shown}"


# (dotted key, smallest allowed value): sizes and counts no other check covers
POSITIVE = (
    ("data.train_size", 0),
    ("data.val_size", 0),
    ("data.max_prompt_tokens", 1),
    ("data.max_row_bytes", 1),
    ("trainer.max_consecutive_skips", 1),
    ("logging.log_every", 1),
    ("reward.length_k_on", 0),
    ("reward.length_k_off", 0),
    ("reward.overlong_buffer_len", 0),
    ("algorithm.reset.interval", 0),
    ("algorithm.reset.window", 1),
    ("algorithm.reset.patience", 0),
    ("rollout.tensor_parallel_size", 1),
)


def size_problems(cfg: Any) -> list[str]:
    """One line per size or count of `cfg` below its smallest allowed value (POSITIVE)."""
    problems = []
    for dotted, low in POSITIVE:
        value = cfg
        for part in dotted.split("."):
            value = getattr(value, part, None)
        if isinstance(value, (int, float)) and value < low:
            problems.append(f"{dotted}={value} must be >= {low}")
    top_k = getattr(getattr(cfg, "rollout", None), "top_k", -1)
    if top_k == 0 or top_k < -1:
        problems.append(f"rollout.top_k={top_k} must be -1 (off) or >= 1")
    return problems


def nonfinite_problems(node: Any, prefix: str = "") -> list[str]:
    """One line per NaN or infinite number in `node` (a config dataclass, walked through its nested
    sections, lists and mappings), naming its dotted key."""
    if isinstance(node, float):
        return [] if math.isfinite(node) else [f"{prefix}={node} must be a finite number"]
    if dataclasses.is_dataclass(node):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, (list, tuple)):
        items = list(enumerate(node))
    else:
        return []
    out = []
    for key, value in items:
        if isinstance(node, (list, tuple)):
            name = f"{prefix}[{key}]"
        else:
            name = f"{prefix}.{key}" if prefix else str(key)
        out += nonfinite_problems(value, name)
    return out


def _optim_problems(cfg: Any) -> list[tuple[bool, str]]:
    """AdamW and its schedule: ranges torch checks only later, without the key (or not at all)."""
    o = cfg.optim
    return [
        (o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0"),
        (0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]"),
        (all(0 <= b < 1 for b in o.betas), f"optim.betas={list(o.betas)} must be in [0, 1)"),
        (o.eps > 0, f"optim.eps={o.eps} must be > 0"),
        (o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0"),
    ]


# the longest verifier timeout: a larger one overflows the wall-clock arithmetic of the workers
MAX_TIMEOUT_S = 7 * 86400.0


def _sampling_and_reward_problems(cfg: Any) -> list[tuple[bool, str]]:
    """Validation sampling, the response-budget schedule, the reward's shaping and timeout."""
    t, r, sched = cfg.trainer, cfg.reward, cfg.rollout.max_response_schedule
    return [
        (t.val_temperature >= 0, f"trainer.val_temperature={t.val_temperature} must be >= 0"),
        (0 < t.val_top_p <= 1, f"trainer.val_top_p={t.val_top_p} must be in (0, 1]"),
        (all(k >= 0 and v >= 1 for k, v in sched.items()),
         f"rollout.max_response_schedule={dict(sched)}: steps must be >= 0 and budgets >= 1"),
        (r.timeout_s <= MAX_TIMEOUT_S, f"reward.timeout_s={r.timeout_s} must be <= "
         f"{MAX_TIMEOUT_S:.0f} (a week)"),
        (r.length_lam >= 0, f"reward.length_lam={r.length_lam} must be >= 0"),
        (r.overlong_penalty >= 0, f"reward.overlong_penalty={r.overlong_penalty} must be >= 0"),
        (cfg.algorithm.reset.kl_spike_factor >= 0,
         "algorithm.reset.kl_spike_factor must be >= 0 (0: no spike resets)"),
        (cfg.scheduler.reprobe_epochs > 0, "scheduler.reprobe_epochs must be > 0"),
    ]  # fmt: skip


def range_problems(cfg: Any) -> list[str]:
    """The values of `cfg` (a prorl Config) outside their range, one message each, in order."""
    algo, trainer, rollout, sched = cfg.algorithm, cfg.trainer, cfg.rollout, cfg.scheduler
    gpu = rollout.gpu_memory_utilization
    checks = [
        (rollout.n >= 1, "rollout.n must be >= 1"),
        (rollout.n >= 2 or not algo.dynamic_sampling, "rollout.n=1 leaves every group all-equal: "
         "dynamic sampling would drop them all (set rollout.n >= 2, or "
         "algorithm.dynamic_sampling=false)"),
        (rollout.temperature >= 0, "rollout.temperature must be >= 0"),
        (0 < rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (rollout.max_response_tokens >= 1, "rollout.max_response_tokens must be >= 1"),
        (gpu == "auto" or isinstance(gpu, float) and 0 < gpu <= 1,
         "rollout.gpu_memory_utilization must be auto or in (0, 1]"),
        (algo.eps_low >= 0 and algo.eps_high >= 0, "algorithm.eps_low/high must be >= 0"),
        (algo.dual_clip is None or algo.dual_clip > 1, "algorithm.dual_clip must be > 1"),
        (algo.kl_coef >= 0, "algorithm.kl_coef must be >= 0"),
        (algo.max_rounds >= 1, "algorithm.max_rounds must be >= 1"),
        (algo.oversample >= 1, "algorithm.oversample must be >= 1"),
        (0 <= algo.is_low <= algo.is_high, "algorithm.is_low must be in [0, is_high]"),
        (cfg.optim.lr > 0, "optim.lr must be > 0"),
        (len(cfg.optim.betas) == 2, "optim.betas must have two values"),
        (trainer.total_steps >= 0, "trainer.total_steps must be >= 0"),
        (trainer.total_epochs >= 0, "trainer.total_epochs must be >= 0"),
        (trainer.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1"),
        (trainer.mini_batches >= 1, "trainer.mini_batches must be >= 1"),
        (trainer.mini_batches < 1 or trainer.prompts_per_step % trainer.mini_batches == 0,
         "trainer.prompts_per_step must be a multiple of trainer.mini_batches"),
        (trainer.save_every >= 0 and trainer.val_every >= 0,
         "trainer.save_every and trainer.val_every must be >= 0"),
        (trainer.keep_last >= 1, "trainer.keep_last must be >= 1"),
        (trainer.val_samples >= 1, "trainer.val_samples must be >= 1"),
        (cfg.reward.timeout_s > 0, "reward.timeout_s must be > 0"),
        (cfg.reward.num_workers >= 1, "reward.num_workers must be >= 1"),
        (cfg.reward.worker_memory_gib >= 0, "reward.worker_memory_gib must be >= 0 (0: none)"),
        (cfg.seed >= 0, "seed must be >= 0"),
        (0 < sched.discount <= 1, "scheduler.discount must be in (0, 1]"),
        (sched.prior_strength > 0, "scheduler.prior_strength must be > 0"),
        (0 <= sched.min_yield < 1, "scheduler.min_yield must be in [0, 1)"),
        (trainer.collective_timeout_s >= 0,
         "trainer.collective_timeout_s must be >= 0 (0: from the config)"),
        (trainer.wait_warning_s >= 0, "trainer.wait_warning_s must be >= 0 (0: never warn)"),
    ]  # fmt: skip
    checks += _optim_problems(cfg) + _sampling_and_reward_problems(cfg)
    return [msg for ok, msg in checks if not ok]


def kernel_options():
    """prorl.kernels.options (the fused ops' option values) without running prorl.kernels'
    __init__, which loads torch and the ops: a command line is checked, and `--help` answered,
    before torch is loaded. Registered under its own name, so the kernels use the same tuples."""
    name = "prorl.kernels.options"
    if name not in sys.modules:
        folder = importlib.util.find_spec("prorl.kernels").submodule_search_locations[0]
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "options.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]
