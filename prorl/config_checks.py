"""What a config file and the command line may hold, checked before OmegaConf sees them (prorl/config.py).

- A YAML file (`--config FILE` or a preset) must be a mapping of sections: a list, an empty file (once
  taken silently as "no config": a truncated or wrong file would run the defaults), YAML that does not
  parse, a key given twice in one mapping and bytes that are not UTF-8 are errors naming the file and
  the line. A UTF-8 byte-order mark and CRLF line ends are accepted.
- A dotted key given twice on the command line with different values: the last wins, with a warning
  (prorl/train.py, rank 0) naming the key and both values. Not an error: appending an override to a base
  command is how this project's own CI and tests shorten a run, and how wrapper scripts pass "$@"; not
  silent either, since a mistyped repeat would otherwise go unseen. The same value twice says nothing.
- Sizes and counts that must be positive (`size_problems`): a zero or negative one is named, instead
  of surfacing as an empty validation set, a loop that never ends or an error deep in a component.

Each function raises ValueError or returns problems as text; prorl/config.py turns them into ConfigError.
"""

from __future__ import annotations

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
        cfg = OmegaConf.create(text) if text.strip() else None  # OmegaConf's loader refuses duplicate keys
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
            f"config file {path} must be a mapping of sections (model:, data:, trainer:, ...), got a "
            f"{type(OmegaConf.to_container(cfg)).__name__}"
        )
    return cfg


def _has_mapping(text: str) -> bool:
    """An explicit empty mapping (`{}`): meant, not an empty file."""
    return any(line.split("#", 1)[0].strip() == "{}" for line in text.splitlines())


def repeated_overrides(overrides: list[str]) -> str | None:
    """The message for keys given twice, with different values, in `key=value` overrides, or None."""
    seen: dict[str, list[str]] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        seen.setdefault(key.strip(), []).append(value)
    twice = {k: v for k, v in seen.items() if len(set(v)) > 1}  # the same value again says nothing new
    if not twice:
        return None
    shown = "; ".join(f"{k} = {' then '.join(map(repr, v))} ({v[-1]!r} is used)" for k, v in twice.items())
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
