"""The one function that applies the parallel plan (FSDP2) to a decoder, and the state-dict helpers
over sharded models (weight sync, exact copies, the HF export).

The model (`engine/model`) holds no parallelism code. The order of operations is always the same:

    info = init_distributed()                       # engine/distributed.py: gloo / NCCL
    model = meta_decoder(ModelConfig.from_hf(...))  # on the meta device: no memory, no init cost
    model = FP8Training("torchao").convert(model)   # optional converters first (engine/fp8.py)
    model = parallelize(model, param_dtype=torch.bfloat16, activation_checkpointing=True)
    materialize(model, info.device, hf_path=path)   # to_empty; each rank reads only what it keeps

`parallelize` applies, per decoder `Block` and in this order: activation checkpointing ->
`torch.compile` (optional) -> FSDP2 `fully_shard`; then `fully_shard` of the root (embeddings, final
norm, LM head). This is torchtitan's order: checkpointing wraps the plain block, compile sees the
wrapped block (so the recomputation is compiled too), and FSDP's all-gather / reduce-scatter hooks
sit outside the compiled region. Mixed precision is FSDP2's `MixedPrecisionPolicy`: fp32 master
weights and optimizer state, bf16 copies for compute, gradients reduced in fp32.

The LM head belongs to the loss (`linear_logprob_entropy(hidden, model.lm_head_weight, ...)`), which
reads the weight after `forward` returns. That works under FSDP2 because the root module is not
resharded after forward: between forward and backward `model.lm_head_weight` is the unsharded
(all-gathered, param-dtype) tensor, and its gradient is reduce-scattered by FSDP's end-of-backward
callback. Read it only between a forward and its backward.

Single process. Without torchrun (`python script.py`, tests, notebooks) there is no process
group (engine/distributed.py) and `parallelize` applies checkpointing / compile but no sharding
(FSDP2 needs a process group; under `torchrun --nproc_per_node=1` it runs with a world of one).
Every helper here (the state-dict helpers, the export) works in both modes.

Gradients are SUMMED over ranks (`grad_reduce="sum"`): each rank normalises its loss by the global
token count (the kernels' `normalizer`), so per-rank losses add up to the single-process loss and
the summed gradient is the single-process gradient, whatever the token count of each rank.

Multi-node (the launch: engine/distributed.py): `parallelize(dp_replicate=NODES)` shards within each
node and replicates across nodes (HSDP, `data_parallel_mesh`); everything else data-parallel (the
batch split, the global token count, metrics, checkpoints) runs over all ranks of the default group
in both layouts.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import fp8
from .distributed import barrier, dist_info
from .model import Decoder, ModelConfig, save_hf
from .model.hf_io import _tensor_files, hf_name, read_config

logger = logging.getLogger(__name__)

# Name segments that wrappers insert into parameter names (checkpoint_wrapper, torch.compile); the
# state-dict helpers below and torch.distributed.checkpoint strip them.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


# --------------------------------------------------------------------------------------------------
# The parallel plan


def data_parallel_mesh(replicate: int = 1):
    """The DeviceMesh FSDP2 shards over. replicate == 1: 1-D ("dp_shard",) over all ranks. replicate
    > 1: HSDP, 2-D ("dp_replicate", "dp_shard") of shape (replicate, world // replicate), row-major:
    each shard group is consecutive ranks. torchrun numbers a node's processes consecutively, so
    with replicate = the number of nodes each node holds a full copy sharded over its GPUs:
    all-gathers and reduce-scatters stay in the node, only each shard's gradient all-reduce crosses
    nodes (torchtitan's `data_parallel_replicate_degree`). Cached: a new 2-D mesh opens new
    communicators (NCCL buffers on every GPU), and policy and reference share one.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if replicate < 1 or world % replicate:
        raise ValueError(
            f"dp_replicate={replicate} must be >= 1 and divide the {world} ranks (the number of "
            "nodes, or 1 for plain FSDP2)"
        )
    device_type = dist_info().device.type
    key = (dist.group.WORLD, device_type, replicate)
    if _MESH and _MESH[0][0] == key:
        return _MESH[0][1]
    if replicate == 1:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
    else:
        shape = (replicate, world // replicate)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))
        if dist.get_rank() == 0:
            logger.info("HSDP: %d replicas x %d shards (FSDP2 over a 2-D mesh)", *shape)
    _MESH[:] = [(key, mesh)]
    return mesh


_MESH: list = []  # [((default group, device type, replicate), mesh)]: the last mesh built


@dataclass(frozen=True)
class ParallelPlan:
    """How `parallelize` wraps and shards a decoder. grad_reduce "sum" (default): gradients are
    summed over ranks, so each rank normalises its loss by the GLOBAL token count (the kernels'
    `normalizer`) and the per-rank losses add up to the single-process loss; "mean": FSDP's default
    average. Master weights and optimizer state keep the model's dtype whatever `param_dtype` is.
    `cpu_offload`: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer state in
    host memory, the optimizer step on the CPU). `compile` comes after checkpointing, so the
    recomputation is compiled too."""

    dp_replicate: int = 1  # HSDP's number of replicas (1: plain FSDP2); with a process group only
    # all-gathered compute dtype (bf16); None: the params' own
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32  # gradient reduce-scatter (fp32 beside bf16)
    activation_checkpointing: bool = False  # recompute each Block in backward (memory for time)
    compile: bool = False  # torch.compile each Block
    cpu_offload: bool = False
    grad_reduce: str = "sum"

    def __post_init__(self):
        if self.grad_reduce not in ("sum", "mean"):
            raise ValueError(f"grad_reduce must be 'sum' or 'mean', got {self.grad_reduce!r}")


def parallelize(
    model: Decoder, plan: ParallelPlan | None = None, *, mesh=None, **options
) -> Decoder:
    """Apply activation checkpointing -> torch.compile -> FSDP2 to `model`, per Block, then the
    root.

    Call it on a model built on the meta device (then `materialize`), or on a materialised one.

    Args:
        plan: the ParallelPlan (None: the defaults), updated by `options`.
        mesh: DeviceMesh to shard over (1-D FSDP2, or 2-D (replicate, shard) HSDP); None =
            `data_parallel_mesh(plan.dp_replicate)` over all ranks of the default group.
        options: ParallelPlan's fields as keywords (`parallelize(model, compile=True)`).
    Returns the same model object (blocks replaced in place by their wrappers). ValueError: mixed
    precision or CPU offload asked for without a process group, or CPU offload without CUDA.
    """
    plan = replace(plan or ParallelPlan(), **options)
    te_layers = fp8.has_te_layers(model)
    _wrap_blocks(model, plan, te_layers)
    if not dist.is_initialized():
        _check_single_process(model, plan)
        return model
    if plan.cpu_offload and dist_info().device.type != "cuda":
        raise ValueError(
            "model.cpu_offload (FSDP2 CPUOffloadPolicy) needs a CUDA device: FSDP2 pins the host "
            "copies (torch 2.13 fails with 'Cannot access accelerator device' without one)"
        )
    # fully_shard replaces every parameter by a DTensor, dropping the attributes TE's modules set on
    # theirs and read back in forward (TE's FSDP2 tests put them back the same way)
    te_attrs = _param_attributes(model) if te_layers else {}
    _fully_shard(model, plan, mesh if mesh is not None else data_parallel_mesh(plan.dp_replicate))
    _restore_param_attributes(model, te_attrs)
    return model


def _wrap_blocks(model: Decoder, plan: ParallelPlan, te_layers: bool) -> None:
    """Activation checkpointing, then torch.compile, of each Block, in place."""
    if not (plan.activation_checkpointing or plan.compile):
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.named_children()):
        if plan.activation_checkpointing and te_layers:
            # TE's checkpoint re-enters the forward's FP8 state for the recomputation, which runs in
            # backward, outside te.autocast; torch's would recompute the FP8 layers in high
            # precision
            block = checkpoint_wrapper(
                block, checkpoint_fn=fp8.te_checkpoint_fn(), use_reentrant=False
            )
        elif plan.activation_checkpointing:
            # preserve_rng_state=False: the decoder has no dropout, so the recomputation needs no
            # RNG
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if plan.compile:
            block = torch.compile(block)
        model.layers.register_module(name, block)


def _check_single_process(model: Decoder, plan: ParallelPlan) -> None:
    """Without a process group there is no FSDP2: refuse the options only FSDP2 applies."""
    if plan.dp_replicate != 1:
        raise ValueError(f"dp_replicate={plan.dp_replicate} is HSDP over ranks: run under torchrun")
    if plan.cpu_offload:
        raise ValueError(
            "cpu_offload is an FSDP2 policy: run under torchrun (a world of 1 is fine)"
        )
    own = {p.dtype for p in model.parameters()}
    if plan.param_dtype is not None and own != {plan.param_dtype}:
        raise ValueError(
            f"param_dtype={plan.param_dtype} is applied by FSDP2, which needs a process group: run "
            "under torchrun (--nproc_per_node=1 is fine), or build the model in that dtype"
        )


def _fully_shard(model: Decoder, plan: ParallelPlan, mesh) -> None:
    """FSDP2 `fully_shard` of each Block, then of the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    offload = CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy()
    # Blocks: keep inputs as given - cos/sin arrive in fp32 (the decoder applies RoPE in fp32) and
    # the hidden states are already in param_dtype, produced by the (root-owned) embedding.
    block_mp = MixedPrecisionPolicy(plan.param_dtype, plan.reduce_dtype, cast_forward_inputs=False)
    root_mp = MixedPrecisionPolicy(plan.param_dtype, plan.reduce_dtype)
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by backward: do not reshard them
        keep = i == len(blocks) - 1
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=block_mp,
            offload_policy=offload,
            reshard_after_forward=not keep,
        )
    fully_shard(model, mesh=mesh, mp_policy=root_mp, offload_policy=offload)
    if plan.grad_reduce == "sum":
        for module in (*blocks, model):
            module.set_gradient_divide_factor(1.0)
            # plain SUM collectives: a factor other than the world size is otherwise NCCL's
            # PREMUL_SUM, which gloo lacks
            module.set_force_sum_reduction_for_comms(True)


def _param_attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The Python attributes set on each parameter (by name), e.g. TE's tensor-parallel markers."""
    return {name: dict(vars(p)) for name, p in model.named_parameters() if vars(p)}


def _restore_param_attributes(model: nn.Module, attrs: dict[str, dict[str, Any]]) -> None:
    for name, p in model.named_parameters():
        for key, value in attrs.get(name, {}).items():
            setattr(p, key, value)


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of `model` back into its sharded state. After a forward FSDP2 leaves
    the root and the last block unsharded (`reshard_after_forward=False`, above): their
    `.parameters()` are then temporary full tensors, and a write into them is lost at the next
    reshard."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def set_gradient_all_reduce(model: nn.Module, enabled: bool) -> None:
    """HSDP: whether the next backward all-reduces the gradient shards across the replicas (the
    reduce-scatter within a replica runs every backward). Off for all but a mini-batch's last
    micro-batch, FSDP2 sums the reduce-scattered shards locally and all-reduces that sum once: one
    cross-node all-reduce per mini-batch instead of one per micro-batch. A no-op for plain FSDP2
    (no replicate group) and for an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)  # recurses into the blocks


@torch.no_grad()
def copy_parameters_(dst: nn.Module, src: nn.Module) -> None:
    """dst's parameters <- src's, exactly, for two models of one architecture and one placement
    (both replicated, or both sharded over the same mesh): shard by shard in the sharded state,
    which is what a checkpoint saves. Casts when the dtypes differ."""
    from torch.distributed.tensor import DTensor

    reshard(dst)
    reshard(src)
    pairs = list(zip(dst.named_parameters(), src.named_parameters(), strict=True))
    for (name_d, p_d), (name_s, p_s) in pairs:
        if clean_name(name_d) != clean_name(name_s) or p_d.shape != p_s.shape:
            raise ValueError(
                f"cannot copy {name_s} {tuple(p_s.shape)} into {name_d} {tuple(p_d.shape)}"
            )
        if isinstance(p_d, DTensor) != isinstance(p_s, DTensor) or (
            isinstance(p_d, DTensor) and p_d.placements != p_s.placements
        ):
            raise ValueError(f"{name_d}: the two models are sharded differently")
        if isinstance(p_d, DTensor):
            p_d.to_local().copy_(p_s.to_local())
        else:
            p_d.copy_(p_s)


def clean_name(name: str) -> str:
    """A parameter name without wrapper segments: `layers.0._orig_mod.mlp.*` -> `layers.0.mlp.*`."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def meta_decoder(cfg: ModelConfig, attention=None, dtype: torch.dtype = torch.float32) -> Decoder:
    """A Decoder on the meta device (no memory, no init). `dtype` = the master-weight dtype."""
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return Decoder(cfg, attention=attention)
        finally:
            torch.set_default_dtype(previous)


def hf_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face checkpoint directory (its config.json)."""
    return ModelConfig.from_hf(read_config(path))


@torch.no_grad()
def materialize(
    model: Decoder, device: torch.device | str, *, hf_path: str | None = None, seed: int = 0
) -> Decoder:
    """Allocate a meta-device (possibly sharded) model on `device` and fill it.

    With `hf_path`, each rank reads every tensor it needs from the safetensors files (memory-mapped,
    one tensor at a time) and keeps only its own shard: no broadcast, peak extra memory one full
    tensor. The directory's config.json must describe the same model. Without `hf_path`,
    `init_weights()` under `torch.manual_seed(seed)` (sharded parameters draw through DTensor's RNG:
    valid init, but not the same numbers as an unsharded model). With
    `parallelize(cpu_offload=True)` pass device="cpu": the shards live in host memory.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    if hf_path is None:
        torch.manual_seed(seed)
        model.init_weights()
        return model

    from safetensors import safe_open

    saved = hf_model_config(hf_path)
    if saved != model.config:
        raise ValueError(
            f"{hf_path}/config.json describes another model: {saved}, not {model.config}"
        )
    files = _tensor_files(hf_path)
    by_file: dict[str, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    missing = []
    for name, param in model.named_parameters():
        key = hf_name(clean_name(name))
        if key not in files:
            missing.append(key)
        else:
            by_file[files[key]].append((key, param))
    if missing:
        raise ValueError(
            f"{hf_path} lacks {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else "")
        )
    for file, entries in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for key, param in entries:
                full = f.get_tensor(key)
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{key}: shape {tuple(full.shape)} in {hf_path}, {tuple(param.shape)} here"
                    )
                if isinstance(param, DTensor):
                    # src_data_rank=None: every rank cuts its own shard from the tensor it read; no
                    # comms
                    local = distribute_tensor(
                        full, param.device_mesh, param.placements, src_data_rank=None
                    )
                    param.to_local().copy_(local.to_local())
                else:
                    param.copy_(full)
    return model


# --------------------------------------------------------------------------------------------------
# Full (unsharded) state dicts: weight sync to the rollout engine, HF export, reference-policy
# copies


def full_state_dict(model: nn.Module, *, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded parameters by clean name (no wrapper segments), in the master-weight dtype; without
    the `_extra_state` entries of FP8 (Transformer Engine) layers.

    A collective under FSDP2: every rank must call it. `cpu_offload=False`: every rank gets every
    full tensor on its device (weight push to a colocated rollout engine). `cpu_offload=True`: full
    tensors on the CPU of rank 0 only, an empty dict elsewhere (HF export, low GPU memory).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        state = {clean_name(k): v.detach() for k, v in model.state_dict().items()}
        state = {k: v.cpu() for k, v in state.items()} if cpu_offload else state
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        reshard(model)
        state = get_model_state_dict(model, options=options)
    # no FP8 metadata (TE's _extra_state) and no FP8 weight wrappers (torchao's all-gather): plain
    # tensors
    return {k: fp8.plain(v) for k, v in state.items() if not k.endswith("_extra_state")}


def iter_full_tensors(model: nn.Module, dtype: torch.dtype | None = None):
    """(clean name, full tensor) of every parameter and buffer of `model`, one at a time, in `dtype`
    (None: the parameter's own); without the `_extra_state` entries of FP8 layers. A sharded
    (DTensor) parameter's local shard is cast BEFORE it is all-gathered: fp32 masters pushed as bf16
    cost half the traffic and half the peak memory. A collective under FSDP2: every rank iterates in
    the same order. For weight pushes (the sampler's copy, a vLLM engine), where memory allows one
    full tensor at a time."""
    from torch.distributed.tensor import DTensor

    reshard(model)  # the registered (sharded) parameters, not FSDP's temporary full copies
    for name, tensor in model.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        tensor = fp8.plain(tensor.detach())
        if isinstance(tensor, DTensor):
            local = tensor.to_local()
            local = local.to(dtype) if dtype is not None else local
            shape, stride = tensor.shape, tensor.stride()
            tensor = DTensor.from_local(
                local, tensor.device_mesh, tensor.placements, shape=shape, stride=stride
            )
            tensor = tensor.full_tensor()
        elif dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield clean_name(name), tensor


def load_full_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], *, broadcast_from_rank0: bool = False
) -> None:
    """Load unsharded tensors (clean names, every parameter) into a possibly sharded model;
    collective.

    `broadcast_from_rank0=True`: only rank 0's `state` is read (other ranks may pass {}); it is
    broadcast tensor by tensor and each rank keeps its shard.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not dist.is_initialized():
        own = {clean_name(k): k for k in model.state_dict()}
        if set(own) != set(state):
            raise ValueError(
                f"state keys differ from the model's: {sorted(set(own) ^ set(state))[:6]}"
            )
        model.load_state_dict({own[k]: v for k, v in state.items()})
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0)
    reshard(model)
    set_model_state_dict(model, state, options=options)


# --------------------------------------------------------------------------------------------------


def export_hf(model: nn.Module, path: str, dtype: torch.dtype | None = None) -> None:
    """Write a (possibly FSDP-sharded) Decoder as a Hugging Face directory; collective under
    torchrun.

    Gathers the full weights to rank 0's CPU (`full_state_dict`), rebuilds a plain Decoder
    there and writes it with `engine.model.save_hf` (config.json + safetensors). dtype: cast on
    export (e.g. torch.bfloat16 for a half-size release); None keeps the master-weight dtype.
    """
    full = full_state_dict(model, cpu_offload=True)
    if dist_info().is_main:
        if dtype is not None:
            full = {k: v.to(dtype) for k, v in full.items()}
        with torch.device("meta"):
            plain = Decoder(model.config)
        plain.load_state_dict(full, strict=True, assign=True)
        save_hf(plain, path)
    barrier()
