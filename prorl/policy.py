"""The models the trainer trains and samples with, and everything done to them as a whole: building
them (replicated or FSDP2, FP8 converted), the sampler (native or vLLM) and its weight sync, the
Hugging Face export and the reference reset. The update (prorl/update.py) reads and trains `policy`;
nothing here computes a loss.

Where things run. The models live on `dist_info().device`: cuda:LOCAL_RANK under torchrun on GPUs,
else the CPU. The sampler is prorl's `NativeGenerator` on the policy itself (no weight copy; under
FSDP on an unsharded copy that receives the weights after each step) or a colocated `VLLMGenerator`
that sleeps while the policy trains and gets the weights pushed and checked after each step.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from prorl import rollout_budget
from prorl.config import Config
from prorl.engine import parallel
from prorl.engine.distributed import dist_info
from prorl.engine.fp8 import FP8Training, fp8_layers
from prorl.engine.model import load_hf
from prorl.engine.parallel import copy_parameters_, iter_full_tensors
from prorl.engine.rollout import build_generator, resolve_backend


class PolicyModels:
    """The policy, the reference, the sampler's model and the sampler (`generator`).

    Replicated: the policy in `model.dtype` (bf16 without an fp32 master copy: small updates round
    away, hence the warning), the native sampler on the policy itself. FSDP2 (whenever asked for and
    a process group exists, one rank included): fp32 master weights whatever the checkpoint's dtype,
    computed in `model.dtype` (mixed precision); the reference holds the same fp32 values, so that
    after a reset it equals the policy exactly and computes identically; the native sampler gets an
    unsharded copy in `model.dtype`, synced after every update. Without a KL term
    (algorithm.kl_coef 0) there is no reference (None): no copy held, no forward pass for it. The
    sampler is built by `start_sampler`, after the optimizer (FSDP2 leaves the root unsharded after
    a forward, and vLLM's calibration runs one)."""

    def __init__(self, cfg: Config, model_path: str):
        self.cfg, self.model_path = cfg, model_path
        info = dist_info()
        self.rank, self.world, self.device = info.rank, info.world_size, info.device
        self.dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.backend = resolve_backend(cfg.rollout.backend, self.device)
        # the rollout ranks run rollout.backend; this sampler
        if cfg.rollout.async_rl.steps_ahead > 0:
            self.backend = "native"  # only validates, on the trainer ranks (prorl/async_rl/)
        self.fsdp = cfg.model.fsdp and dist.is_available() and dist.is_initialized()
        if cfg.model.fp8 != "none" and not self.fsdp:
            raise RuntimeError(
                f"model.fp8={cfg.model.fp8} needs FSDP2, which needs a process group: launch with "
                "torchrun (--nproc_per_node=1 is fine)"
            )
        self.fp8 = FP8Training.of(cfg.model, fsdp=self.fsdp)
        # no KL term (algorithm.kl_coef 0, verl's use_kl_loss false): no reference copy, no pass
        self.kl = cfg.algorithm.kl_coef != 0
        self.policy, self.reference, self.sampler_model = self._build()
        self.generator = None
        self.last_sync_check: dict | None = None  # vLLM: the post-sync probe report

    def _build(self):
        cfg = self.cfg
        attention = None if cfg.model.attention == "auto" else cfg.model.attention

        def load(dtype):
            return load_hf(self.model_path, dtype=dtype, device=self.device, attention=attention)

        if not self.fsdp:
            if self.dtype != torch.float32 and self.rank == 0:
                warnings.warn(
                    f"model.dtype={cfg.model.dtype} without FSDP: the policy's weights and AdamW "
                    f"step are in {cfg.model.dtype} (no fp32 master copy), so small updates are "
                    "lost to rounding. For bf16 compute over fp32 master weights set "
                    "model.fsdp=true and launch with torchrun (one process is enough).",
                    RuntimeWarning,
                    stacklevel=4,
                )
            policy = load(self.dtype)
            reference = load(self.dtype).requires_grad_(False).eval() if self.kl else None
            if cfg.model.compile:
                policy.compile()
                if reference is not None:
                    reference.compile()
            return policy, reference, policy if self.backend == "native" else None
        opts = dict(
            activation_checkpointing=cfg.model.activation_checkpointing,
            compile=cfg.model.compile,
            param_dtype=None if self.dtype == torch.float32 else self.dtype,
            cpu_offload=cfg.model.cpu_offload,
            # HSDP across nodes (engine.parallel.data_parallel_mesh)
            dp_replicate=cfg.model.dp_replicate,
        )
        # FP8 (model.fp8): policy and reference get the same conversion, so that after a reset they
        # compute identically and the KL is exactly zero; the sampler's copy stays unconverted
        policy = parallel.parallelize(self.fp8.convert(load(torch.float32)), **opts)
        reference = None
        if self.kl:
            frozen = self.fp8.convert(load(torch.float32)).requires_grad_(False).eval()
            reference = parallel.parallelize(frozen, **opts)
        if self.backend != "native":  # vLLM holds its own weights
            return policy, reference, None
        return policy, reference, load(self.dtype).requires_grad_(False).eval()

    def start_sampler(self):
        """Build the sampler (`rollout.backend`) and return it."""
        r = self.cfg.rollout
        self.generator = build_generator(
            self.backend,
            model=self.sampler_model,
            model_path=self.model_path,
            dtype=self.dtype,
            compile=r.compile,
            world_size=self.world,
            seed=self.cfg.seed + self.rank,
            deterministic=self.cfg.trainer.deterministic,
            sleep=self.device.type == "cuda",  # training and sampling share the GPU
            tensor_parallel_size=r.tensor_parallel_size,
            gpu_memory_utilization=rollout_budget.gpu_fraction(self.cfg, self.policy, self.backend),
            max_model_len=self.cfg.data.max_prompt_tokens
            + max([r.max_response_tokens, *r.max_response_schedule.values()]),
        )
        if self.backend == "vllm":
            # engine and policy hold the same weights now: the gap measured here is the yardstick of
            # the post-sync checks (a collective under FSDP)
            self.generator.calibrate(self.policy)
        return self.generator

    @property
    def fp8_summary(self) -> str:
        """One line on what runs in FP8 (model.fp8): the converted layers, where the GEMMs run."""
        layers = fp8_layers(self.policy)
        emulated = any(getattr(getattr(m, "config", None), "emulate", False) for m in layers)
        gemm = "emulated FP8 GEMMs (CPU)" if emulated else "FP8 GEMMs"
        return (
            f"{self.fp8.backend} {self.fp8.recipe}: {len(layers)} Linear layers of the policy and "
            f"the reference in {gemm}; LM head and sampler in {self.cfg.model.dtype}"
        )

    def sync_sampler(self) -> None:
        """Give the sampler the policy's current weights: nothing for the native sampler on the
        policy itself; the unsharded copy (native under FSDP) or the vLLM engine (woken first, then
        checked against the policy: a failed sync raises StaleWeightsError instead of sampling stale
        weights). Tensors travel one at a time, cast to the sampler's dtype before the gather."""
        if self.backend == "vllm":
            tensors = iter_full_tensors(self.policy, self.dtype)
            self.last_sync_check = self.generator.update_weights(tensors, reference=self.policy)
        elif self.fsdp:
            self.generator.update_weights(iter_full_tensors(self.policy, self.dtype))

    def sleep_sampler(self) -> None:
        """Free the vLLM engine's GPU memory while the policy trains; `sync_sampler` wakes it."""
        if self.backend == "vllm":
            self.generator.sleep()

    @torch.no_grad()
    def reset_reference(self) -> None:
        """pi_ref <- current policy, exactly (shard by shard under FSDP, in the sharded state
        checkpoints save)."""
        if self.reference is not None:
            copy_parameters_(self.reference, self.policy)

    def export_hf(self, path: str) -> None:
        """The policy as a Hugging Face directory in `model.dtype` (collective under FSDP)."""
        parallel.export_hf(self.policy, path, dtype=self.dtype)

    def close(self) -> None:
        """Release the sampler (a vLLM engine) before the process group goes."""
        if self.generator is not None:
            self.generator.close()
