"""The process group and the collectives every component uses: torchrun init, where this process
sits (`DistInfo`), and all-reduces of floats, tensors and dicts of metrics.

    info = init_distributed()                          # torchrun env -> gloo (CPU) / NCCL (CUDA)
    total = all_reduce_sum(local_tokens, what="the token count")
    metrics = all_reduce_mean({"loss": loss, "tokens": n})   # one collective for the dict

Single process. Without torchrun (`python script.py`, tests, notebooks) `init_distributed` creates
no process group and every function here works on this process alone (a reduction returns its input;
under `torchrun --nproc_per_node=1` there is a world of one). FSDP2 and the state-dict helpers over
ranks are engine/parallel.py.

Failure. Every collective has a timeout (`timeout_s`, default 600 s: long enough for a slow
checkpoint write or a rank compiling, short enough that a stuck job ends within minutes). Measured
with gloo and a 2 s timeout (tests/engine/test_parallel.py): a peer that is alive but never joins ->
RuntimeError "Timed out waiting 2000ms for recv operation" after 2.0 s; a peer that dies ->
RuntimeError "Connection closed by peer ... typically caused by a remote worker crashing" as soon as
its process exits. On NCCL a timed-out collective makes the watchdog abort the process. Under
torchrun the elastic agent also stops the surviving workers once one exits with an error. The last
complete checkpoint is never touched (engine/checkpoint.py commits by rename). A rank that waits
long in `all_reduce` says so through the process's `Watchdog` (engine/watchdog.py, `set_watchdog`).

Multi-node: start the same command on every node with torchrun's rendezvous flags, one process per
GPU, e.g. 2 nodes of 8 GPUs with the c10d rendezvous (ranks assigned on arrival):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
             --rdzv_id=$JOB_ID prorl/train.py ...

or with static ranks: `--nnodes=2 --node_rank=$NODE_RANK --master_addr=$HEAD_NODE
--master_port=29500`. torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which
`init_distributed` reads. Checkpoint directories must be on a filesystem every node sees (each rank
writes its shards).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .watchdog import Watchdog, null_watchdog

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits. `backend` is None in single-process mode (no process group)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def dist_info() -> DistInfo:
    """The current process's `DistInfo` (from the process group if one exists; never creates
    one)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not dist.is_initialized():
        return DistInfo(0, 1, 0, _default_device(0), None)
    backend = dist.get_backend()
    device = _default_device(local_rank) if "nccl" in backend else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def process_group_backend(cuda: bool, cpu_offload: bool = False) -> str:
    """gloo on the CPU; NCCL on GPUs, with gloo beside it for CPU tensors when FSDP offloads
    parameters and gradients to host memory (the gradient norm's all-reduce then runs on CPU
    tensors, which NCCL cannot reduce; torchtitan does the same)."""
    if not cuda:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_distributed(
    *, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None
) -> DistInfo:
    """Create the default process group from torchrun's environment; one process per device.

    Args:
        timeout_s: collective timeout: a collective that a peer never joins raises after this long.
        backend: "gloo" | "nccl" | "cuda:nccl,cpu:gloo" | None (NCCL when CUDA is available, else
            gloo; see `process_group_backend`).
    Returns:
        DistInfo. Not under torchrun (no RANK / WORLD_SIZE in the environment): single-process mode,
        no process group, device cuda:0 or cpu. A group created earlier by the caller is reused.
    """
    if dist.is_initialized():
        return dist_info()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return dist_info()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device_id = None
    if "nccl" in backend:
        # Tear the process down on a failed or timed-out NCCL collective instead of hanging (torch's
        # default in recent versions; stated here so the behaviour does not depend on the version).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        device_id = _default_device(local_rank)
        torch.cuda.set_device(device_id)
    timeout = datetime.timedelta(seconds=timeout_s)
    if local_rank == 0 and (warning := loopback_warning(os.environ)):
        warnings.warn(warning, RuntimeWarning, stacklevel=2)
    store, rank, world = attempt_store(timeout)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device_id,  # NCCL: eager communicator creation on this GPU
    )
    info = dist_info()
    if info.is_main:
        logger.info(
            "distributed: %s, world size %d, device %s", backend, info.world_size, info.device
        )
    return info


def hostname_address() -> str:
    """The address this host's name resolves to: the one gloo binds without GLOO_SOCKET_IFNAME."""
    return socket.gethostbyname(socket.gethostname())


def loopback_warning(env, resolve=None) -> str | None:
    """The warning for ranks that span nodes (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE) when this
    host's name resolves to a loopback address and GLOO_SOCKET_IFNAME is unset, else None. gloo
    (the CPU backend, `cuda:nccl,cpu:gloo` under CPU offload, vLLM's CPU group) binds the hostname's
    address; a default Ubuntu /etc/hosts maps it to 127.0.1.1, which no other node can reach."""
    world, local = int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", 0))
    if not 0 < local < world or env.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        address = (resolve or hostname_address)()
        loopback = ipaddress.ip_address(address).is_loopback
    except (OSError, ValueError):
        return None
    if not loopback:
        return None
    return (
        f"ranks span nodes ({local} of {world} on this one) but this host's name resolves to the "
        f"loopback address {address}, which gloo binds: peers on other nodes cannot connect. Set "
        "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface the nodes reach each other "
        "on, e.g. GLOO_SOCKET_IFNAME=eth0 (`ip -br addr` lists them)"
    )


def attempt_store(timeout: datetime.timedelta):
    """torchrun's env:// rendezvous, with a store of this attempt's own: (store, rank, world).

    Under torchrun (TORCHELASTIC_USE_AGENT_STORE) the workers share the agents' store, which
    outlives a `--max-restarts` restart with the dead attempt's keys in it; a restarted rank would
    read a dead rank's address. No count that every rank agrees on tells the attempts apart:
    TORCHELASTIC_RESTART_COUNT grows only on the node whose worker failed (a membership change does
    not count as a retry, torch/distributed/elastic/agent/server/api.py). So rank 0 starts a fresh
    TCPStore on MASTER_ADDR and posts its port and a nonce in the agents' store; the other ranks
    connect to what is posted there, retrying while it is a dead attempt's (refused, or another
    nonce), and every key of the attempt lives in the fresh store. Otherwise rank 0 hosts the
    env:// store itself, fresh with each process."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store, rank, world
    host = os.environ["MASTER_ADDR"]
    if rank == 0:
        own = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = f"{socket.gethostname()}/{os.getpid()}/{time.time_ns()}"
        own.set("prorl/nonce", nonce)
        store.set("prorl/attempt_store", f"{own.port} {nonce}")
        return own, rank, world
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, nonce = store.get("prorl/attempt_store").decode().split(" ", 1)
        try:
            probe = datetime.timedelta(seconds=3)
            own = dist.TCPStore(host, int(port), world, is_master=False, timeout=probe)
            if own.get("prorl/nonce").decode() == nonce:
                own.set_timeout(timeout)
                return own, rank, world
        except (RuntimeError, OSError):  # a dead attempt's store: nothing listens there now
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no store of this attempt posted by rank 0")
        time.sleep(0.2)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Collectives (single-process mode: identity)

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


_WATCHDOG = null_watchdog()


def set_watchdog(watchdog: Watchdog) -> None:
    """The watchdog that `all_reduce` reports its waits to (engine/watchdog.py); one per process."""
    global _WATCHDOG
    _WATCHDOG = watchdog


def watchdog() -> Watchdog:
    return _WATCHDOG


def all_reduce(value: Any, op: str = "sum", group=None, *, what: str | None = None) -> Any:
    """Reduce a float, a tensor or a dict of floats/scalar tensors over ranks; returns the same
    kind.

    op: "sum" | "mean" | "max" | "min". A dict costs one collective (values stacked in fp64); dict
    values come back as floats. Tensors come back as new tensors (the input is not modified). No
    process group: the value itself (mean of one rank = the value). `what` names the collective in
    the watchdog's message should this rank wait long in it.
    """
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {sorted(_OPS)}")
    if isinstance(value, dict):
        keys = list(value)
        flat = torch.tensor([float(value[k]) for k in keys], dtype=torch.float64)
        out = all_reduce(flat, op, group, what=what)
        return {k: float(v) for k, v in zip(keys, out.tolist())}
    if not isinstance(value, torch.Tensor):
        return float(
            all_reduce(torch.tensor(float(value), dtype=torch.float64), op, group, what=what)
        )
    if not dist.is_initialized():
        return value.clone()
    # NCCL reduces only CUDA tensors: host values travel through this rank's GPU
    nccl = dist.get_backend(group) == "nccl"
    device = dist_info().device if nccl and value.device.type == "cpu" else value.device
    out = value.detach().to(device, copy=True)
    with _WATCHDOG.waiting(f"all-reduce of {what or 'a value'}"):
        dist.all_reduce(out, op=_OPS[op], group=group)
    if op == "mean":
        out = out / dist.get_world_size(group)
    return out.to(value.device)


def all_reduce_sum(value: Any, group=None, *, what: str | None = None) -> Any:
    return all_reduce(value, "sum", group, what=what)


def all_reduce_mean(value: Any, group=None, *, what: str | None = None) -> Any:
    return all_reduce(value, "mean", group, what=what)


def all_reduce_max(value: Any, group=None, *, what: str | None = None) -> Any:
    return all_reduce(value, "max", group, what=what)


def all_reduce_min(value: Any, group=None, *, what: str | None = None) -> Any:
    return all_reduce(value, "min", group, what=what)


def barrier() -> None:
    """Wait for every rank (no-op in single-process mode)."""
    if dist.is_initialized():
        dist.barrier()
