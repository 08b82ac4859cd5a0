"""The ProRL v2 trainer. One RL step (`Trainer.step`), top to bottom:

    sample n responses per prompt, verify, dynamic sampling         prorl/sampling.py: GroupSampler.collect
    pi_old of the carry-over (before the update)                    Trainer.carry_old_logprobs
    shape rewards (stop-properly, scheduled cosine length term)     prorl/sampling.py: shape_rewards
    flatten the kept groups once                                    prorl/packing.py: StepBatch
    REINFORCE++-baseline advantages, whitened over all ranks        Trainer.update -> group_advantages
    reference (and, off-policy, old) log-probs                      Trainer.response_logprobs
    M mini-batches x micro-batches of PPO-Clip-Higher + k2 KL       packing.plan_update, Trainer.loss
    weights to the sampler, metrics, reference reset                Trainer.sync_sampler, reset_reference

What ProRL does differently from textbook GRPO is listed in prorl/algorithm.py's docstring.

Under torchrun every rank takes `prompts_per_step / world` prompts, samples and verifies its own groups (a
group never straddles ranks), and the global pieces are collective: the sampling rounds, the advantage
whitening, the loss normaliser of each mini-batch, the gradients (summed: each rank's loss is already
divided by the global normaliser) and the metrics (prorl/metrics.py). A rank with less work (fewer kept
groups, shorter responses) runs dummy passes so that FSDP's collectives match.

Where things run. Models and step tensors live on `dist_info().device`: cuda:LOCAL_RANK under torchrun on
GPUs, else the CPU. The sampler is prorl's `NativeGenerator` on the policy itself (no weight copy; under
FSDP on an unsharded copy that receives the weights after each step) or a colocated `VLLMGenerator` that
sleeps while the policy trains and gets the weights pushed and checked after each step.

Cost. The log-prob passes pack each group's prompt once with its n responses attending to it (packing.py)
and split the work into micro-batches of at most `trainer.micro_batch_tokens` tokens (gradient
accumulation). The old-policy pass skips the first mini-batch's groups: there old_logp = logp.detach().
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings

import torch
import torch.distributed as dist

from prorl import algorithm, packing, rollout_budget
from prorl.config import Config, check_world
from prorl.data import stop_token_ids
from prorl.engine.fp8 import FP8Training, fp8_layers
from prorl.engine.model import load_hf
from prorl.engine.optim import Optimizer
from prorl.engine.parallel import all_reduce, copy_parameters_, dist_info, iter_full_tensors, watchdog
from prorl.engine.rollout import build_generator, resolve_backend
from prorl.kernels import group_advantages, linear_logprob_entropy, ppo_loss
from prorl.metrics import StepAccumulator, perf_metrics, step_metrics
from prorl.packing import MicroBatch, StepBatch
from prorl.sampling import Group, GroupSampler, shape_rewards


class TrainingStalled(RuntimeError):
    """Training cannot go on (steps without a group to train on, or non-finite gradients, repeated
    `trainer.max_consecutive_skips` times); raised on every rank together, the message says why."""


class Trainer:
    """The RL step and everything it trains: policy, reference, optimizer, sampler. A stateful object
    (`state_dict` / `load_state_dict`: collective, the same dict on every rank) beside the models and the
    optimizer, which the checkpointer saves through DCP."""

    DUMMY_TOKENS = 16  # a dummy pass's length: Transformer Engine's FP8 GEMMs need a multiple of 16 rows

    def __init__(self, cfg: Config, model_path: str, tokenizer, train_examples, val_examples, reward_pool):
        self.cfg, self.model_path, self.tokenizer, self.pool = cfg, model_path, tokenizer, reward_pool
        info = dist_info()
        self.rank, self.world, self.device = info.rank, info.world_size, info.device
        check_world(cfg, self.world)
        torch.manual_seed(cfg.seed + self.rank)
        self.dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.backend = resolve_backend(cfg.rollout.backend, self.device)
        self.fsdp = cfg.model.fsdp and dist.is_available() and dist.is_initialized()
        if cfg.model.fp8 != "none" and not self.fsdp:
            raise RuntimeError(
                f"model.fp8={cfg.model.fp8} needs FSDP2, which needs a process group: launch with torchrun "
                "(--nproc_per_node=1 is fine)"
            )
        self.fp8 = FP8Training.of(cfg.model, fsdp=self.fsdp)
        self.policy, self.reference, self.sampler_model = self._build_models()
        # before any forward: FSDP2 leaves the root unsharded after one (engine.optim reshards anyway)
        total = max(cfg.trainer.total_steps * cfg.trainer.mini_batches, 1)
        self.optimizer = Optimizer(self.policy, dataclasses.replace(cfg.optim, total_steps=total))
        self.reset_policy = algorithm.ReferenceResetPolicy(**vars(cfg.algorithm.reset))
        self.stop_ids = stop_token_ids(tokenizer, model_path)
        self.generator = self._build_generator()
        self.sampler = GroupSampler(
            cfg,
            tokenizer,
            train_examples,
            self.generator,
            reward_pool,
            self.stop_ids,
            rank=self.rank,
            world=self.world,
        )
        self.val_examples = val_examples
        # one copy of each prompt per group in the log-prob passes; not with dynamic RoPE, whose scaling
        # depends on the whole sequence's length
        self.share = cfg.trainer.share_prompts and self.policy.config.rope.rope_type != "dynamic"
        self.last_sync_check: dict | None = None  # vLLM: the post-sync probe report
        self.step_count = 0
        self.consecutive_skips = 0  # optimizer steps skipped in a row (non-finite gradients)
        self.empty_steps = 0  # RL steps in a row that kept no group on any rank

    # -- models and sampler ----------------------------------------------------------------------------
    def _build_models(self):
        """(policy, reference, sampler_model). Replicated: the policy in `model.dtype` (bf16 without an fp32
        master copy: small updates round away, hence the warning), the native sampler on the policy itself.
        FSDP2 (whenever asked for and a process group exists, one rank included): fp32 master weights
        whatever the checkpoint's dtype, computed in `model.dtype` (mixed precision); the reference holds
        the same fp32 values, so that after a reset it equals the policy exactly and computes identically;
        the native sampler gets an unsharded copy in `model.dtype`, synced after every update."""
        cfg, attention = self.cfg, None if self.cfg.model.attention == "auto" else self.cfg.model.attention
        load = lambda dtype: load_hf(self.model_path, dtype=dtype, device=self.device, attention=attention)

        if not self.fsdp:
            if self.dtype != torch.float32 and self.rank == 0:
                warnings.warn(
                    f"model.dtype={cfg.model.dtype} without FSDP: the policy's weights and AdamW step are in "
                    f"{cfg.model.dtype} (no fp32 master copy), so small updates are lost to rounding. For "
                    "bf16 compute over fp32 master weights set model.fsdp=true and launch with torchrun "
                    "(one process is enough).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            policy, reference = load(self.dtype), load(self.dtype).requires_grad_(False).eval()
            if cfg.model.compile:
                policy.compile()
                reference.compile()
            return policy, reference, policy if self.backend == "native" else None
        from prorl.engine.parallel import parallelize

        opts = dict(
            activation_checkpointing=cfg.model.activation_checkpointing,
            compile=cfg.model.compile,
            param_dtype=None if self.dtype == torch.float32 else self.dtype,
            cpu_offload=cfg.model.cpu_offload,
            dp_replicate=cfg.model.dp_replicate,  # HSDP across nodes (engine.parallel.data_parallel_mesh)
        )
        # FP8 (model.fp8): policy and reference get the same conversion, so that after a reset they compute
        # identically and the KL is exactly zero; the sampler's copy stays unconverted (engine/fp8.py)
        policy = parallelize(self.fp8.convert(load(torch.float32)), **opts)
        reference = parallelize(self.fp8.convert(load(torch.float32)).requires_grad_(False).eval(), **opts)
        sampler_model = load(self.dtype).requires_grad_(False).eval() if self.backend == "native" else None
        return policy, reference, sampler_model

    @property
    def fp8_summary(self) -> str:
        """One line on what runs in FP8 (model.fp8): the converted layers and where the GEMMs run."""
        layers = fp8_layers(self.policy)
        emulated = any(getattr(getattr(m, "config", None), "emulate", False) for m in layers)
        gemm = "emulated FP8 GEMMs (CPU)" if emulated else "FP8 GEMMs"
        return (
            f"{self.fp8.backend} {self.fp8.recipe}: {len(layers)} Linear layers of the policy and the "
            f"reference in {gemm}; LM head and sampler in {self.cfg.model.dtype}"
        )

    def _build_generator(self):
        r = self.cfg.rollout
        generator = build_generator(
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
            # engine and policy hold the same weights now: the gap measured here is the yardstick of the
            # post-sync checks (a collective under FSDP)
            generator.calibrate(self.policy)
        return generator

    def sync_sampler(self) -> None:
        """Give the sampler the policy's current weights: nothing for the native sampler on the policy
        itself; the unsharded copy (native under FSDP) or the vLLM engine (woken first, then checked
        against the policy: a failed sync raises StaleWeightsError instead of sampling stale weights).
        Tensors travel one at a time, cast to the sampler's dtype before they are gathered."""
        if self.backend == "vllm":
            tensors = iter_full_tensors(self.policy, self.dtype)
            self.last_sync_check = self.generator.update_weights(tensors, reference=self.policy)
        elif self.fsdp:
            self.generator.update_weights(iter_full_tensors(self.policy, self.dtype))

    def export_hf(self, path: str) -> None:
        """The policy as a Hugging Face directory in `model.dtype` (collective under FSDP)."""
        from prorl.engine.parallel import export_hf

        export_hf(self.policy, path, dtype=self.dtype)

    def close(self) -> None:
        """Release the sampler (a vLLM engine) before the process group goes."""
        self.generator.close()

    @property
    def logprob_temperature(self) -> float:
        """The temperature the trainer divides logits by: the sampler's (1 for greedy sampling)."""
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    # -- one step --------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One RL step (module docstring); returns its metrics (global: every rank gets the same)."""
        cfg, t_start, acc = self.cfg, time.perf_counter(), StepAccumulator(self.device)
        max_new = algorithm.scheduled_value(
            self.step_count, cfg.rollout.max_response_schedule, cfg.rollout.max_response_tokens
        )
        self.sampler.reward_time = 0.0
        groups = self.sampler.collect(
            cfg.trainer.prompts_per_step // self.world, max_new, self.step_count, acc
        )
        timing = {"timing_s/reward": self.sampler.reward_time}
        timing["timing_s/gen"] = time.perf_counter() - t_start - self.sampler.reward_time
        trained = int(all_reduce(float(len(groups)), what="the kept-group count"))  # every rank's
        if trained and self.backend == "vllm":
            self.generator.sleep()  # free the engine's GPU memory while we train; sync_sampler wakes it
        if cfg.algorithm.dynamic_sampling:
            self.carry_old_logprobs()
        term = shape_rewards(groups, cfg.reward, self.step_count, max_new)
        self._record_batch(acc, groups, term)
        if trained:
            timing.update(self.update(StepBatch.of(groups, cfg.rollout.n, self.device), max_new, acc))
        reduced = acc.reduce()
        metrics = step_metrics(reduced) | timing
        metrics["actor/lr"] = self.optimizer.lr
        reason = self._after_update(metrics["actor/kl_mean"], metrics["dynamic_sampling/rounds"], trained)
        metrics.update(
            {
                "trainer/empty_step": float(not trained),
                "ref/num_resets": self.reset_policy.num_resets,
                "ref/last_reset_step": self.reset_policy.last_reset_step,
                "ref/reset_reason": reason or "",
            }
        )
        metrics.update(perf_metrics(reduced[0], self._clock() - t_start, self.world))
        self.step_count += 1
        metrics["step"] = self.step_count
        return metrics

    def _after_update(self, kl: float, rounds: float, trained: int) -> str | None:
        """The reference-reset policy after a step that trained (counted in completed steps: interval N
        resets after steps N, 2N, ...); the empty-step count after one that did not. Returns the reset's
        reason, if any."""
        if trained:
            self.empty_steps = 0
            reason = self.reset_policy.should_reset(self.step_count + 1, kl)
            if reason is not None:
                self.reset_reference()
            return reason
        self.empty_steps += 1  # no group of this step carried a learning signal on any rank
        if self.empty_steps >= self.cfg.trainer.max_consecutive_skips:
            raise TrainingStalled(
                f"{self.empty_steps} consecutive steps kept no group: every sampled group's rewards were all "
                f"equal (all right or all wrong) after {int(rounds)} rounds of dynamic sampling. The data is "
                "too easy or too hard for the model, or rollout.max_response_tokens cuts every answer; raise "
                "algorithm.max_rounds (scheduler.min_yield=0: no refill round skipped) or "
                "trainer.max_consecutive_skips to wait longer"
            )
        return None

    @staticmethod
    def _record_batch(acc: StepAccumulator, groups: list[Group], term: torch.Tensor) -> None:
        """Per-sample statistics of the groups trained on (scores, rewards, lengths)."""

        def values(per_sample):
            return torch.tensor(list(per_sample), dtype=torch.float64)

        acc.sum("samples", sum(len(g.raw) for g in groups))
        acc.sum("truncated", values(t for g in groups for t in g.truncated).sum())
        acc.sum("length_term", term.double().sum())
        for name, v in (
            ("score", values(r for g in groups for r in g.raw)),
            ("reward", values(r for g in groups for r in g.shaped)),
            ("response_length", values(len(t) for g in groups for t in g.responses)),
            ("prompt_length", values(len(g.prompt_ids) for g in groups for _ in g.responses)),
        ):
            acc.sum(name, v.sum())
            acc.max(name, v.max() if v.numel() else -math.inf)
            acc.min(name, v.min() if v.numel() else math.inf)

    # -- log-probs -------------------------------------------------------------------------------------
    def logprobs(self, model, batch: packing.PackedBatch, grad: bool, entropy: bool = False):
        """Log-probs (and entropies) of the batch's response tokens, [R], from hidden states (fused op)."""
        with torch.set_grad_enabled(grad):
            with self.fp8.autocast():  # TE: FP8 forward; the backward runs outside (TE's rule)
                hidden = packing.hidden_states(model, batch, pad_multiple=self.fp8.token_multiple)
            t = self.logprob_temperature
            return linear_logprob_entropy(
                hidden, model.lm_head_weight, batch.labels, temperature=t, return_entropy=entropy
            )

    def dummy_pass(self, model, grad: bool) -> None:
        """A pass that contributes nothing, for a rank with less work than another under FSDP: every
        forward all-gathers and every backward reduce-scatters, so every rank runs as many. It goes through
        the same code as a real micro-batch (the fused op reads the LM head), so that its backward produces
        a gradient for every parameter a real one does: with an untied LM head a plain forward would leave
        lm_head.weight without one, and the ranks' reduce-scatters would differ in size (gloo aborts,
        NCCL hangs)."""
        batch = packing.pack([([0], [[0] * (self.DUMMY_TOKENS - 1)])], self.share, self.device)
        logp, ent = self.logprobs(model, batch, grad=grad, entropy=grad)
        if grad:
            ((logp.float().sum() + ent.float().sum()) * 0.0).backward()

    @torch.no_grad()
    def response_logprobs(self, model, batch: StepBatch, first_group: int = 0) -> torch.Tensor:
        """Log-probs of the response tokens under `model`, micro-batched: fp32 [R], 0 before first_group."""
        model.eval()
        out = torch.zeros(batch.resp_cu[-1], dtype=torch.float32, device=self.device)
        plan = dict(budget=self.cfg.trainer.micro_batch_tokens, share=self.share, even=self.fsdp)
        for micro in packing.plan_passes(batch, first_group, len(batch.groups), **plan):
            if micro is None:
                self.dummy_pass(model, grad=False)
            else:
                out[micro.lo : micro.hi] = self.logprobs(model, micro.packed, grad=False)[0].float()
        return out

    def carry_old_logprobs(self) -> None:
        """The trainer's log-probs of the carried-over groups under the current policy - the one that
        sampled them - taken before this step's update: their pi_old when the next step trains on them
        (off-policy by one update). Without it their ratio would be 1 and clipping would never act on
        them. A collective under FSDP: every rank calls it, with or without carried groups."""
        carry, n = self.sampler.carry, self.cfg.rollout.n
        batch = StepBatch.of(carry, n, self.device)
        old, cu = self.response_logprobs(self.policy, batch).tolist(), batch.resp_cu
        for i, g in enumerate(carry):
            g.old_logps = [old[cu[i * n + j] : cu[i * n + j + 1]] for j in range(len(g.responses))]

    # -- the update ------------------------------------------------------------------------------------
    def update(self, batch: StepBatch, max_new: int, acc: StepAccumulator) -> dict[str, float]:
        """Advantages, reference (and old) log-probs, then M mini-batch updates, each micro-batched.

        pi_old: for groups sampled this step, the first mini-batch differentiates the policy that sampled
        them and old_logp = logp.detach() exactly, so the no-grad pass skips them (TRL and verl do the same
        with one mini-batch); the later mini-batches are off-policy and their old_logp is recomputed.
        Carried-over groups use the log-probs recorded before the previous step's update. A rank may hold
        no group: it still takes part in every collective. Returns the phase timings."""
        cfg, a, timing, t0 = self.cfg, self.cfg.algorithm, {}, self._clock()
        adv = self.advantages(batch)
        token_adv = batch.per_token(adv)
        timing["timing_s/adv"], t0 = self._clock() - t0, self._clock()
        t, old = cfg.trainer, None
        minis = packing.plan_update(
            batch,
            mini_batches=t.mini_batches,
            budget=t.micro_batch_tokens,
            share=self.share,
            agg=a.agg,
            max_new=max_new,
            even=self.fsdp,
        )
        first = 0 if t.recompute_old_logp else minis[0].groups[1]  # mini-batch 0: logp.detach()
        if t.mini_batches > 1 or t.recompute_old_logp:
            fresh = self.response_logprobs(self.policy, batch, first)
            old = torch.where(batch.carried, batch.stored_old, fresh)
        timing["timing_s/old_log_prob"], t0 = self._clock() - t0, self._clock()
        with watchdog().phase(f"step {self.step_count + 1}, reference log-probs"):
            ref = self.response_logprobs(self.reference, batch)
        timing["timing_s/ref"], t0 = self._clock() - t0, self._clock()
        self.policy.train()
        norms = 0.0
        for m, mini in enumerate(minis):
            if mini.empty:  # no response token in this mini-batch on any rank (a rank with none still steps)
                continue
            for micro in mini.passes:
                if micro is None:
                    self.dummy_pass(self.policy, grad=True)
                    continue
                logp, ent = self.logprobs(self.policy, micro.packed, grad=True, entropy=True)
                s, e = micro.lo, micro.hi
                if old is None or (m == 0 and first):
                    old_mb = torch.where(batch.carried[s:e], batch.stored_old[s:e], logp.detach().float())
                else:
                    old_mb = old[s:e]
                loss, metrics, ent_sum = self.loss(
                    micro, logp, ent, old_mb, ref[s:e], token_adv[s:e], batch, mini
                )
                loss.backward()
                self._record(acc, metrics, ent_sum, old_mb, batch.sampler_logp[s:e])
            norms += self.optimizer_step()
            acc.max("updates", m + 1)
        acc.max("grad_norm", norms)  # the global norm, the same on every rank: not summed over ranks
        timing["timing_s/update_actor"], t0 = self._clock() - t0, self._clock()
        with watchdog().phase(f"step {self.step_count + 1}, weight sync"):
            self.sync_sampler()
        timing["timing_s/update_weights"] = self._clock() - t0
        acc.sum("advantage", adv.sum())
        acc.max("advantage", adv.max() if adv.numel() else -math.inf)
        acc.min("advantage", adv.min() if adv.numel() else math.inf)
        return timing

    def advantages(self, batch: StepBatch) -> torch.Tensor:
        """Per-response advantages [S]: centred per group, whitened over all ranks (docs/recipe.md §2)."""
        a = self.cfg.algorithm
        return group_advantages(
            batch.rewards,
            torch.arange(len(batch.groups), device=self.device).repeat_interleave(batch.n),
            mode=a.advantage,
            std_unbiased=a.grpo_std_unbiased,
            lengths=torch.tensor(batch.lengths, dtype=torch.float32, device=self.device),
            weighting=a.whiten_weighting,
            num_groups=len(batch.groups),
            process_group=dist.group.WORLD if self.world > 1 else None,
        )

    def loss(self, micro: MicroBatch, logp, ent, old, ref, adv, batch: StepBatch, mini: packing.MiniBatch):
        """This micro-batch's share of the mini-batch loss: PPO-Clip-Higher + KL (+ entropy bonus), with
        the raw sampler-vs-trainer weights when `algorithm.is_mode` corrects for them (bounded once, in
        ppo_loss). Returns (loss, ppo_loss's metrics, the entropy sum)."""
        a, s, e, normalizer = self.cfg.algorithm, micro.lo, micro.hi, mini.normalizer
        is_w = algorithm.importance_weights(old, batch.sampler_logp[s:e]) if a.is_mode != "none" else None
        loss, metrics = ppo_loss(
            logp,
            old,
            adv,
            batch.mask[s:e],
            eps_low=a.eps_low,
            eps_high=a.eps_high,
            dual_clip=a.dual_clip,
            ref_logp=ref,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
            kl_clamp=a.kl_clamp,
            is_weights=is_w,
            is_mode=a.is_mode,
            is_bounds=(a.is_low, a.is_high),
            agg=a.agg,
            normalizer=normalizer,
            cu_seqlens=micro.packed.resp_cu,
        )
        ent_sum = ent.float().sum()
        if a.entropy_coef:
            loss = loss - a.entropy_coef * ent_sum / normalizer
        return loss, metrics, ent_sum

    def optimizer_step(self) -> float:
        """Sum the gradients over ranks (FSDP2 reduces them itself), step; returns the finite grad norm."""
        if self.world > 1 and not self.fsdp:
            params = list(self.policy.parameters())
            for p in params:  # a rank with no tokens in this mini-batch still takes part
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        result = self.optimizer.step()
        self.fp8.after_optimizer_step(self.policy)
        self.consecutive_skips = 0 if not result.skipped else self.consecutive_skips + 1
        if self.consecutive_skips >= self.cfg.trainer.max_consecutive_skips:
            raise TrainingStalled(
                f"{self.consecutive_skips} consecutive optimizer steps skipped for non-finite gradients; "
                "stopping (lower optim.lr or check the data)"
            )
        return result.grad_norm if math.isfinite(result.grad_norm) else 0.0

    @staticmethod
    def _record(acc: StepAccumulator, m: dict, ent_sum, old_logp, sampler_logp) -> None:
        """One micro-batch's loss metrics (means over its tokens, weighted back to sums)."""
        n_tok = m["num_tokens"].double()
        acc.sum("tokens", n_tok)
        acc.sum("pg_loss", m["pg_loss"])
        acc.sum("kl_loss", m["kl_loss"])
        acc.sum("entropy", ent_sum.detach())
        for key, name in (
            ("clipfrac", "clip_any"),
            ("dualclip_frac", "clip_dual"),
            ("clipfrac_high", "clip_high"),
            ("clipfrac_low", "clip_low"),
            ("approx_kl", "old_minus_new"),
            ("kl_mean", "kl"),
        ):
            acc.sum(name, m[key].double() * n_tok)
        gap = (old_logp - sampler_logp).abs()
        acc.sum("mismatch", gap.sum())
        acc.max("mismatch", gap.max() if gap.numel() else -math.inf)
        if "is_mean" in m:
            acc.sum("is_weight", m["is_mean"].double() * n_tok)
            acc.sum("is_modified", m["is_frac_modified"].double() * n_tok)
            acc.max("is_weight", m["is_max"])

    def _clock(self) -> float:
        """time.perf_counter() after the device's queued work (CUDA runs asynchronously: without the sync
        a phase's kernels would be timed in the next phase). One sync per phase boundary."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- reference reset and validation ----------------------------------------------------------------
    @torch.no_grad()
    def reset_reference(self) -> None:
        """pi_ref <- current policy, exactly (shard by shard under FSDP, in the sharded state checkpoints
        save); optimizer state kept unless reset_optimizer (v1)."""
        copy_parameters_(self.reference, self.policy)
        if self.reset_policy.reset_optimizer:  # v1 behaviour; v2 keeps the optimizer state
            self.optimizer.reset_state()
        self.reset_policy.record_reset(self.step_count + 1)

    @torch.no_grad()
    def validate(self, log=None) -> dict[str, float]:
        """Held-out evaluation with the trainer's own sampler: `prorl.eval.evaluate` on this rank's share of
        the validation examples (`trainer.val_samples` per prompt at `trainer.val_temperature` /
        `val_top_p`), the per-sample records gathered from every rank and summarised together.

        Returns `val/accuracy` (mean verifier score over every sample; for binary verifiers the mean
        pass@1), `val/pass@j`, and per data source `val-core/<source>/reward/mean@k` (verl's name),
        `val-core/<source>/pass@j` and a reward function's extras (`prorl.eval.source_val_metrics`).
        Collective: every rank calls it."""
        from prorl.eval import evaluate, source_val_metrics, summarize

        cfg, k = self.cfg, self.cfg.trainer.val_samples
        mine = list(range(self.rank, len(self.val_examples), self.world))
        results = evaluate(
            None,
            [self.val_examples[i] for i in mine],
            k,
            temperature=cfg.trainer.val_temperature,
            top_p=cfg.trainer.val_top_p if cfg.trainer.val_temperature > 0 else 1.0,
            max_tokens=cfg.rollout.max_response_tokens,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            seed=cfg.seed,
            model=self.sampler_model if self.sampler_model is not None else self.policy,
            tokenizer=self.tokenizer,
            pool=self.pool,
            generator=self.generator,
            log=log,
        )
        fields = "data_source score correct timed_out errored finish_reason response_tokens extras".split()
        records = [{"index": mine[r["index"]], **{f: r[f] for f in fields}} for r in results["samples"]]
        if self.world > 1:
            gathered = [None] * self.world
            with watchdog().waiting("all-gather of the validation records"):
                dist.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        summary = summarize(records, k)
        out = {"val/accuracy": summary["all"]["mean_score"] or 0.0}
        out.update({f"val/{m}": v for m, v in summary["all"].items() if m.startswith("pass@")})
        for source, m in summary["by_source"].items():
            out.update(source_val_metrics(source, m, k))
        self.reset_policy.observe_validation(out["val/accuracy"])
        return out

    # -- checkpointed state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything besides the models and the optimizer that an exact resume needs. Collective: the data
        position and the carry-over differ by rank, so every rank's part is gathered; the result is the
        same on every rank."""
        local = {
            "sampler": self.sampler.state_dict(),
            "consecutive_skips": self.consecutive_skips,
            "empty_steps": self.empty_steps,
        }
        ranks = [local]
        if self.world > 1:
            ranks = [None] * self.world
            with watchdog().waiting("all-gather of the trainer state"):
                dist.all_gather_object(ranks, local)
        policy = self.reset_policy.state_dict()
        return {"world": self.world, "step_count": self.step_count, "ranks": ranks, "reset_policy": policy}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`. On another number of ranks (the models and optimizer were resharded by
        DCP) every rank starts a fresh pass over the data and the carry-over is dropped (per-rank data
        positions cannot be mapped onto other ranks); the prompt record, global, is kept."""
        ranks = [_upgrade(r) for r in state["ranks"]]
        self.step_count = state.get("step_count", ranks[0].get("step_count", 0))
        self.reset_policy.load_state_dict(state["reset_policy"])
        same_world = state["world"] == self.world
        local = ranks[self.rank] if same_world else ranks[0]  # the prompt record is the same on every rank
        self.sampler.load_state_dict(local["sampler"], record_only=not same_world)
        if same_world:
            self.consecutive_skips, self.empty_steps = local["consecutive_skips"], local.get("empty_steps", 0)
        elif self.rank == 0:
            warnings.warn(
                f"resuming a checkpoint of {state['world']} ranks on {self.world}: the models, the optimizer "
                "and the prompt record are restored, but each rank starts a fresh pass over the data and "
                "the dynamic-sampling carry-over is dropped",
                RuntimeWarning,
                stacklevel=2,
            )
        self.sync_sampler()  # the checkpoint restored the policy, not the sampler's copy


def _upgrade(local: dict) -> dict:
    """A rank's trainer state as saved before the sampler had a state of its own."""
    if "sampler" in local:
        return local
    keys = ("data_order", "data_rng", "carry")
    return {**local, "sampler": {k: local[k] for k in keys}}
