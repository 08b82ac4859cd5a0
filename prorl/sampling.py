"""Sampling one rank's share of a step: prompts in data order -> groups of n responses -> raw
verifier scores -> dynamic sampling (docs/recipe.md §6) -> reward shaping (docs/recipe.md §5).

    sampler = GroupSampler(cfg, tokenizer, examples, generator, pool, stop_ids, rank=r, world=w)
    groups = sampler.collect(need, max_new, step, acc)       # kept groups, raw rewards, carry-over
    term = shape_rewards(groups, cfg.reward, step, max_new)  # Group.shaped; returns the length term

A `Group` is one prompt's n responses as they travel through a step. Sampling rounds are collective:
every rank runs the same rounds (one all-reduce per round agrees whether any rank still lacks
groups), so no rank waits in a collective for longer than one round of another's sampling. The
carry-over (kept groups beyond this step's need) is this object's state, with the data position:
`state_dict` / `load_state_dict`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from prorl import algorithm, rollout_budget
from prorl.config import ConfigError
from prorl.data import dropped_by_source, encode_prompts
from prorl.engine.distributed import all_reduce, watchdog
from prorl.engine.rollout import SamplingParams
from prorl.metrics import StepAccumulator
from prorl.prompt_schedule import PromptScheduler
from prorl.rewards.function import numeric_extras
from prorl.rewards.pool import pool_counts


@dataclass
class Group:
    """One prompt's n responses, as they travel through a step."""

    example_index: int
    prompt_ids: list[int]
    responses: list[list[int]]
    sampler_logps: list[list[float]]
    truncated: list[bool]
    raw: list[float] | None = None  # verifier scores
    verified: list[bool] | None = None  # False: the verification failed (its raw score imputed)
    shaped: list[float] | None = None  # the rewards trained on
    # carried-over groups only: the trainer's log-probs under the policy that sampled them (pi_old;
    # Updater.store_old_logprobs writes them, TokenInputs.pi_old reads them)
    old_logps: list[list[float]] | None = None
    # asynchronous RL (prorl/async_rl/): the policy version (completed updates) that sampled it, and
    # an id "step/rollout rank/position" given where it was sampled
    version: int | None = None
    uid: str | None = None

    @property
    def carried(self) -> bool:
        """Carried over from an earlier step (its pi_old is stored)."""
        return self.old_logps is not None


class GroupSampler:
    """Groups of `rollout.n` responses from `generator`, verified by `pool`, for one rank (see
    module doc).

    Training prompts are encoded once; those over `data.max_prompt_tokens` are dropped and counted
    (`filtered`), never truncated. Each rank walks its own shuffled order of all prompts (seeded by
    rank).
    """

    def __init__(
        self, cfg, tokenizer, examples, generator, pool, stop_ids, *, rank: int = 0, world: int = 1
    ):
        self.cfg, self.tokenizer, self.examples, self.stop_ids = (
            cfg,
            tokenizer,
            examples,
            list(stop_ids),
        )
        self.generator, self.pool, self.rank, self.world = generator, pool, rank, world
        self.prompts, self.kept, self.filtered = encode_prompts(
            examples, tokenizer, cfg.data.max_prompt_tokens
        )
        limit = f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
        dropped = dropped_by_source(examples, self.kept) if self.filtered else {}
        if rank == 0:
            for source, (n, total) in dropped.items():
                print(
                    f"prorl: data: {n} of {total} prompts of "
                    f"{source} are longer than {limit}: dropped"
                )
        if not self.kept:
            raise ConfigError(
                f"no training prompt fits {limit}: "
                + ("no training examples" if not examples else f"all {len(examples)} are longer")
            )
        self.data_rng = random.Random(cfg.seed * 1000 + rank)
        self.data_order: list[int] = []
        self.scheduler = None
        if cfg.scheduler.mode != "none":
            pps, n = cfg.trainer.prompts_per_step, cfg.rollout.n
            self.scheduler = PromptScheduler(cfg.scheduler, len(self.kept), n, pps, cfg.seed)
        self.carry: list[Group] = []  # kept groups beyond this step's need, used first next step
        # native: refuses a round that cannot fit
        budget = rollout_budget.report(cfg, world, generator)
        if rank == 0 and budget:
            print(f"prorl: rollout: {budget}")
        self.reward_time = 0.0  # seconds spent verifying since the last reset of this counter
        # the pool's counters when last reported: what happened since (validation shares the pool)
        # goes into the next step's row
        self.pool_seen = pool_counts(pool)

    # -- data --------------------------------------------------------------------------------------
    def next_examples(self, k: int) -> list[int]:
        """Positions in `kept` of the next k prompts (reshuffled at each epoch boundary)."""
        out = []
        while len(out) < k:
            if not self.data_order:
                self.data_order = list(range(len(self.kept)))
                if self.cfg.data.shuffle:
                    self.data_rng.shuffle(self.data_order)
            out.append(self.data_order.pop())
        return out

    def seed(self, step: int, round_: int) -> int:
        """The sampling seed of one round (the samplers take 32 bits): a hash of (seed, step) plus
        round x world + rank, so that within a step every round of every rank draws its own stream,
        whatever the number of ranks."""
        base = int(np.random.SeedSequence([self.cfg.seed, step]).generate_state(1)[0])
        return (base + round_ * self.world + self.rank) % 2**32

    # -- sampling and verification -----------------------------------------------------------------
    def rollout(self, example_indices: list[int], seed: int, max_new: int) -> list[Group]:
        r = self.cfg.rollout
        prompts = [self.prompts[i] for i in example_indices]
        params = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=max_new,
            stop_token_ids=self.stop_ids,
            seed=seed,
        )
        out = self.generator.generate(prompts, params).by_prompt()
        return [
            Group(
                ex,
                prompts[p],
                [s.token_ids for s in out[p]],
                [s.logprobs for s in out[p]],
                [s.finish_reason == "length" for s in out[p]],
            )
            for p, ex in enumerate(example_indices)
        ]

    def verify(self, groups: list[Group], acc: StepAccumulator) -> None:
        """Raw verifier scores of every response (`Group.raw`), from the reward pool."""
        t0 = time.perf_counter()
        exs = [self.examples[self.kept[g.example_index]] for g in groups for _ in g.responses]
        texts = [
            self.tokenizer.decode(t, skip_special_tokens=True) for g in groups for t in g.responses
        ]
        res = self.pool.score_batch(
            [e.data_source for e in exs],
            texts,
            [e.ground_truth for e in exs],
            [e.extra for e in exs],
        )
        i = 0
        for g in groups:
            n = len(g.responses)
            failed = [a or b for a, b in zip(res.errored[i : i + n], res.timed_out[i : i + n])]
            g.raw = impute_failed(res.scores[i : i + n], failed)
            g.verified = [not f for f in failed]
            i += n
        acc.sum("samples_seen", len(texts))
        # a verifier's numeric extras (verl's reward_extra_info), per sample
        for info in res.extras:
            for key, value in numeric_extras(info).items():
                acc.sum(f"reward_extra/{key}", value)
                acc.sum(f"reward_extra_n/{key}", 1)
        acc.sum("samples_timeout", sum(res.timed_out))
        acc.sum("samples_error", sum(res.errored))
        now = pool_counts(self.pool)
        for key, n in now.items():
            acc.sum(f"reward_pool/{key}", n - self.pool_seen[key])
        self.pool_seen = now
        self.reward_time += time.perf_counter() - t0

    def collect(self, need: int, max_new: int, step: int, acc: StepAccumulator) -> list[Group]:
        """Dynamic sampling (docs/recipe.md §6): keep groups whose RAW rewards differ, refill to
        `need`.

        Before each round the ranks agree (one all-reduce) whether any of them still lacks groups,
        and every rank then samples as many prompts as the largest shortfall asks for (oversampled
        after the first round). Kept groups beyond `need` - a rank that was already full keeps
        sampling with the others - are carried into the next step, at most `need` of them (the rest
        are dropped and counted), and are used first there; the trainer records their log-probs
        under the policy that sampled them before this step's update. A carried group is never
        carried twice."""
        algo = self.cfg.algorithm
        # carried groups first: they are one update old already
        kept, self.carry = list(self.carry), []
        acc.sum("groups_carried", len(kept))
        if self.scheduler is not None:
            self.scheduler.new_step()
        rounds = 0
        while rounds < (algo.max_rounds if algo.dynamic_sampling else 1):
            with watchdog().phase(f"step {step + 1}, sampling round {rounds}"):
                most = int(
                    all_reduce(
                        float(need - len(kept)), "max", what="the ranks' shortfall of groups"
                    )
                )
                chosen = self._round_prompts(most, rounds, step, acc) if most > 0 else None
                if chosen is None:
                    break
                groups = self.rollout(chosen, self.seed(step, rounds), max_new)
                self.verify(groups, acc)
            rounds += 1
            kept += self._keep(groups, acc)
        acc.max("rounds", rounds)
        if self.scheduler is not None:
            acc.max("scheduler/rounds_skipped", 0)
            self._merge_records(step, acc)
        kept, leftover = kept[:need], kept[need:]
        self.carry = [g for g in leftover if not g.carried][:need]
        acc.sum("groups_kept", len(kept))
        # verl's prompt_length/clip_ratio: prompts at the limit
        limit = self.cfg.data.max_prompt_tokens
        acc.sum("prompt_at_limit", sum(len(g.prompt_ids) >= limit for g in kept for _ in g.raw))
        acc.sum("groups_dropped", len(leftover) - len(self.carry))
        return kept

    def _round_prompts(self, most: int, rounds: int, step: int, acc: StepAccumulator):
        """The prompts of sampling round `rounds` for the largest shortfall `most` (oversampled
        after the first round); None when the scheduler expects too few mixed groups from a refill
        round."""
        algo = self.cfg.algorithm
        k = most if rounds == 0 or not algo.dynamic_sampling else math.ceil(most * algo.oversample)
        if self.scheduler is None:
            return self.next_examples(k)
        chosen = self.scheduler.select(
            k, step=step, round_=rounds, rank=self.rank, world=self.world
        )
        if not chosen:
            acc.max("scheduler/rounds_skipped", algo.max_rounds - rounds)
            return None
        return chosen

    def _keep(self, groups: list[Group], acc: StepAccumulator) -> list[Group]:
        """The round's groups that train: the keep rule on their RAW rewards
        (`algorithm.keep_groups`; every group without dynamic sampling), counted."""
        raw = torch.tensor([r for g in groups for r in g.raw], dtype=torch.float64)
        index = torch.arange(len(groups)).repeat_interleave(
            torch.tensor([len(g.raw) for g in groups])
        )
        for key, value in algorithm.group_pass_counts(raw, index, len(groups)).items():
            acc.sum(key, value)
        passed = algorithm.keep_groups(raw, index, len(groups)).tolist()
        kept = []
        for g, mixed in zip(groups, passed):
            acc.sum("generated_tokens", sum(len(t) for t in g.responses))
            if self.scheduler is not None:  # an imputed score is no evidence of a pass rate
                ok = g.verified or [True] * len(g.raw)
                verified = [r for r, v in zip(g.raw, ok) if v]
                if verified:
                    self.scheduler.observe(g.example_index, verified)
            if not self.cfg.algorithm.dynamic_sampling or mixed:
                kept.append(g)
                acc.sum("groups_passed", 1)
        return kept

    def _merge_records(self, step: int, acc: StepAccumulator) -> None:
        """Every rank's observations of this step into every rank's record (one all-gather), and the
        record's counts as metrics (the same on every rank)."""
        gathered = [self.scheduler.pending]
        if self.world > 1:
            import torch.distributed as dist

            gathered = [None] * self.world
            with watchdog().waiting("all-gather of the prompt records"):
                dist.all_gather_object(gathered, self.scheduler.pending)
        self.scheduler.merge(step, gathered)
        for state, count in self.scheduler.counts(step + 1).items():
            acc.max(f"scheduler/{state}", count)

    # -- checkpointed state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "data_order": list(self.data_order),
            "data_rng": self.data_rng.getstate(),
            "carry": [dataclasses.asdict(g) for g in self.carry],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict, record_only: bool = False) -> None:
        """This rank's saved state; `record_only`: just the prompt record, the same on every rank (a
        run resumed on another number of ranks starts a fresh pass over the data)."""
        if not record_only:
            self.data_order = list(state["data_order"])
            version, internal, gauss = state["data_rng"]  # lists after the async wire's JSON
            self.data_rng.setstate((version, tuple(internal), gauss))
            self.carry = [Group(**g) for g in state["carry"]]
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def impute_failed(scores: list[float], failed: list[bool]) -> list[float]:
    """A group's raw scores with each failed verification (the verifier raised, died or timed out)
    set to the mean of the group's other scores: a harness failure carries no information about the
    response, and at the group mean it leaves the group's baseline and every other sample's
    advantage as they were (a fixed 0 would rank it below a wrong answer scored -1, or above one
    scored 0). A group with no successful verification scores 0 throughout: all equal, it carries no
    signal."""
    ok = [s for s, f in zip(scores, failed) if not f]
    fill = math.fsum(ok) / len(ok) if ok else 0.0
    return [fill if f else s for s, f in zip(scores, failed)]


def shape_rewards(groups: list[Group], rc, step: int, max_new: int) -> torch.Tensor:
    """docs/recipe.md §5 on the raw scores: stop-properly, then DAPO's overlong buffer when
    configured, then the cosine length term while its schedule is on. Sets `Group.shaped`; returns
    the length terms [S]."""
    raw = torch.tensor([r for g in groups for r in g.raw], dtype=torch.float32)
    trunc = torch.tensor([t for g in groups for t in g.truncated], dtype=torch.bool)
    lengths = torch.tensor([len(t) for g in groups for t in g.responses], dtype=torch.long)
    shaped = algorithm.stop_properly(raw, trunc, rc.c_stop)
    term = torch.zeros_like(shaped)
    if rc.overlong_buffer_len > 0:
        term = algorithm.overlong_buffer_penalty(
            lengths, max_new, rc.overlong_buffer_len, rc.overlong_penalty
        )
        shaped = shaped + term
    if rc.length_penalty and algorithm.length_penalty_on(step, rc.length_k_on, rc.length_k_off):
        shaped, cosine = algorithm.cosine_length_shaping(
            shaped,
            lengths,
            trunc,
            raw >= 1.0,
            max_len=max_new,
            lam=rc.length_lam,
            eta=(rc.length_eta_min, rc.length_eta_max),
            wrong_eta=(rc.wrong_eta_min, rc.wrong_eta_max),
        )
        term = term + cosine
    i = 0
    for g in groups:
        g.shaped = shaped[i : i + len(g.responses)].tolist()
        i += len(g.responses)
    return term
