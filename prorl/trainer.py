"""The ProRL v2 trainer: one RL step reads like the data flow in DESIGN.md.

    prompts -> generate n each -> verify -> shape (stop-properly, scheduled cosine length penalty)
      -> dynamic sampling on RAW rewards (drop all-equal groups, refill with new prompts, carry surplus)
      -> REINFORCE++-baseline advantages (global whitening) -> reference (and old) log-probs
      -> M mini-batch updates of PPO-Clip-Higher + k2 KL, from hidden states with the fused op
      -> weights to the sampler -> metrics -> reference reset

Under torchrun every rank takes `prompts_per_step / world` prompts, generates and verifies its own groups
(a group never straddles ranks), and the global pieces are collective: the advantage whitening, the loss
normaliser of each mini-batch, the gradients (summed: each rank's loss is already divided by the global
normaliser) and the metrics.

Where things run. Models and step tensors live on `dist_info().device`: cuda:LOCAL_RANK under torchrun on
GPUs, else the CPU. The sampler (`rollout.backend`) is prorl's `NativeGenerator` on the policy itself (no
weight copy; under FSDP on an unsharded copy that receives the weights after each step) or a colocated
`VLLMGenerator` that sleeps while the policy trains and gets the weights pushed and checked after each
step. On CUDA the native-sampler path ran on one H200 (tests/gpu, the embedded default on cuda:0); vLLM on
CUDA, NCCL across GPUs and FSDP2 on GPUs are written against the documented APIs and UNVERIFIED.

Cost. The log-prob passes pack each group's prompt once with its n responses attending to it
(prorl/packing.py: exact, tested against unpacked sequences) and split the work into micro-batches of at
most `trainer.micro_batch_tokens` tokens (gradient accumulation; under FSDP every rank runs as many
passes). With one mini-batch per step the old-policy pass is skipped: old_logp = logp.detach() exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from prorl import algorithm, packing
from prorl.config import Config, check_world
from prorl.data import stop_token_ids
from prorl.engine.model import load_hf
from prorl.engine.optim import Optimizer, OptimizerConfig
from prorl.engine.parallel import all_reduce, copy_parameters_, dist_info, iter_full_tensors, watchdog
from prorl.engine.rollout import NativeGenerator, SamplingParams
from prorl.kernels import group_advantages, linear_logprob_entropy, ppo_loss
from prorl.metrics import StepAccumulator, step_metrics


class TrainingStalled(RuntimeError):
    """Training cannot go on (steps without a group to train on, or non-finite gradients, repeated
    `trainer.max_consecutive_skips` times); raised on every rank together, the message says why."""


@dataclass
class Group:
    """One prompt's n responses, as they travel through a step."""

    example_index: int
    prompt_ids: list[int]
    responses: list[list[int]]
    sampler_logps: list[list[float]]
    truncated: list[bool]
    raw: list[float] | None = None  # verifier scores
    shaped: list[float] | None = None
    # carried-over groups only: the trainer's log-probs under the policy that sampled them (pi_old)
    old_logps: list[list[float]] | None = None


class Trainer:
    def __init__(self, cfg: Config, model_path: str, tokenizer, train_examples, val_examples, reward_pool):
        self.cfg = cfg
        info = dist_info()
        self.rank, self.world = info.rank, info.world_size
        check_world(cfg, self.world)
        # cuda:LOCAL_RANK under torchrun on GPUs (init_distributed set it), else the CPU: models and every
        # tensor of the step live there; NCCL collectives need device tensors
        self.device = info.device
        torch.manual_seed(cfg.seed + self.rank)
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.model_path, self.dtype = model_path, dtype
        attention = None if cfg.model.attention == "auto" else cfg.model.attention
        self.backend = self._resolve_backend(cfg.rollout.backend)
        # Replicated (default, CPU) or FSDP2-sharded policy and reference. The native sampler needs whole
        # weights and steps at its own pace on each rank, so under FSDP it samples from an unsharded
        # inference copy that receives the policy's weights after every update (`sync_sampler`); the vLLM
        # engine holds its own copy, pushed the same way.
        # FSDP2 whenever asked for and a process group exists, one rank included: it is also what gives
        # bf16 compute over fp32 master weights (MixedPrecisionPolicy). Without it a bf16 policy is trained
        # in bf16 itself: an update below bf16's resolution (~0.4% of a weight) is rounded away.
        self.fsdp = cfg.model.fsdp and dist.is_available() and dist.is_initialized()
        if dtype != torch.float32 and not self.fsdp and self.rank == 0:
            warnings.warn(
                f"model.dtype={cfg.model.dtype} without FSDP: the policy's weights and AdamW step are in "
                f"{cfg.model.dtype} (no fp32 master copy), so small updates are lost to rounding. For bf16 "
                "compute over fp32 master weights set model.fsdp=true and launch with torchrun (one process "
                "is enough).",
                RuntimeWarning,
                stacklevel=2,
            )

        def load(**kw):
            return load_hf(model_path, device=self.device, attention=attention, **kw)

        self.sampler_model = None
        if not self.fsdp:
            self.policy = load(dtype=dtype)
            self.reference = load(dtype=dtype).requires_grad_(False).eval()
            if cfg.model.compile:
                self.policy.compile()
                self.reference.compile()
            if self.backend == "native":
                self.sampler_model = self.policy
        else:
            from prorl.engine.parallel import parallelize

            # fp32 master weights whatever the checkpoint's dtype (a bf16 checkpoint loaded as is would
            # leave FSDP nothing to cast: bf16 masters and AdamW state, and updates at lr 2e-6 round away),
            # computed in the configured dtype (bf16: FSDP2 mixed precision). The reference holds the same
            # fp32 values, so that after a reset it equals the policy exactly and computes identically.
            opts = dict(
                activation_checkpointing=cfg.model.activation_checkpointing,
                compile=cfg.model.compile,
                param_dtype=None if dtype == torch.float32 else dtype,
                cpu_offload=cfg.model.cpu_offload,
            )
            self.policy = parallelize(load(dtype=torch.float32), **opts)
            self.reference = parallelize(load(dtype=torch.float32).requires_grad_(False).eval(), **opts)
            if self.backend == "native":
                self.sampler_model = load(dtype=dtype).requires_grad_(False).eval()
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer, model_path)
        self.generator = self._make_generator(model_path, dtype)
        # training prompts are encoded once; those over max_prompt_tokens are dropped and counted, never
        # truncated (validation prompts are encoded and filtered by prorl.eval.evaluate)
        self.train_examples, self.val_examples = train_examples, val_examples
        self.train_prompts, self.train_kept, self.filtered = self._encode(train_examples)
        if not self.train_kept:
            raise ValueError(f"no training prompt fits data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
        self.pool = reward_pool
        o = cfg.optim
        self.optimizer = Optimizer(
            self.policy,
            OptimizerConfig(
                lr=o.lr,
                betas=tuple(o.betas),
                weight_decay=o.weight_decay,
                max_grad_norm=o.grad_clip,
                schedule=o.schedule,
                warmup_steps=o.warmup_steps,
                total_steps=max(cfg.trainer.total_steps * cfg.trainer.mini_batches, 1),
                min_lr_ratio=o.min_lr_ratio,
            ),
        )
        a = cfg.algorithm
        self.reset_policy = algorithm.ReferenceResetPolicy(
            interval=a.reset_interval,
            kl_spike_factor=a.reset_kl_spike_factor,
            window=a.reset_window,
            patience=a.reset_patience,
            reset_optimizer=a.reset_optimizer,
        )
        self.budget = cfg.trainer.micro_batch_tokens
        # one copy of each prompt per group in the log-prob passes (packing.py); not with dynamic RoPE,
        # whose scaling depends on the whole sequence's length
        self.share = cfg.trainer.share_prompts and self.policy.config.rope.rope_type != "dynamic"
        self.last_sync_check: dict | None = None  # vLLM: the post-sync probe report
        self.step_count = 0
        self.data_rng = random.Random(cfg.seed * 1000 + self.rank)
        self.data_order: list[int] = []
        self.carry: list[Group] = []  # kept groups beyond this step's need, used first next step
        self.consecutive_skips = 0  # optimizer steps skipped in a row (non-finite gradients)
        self.empty_steps = 0  # RL steps in a row that kept no group on any rank
        self.reward_time = 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the trainer divides logits by: the sampler's (1 for greedy sampling)."""
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    # ------------------------------------------------------------------------------------------
    # the sampler
    # ------------------------------------------------------------------------------------------
    def _resolve_backend(self, name: str) -> str:
        """rollout.backend -> "native" | "vllm" ("auto": engine.rollout's measured rule for this device)."""
        if name != "auto":
            return name
        from prorl.engine.rollout import resolve_backend

        return resolve_backend("auto", self.device)

    def _make_generator(self, model_path: str, dtype: torch.dtype):
        if self.backend == "native":
            return NativeGenerator(self.sampler_model, compile=self.cfg.rollout.compile)
        from prorl.engine.rollout.vllm import VLLMGenerator, torchrun_engine_kwargs

        r, cuda = self.cfg.rollout, self.device.type == "cuda"
        generator = VLLMGenerator(
            model_path,
            tensor_parallel_size=r.tensor_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization,
            dtype=dtype,
            enable_sleep_mode=cuda,  # training and sampling share the GPU: the engine sleeps while we train
            seed=self.cfg.seed + self.rank,
            per_request_seeds=self.cfg.trainer.deterministic,
            max_model_len=self.cfg.data.max_prompt_tokens
            + max([r.max_response_tokens, *r.max_response_schedule.values()]),
            # one independent engine per rank under torchrun (see torchrun_engine_kwargs)
            **torchrun_engine_kwargs(self.world, r.tensor_parallel_size),
        )
        # the engine and the policy hold the same weights now: the sampler/trainer gap measured here is the
        # yardstick of the post-sync checks (a collective under FSDP)
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
        """Write the current policy as a Hugging Face checkpoint directory (rank 0 writes; a collective
        under FSDP: every rank must call it). With the native sampler that is the model it samples from
        (the policy, or its unsharded copy, synced after every update); with vLLM the policy itself,
        gathered from its shards when sharded, in the configured dtype."""
        from prorl.engine.model import save_hf

        if self.sampler_model is not None or not self.fsdp:
            if self.rank == 0:
                save_hf(self.sampler_model if self.sampler_model is not None else self.policy, path)
            return
        from prorl.engine.parallel import full_state_dict

        state = full_state_dict(self.policy, cpu_offload=True)  # collective; full tensors on rank 0 only
        if self.rank == 0:
            model = load_hf(self.model_path, dtype=self.dtype)  # same architecture, on the CPU
            model.load_state_dict(state, strict=True)
            save_hf(model, path)

    def close(self) -> None:
        """Release the sampler (a vLLM engine) before the process group goes."""
        self.generator.close()

    # ------------------------------------------------------------------------------------------
    # data
    # ------------------------------------------------------------------------------------------
    def _encode(self, examples):
        from prorl.data import encode_prompts

        return encode_prompts(examples, self.tokenizer, self.cfg.data.max_prompt_tokens)

    def next_examples(self, k: int) -> list[int]:
        """Positions in `train_kept` of the next k prompts (reshuffled at each epoch boundary)."""
        out = []
        while len(out) < k:
            if not self.data_order:
                self.data_order = list(range(len(self.train_kept)))
                if self.cfg.data.shuffle:
                    self.data_rng.shuffle(self.data_order)
            out.append(self.data_order.pop())
        return out

    # ------------------------------------------------------------------------------------------
    # rollout + verification
    # ------------------------------------------------------------------------------------------
    def rollout(self, example_indices: list[int], seed: int, max_new: int) -> list[Group]:
        r = self.cfg.rollout
        prompts = [self.train_prompts[i] for i in example_indices]
        params = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=max_new,
            stop_token_ids=self.stop_ids,
            seed=seed,
        )
        self.policy.eval()
        out = self.generator.generate(prompts, params).by_prompt()
        groups = []
        for p, ex in enumerate(example_indices):
            samples = out[p]
            groups.append(
                Group(
                    ex,
                    prompts[p],
                    [s.token_ids for s in samples],
                    [s.logprobs for s in samples],
                    [s.finish_reason == "length" for s in samples],
                )
            )
        return groups

    def verify(self, groups: list[Group], acc: StepAccumulator) -> None:
        """Raw verifier scores of every response (`Group.raw`), from the reward pool."""
        t0 = time.perf_counter()
        exs = [self.train_examples[self.train_kept[g.example_index]] for g in groups for _ in g.responses]
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for g in groups for t in g.responses]
        res = self.pool.score_batch(
            [e.data_source for e in exs], texts, [e.ground_truth for e in exs], [e.extra for e in exs]
        )
        i = 0
        for g in groups:
            g.raw = res.scores[i : i + len(g.responses)]
            i += len(g.responses)
        acc.sum("samples_seen", len(texts))
        acc.sum("samples_timeout", sum(res.timed_out))
        acc.sum("samples_error", sum(res.errored))
        self.reward_time += time.perf_counter() - t0

    def rollout_seed(self, round_: int) -> int:
        """The sampling seed of one round (the samplers take 32 bits): a hash of (seed, step) plus
        round x world + rank, so that within a step every round of every rank draws its own stream,
        whatever the number of ranks."""
        base = int(np.random.SeedSequence([self.cfg.seed, self.step_count]).generate_state(1)[0])
        return (base + round_ * self.world + self.rank) % 2**32

    def collect(self, need: int, max_new: int, acc: StepAccumulator) -> list[Group]:
        """Dynamic sampling (RECIPE §6): keep groups whose RAW rewards differ, refill until `need` groups.

        Rounds are collective: before each round the ranks agree (one all-reduce) whether any of them still
        lacks groups, and every rank then samples as many prompts as the largest shortfall asks for
        (oversampled after the first round). So all ranks run the same rounds, and no rank waits in a
        collective for longer than one round of another rank's sampling (the timeout is per collective).
        Kept groups beyond `need` - a rank that was already full keeps sampling with the others - are
        carried into the next step, at most `need` of them (the rest are dropped and counted), and are used
        first there; `carry_old_logprobs` records their log-probs under the policy that sampled them, before
        this step's update."""
        a = self.cfg.algorithm
        kept, self.carry = list(self.carry), []  # carried groups first: they are one update old already
        acc.sum("groups_carried", len(kept))
        rounds = 0
        while rounds < (a.max_rounds if a.dynamic_sampling else 1):
            with watchdog().phase(f"step {self.step_count + 1}, sampling round {rounds}"):
                most = int(all_reduce(float(need - len(kept)), "max", what="the ranks' shortfall of groups"))
                if most <= 0:
                    break
                k = most if rounds == 0 or not a.dynamic_sampling else math.ceil(most * a.oversample)
                groups = self.rollout(self.next_examples(k), self.rollout_seed(rounds), max_new)
                self.verify(groups, acc)
            rounds += 1
            for g in groups:
                correct = sum(r >= 1.0 for r in g.raw)
                acc.sum("groups_seen", 1)
                acc.sum("groups_all_correct", correct == len(g.raw))
                acc.sum("groups_all_wrong", correct == 0)
                acc.sum("samples_correct", correct)
                if not a.dynamic_sampling or max(g.raw) > min(g.raw):
                    kept.append(g)
        acc.max("rounds", rounds)
        # the carry-over: this step's surplus, at most `need` (all of it is used first next step); a
        # carried group is never carried again (it would be trained two updates late)
        kept, leftover = kept[:need], kept[need:]
        self.carry = [g for g in leftover if g.old_logps is None][:need]
        acc.sum("groups_kept", len(kept))
        acc.sum("groups_dropped", len(leftover) - len(self.carry))
        return kept

    @torch.no_grad()
    def carry_old_logprobs(self, temperature: float) -> None:
        """The trainer's log-probs of the carried-over groups under the current policy - the one that
        sampled them - taken before this step's update: their pi_old when the next step trains on them
        (off-policy by one update). Without it their ratio would be 1 and clipping would never act on
        them. A collective under FSDP: every rank calls it, with or without carried groups."""
        lengths = [len(t) for g in self.carry for t in g.responses]
        resp_cu = [0, *itertools.accumulate(lengths)]
        self.policy.eval()
        old = self.response_logprobs(self.policy, self.carry, resp_cu, temperature).tolist()
        i = 0
        for g in self.carry:
            g.old_logps = []
            for t in g.responses:
                g.old_logps.append(old[resp_cu[i] : resp_cu[i] + len(t)])
                i += 1

    def shape(self, groups: list[Group], max_new: int) -> torch.Tensor:
        """Stop-properly, then the cosine length term while its schedule is on; returns the length term."""
        rc = self.cfg.reward
        raw = torch.tensor([r for g in groups for r in g.raw], dtype=torch.float32)
        trunc = torch.tensor([t for g in groups for t in g.truncated], dtype=torch.bool)
        lengths = torch.tensor([len(t) for g in groups for t in g.responses], dtype=torch.long)
        shaped = algorithm.stop_properly(raw, trunc, rc.c_stop)
        term = torch.zeros_like(shaped)
        if rc.length_penalty and algorithm.length_penalty_on(
            self.step_count, rc.length_k_on, rc.length_k_off
        ):
            shaped, term = algorithm.cosine_length_shaping(
                shaped,
                lengths,
                trunc,
                raw >= 1.0,
                max_len=max_new,
                lam=rc.length_lam,
                eta_min=rc.length_eta_min,
                eta_max=rc.length_eta_max,
                wrong_eta_min=rc.wrong_eta_min,
                wrong_eta_max=rc.wrong_eta_max,
            )
        i = 0
        for g in groups:
            g.shaped = shaped[i : i + len(g.responses)].tolist()
            i += len(g.responses)
        return term

    # ------------------------------------------------------------------------------------------
    # log-probs and the update
    # ------------------------------------------------------------------------------------------
    def logprobs(self, model, batch: packing.PackedBatch, temperature, grad: bool, entropy: bool = False):
        """Log-probs (and entropies) of the batch's response tokens, [R], from hidden states (fused op)."""
        with torch.set_grad_enabled(grad):
            hidden = packing.hidden_states(model, batch)
            return linear_logprob_entropy(
                hidden, model.lm_head_weight, batch.labels, temperature=temperature, return_entropy=entropy
            )

    def micro_batches(self, groups: list[Group], g0: int, g1: int) -> list[list[tuple[int, int, int]] | None]:
        """Groups g0..g1 as micro-batches of units (group, first response, end response) of at most
        trainer.micro_batch_tokens tokens (a group is split when it alone exceeds them). Under FSDP every
        rank must run as many forwards (each one all-gathers): the list is padded with None (dummy passes)
        up to the largest count over ranks."""
        lp = [len(g.prompt_ids) for g in groups[g0:g1]]
        lr = [[len(t) for t in g.responses] for g in groups[g0:g1]]
        units = packing.split_groups(lp, lr, self.budget, self.share)
        sizes = [packing.unit_tokens(lp[g], lr[g][a:b], self.share) for g, a, b in units]
        chunks: list = [
            [(g0 + g, a, b) for g, a, b in units[c0:c1]]
            for c0, c1 in algorithm.token_budget_chunks(sizes, self.budget)
        ]
        if self.fsdp:
            most = int(
                all_reduce(torch.tensor(len(chunks), device=self.device), "max", what="micro-batch counts")
            )
            chunks += [None] * (most - len(chunks))
        return chunks

    def batch_of(self, groups: list[Group], units, resp_cu: list[int]):
        """The PackedBatch of these units and its [lo, hi) range in the step's response-token space."""
        n = self.cfg.rollout.n
        entries = [(groups[g].prompt_ids, groups[g].responses[a:b]) for g, a, b in units]
        (g_first, a_first, _), (g_last, _, b_last) = units[0], units[-1]
        lo, hi = resp_cu[g_first * n + a_first], resp_cu[g_last * n + b_last]
        return packing.pack(entries, self.share, self.device), lo, hi

    DUMMY_TOKENS = 16  # Transformer Engine's FP8 GEMMs need a multiple of 16 rows

    def dummy_pass(self, model, grad: bool) -> None:
        """A pass that contributes nothing, for a rank with less work than another under FSDP: every
        forward all-gathers and every backward reduce-scatters, so every rank runs as many. It goes through
        the same code as a real micro-batch (the fused op reads the LM head), so that its backward produces
        a gradient for every parameter a real one does: with an untied LM head a plain forward would leave
        lm_head.weight without one, and the ranks' reduce-scatters would differ in size (gloo aborts,
        NCCL hangs)."""
        batch = packing.pack([([0], [[0] * (self.DUMMY_TOKENS - 1)])], self.share, self.device)
        logp, ent = self.logprobs(model, batch, self.logprob_temperature, grad=grad, entropy=grad)
        if grad:
            ((logp.float().sum() + ent.float().sum()) * 0.0).backward()

    @torch.no_grad()
    def response_logprobs(self, model, groups, resp_cu, temperature) -> torch.Tensor:
        """Log-probs of every response token of the step under `model`, micro-batched: fp32 [R] (no grad)."""
        out = torch.zeros(resp_cu[-1], dtype=torch.float32, device=self.device)
        for units in self.micro_batches(groups, 0, len(groups)):
            if units is None:
                self.dummy_pass(model, grad=False)
                continue
            batch, lo, hi = self.batch_of(groups, units, resp_cu)
            out[lo:hi] = self.logprobs(model, batch, temperature, grad=False)[0].float()
        return out

    def update(self, groups: list[Group], max_new: int, acc: StepAccumulator) -> dict[str, float]:
        """Advantages, reference (and old) log-probs, then M mini-batch updates, each micro-batched.

        Every per-token tensor here is over the step's response tokens [R] (group-major; see packing.py).
        pi_old: for groups sampled this step, with one mini-batch the policy that is differentiated is the
        one that sampled them and old_logp = logp.detach() exactly, so the no-grad pass is skipped (TRL and
        verl do the same); with M > 1 the later mini-batches are off-policy and old_logp is recomputed.
        Groups carried over from the previous step use the log-probs recorded before that step's update
        (`carry_old_logprobs`). A rank may hold no group (dynamic sampling fell short): it still takes
        part in every collective. Returns the phase timings; the metrics go to `acc`."""
        cfg, a = self.cfg, self.cfg.algorithm
        dev, n = self.device, cfg.rollout.n
        temp = self.logprob_temperature
        timing = {}
        # advantages over the global batch (group centring local, whitening across ranks)
        t0 = self._clock()
        rewards = torch.tensor([r for g in groups for r in g.shaped], dtype=torch.float32, device=dev)
        gidx = torch.arange(len(groups), device=dev).repeat_interleave(n)
        lengths = [len(t) for g in groups for t in g.responses]
        adv = group_advantages(
            rewards,
            gidx,
            mode=a.advantage,
            std_unbiased=a.grpo_std_unbiased,
            lengths=torch.tensor(lengths, dtype=torch.float32, device=dev),
            weighting=a.whiten_weighting,
            num_groups=len(groups),
            process_group=dist.group.WORLD if self.world > 1 else None,
        )
        resp_cu = [0, *itertools.accumulate(lengths)]
        cu_all = torch.tensor(resp_cu, dtype=torch.int32, device=dev)

        def per_token(values):  # [R] fp32 from per-response lists
            return torch.tensor([x for v in values for x in v], dtype=torch.float32, device=dev)

        sampler = per_token(lp for g in groups for lp in g.sampler_logps)
        nan = float("nan")
        stored_old = per_token(
            g.old_logps[j] if g.old_logps is not None else [nan] * len(t)
            for g in groups
            for j, t in enumerate(g.responses)
        )
        carried = ~torch.isnan(stored_old)
        token_adv = torch.repeat_interleave(adv, torch.tensor(lengths, dtype=torch.long, device=dev))
        mask = torch.ones(resp_cu[-1], dtype=torch.bool, device=dev)
        # reference (and, off-policy, old) log-probs: packed, micro-batched, no grad
        on_policy = cfg.trainer.mini_batches == 1 and not cfg.trainer.recompute_old_logp
        self.policy.eval()
        old = None
        if not on_policy:
            old = torch.where(carried, stored_old, self.response_logprobs(self.policy, groups, resp_cu, temp))
        timing["timing_s/old_logp"] = self._clock() - t0
        t0 = self._clock()
        with watchdog().phase(f"step {self.step_count + 1}, reference log-probs"):
            ref = self.response_logprobs(self.reference, groups, resp_cu, temp)
        timing["timing_s/ref"] = self._clock() - t0

        # M mini-batch updates, each accumulated over micro-batches
        t0 = self._clock()
        self.policy.train()
        per_mb = max(math.ceil(len(groups) / cfg.trainer.mini_batches), 1)
        norms = 0.0
        for m in range(cfg.trainer.mini_batches):
            g0, g1 = min(m * per_mb, len(groups)), min((m + 1) * per_mb, len(groups))
            lo, hi = resp_cu[g0 * n], resp_cu[g1 * n]
            norm = all_reduce(
                algorithm.loss_normalizer(a.agg, mask[lo:hi], cu_all[g0 * n : g1 * n + 1] - lo, max_new),
                what=f"mini-batch {m}'s loss normaliser",
            )
            if float(norm) == 0:  # no response token in this mini-batch on any rank
                continue
            norm = norm.float()
            for units in self.micro_batches(groups, g0, g1):
                if units is None:
                    with watchdog().phase(f"step {self.step_count + 1}, update {m}, dummy pass"):
                        self.dummy_pass(self.policy, grad=True)
                    continue
                batch, s, e = self.batch_of(groups, units, resp_cu)
                logp, ent = self.logprobs(self.policy, batch, temp, grad=True, entropy=True)
                if on_policy:
                    old_mb = torch.where(carried[s:e], stored_old[s:e], logp.detach().float())
                else:
                    old_mb = old[s:e]
                is_w = algorithm.importance_weights(old_mb, sampler[s:e]) if a.is_mode != "none" else None
                loss, metrics = ppo_loss(
                    logp,
                    old_mb,
                    token_adv[s:e],
                    mask[s:e],
                    eps_low=a.eps_low,
                    eps_high=a.eps_high,
                    dual_clip=a.dual_clip,
                    ref_logp=ref[s:e],
                    kl_coef=a.kl_coef,
                    kl_estimator=a.kl_estimator,
                    kl_clamp=a.kl_clamp,
                    is_weights=is_w,
                    is_mode=a.is_mode,
                    is_bounds=(a.is_low, a.is_high),
                    agg=a.agg,
                    normalizer=norm,
                    cu_seqlens=batch.resp_cu,
                )
                ent_sum = ent.float().sum()
                if a.entropy_coef:
                    loss = loss - a.entropy_coef * ent_sum / norm
                loss.backward()
                self._record(acc, metrics, ent_sum, old_mb, sampler[s:e])
            self.sync_grads()
            result = self.optimizer.step()
            norms += result.grad_norm if math.isfinite(result.grad_norm) else 0.0
            acc.max("updates", m + 1)
            self.consecutive_skips = 0 if not result.skipped else self.consecutive_skips + 1
            if self.consecutive_skips >= cfg.trainer.max_consecutive_skips:
                raise TrainingStalled(
                    f"{self.consecutive_skips} consecutive optimizer steps skipped for non-finite "
                    "gradients; stopping (lower optim.lr or check the data)"
                )
        acc.max("grad_norm", norms)  # the global norm, the same on every rank: not summed over ranks
        timing["timing_s/update"] = self._clock() - t0
        t0 = time.perf_counter()
        with watchdog().phase(f"step {self.step_count + 1}, weight sync"):
            self.sync_sampler()
        timing["timing_s/sync"] = self._clock() - t0
        acc.sum("advantage", adv.sum())
        acc.max("advantage", adv.max() if adv.numel() else -math.inf)
        acc.min("advantage", adv.min() if adv.numel() else math.inf)
        return timing

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

    def sync_grads(self) -> None:
        """Sum gradients over ranks (each rank's loss is already divided by the global token count);
        FSDP2 reduces them itself."""
        if self.world == 1 or self.fsdp:
            return
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

    # ------------------------------------------------------------------------------------------
    # one step, validation, reference reset
    def _clock(self) -> float:
        """time.perf_counter() after the device's queued work (CUDA runs asynchronously: without the sync
        a phase's kernels would be timed in the next phase). One sync per phase boundary."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One RL step (module docstring); returns its metrics (global: every rank gets the same)."""
        cfg = self.cfg
        t_start = time.perf_counter()
        max_new = algorithm.scheduled_value(
            self.step_count, cfg.rollout.max_response_schedule, cfg.rollout.max_response_tokens
        )
        need = cfg.trainer.prompts_per_step // self.world
        acc = StepAccumulator(self.device)
        t0 = time.perf_counter()
        self.reward_time = 0.0
        groups = self.collect(need, max_new, acc)
        timing = {"timing_s/reward": self.reward_time}
        timing["timing_s/gen"] = time.perf_counter() - t0 - self.reward_time
        trained = int(all_reduce(float(len(groups)), what="the kept-group count"))  # every rank's
        if trained and self.backend == "vllm":
            self.generator.sleep()  # free the engine's GPU memory while we train; sync_sampler wakes it
        if cfg.algorithm.dynamic_sampling:
            self.carry_old_logprobs(self.logprob_temperature)
        term = self.shape(groups, max_new)
        self._record_batch(acc, groups, term)
        if trained:
            timing.update(self.update(groups, max_new, acc))
        reduced = acc.reduce()
        metrics = step_metrics(reduced)
        metrics["actor/lr"] = self.optimizer.lr
        reason = None
        if trained:
            self.empty_steps = 0
            # counted in completed steps (this one included): interval N resets after steps N, 2N, ...
            reason = self.reset_policy.should_reset(self.step_count + 1, metrics["actor/kl_mean"])
            if reason is not None:
                self.reset_reference(reason)
        else:  # no group of this step carries a learning signal on any rank: nothing to train on
            self.empty_steps += 1
            if self.empty_steps >= cfg.trainer.max_consecutive_skips:
                raise TrainingStalled(
                    f"{self.empty_steps} consecutive steps kept no group: every sampled group's rewards "
                    "were all equal (all right or all wrong) after "
                    f"{int(metrics['dynamic_sampling/rounds'])} rounds of dynamic sampling. The data is "
                    "too easy or too hard for the model, or rollout.max_response_tokens cuts every "
                    "answer; raise algorithm.max_rounds or trainer.max_consecutive_skips to wait longer"
                )
        metrics.update(
            {
                "trainer/empty_step": float(not trained),
                "ref/num_resets": self.reset_policy.num_resets,
                "ref/last_reset_step": self.reset_policy.last_reset_step,
                "ref/reset_reason": reason or "",
            }
        )
        metrics.update(timing)
        elapsed = self._clock() - t_start
        metrics["timing_s/step"] = elapsed
        metrics["perf/tokens_per_s"] = reduced[0].get("response_length", 0.0) / max(elapsed, 1e-9)
        self.step_count += 1
        metrics["step"] = self.step_count
        return metrics

    @staticmethod
    def _record_batch(acc: StepAccumulator, groups: list[Group], term: torch.Tensor) -> None:
        """Per-sample statistics of the groups trained on (scores, rewards, lengths)."""
        raw = torch.tensor([r for g in groups for r in g.raw], dtype=torch.float64)
        shaped = torch.tensor([r for g in groups for r in g.shaped], dtype=torch.float64)
        lengths = torch.tensor([len(t) for g in groups for t in g.responses], dtype=torch.float64)
        prompts = torch.tensor([len(g.prompt_ids) for g in groups for _ in g.responses], dtype=torch.float64)
        trunc = torch.tensor([t for g in groups for t in g.truncated], dtype=torch.float64)
        acc.sum("samples", raw.numel())
        acc.sum("truncated", trunc.sum())
        acc.sum("length_term", term.double().sum())
        for name, values in (
            ("score", raw),
            ("reward", shaped),
            ("response_length", lengths),
            ("prompt_length", prompts),
        ):
            acc.sum(name, values.sum())
            acc.max(name, values.max() if values.numel() else -math.inf)
            acc.min(name, values.min() if values.numel() else math.inf)

    # ------------------------------------------------------------------------------------------
    # checkpointed state of the trainer itself
    # ------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """Everything besides the models and the optimizer that an exact resume needs. Collective: the data
        position and the dynamic-sampling carry-over differ by rank, so every rank's part is gathered."""
        local = {
            "step_count": self.step_count,
            "data_order": list(self.data_order),
            "data_rng": self.data_rng.getstate(),
            "carry": [dataclasses.asdict(g) for g in self.carry],
            "consecutive_skips": self.consecutive_skips,
        }
        ranks = [local]
        if self.world > 1:
            ranks = [None] * self.world
            dist.all_gather_object(ranks, local)
        return {"world": self.world, "ranks": ranks, "reset_policy": self.reset_policy.state_dict()}

    def restore(self, state: dict) -> None:
        if state["world"] != self.world:
            raise ValueError(
                f"this checkpoint was written by {state['world']} ranks; resume it with the same number "
                f"(this run has {self.world}): the data position and carry-over are per rank"
            )
        local = state["ranks"][self.rank]
        self.step_count = local["step_count"]
        self.data_order = list(local["data_order"])
        self.data_rng.setstate(local["data_rng"])
        self.carry = [Group(**g) for g in local["carry"]]
        self.consecutive_skips = local["consecutive_skips"]
        self.reset_policy.load_state_dict(state["reset_policy"])
        self.sync_sampler()  # the checkpoint restored the policy, not the sampler's copy

    @torch.no_grad()
    def reset_reference(self, reason: str) -> None:
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
        pass@1), `val/pass@j`, and per data source `val-core/<source>/reward/mean@k` (verl's name) and
        `val-core/<source>/pass@j`. Collective: every rank calls it."""
        from prorl.eval import evaluate, summarize

        cfg = self.cfg
        mine = list(range(self.rank, len(self.val_examples), self.world))
        k = cfg.trainer.val_samples
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
        fields = "data_source score correct timed_out errored finish_reason response_tokens".split()
        records = [{"index": mine[r["index"]], **{f: r[f] for f in fields}} for r in results["samples"]]
        if self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        summary = summarize(records, k)
        out = {"val/accuracy": summary["all"]["mean_score"] or 0.0}
        out.update({f"val/{m}": v for m, v in summary["all"].items() if m.startswith("pass@")})
        for source, m in summary["by_source"].items():
            out[f"val-core/{source}/reward/mean@{k}"] = m["mean_score"] or 0.0
            out.update({f"val-core/{source}/{j}": v for j, v in m.items() if j.startswith("pass@")})
        self.reset_policy.observe_validation(out["val/accuracy"])
        return out
