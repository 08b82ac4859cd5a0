"""`rollout.async_rl.*` (`async` is a Python keyword, so the section cannot carry that name; the
old spelling `rollout.async.*` is still read, with a deprecation warning). Plain dataclass, no
project imports: prorl/config.py embeds it in `RolloutConfig`, and prorl/async_rl/roles.py checks it
against the world."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field


def _help(default, text: str):
    return field(default=default, metadata={"help": text, "choices": None})


@dataclass
class AsyncConfig:
    steps_ahead: int = _help(
        0,
        "asynchronous RL: a group trained at step s was sampled with weights at most this many "
        "updates old (0: the synchronous colocated step; >= 1 needs torchrun and rollout_ranks)",
    )
    rollout_ranks: int = _help(
        1, "with steps_ahead >= 1: the last this-many ranks sample and verify, the others train"
    )


def rename_async_section(node) -> None:
    """A config file's `rollout: {async: ...}` read as `rollout.async_rl` (an OmegaConf
    DictConfig)."""
    rollout = node.get("rollout") if hasattr(node, "get") else None
    if hasattr(rollout, "keys") and "async" in rollout:
        if "async_rl" in rollout:
            raise ValueError(
                "the config file sets both rollout.async and rollout.async_rl: keep one"
            )
        rollout["async_rl"] = rollout.pop("async")
        warn_async_name("rollout.async_rl")


def warn_async_name(new: str) -> None:
    """The deprecation warning of the old spelling `rollout.async`."""
    warnings.warn(
        f"{new.replace('rollout.async_rl', 'rollout.async', 1)} is now spelt {new} (the old "
        "name is still read)",
        FutureWarning,
        stacklevel=3,
    )
