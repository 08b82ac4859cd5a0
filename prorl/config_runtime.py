"""The config against the run it drives: the number of ranks (`check_world`, the collective
timeout), the checkpoint it resumes (`resume_conflicts`) and the recipe it departs from
(`non_default`, printed at start). prorl/config.py checks a config on its own; these need the world
size, a saved config or the defaults beside it.
"""

from __future__ import annotations

import math
import os

from prorl.config import Config, ConfigError, ModelConfig, to_dict


def steps_from_epochs(cfg: Config, prompts: int) -> None:
    """trainer.total_epochs > 0: trainer.total_steps = total_epochs x (prompts // prompts_per_step),
    as verl counts (its dataloader drops the last partial batch)."""
    epochs, pps = cfg.trainer.total_epochs, cfg.trainer.prompts_per_step
    if epochs <= 0:
        return
    if prompts < pps:
        raise ConfigError(
            f"trainer.total_epochs={epochs}: the {prompts} training prompts make no full step of "
            f"trainer.prompts_per_step={pps}; lower it or set trainer.total_steps"
        )
    cfg.trainer.total_steps = epochs * (prompts // pps)


# -- the world -------------------------------------------------------------------------------------


def check_world(cfg: Config, world: int) -> None:
    """Checks that need the number of ranks: each rank trains prompts_per_step / world prompts;
    HSDP's replicas split the ranks evenly."""
    rep = cfg.model.dp_replicate
    if world % rep:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"model.dp_replicate={rep} does not divide the {world} ranks: HSDP keeps dp_replicate "
            "copies of the model, each sharded over world / dp_replicate ranks (set it to the "
            f"number of nodes; divisors of {world}: {', '.join(map(str, divisors))})"
        )
    pps = cfg.trainer.prompts_per_step
    if pps % world:
        raise ConfigError(
            f"trainer.prompts_per_step={pps} is not a multiple of the {world} ranks: each rank "
            f"takes prompts_per_step / world prompts (use {pps - pps % world or world} or "
            f"{pps + world - pps % world})"
        )


def collective_timeout_s(cfg: Config, world: int | None = None) -> float:
    """The process group's collective timeout: `trainer.collective_timeout_s`, or when that is 0 one
    sized from the config. The longest legitimate wait in one collective is a sampling round of
    another rank: generating up to the longest response budget, then verifying the round's samples,
    at worst every one at `reward.timeout_s` (sampling rounds are collective: prorl/sampling.py).
    Hence 600 s (engine start, checkpoint writes) + 0.1 s per response token + ceil(round samples /
    reward workers) x reward.timeout_s, with a round of ceil(prompts per rank x oversample) prompts
    x rollout.n samples."""
    if cfg.trainer.collective_timeout_s > 0:
        return cfg.trainer.collective_timeout_s
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    r = cfg.rollout
    max_new = max([r.max_response_tokens, *r.max_response_schedule.values()])
    prompts = math.ceil(max(cfg.trainer.prompts_per_step // world, 1) * cfg.algorithm.oversample)
    verify = math.ceil(prompts * r.n / max(cfg.reward.num_workers, 1)) * cfg.reward.timeout_s
    return 600.0 + 0.1 * max_new + verify


# -- resuming --------------------------------------------------------------------------------------

# Settings that fix what a resumed run trains on and how its batch is built: changing them between a
# checkpoint and its resume would silently make a different run, so resuming refuses. Anything else
# (log and eval intervals, total steps, learning rate, timeouts, worker counts) is allowed and
# reported.
INCOMPATIBLE_ON_RESUME = (
    "seed",
    "model.path",
    "model.dtype",
    "data.",
    "rollout.n",
    "trainer.prompts_per_step",
    "trainer.mini_batches",
)


def config_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted keys whose values differ between two config dicts -> (old, new)."""
    out: dict[str, tuple] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        # a tuple comes back from JSON a list
        a, b = (list(v) if isinstance(v, tuple) else v for v in (a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, f"{prefix}{key}."))
        elif a != b and f"{prefix}{key}" != "output_dir":
            out[f"{prefix}{key}"] = (a, b)
    return out


def resume_conflicts(saved: dict, cfg: Config) -> tuple[list[str], dict[str, tuple]]:
    """(keys that forbid resuming, every changed key -> (saved, now)) between a checkpoint's config
    dict and this run's."""
    changed = config_changes(saved, to_dict(cfg))
    bad = [k for k in changed if k.startswith(INCOMPATIBLE_ON_RESUME)]
    # a run without a KL term saved no reference: a KL term cannot start from its checkpoint
    if saved.get("algorithm", {}).get("kl_coef", 1.0) == 0 and cfg.algorithm.kl_coef != 0:
        bad.append("algorithm.kl_coef")
    return sorted(bad), changed


# -- the recipe ------------------------------------------------------------------------------------


def non_default(cfg: Config) -> dict[str, tuple]:
    """Keys whose values differ from the dataclass defaults (the recipe's) -> (default, value)."""
    defaults = to_dict(Config(model=ModelConfig(path=cfg.model.path)))
    return config_changes(defaults, to_dict(cfg))
