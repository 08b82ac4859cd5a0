"""The trainer ranks' side of an asynchronous run: the Trainer's rollout component.

    remote = RemoteRollouts(cfg, roles, rank, world)
    groups, timing = remote.take(step, acc)  # this trainer's slice of step s, from v >= s - k
    remote.push(policy, dtype, version)      # after each update (every trainer; collective in FSDP)

`take` checks every batch and every group in it against the bound (s - v <= steps_ahead and v <= s,
else RolloutLost: never trained on) and against the trainers' own checksum of version v (the
rollout's weights are the version it reports), adds the rollout ranks' sampling metrics to this
step's, and keeps the newest sampler state of the rollout ranks whose metrics it carries, which the
checkpoint saves (`state_dict`). Once the last step's batch is taken the rollout ranks are told to
stop. Groups sampled for later steps and not yet taken when a run stops are dropped (counted at
`close`): a resumed run's rollout ranks start from the state that produced the last trained step, so
no group is trained twice.
"""

from __future__ import annotations

import json
import os
import time

from prorl.async_rl import transport
from prorl.async_rl.push import WeightPusher
from prorl.async_rl.roles import Roles, batch_key, slices, timeouts
from prorl.async_rl.wire import Refused
from prorl.config import Config
from prorl.engine.parallel import iter_full_tensors
from prorl.metrics import StepAccumulator
from prorl.sampling import Group


class RemoteRollouts:
    def __init__(self, cfg: Config, roles: Roles, rank: int, world: int):
        self.cfg, self.roles, self.rank = cfg, roles, rank
        self.k = cfg.rollout.async_rl.steps_ahead
        pps = cfg.trainer.prompts_per_step
        self.slices = [s for s in slices(pps, roles.trainers, roles.rollouts) if s[1] == rank]
        self.pusher = WeightPusher(roles.store, roles.push, roles.secret) if rank == 0 else None
        self.checksums: dict[int, float] = {}
        self.states: dict[int, dict] = {}  # rollout rank -> newest sampler state received
        self.started, self.taken = False, -1
        # the longest a batch may take: every sampling round of the rollout ranks (prorl/config.py);
        # a dead rollout rank is seen sooner, by its heartbeat
        self.timeout_s = timeouts(cfg, roles.trainers, roles.rollouts)["step"]
        self.heartbeat = transport.Heartbeat(roles.store, "alive/trainer") if rank == 0 else None
        self.alive = [
            transport.Liveness(
                roles.store, f"alive/rollout/{j}", f"rollout rank {j}", self.timeout_s
            )
            for j in sorted({s[0] for s in self.slices})
        ]
        self.trace = os.path.join(cfg.output_dir, f"async_trained.rank{rank}.jsonl")
        if rank == 0 and cfg.algorithm.is_mode == "none":
            print(
                "prorl: warning: asynchronous RL with algorithm.is_mode=none: the gap between the "
                "sampler's (older) weights and the trainer's pi_old is not corrected; set "
                "is_mode=tis or icepop (docs/recipe.md §11)",
                flush=True,
            )

    # -- weights -----------------------------------------------------------------------------------
    def push(self, policy, dtype, version: int, extra=None) -> None:
        """The policy's weights as `version` (completed updates) to the rollout ranks: every trainer
        records their checksum, trainer 0 stages them for its push thread. Tensor by tensor (as
        iter_full_tensors gathers them): only trainer 0 keeps a host copy."""
        total = transport.Checksum()

        def named():
            for name, t in iter_full_tensors(policy, dtype):
                total.add(t)
                yield name, t

        if self.pusher is not None:
            self.pusher.stage(version, named(), extra=extra, checksum_of=lambda: total.value)
        else:
            for _ in named():
                pass
        self.checksums[version] = total.value
        for old in [v for v in self.checksums if v < version - self.k - 1]:
            del self.checksums[old]

    def start(self, policy, dtype, step: int) -> None:
        """The first push (the weights the run starts or resumes from), with the rollout ranks'
        saved sampler states on resume."""
        # saved by as many rollout ranks as now, else each starts a fresh pass over the data
        same = len(self.states) == self.roles.rollouts
        self.push(policy, dtype, step, extra=dict(self.states) if same else None)
        self.started = True
        if os.path.exists(self.trace):  # cut back to the checkpoint, as metrics.jsonl is
            with open(self.trace) as f:
                kept = [line for line in f if json.loads(line)["step"] < step]
            with open(self.trace, "w") as f:
                f.writelines(kept)

    # -- groups ------------------------------------------------------------------------------------
    def take(self, step: int, acc: StepAccumulator) -> tuple[list, dict[str, float]]:
        """This trainer's groups of `step` and the step's timings (module docstring)."""
        t0, groups, gen, reward, waited = time.perf_counter(), [], 0.0, 0.0, 0.0
        queued = self.queued(step)
        for j, t, lo, hi in self.slices:
            what = f"groups of step {step + 1} from rollout rank {j}"
            key, roles = batch_key(step, j, t), self.roles
            message = transport.take(
                roles.store, roles.pairs[j, t], roles.secret, key, self.timeout_s, what, self.alive
            )
            message["groups"] = check_batch(message, hi - lo, self.cfg.rollout.n, key)
            version = message["version"]
            for v in {version, *(g.version for g in message["groups"])}:
                if step - v > self.k or v > step:
                    raise transport.RolloutLost(
                        f"{what} hold groups sampled with weights of version {v}"
                    )
            for g in message["groups"]:
                g.old_logps = None  # pi_old is the trainer's own (recomputed before the update)
                acc.sum("async_staleness", step - g.version)
                acc.sum("async_groups", 1)
                acc.max("async_staleness", step - g.version)
            self._check_weights(version, message["checksum"], what)
            # vLLM: its post-sync probe against the model copy
            if message["engine_rms"] is not None:
                acc.max("async_engine_rms", message["engine_rms"])
            groups.extend(message["groups"])
            if "state" in message:
                self.states[j] = message["state"]
                for key, value in message["sums"].items():
                    acc.sum(key, value)
                for key, value in message["extrema"].items():
                    acc.max(key, value)
                gen, reward = (
                    max(gen, message["timing"]["gen"]),
                    max(reward, message["timing"]["reward"]),
                )
                waited = max(waited, message["waited"])
        acc.sum("async_queue_groups", queued)
        acc.max("async_wait_trainer", waited)
        self.taken = step
        if step + 1 >= self.cfg.trainer.total_steps:  # the last batch: the rollout ranks may go now
            self.stop_rollouts()
        self._trace(step, groups)
        wait = time.perf_counter() - t0
        return groups, {
            "timing_s/gen": gen,
            "timing_s/reward": reward,
            "timing_s/wait_rollout": wait,
        }

    def queued(self, after: int) -> int:
        """Groups of steps after `after` already waiting in the store for this trainer (nominal
        sizes)."""
        return sum(
            hi - lo
            for s in range(after + 1, after + self.k + 2)
            for j, t, lo, hi in self.slices
            if transport.valid_ticket(self.roles.store, self.roles.secret, batch_key(s, j, t))
        )

    def _check_weights(self, version: int, reported: float, what: str) -> None:
        expected = self.checksums.get(version)
        if expected is None or not transport.same_checksum(expected, reported):
            raise transport.RolloutLost(
                f"{what}: the rollout's weights (checksum {reported!r}) are not version {version} "
                f"(checksum {expected!r})"
            )

    def _trace(self, step: int, groups: list) -> None:
        """One JSON line per step in `async_trained.rank{r}.jsonl` of the run directory: [id,
        version, example index] of each group trained (tests, benchmarks); cut back to the step
        resumed from."""
        with open(self.trace, "a") as f:
            uids = [[g.uid, g.version, g.example_index] for g in groups]
            f.write(json.dumps({"step": step, "groups": uids}) + "\n")

    # -- state and shutdown ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rollout_states": dict(self.states)}

    def load_state_dict(self, state: dict) -> None:
        self.states.update(state.get("rollout_states") or {})

    def close(self) -> None:
        """Tell the rollout ranks to stop; count the groups sampled but never trained."""
        dropped = self.queued(self.taken)
        if dropped:
            print(
                f"prorl: async: rank {self.rank}: {dropped} groups sampled for steps after "
                f"{self.taken + 1} dropped (never trained)",
                flush=True,
            )
        self.stop_rollouts()

    def stop_rollouts(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        if self.heartbeat is not None:
            self.heartbeat.stop()


GROUP_TYPES = {  # Group's fields (prorl/sampling.py) as they travel, and what each must hold
    "example_index": "index",
    "prompt_ids": "tokens",
    "responses": "n token lists",
    "sampler_logps": "n number lists",
    "truncated": "n bools",
    "raw": "n numbers or None",
    "verified": "n bools or None",
    "shaped": "n numbers or None",
    "old_logps": "None or []",  # [] marks a carried group (no pi_old travels)
    "version": "index",
    "uid": "str",
}


def check_batch(message, most: int, n: int, key: str) -> list[Group]:
    """The groups of a received batch, each field checked against the rollout's schema (types,
    counts: at most `most` groups of `n` responses, one log-prob per response token) and the
    message's own fields typed; Refused naming the key and field otherwise."""

    def need(ok, what):
        if not ok:
            raise Refused(f"{key}: {what}")

    need(isinstance(message, dict), "not a dict")
    need(type(message.get("version")) is int, "version is not an int")
    need(isinstance(message.get("checksum"), float), "checksum is not a float")
    need(message.get("engine_rms") is None or _number(message["engine_rms"]), "engine_rms")
    for name in ("sums", "extrema", "timing"):
        if name in message:
            d = message[name]
            need(isinstance(d, dict) and all(_number(v) for v in d.values()), f"{name}")
    need("state" not in message or isinstance(message["state"], dict), "state is not a dict")
    groups = message.get("groups")
    need(isinstance(groups, list) and len(groups) <= most, f"more than {most} groups")
    out = []
    for i, g in enumerate(groups):
        need(isinstance(g, dict) and set(g) == set(GROUP_TYPES), f"group {i}: fields")
        for field, kind in GROUP_TYPES.items():
            need(_typed(g[field], kind, n), f"group {i}: {field} is not {kind}")
        lengths = [len(r) for r in g["responses"]]
        need(lengths == [len(lp) for lp in g["sampler_logps"]], f"group {i}: log-probs/tokens")
        out.append(Group(**g))
    return out


def _number(v) -> bool:
    return type(v) in (int, float)


def _typed(v, kind: str, n: int) -> bool:
    def tokens(x):
        return isinstance(x, list) and all(type(t) is int and t >= 0 for t in x)

    def numbers(x):
        return isinstance(x, list) and all(_number(t) for t in x)

    def n_of(x, each):
        return isinstance(x, list) and len(x) == n and all(each(e) for e in x)

    return {
        "index": lambda: type(v) is int and v >= 0,
        "str": lambda: type(v) is str,
        "tokens": lambda: tokens(v),
        "n token lists": lambda: n_of(v, tokens),
        "n number lists": lambda: n_of(v, numbers),
        "n bools": lambda: n_of(v, lambda e: type(e) is bool),
        "n numbers or None": lambda: v is None or n_of(v, _number),
        "n bools or None": lambda: v is None or n_of(v, lambda e: type(e) is bool),
        "None or []": lambda: v is None or v == [],
    }[kind]()
