"""The rollout ranks' loop of an asynchronous run: sample and verify the groups of step s with
weights of version v >= s - steps_ahead, send them to the trainers, take newer weights between
steps.

    weights <- the first push (the trainers' weights at the step they start from, and on resume each
    rollout rank's saved sampler state)
    for s = start, start + 1, ...:
        take every push announced by now (all rollout ranks the same ones); block while v < s - k
        groups = GroupSampler.collect(prompts_per_step / rollout_ranks, max_new(s), s)  # collective
        send each trainer its slice of the step's groups (`slices`), with v and the weights'
        checksum
    take pushes until the trainers say stop

Recipe semantics (docs/recipe.md, "Asynchronous RL"): the step s a batch is for is known when it is
sampled, so `max_response_schedule`, the length penalty and every other per-step schedule use s, the
step that trains it. Dynamic sampling and the prompt scheduler run here, collectively over the
rollout ranks (their own process group), exactly as the synchronous step runs them over all ranks. A
carried-over group keeps the version that sampled it and is dropped (counted in
dynamic_sampling/dropped_groups) when it would be trained more than k updates after it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from prorl import algorithm, rollout_budget
from prorl.async_rl import transport
from prorl.async_rl.push import WeightReceiver
from prorl.async_rl.roles import Roles, batch_key, slices
from prorl.data import stop_token_ids
from prorl.engine.distributed import all_reduce, dist_info
from prorl.engine.model import load_hf
from prorl.engine.rollout import StaleWeightsError, build_generator, resolve_backend
from prorl.metrics import StepAccumulator
from prorl.sampling import GroupSampler


class RolloutWorker:
    """One rollout rank (module docstring)."""

    def __init__(self, cfg, roles: Roles, model_path: str, tokenizer, examples, pool):
        self.cfg, self.roles = cfg, roles
        # while sampling: when a round's generation or scoring began
        self.progress: float | None = None
        key = f"alive/rollout/{roles.index}"  # the trainers watch it
        self.heartbeat = transport.Heartbeat(roles.store, key, healthy=self.healthy)
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        attention = None if cfg.model.attention == "auto" else cfg.model.attention
        device = dist_info().device
        self.model = load_hf(model_path, dtype=dtype, device=device, attention=attention)
        self.model.requires_grad_(False).eval()
        self.generator = self._generator(model_path, dtype, device)
        stop_ids = stop_token_ids(tokenizer, model_path)
        j, r = roles.index, roles.rollouts
        self.sampler = GroupSampler(
            cfg, tokenizer, examples, self.generator, pool, stop_ids, rank=j, world=r
        )
        self.weights = WeightReceiver(
            roles.store, roles.push, self.model, roles.secret, roles.timeout_s
        )
        self.engine_check = None  # vLLM: the last post-sync probe report
        self.slices = [
            s for s in slices(cfg.trainer.prompts_per_step, roles.trainers, r) if s[0] == j
        ]
        self.senders = {
            t: transport.BatchSender(roles.store, roles.pairs[j, t], roles.secret)
            for _, t, _, _ in self.slices
        }
        self.watch_sampler()

    def healthy(self) -> bool:
        """False once one round's generation or scoring has run past this side's collective timeout
        (one sampling round's bound, prorl/config.py): the heartbeat stops, and the trainers end the
        run (exit 8) about HEARTBEAT_STALE_S later instead of after every round's timeout."""
        since = self.progress
        return since is None or time.monotonic() - since <= self.roles.timeout_s

    def watch_sampler(self) -> None:
        """Mark progress at each start and end of the sampler's generation and scoring calls."""
        for name in ("rollout", "verify"):
            call = getattr(self.sampler, name)

            def watched(*args, _call=call, **kwargs):
                self.progress = time.monotonic()
                try:
                    return _call(*args, **kwargs)
                finally:
                    self.progress = time.monotonic()

            setattr(self.sampler, name, watched)

    def _generator(self, model_path: str, dtype, device):
        """The native sampler on the received model itself, or a vLLM engine beside it: the model
        then receives the pushes (and their checksum) and the engine is loaded from it and checked
        against it after every push (engine/rollout/vllm.py's post-sync probe)."""
        cfg, r = self.cfg, self.cfg.rollout
        if resolve_backend(r.backend, device) == "native":
            return build_generator("native", model=self.model, compile=r.compile)
        budget = max([r.max_response_tokens, *r.max_response_schedule.values()])
        generator = build_generator(
            "vllm",
            model_path=model_path,
            dtype=dtype,
            world_size=self.roles.rollouts,
            seed=cfg.seed + self.roles.rank,
            deterministic=cfg.trainer.deterministic,
            # asked now that the model copy is resident (vLLM refuses more than is free)
            gpu_memory_utilization=rollout_budget.rollout_rank_fraction(cfg, device),
            max_model_len=cfg.data.max_prompt_tokens + budget,
        )
        generator.calibrate(self.model)
        return generator

    def receive(self) -> None:
        """The next push into the model, and from it into a vLLM engine."""
        self.weights.receive()
        if not self.weights.stopped and hasattr(self.generator, "calibrate"):
            params = list(self.weights.params.items())
            try:  # the engine's post-sync probe against the model
                self.engine_check = self.generator.update_weights(params, reference=self.model)
            except StaleWeightsError as exc:  # the documented exit 8, not a crash
                raise transport.RolloutLost(
                    f"rollout rank {self.roles.index}: the vLLM engine does not follow the weights "
                    f"of version {self.weights.version}: {exc}"
                ) from exc

    def run(self) -> int:
        """Serve until the trainers say stop; returns the exit code (0)."""
        w, k = self.weights, self.cfg.rollout.async_rl.steps_ahead
        self.receive()
        if w.stopped:
            return 0
        state = (w.extra or {}).get(self.roles.index)
        if state is not None:
            self.sampler.load_state_dict(state)
        step = w.version
        while step < self.cfg.trainer.total_steps:
            t0 = time.perf_counter()
            target = int(all_reduce(float(w.visible()), "max", what="the weight pushes announced"))
            if self.roles.index == 0:  # every rollout rank has taken the pushes before w.next
                w.release()
            while w.next < target and not w.stopped:
                self.receive()
            while not w.stopped and w.version < step - k:
                self.receive()
            if w.stopped:
                return 0
            self.produce(step, time.perf_counter() - t0)
            step += 1
        while not w.stopped:  # the trainers' last pushes, then their stop
            self.receive()
        return 0

    def produce(self, step: int, waited: float) -> None:
        """Sample and verify step `step`'s groups and send each trainer its slice."""
        cfg, w, sampler, acc = self.cfg, self.weights, self.sampler, StepAccumulator()
        k = cfg.rollout.async_rl.steps_ahead
        stale = [g for g in sampler.carry if step - g.version > k]
        sampler.carry = [g for g in sampler.carry if step - g.version <= k]
        acc.sum("groups_dropped", len(stale))
        max_new = algorithm.scheduled_value(
            step, cfg.rollout.max_response_schedule, cfg.rollout.max_response_tokens
        )
        t0, sampler.reward_time = time.perf_counter(), 0.0
        need = cfg.trainer.prompts_per_step // self.roles.rollouts
        self.progress = time.monotonic()
        try:
            groups = sampler.collect(need, max_new, step, acc)
        finally:
            self.progress = None
        timing = {
            "gen": time.perf_counter() - t0 - sampler.reward_time,
            "reward": sampler.reward_time,
        }
        for i, g in enumerate([*groups, *sampler.carry]):
            if g.uid is None:
                g.version, g.uid = w.version, f"{step}/{self.roles.index}/{i}"
        for g in sampler.carry:
            # marks it carried (GroupSampler carries a group once); no pi_old travels
            g.old_logps = []
        sums = {key: float(v) for key, v in acc._sum.items()}
        extrema = {key: float(v) for key, v in acc._max.items()}
        for n, (j, t, lo, hi) in enumerate(self.slices):
            sent = [dataclasses.asdict(g) for g in groups[lo:hi]]
            message = {"groups": sent, "version": w.version, "checksum": w.checksum}
            message["engine_rms"] = (self.engine_check or {}).get("rms_diff")
            if n == 0:  # the rollout rank's metrics and state travel with its first slice
                message.update(sums=sums, extrema=extrema, timing=timing, waited=waited)
                message["state"] = sampler.state_dict()
            self.senders[t].send(batch_key(step, j, t), message)
