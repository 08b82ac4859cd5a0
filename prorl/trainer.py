"""The ProRL v2 trainer. One RL step (`Trainer.step`), top to bottom:

    sample n responses per prompt, verify, dynamic sampling    sampling.py: GroupSampler.collect
    pi_old of the carry-over (before the update)               update.py: Updater.store_old_logprobs
    shape rewards (stop-properly, scheduled cosine length)     sampling.py: shape_rewards
    flatten the kept groups once                               packing.py: StepBatch
    REINFORCE++-baseline advantages, whitened over all ranks   update.py: Updater.advantages
    reference (and, off-policy, old) log-probs                 update.py: Updater.response_logprobs
    M mini-batches x micro-batches of PPO-Clip-Higher + k2 KL  packing.plan_update, Updater.loss
    weights to the sampler                                     policy.py: PolicyModels.sync_sampler
    metrics, reference reset                                   metrics.py, Trainer.reset_reference

What ProRL does differently from textbook GRPO is listed in prorl/algorithm.py's docstring.

The Trainer is built from parts that each own one concern (docs/architecture.md): `models`
(prorl/policy.py: policy, reference, the sampler and its weight sync, export), `updater`
(prorl/update.py: optimizer, log-prob passes, loss, optimizer step), `sampler`
(prorl/sampling.py: the groups of a step and the carry-over), the reference-reset policy
(prorl/algorithm.py) and validation (prorl/eval.py: `validate`). The Trainer sequences them and
holds the step's own state.

Under torchrun every rank takes `prompts_per_step / world` prompts, samples and verifies its own
groups (a group never straddles ranks); the sampling rounds, the update and the metrics are
collective.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from prorl import algorithm
from prorl.async_rl.remote import RemoteRollouts
from prorl.async_rl.roles import roles
from prorl.config import Config
from prorl.config_runtime import check_world
from prorl.data import stop_token_ids
from prorl.engine.distributed import all_reduce, dist_info, watchdog
from prorl.eval import validate
from prorl.metrics import (
    StepAccumulator,
    async_metrics,
    memory_metrics,
    perf_metrics,
    record_batch,
    record_memory,
    step_metrics,
)
from prorl.packing import StepBatch
from prorl.policy import PolicyModels
from prorl.sampling import GroupSampler, shape_rewards
from prorl.update import UPDATE_TIMINGS, TrainingStalled, Updater, clock

__all__ = ["Trainer", "TrainingStalled", "nothing_learnt"]


def nothing_learnt(metrics: dict, cfg: Config, max_new: int, trained: int) -> str | None:
    """Why a step taught the policy nothing, naming the key to change; None when it did. A step
    learns nothing when it keeps no group, when every advantage is 0 (the policy-gradient term is
    0; only the KL term moves the weights), or when every response hit the response budget."""
    budget = f"rollout.max_response_tokens={max_new}"
    if not trained:
        return (
            "no group kept: every sampled group's rewards were all equal (all right or all wrong) "
            f"after {int(metrics['dynamic_sampling/rounds'])} rounds of dynamic sampling. The "
            f"data is too easy or too hard for the model, or {budget} cuts every answer; raise "
            "algorithm.max_rounds (scheduler.min_yield=0: no refill round skipped)"
        )
    cut = metrics["response_length/clip_ratio"]
    if cut >= 1.0:
        zeroed = " (reward.c_stop=0 scores a cut response 0)" if cfg.reward.c_stop == 0 else ""
        return f"every response hit the budget {budget}{zeroed}: raise it"
    if metrics["critic/advantages/max"] == 0 and metrics["critic/advantages/min"] == 0:
        if not cfg.algorithm.dynamic_sampling:
            fix = "set algorithm.dynamic_sampling=true to drop groups whose rewards are all equal"
        elif cfg.reward.c_stop == 0 and cut > 0:
            fix = (
                f"{cut:.0%} of the responses hit {budget} and reward.c_stop=0 scores them 0: "
                "raise the budget or set reward.c_stop=1"
            )
        else:
            fix = "the reward shaping (reward.length_penalty, reward.c_stop) evened them out"
        return f"every advantage is 0 (each group's shaped rewards are equal): {fix}"
    return None


class Trainer:
    """The RL step and everything it trains. A stateful object (`state_dict` / `load_state_dict`:
    collective, the same dict on every rank) beside the models and the optimizer (`policy`,
    `reference`, `optimizer`), which the checkpointer saves through DCP."""

    def __init__(self, cfg: Config, model_path: str, tokenizer, train_examples, val_examples, pool):
        self.cfg, self.model_path, self.tokenizer, self.pool = cfg, model_path, tokenizer, pool
        info = dist_info()
        self.rank, self.world, self.device = info.rank, info.world_size, info.device
        check_world(cfg, self.world)
        torch.manual_seed(cfg.seed + self.rank)
        self.models = PolicyModels(cfg, model_path)
        # the optimizer is built before any forward (prorl/policy.py says why)
        self.updater = Updater(cfg, self.models)
        self.policy, self.reference = self.models.policy, self.models.reference
        self.optimizer = self.updater.optimizer
        self.reset_policy = algorithm.ReferenceResetPolicy(**vars(cfg.algorithm.reset))
        self.stop_ids = stop_token_ids(tokenizer, model_path)
        self.sampler = GroupSampler(
            cfg,
            tokenizer,
            train_examples,
            self.models.start_sampler(),
            pool,
            self.stop_ids,
            rank=self.rank,
            world=self.world,
        )
        self.val_examples = val_examples
        # asynchronous RL: the step's groups come from the rollout ranks (prorl/async_rl/)
        self.remote = RemoteRollouts(cfg, roles(), self.rank, self.world) if roles() else None
        self.step_count = 0
        self.empty_steps = 0  # RL steps in a row that learnt nothing on any rank
        self.row_keys: dict[str, None] = {}  # every metric key a step row has carried

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One RL step (module docstring); returns its metrics (global: the same on every rank)."""
        cfg, t_start, acc = self.cfg, time.perf_counter(), StepAccumulator(self.device)
        max_new = algorithm.scheduled_value(
            self.step_count, cfg.rollout.max_response_schedule, cfg.rollout.max_response_tokens
        )
        groups, timing = self.sample(max_new, acc, t_start)
        trained = int(all_reduce(float(len(groups)), what="the kept-group count"))  # every rank's
        if trained:
            self.models.sleep_sampler()  # vLLM: free the engine's GPU memory while we train
        if cfg.algorithm.dynamic_sampling:
            self.updater.store_old_logprobs(self.sampler.carry)
        term = shape_rewards(groups, cfg.reward, self.step_count, max_new)
        record_batch(acc, groups, term)
        if trained:
            batch = StepBatch.of(groups, cfg.rollout.n, self.device)
            timing.update(self.update(batch, max_new, acc))
        else:  # the same keys in every row: a step that trains nothing took no time there
            timing.update(dict.fromkeys(UPDATE_TIMINGS, 0.0))
        record_memory(acc, self.device)
        reduced = acc.reduce()
        metrics = step_metrics(reduced, importance=cfg.algorithm.is_mode != "none") | timing
        metrics |= memory_metrics(reduced[1])
        metrics["actor/lr"] = self.optimizer.lr
        empty = nothing_learnt(metrics, cfg, max_new, trained)
        reason = self._end_step(metrics["actor/kl_mean"], empty)
        metrics.update(
            {
                "trainer/empty_step": float(empty is not None),
                "trainer/empty_reason": empty or "",
                "ref/num_resets": self.reset_policy.num_resets,
                "ref/last_reset_step": self.reset_policy.last_reset_step,
                "ref/reset_reason": reason or "",
            }
        )
        metrics.update(perf_metrics(reduced[0], clock(self.device) - t_start, self.world))
        for key in self.row_keys.keys() - metrics.keys():  # keys only some steps register
            metrics[key] = 0.0
        self.row_keys.update(dict.fromkeys(metrics))
        self.step_count += 1
        metrics["step"] = self.step_count
        if self.remote is not None:  # after every step: a version is a count of completed steps
            t0 = clock(self.device)
            if self.step_count < cfg.trainer.total_steps:
                self.remote.push(self.policy, self.models.dtype, self.step_count)
            metrics |= async_metrics(reduced) | {"timing_s/update_weights": clock(self.device) - t0}
        return metrics

    def sample(self, max_new: int, acc: StepAccumulator, t_start: float):
        """This rank's groups of the step (sampled here, or by the rollout ranks) and the
        timings."""
        if self.remote is not None:
            if not self.remote.started:  # after a resume restored the policy
                self.remote.start(self.policy, self.models.dtype, self.step_count)
            return self.remote.take(self.step_count, acc)
        self.sampler.reward_time = 0.0
        groups = self.sampler.collect(
            self.cfg.trainer.prompts_per_step // self.world, max_new, self.step_count, acc
        )
        timing = {"timing_s/reward": self.sampler.reward_time}
        timing["timing_s/gen"] = time.perf_counter() - t_start - self.sampler.reward_time
        return groups, timing

    def update(self, batch: StepBatch, max_new: int, acc: StepAccumulator) -> dict[str, float]:
        """The policy update (prorl/update.py: `Updater.run`), then the new weights to the sampler.
        Returns the phase timings."""
        timing = self.updater.run(batch, max_new, acc, self.step_count)
        t0 = clock(self.device)
        with watchdog().phase(f"step {self.step_count + 1}, weight sync"):
            if self.remote is None:  # asynchronous: the rollout ranks get them after the step
                self.models.sync_sampler()
        timing["timing_s/update_weights"] = clock(self.device) - t0
        return timing

    def _end_step(self, kl: float, empty: str | None) -> str | None:
        """After a step that trained something, the reference-reset policy (counted in completed
        steps: interval N resets after steps N, 2N, ...); after one that did not (`empty`: why),
        the empty-step count, which stops a run that keeps learning nothing. Returns the reset's
        reason, if any."""
        if empty is None:
            self.empty_steps = 0
            reason = self.reset_policy.should_reset(self.step_count + 1, kl)
            if reason is not None:
                self.reset_reference()
            return reason
        self.empty_steps += 1  # no learning signal on any rank
        if self.empty_steps >= self.cfg.trainer.max_consecutive_skips:
            raise TrainingStalled(
                f"{self.empty_steps} consecutive steps learnt nothing; the last: {empty}. Raise "
                "trainer.max_consecutive_skips to wait longer"
            )
        return None

    # -- reference reset and validation ------------------------------------------------------
    def reset_reference(self) -> None:
        """pi_ref <- current policy, exactly; optimizer state kept unless reset_optimizer (v1)."""
        self.models.reset_reference()
        if self.reset_policy.reset_optimizer:  # v1 behaviour; v2 keeps the optimizer state
            self.optimizer.reset_state()
        self.reset_policy.record_reset(self.step_count + 1)

    @torch.no_grad()
    def validate(self, log=None) -> dict[str, float]:
        """Held-out evaluation with the trainer's own sampler (prorl/eval.py: `validate`,
        collective); the reference-reset policy sees its accuracy."""
        m = self.models
        if self.remote is not None:  # asynchronous: this sampler is synced for validation only
            m.sync_sampler()
        model = m.sampler_model if m.sampler_model is not None else self.policy
        examples, tokenizer = self.val_examples, self.tokenizer
        out = validate(
            self.cfg, examples, model, tokenizer, self.pool, m.generator, log, self.step_count
        )
        self.reset_policy.observe_validation(out["val/accuracy"])
        return out

    # -- checkpointed state ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything besides the models and the optimizer that an exact resume needs.
        Collective: the data position and the carry-over differ by rank, so every rank's part is
        gathered; the result is the same on every rank."""
        local = {
            "sampler": self.sampler.state_dict(),
            "consecutive_skips": self.updater.consecutive_skips,
            "empty_steps": self.empty_steps,
        }
        if self.remote is not None:
            local["remote"] = self.remote.state_dict()
        ranks = [local]
        if self.world > 1:
            ranks = [None] * self.world
            with watchdog().waiting("all-gather of the trainer state"):
                dist.all_gather_object(ranks, local)
        return {
            "world": self.world,
            "step_count": self.step_count,
            "ranks": ranks,
            "reset_policy": self.reset_policy.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`. On another number of ranks (the models and optimizer were
        resharded by DCP) every rank starts a fresh pass over the data and the carry-over is dropped
        (per-rank data positions cannot be mapped onto other ranks); the prompt record, global, is
        kept."""
        ranks = [_upgrade(r) for r in state["ranks"]]
        self.step_count = state.get("step_count", ranks[0].get("step_count", 0))
        self.reset_policy.load_state_dict(state["reset_policy"])
        same_world = state["world"] == self.world
        # the prompt record is the same on every rank
        local = ranks[self.rank] if same_world else ranks[0]
        self.sampler.load_state_dict(local["sampler"], record_only=not same_world)
        # the rollout ranks' sampler states, whichever trainer held them
        if self.remote is not None:
            for r in ranks:
                self.remote.load_state_dict(r.get("remote", {}))
        if same_world:
            self.updater.consecutive_skips = local["consecutive_skips"]
            self.empty_steps = local.get("empty_steps", 0)
        elif self.rank == 0:
            warnings.warn(
                f"resuming a checkpoint of {state['world']} ranks on {self.world}: the models, "
                "the optimizer and the prompt record are restored, but each rank starts a fresh "
                "pass over the data and the dynamic-sampling carry-over is dropped",
                RuntimeWarning,
                stacklevel=2,
            )
        self.models.sync_sampler()  # the checkpoint restored the policy, not the sampler's copy


def _upgrade(local: dict) -> dict:
    """A rank's trainer state as saved before the sampler had a state of its own."""
    if "sampler" in local:
        return local
    keys = ("data_order", "data_rng", "carry")
    return {**local, "sampler": {k: local[k] for k in keys}}
