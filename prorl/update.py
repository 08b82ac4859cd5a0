"""The policy update of one RL step: advantages, the log-prob passes (old and reference), then M
mini-batches x micro-batches of PPO-Clip-Higher + k2 KL, each mini-batch one optimizer step.

Cost. The log-prob passes pack each group's prompt once with its n responses attending to it
(packing.py) and split the work into micro-batches of at most `trainer.micro_batch_tokens` tokens
(gradient accumulation). The old-policy pass skips the first mini-batch's groups: there old_logp =
logp.detach().

Across ranks the global pieces are collective: the advantage whitening, the loss normaliser of each
mini-batch, the gradients (summed: each rank's loss is already divided by the global normaliser) and
the metrics (prorl/metrics.py). A rank with less work (fewer kept groups, shorter responses) runs
dummy passes so that FSDP's collectives match.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

from prorl import algorithm, packing
from prorl.config import Config
from prorl.engine import parallel
from prorl.engine.distributed import watchdog
from prorl.engine.optim import Optimizer
from prorl.kernels import group_advantages, linear_logprob_entropy, ppo_loss
from prorl.metrics import StepAccumulator, record_loss
from prorl.packing import MicroBatch, StepBatch, TokenInputs
from prorl.policy import PolicyModels


class TrainingStalled(RuntimeError):
    """Training cannot go on (steps without a group to train on, or non-finite gradients, repeated
    `trainer.max_consecutive_skips` times); raised on every rank together, the message says why."""


# the phases of the update, in every step row (0 in a step that trains nothing)
UPDATE_TIMINGS = ("timing_s/adv", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor",
                  "timing_s/update_weights")  # fmt: skip


class Updater:
    """Trains `models.policy`: owns the optimizer, the log-prob passes (`logprobs`, `dummy_pass`,
    `response_logprobs`) and pi_old (`store_old_logprobs`), runs the update (`run`) and counts the
    optimizer steps skipped in a row."""

    # a dummy pass's length: Transformer Engine's FP8 GEMMs need a multiple of 16 rows
    DUMMY_TOKENS = 16

    def __init__(self, cfg: Config, models: PolicyModels):
        self.cfg, self.policy, self.reference = cfg, models.policy, models.reference
        self.fp8, self.device, self.world = models.fp8, models.device, models.world
        # under FSDP every rank runs as many passes (dummy ones where it has less work)
        self.fsdp = models.fsdp
        # before any forward: FSDP2 leaves the root unsharded after one (engine.optim reshards)
        total = max(cfg.trainer.total_steps * cfg.trainer.mini_batches, 1)
        self.optimizer = Optimizer(self.policy, dataclasses.replace(cfg.optim, total_steps=total))
        # one copy of each prompt per group in the log-prob passes; not with dynamic RoPE, whose
        # scaling depends on the whole sequence's length
        self.share = cfg.trainer.share_prompts and self.policy.config.rope.rope_type != "dynamic"
        self.consecutive_skips = 0  # optimizer steps skipped in a row (non-finite gradients)

    @property
    def logprob_temperature(self) -> float:
        """The temperature the trainer divides logits by: the sampler's (1 for greedy sampling)."""
        temperature = self.cfg.rollout.temperature
        return temperature if temperature > 0 else 1.0

    # -- log-prob passes -----------------------------------------------------------------------
    def logprobs(self, model, batch: packing.PackedBatch, grad: bool, entropy: bool = False):
        """Log-probs (and entropies) of the batch's response tokens [R], by the fused op."""
        with torch.set_grad_enabled(grad):
            with self.fp8.autocast():  # TE: FP8 forward; the backward runs outside (TE's rule)
                hidden = packing.hidden_states(model, batch, pad_multiple=self.fp8.token_multiple)
            return linear_logprob_entropy(
                hidden,
                model.lm_head_weight,
                batch.labels,
                temperature=self.logprob_temperature,
                return_entropy=entropy,
            )

    def dummy_pass(self, model, grad: bool) -> None:
        """A pass that contributes nothing, for a rank with less work than another under FSDP: every
        forward all-gathers and every backward reduce-scatters, so every rank runs as many. It goes
        through the same code as a real micro-batch (the fused op reads the LM head), so that its
        backward produces a gradient for every parameter a real one does: with an untied LM head a
        plain forward would leave lm_head.weight without one, and the ranks' reduce-scatters would
        differ in size (gloo aborts, NCCL hangs)."""
        batch = packing.pack([([0], [[0] * (self.DUMMY_TOKENS - 1)])], self.share, self.device)
        logp, ent = self.logprobs(model, batch, grad=grad, entropy=grad)
        if grad:
            ((logp.float().sum() + ent.float().sum()) * 0.0).backward()

    def store_old_logprobs(self, groups: list) -> None:
        """pi_old of groups carried into the next step (`Group.old_logps`): their log-probs under
        the current policy - the one that sampled them - taken before this step's update, so that
        the next step trains on them off-policy by one update (without it their ratio would be 1
        and clipping would never act on them). A collective under FSDP: every rank calls it, with
        or without groups."""
        n = self.cfg.rollout.n
        batch = StepBatch.of(groups, n, self.device)
        old, cu = self.response_logprobs(self.policy, batch).tolist(), batch.resp_cu
        for i, g in enumerate(groups):
            g.old_logps = [old[cu[i * n + j] : cu[i * n + j + 1]] for j in range(len(g.responses))]

    @torch.no_grad()
    def response_logprobs(self, model, batch: StepBatch, passes=None) -> torch.Tensor:
        """Log-probs of the response tokens under `model`: fp32 [R], 0 outside `passes` (the
        step's planned micro-batches; None: planned here for the whole batch)."""
        model.eval()
        out = torch.zeros(batch.resp_cu[-1], dtype=torch.float32, device=self.device)
        if passes is None:
            budget = self.cfg.trainer.micro_batch_tokens
            plan = dict(budget=budget, share=self.share, lockstep=self.fsdp)
            passes = packing.plan_passes(batch, 0, len(batch.groups), **plan)
        for micro in passes:
            if micro is None:
                self.dummy_pass(model, grad=False)
            else:
                out[micro.lo : micro.hi] = self.logprobs(model, micro.packed, grad=False)[0].float()
        # FSDP2 keeps the root and the last block unsharded after a forward and reshards them in
        # backward, which a no-grad pass lacks: without this the reference would hold them full
        # (0.9 GB at 1.5B) through the update and the colocated sampler's wake
        parallel.reshard(model)
        return out

    # -- the update ----------------------------------------------------------------------------
    def run(self, batch: StepBatch, max_new: int, acc: StepAccumulator, step: int) -> dict:
        """Advantages, reference (and old) log-probs, then M mini-batch updates, each micro-batched.

        pi_old (`TokenInputs.pi_old`): for groups sampled this step, the first mini-batch
        differentiates the policy that sampled them and old_logp = logp.detach() exactly, so the
        no-grad pass skips them (TRL and verl do the same with one mini-batch); the later
        mini-batches are off-policy and their old_logp is recomputed. Carried-over groups use the
        log-probs stored before the previous step's update. A rank may hold no group: it still takes
        part in every collective. `step` (0-based) names the phases for the watchdog. Returns the
        phase timings."""
        schedule, timing, t0 = self.cfg.trainer, {}, clock(self.device)
        adv = self.advantages(batch)
        token_adv = batch.per_token(adv)
        timing["timing_s/adv"], t0 = clock(self.device) - t0, clock(self.device)
        minis = packing.plan_update(
            batch,
            mini_batches=schedule.mini_batches,
            budget=schedule.micro_batch_tokens,
            share=self.share,
            agg=self.cfg.algorithm.agg,
            max_new=max_new,
            lockstep=self.fsdp,
        )
        # this step's groups in mini-batch 0: old_logp = logp.detach(), no pass
        first = 0 if schedule.recompute_old_logp else minis[0].groups[1]
        old, ref, t0 = self.old_and_reference(batch, minis, step, timing, t0)
        inputs = dataclasses.replace(batch.tokens, advantage=token_adv, ref_logp=ref, old_logp=old)
        self.policy.train()
        norms = 0.0
        for m, mini in enumerate(minis):
            # no response token in this mini-batch on any rank (a rank with none still steps)
            if mini.empty:
                continue
            for i, micro in enumerate(mini.passes):  # as many on every rank under FSDP
                parallel.set_gradient_all_reduce(self.policy, i == len(mini.passes) - 1)  # HSDP
                if micro is None:
                    self.dummy_pass(self.policy, grad=True)
                    continue
                logp, ent = self.logprobs(self.policy, micro.packed, grad=True, entropy=True)
                tokens = inputs.slice(micro)
                if tokens.old_logp is None or (m == 0 and first):
                    tokens.old_logp = tokens.pi_old(logp.detach().float())
                loss, metrics, ent_sum = self.loss(micro, logp, ent, tokens, mini.normalizer)
                loss.backward()
                record_loss(acc, metrics, ent_sum, tokens.old_logp, tokens.sampler_logp)
            norms += self.optimizer_step()
            acc.max("updates", m + 1)
        # the global norm, the same on every rank: not summed over ranks
        acc.max("grad_norm", norms)
        timing["timing_s/update_actor"] = clock(self.device) - t0
        acc.sum("advantage", adv.sum())
        acc.max("advantage", adv.max() if adv.numel() else -math.inf)
        acc.min("advantage", adv.min() if adv.numel() else math.inf)
        return timing

    def old_and_reference(self, batch: StepBatch, minis: list, step: int, timing: dict, t0):
        """pi_old [R] (None when every mini-batch takes it from its own pass; mini-batch 0's
        groups sampled this step skipped, `run`) and the reference's log-probs [R], through the
        update's own passes: packed once per step, they serve all three. Adds their timings;
        returns (old, ref, clock)."""
        schedule = self.cfg.trainer
        passes = [[p for mini in minis[m:] for p in mini.passes] for m in (0, 1)]
        old = None
        if schedule.mini_batches > 1 or schedule.recompute_old_logp:
            old_passes = passes[0] if schedule.recompute_old_logp else passes[1]
            old = batch.tokens.pi_old(self.response_logprobs(self.policy, batch, old_passes))
        timing["timing_s/old_log_prob"], t0 = clock(self.device) - t0, clock(self.device)
        with watchdog().phase(f"step {step + 1}, reference log-probs"):
            ref = None
            if self.reference is not None:
                ref = self.response_logprobs(self.reference, batch, passes[0])
        timing["timing_s/ref"] = clock(self.device) - t0
        return old, ref, clock(self.device)

    def advantages(self, batch: StepBatch) -> torch.Tensor:
        """Per-response advantages [S]: centred per group, whitened over all ranks (recipe §2)."""
        algo = self.cfg.algorithm
        return group_advantages(
            batch.rewards,
            torch.arange(len(batch.groups), device=self.device).repeat_interleave(batch.n),
            mode=algo.advantage,
            std_unbiased=algo.grpo_std_unbiased,
            lengths=torch.tensor(batch.lengths, dtype=torch.float32, device=self.device),
            weighting=algo.whiten_weighting,
            num_groups=len(batch.groups),
            process_group=dist.group.WORLD if self.world > 1 else None,
        )

    def loss(self, micro: MicroBatch, logp, ent, tokens: TokenInputs, normalizer: torch.Tensor):
        """This micro-batch's share of the mini-batch loss (`normalizer`: the mini-batch's global
        one): PPO-Clip-Higher + KL (+ entropy bonus), with the raw sampler-vs-trainer weights when
        `algorithm.is_mode` corrects for them (bounded once, in ppo_loss). logp, ent [T]: the
        policy's, with grad; `tokens`: the micro-batch's inputs. Returns (loss, ppo_loss's metrics,
        entropy sum)."""
        algo, old = self.cfg.algorithm, tokens.old_logp
        is_w = None
        if algo.is_mode != "none":
            is_w = algorithm.importance_weights(old, tokens.sampler_logp)
        loss, metrics = ppo_loss(
            logp,
            old,
            tokens.advantage,
            tokens.mask,
            eps_low=algo.eps_low,
            eps_high=algo.eps_high,
            dual_clip=algo.dual_clip,
            ref_logp=tokens.ref_logp,
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            kl_clamp=algo.kl_clamp,
            is_weights=is_w,
            is_mode=algo.is_mode,
            is_bounds=(algo.is_low, algo.is_high),
            agg=algo.agg,
            normalizer=normalizer,
            cu_seqlens=micro.packed.resp_cu,
        )
        ent_sum = ent.float().sum()
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * ent_sum / normalizer
        return loss, metrics, ent_sum

    def optimizer_step(self) -> float:
        """Sum the gradients over ranks (FSDP2 reduces them itself), step; returns the finite grad
        norm."""
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
                f"{self.consecutive_skips} consecutive optimizer steps skipped for non-finite "
                "gradients; stopping (lower optim.lr or check the data)"
            )
        return result.grad_norm if math.isfinite(result.grad_norm) else 0.0


def clock(device: torch.device) -> float:
    """time.perf_counter() after the device's queued work (CUDA runs asynchronously: without the
    sync a phase's kernels would be timed in the next phase). One sync per phase boundary."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
