"""The role split of an asynchronous run under torchrun, and the process groups of each side.

With `rollout.async_rl.steps_ahead` = k >= 1 and `rollout_ranks` = r, of W ranks the first W - r
train and the last r sample and verify. Each side gets a DEFAULT process group of its own (over its
own ranks, from the job's rendezvous store under a prefix), so that everything written for "all
ranks" - `dist_info()`, `all_reduce`, the FSDP2 mesh, DCP checkpoints, the collective sampling
rounds and the prompt scheduler's merged record - runs unchanged over one side's ranks: the trainers
are an ordinary FSDP2 job of W - r ranks, the rollout ranks an ordinary sampling job of r ranks.
Across the sides:

- a gloo group of two ranks for each rollout rank j and trainer t that trains part of its batch
  (`pairs`) carries the step's groups, point to point (prorl/async_rl/transport.py);
- a gloo group of trainer rank 0 and the rollout ranks (`push`) carries the weights (broadcast,
  bucketed; prorl/async_rl/push.py);
- the job's store (torchrun's TCPStore, under `prorl/async/`) carries only small control keys:
  signed tickets announcing batches and pushes, the stop key, heartbeats. Every message is signed
  with the attempt's secret (`secret`, prorl/async_rl/wire.py), which the store never holds.

Why not one default group over all ranks with sub-groups: every collective and checkpoint of the
trainer would then have to be told its group, and one missed call would hang both sides.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from prorl.async_rl import wire
from prorl.config import Config, ConfigError
from prorl.config_runtime import collective_timeout_s
from prorl.engine.distributed import attempt_store

STORE_PREFIX = "prorl/async/"


@dataclass
class Roles:
    """Where this process sits in an asynchronous run. `index`: its rank within its own side."""

    rank: int  # global (torchrun's RANK)
    world: int
    trainers: int
    rollouts: int
    store: object  # the job's store under STORE_PREFIX
    push: object | None  # gloo group of trainer 0 + the rollout ranks (None on the other trainers)
    timeout_s: float  # this side's own collective timeout (`timeouts`)
    pairs: dict = field(default_factory=dict)  # (rollout j, trainer t) -> wire channel to the peer
    secret: bytes = b""  # the attempt's secret (prorl/async_rl/wire.py)

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainers

    @property
    def index(self) -> int:
        return self.rank - self.trainers if self.is_rollout else self.rank


_ROLES: list[Roles] = []


def roles() -> Roles | None:
    """This process's roles, or None outside an asynchronous run."""
    return _ROLES[0] if _ROLES else None


def is_rollout_rank() -> bool:
    """True on an asynchronous run's rollout ranks (they hold no trainer state)."""
    return bool(_ROLES) and _ROLES[0].is_rollout


def enabled(cfg: Config) -> bool:
    return cfg.rollout.async_rl.steps_ahead > 0


def check_async(cfg: Config, world: int, torchrun: bool) -> None:
    """The settings an asynchronous run needs, against the world of `world` ranks (ConfigError)."""
    a, pps = cfg.rollout.async_rl, cfg.trainer.prompts_per_step
    if a.steps_ahead < 0 or a.rollout_ranks < 1:
        raise ConfigError(
            f"rollout.async_rl.steps_ahead={a.steps_ahead} must be >= 0 and "
            f"rollout.async_rl.rollout_ranks={a.rollout_ranks} >= 1"
        )
    if a.steps_ahead == 0:
        return
    if not torchrun:
        raise ConfigError(
            f"rollout.async_rl.steps_ahead={a.steps_ahead} puts sampling and training on different "
            "ranks: launch with torchrun (e.g. --nproc_per_node=2 for 1 rollout + 1 trainer rank)"
        )
    if a.rollout_ranks >= world:
        raise ConfigError(
            f"rollout.async_rl.rollout_ranks={a.rollout_ranks} leaves no trainer rank among the "
            f"{world} ranks: at most {world - 1}"
        )
    trainers = world - a.rollout_ranks
    for count, who in ((trainers, "trainer"), (a.rollout_ranks, "rollout")):
        if pps % count:
            raise ConfigError(
                f"trainer.prompts_per_step={pps} is not a multiple of the {count} {who} ranks "
                f"({world} ranks, rollout.async_rl.rollout_ranks={a.rollout_ranks})"
            )
    if cfg.rollout.tensor_parallel_size > 1:
        raise ConfigError(
            "rollout.tensor_parallel_size>1 does not work with rollout.async_rl.steps_ahead yet: "
            "each rollout rank runs its own engine (set rollout.tensor_parallel_size=1)"
        )


def timeouts(cfg: Config, trainers: int, rollouts: int) -> dict[str, float]:
    """Seconds: `train` and `rollout`, each side's own collectives (a sampling round of its own
    world, prorl/config.py); `step`, the longest one rollout step may take (every round of dynamic
    sampling): the push group's (its root waits for rollout ranks that join only between steps) and
    the trainers' wait for a batch (prorl/async_rl/remote.py)."""
    rounds = cfg.algorithm.max_rounds if cfg.algorithm.dynamic_sampling else 1
    rollout = collective_timeout_s(cfg, world=rollouts)
    return {
        "train": collective_timeout_s(cfg, world=trainers),
        "rollout": rollout,
        "step": rollout * rounds,
    }


def init_async(cfg: Config, backend: str) -> Roles:
    """Split the torchrun job (module docstring): each side's default process group, the push group
    and the store. Returns this process's Roles (also `roles()`)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    check_async(cfg, world, torchrun=True)
    r = cfg.rollout.async_rl.rollout_ranks
    trainers = world - r
    rollout = rank >= trainers
    side = "rollout" if rollout else "train"
    limits = timeouts(cfg, trainers, r)
    timeout_s = limits[side]
    timeout = datetime.timedelta(seconds=timeout_s)
    # a store of this attempt's own (engine/distributed.py says why): the process groups'
    # addresses, stop, pushes and batches of a restarted attempt never meet a dead one's
    store, _, _ = attempt_store(timeout)
    device_id = None
    if "nccl" in backend:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        device_id = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        )
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"prorl/{side}/", store),
        rank=rank - trainers if rollout else rank,
        world_size=r if rollout else trainers,
        timeout=timeout,
        device_id=device_id,
    )
    push, step = None, datetime.timedelta(seconds=limits["step"])
    if rank == 0 or rollout:  # trainer 0 is the push group's rank 0
        push_store = dist.PrefixStore("prorl/push/", store)
        push = dist.ProcessGroupGloo(push_store, rank - trainers + 1 if rollout else 0, r + 1, step)
    pairs = {}
    for j, t, _, _ in slices(cfg.trainer.prompts_per_step, trainers, r):
        if rank in (trainers + j, t):  # the rollout rank is the pair's rank 0
            pair_store = dist.PrefixStore(f"prorl/pair/{j}/{t}/", store)
            pg = dist.ProcessGroupGloo(pair_store, 0 if rollout else 1, 2, step)
            pairs[j, t] = wire.PairChannel(pg, 1 if rollout else 0)
    store = dist.PrefixStore(STORE_PREFIX, store)
    secret = wire.run_secret(store, cfg.output_dir, rank, timeout_s)
    _ROLES[:] = [Roles(rank, world, trainers, r, store, push, timeout_s, pairs, secret)]
    return _ROLES[0]


def slices(pps: int, trainers: int, rollouts: int) -> list[tuple[int, int, int, int]]:
    """(rollout j, trainer t, lo, hi): the step's prompts_per_step groups are rollout 0's batch,
    then rollout 1's, ...; trainer t trains positions [t * pps / trainers, (t + 1) * pps /
    trainers). lo:hi is the part of rollout j's batch that goes to trainer t (by nominal positions:
    a batch short of groups after max_rounds gives its trainers fewer)."""
    per_r, per_t, out = pps // rollouts, pps // trainers, []
    for j in range(rollouts):
        for t in range(trainers):
            lo, hi = max(j * per_r, t * per_t), min((j + 1) * per_r, (t + 1) * per_t)
            if lo < hi:
                out.append((j, t, lo - j * per_r, hi - j * per_r))
    return out


def batch_key(step: int, j: int, t: int) -> str:
    return f"batch/{step}/{j}/{t}"
