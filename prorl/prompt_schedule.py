"""Pass-rate-aware prompt scheduling: generate for the prompts whose groups will carry a signal.

Dynamic sampling (docs/recipe.md §6) drops a group whose raw rewards are all equal - after paying
for its n responses. As the policy improves most prompts come back all-correct (or stay all-wrong),
and most of a step's generation is thrown away. The scheduler decides BEFORE generation, from a
per-prompt record:

    record: per prompt, the evidence of its verified groups (a group adds sum(rewards) successes and
            n - sum(rewards) failures), discounted by `discount` per step since its last update,
            because the policy moves;
    prior:  Beta(k m, k (1 - m)), m the population's discounted pass rate, k = `prior_strength`: a
            prompt with little evidence is expected to behave like the others (on a mostly solved
            data set an unseen or long-unprobed prompt is probably solved too);
    score:  for p ~ Beta(alpha, beta) = prior + evidence, P(a group of n is mixed)
                = 1 - E[p^n] - E[(1 - p)^n]
                = 1 - B(alpha + n, beta) / B(alpha, beta) - B(alpha, beta + n) / B(alpha, beta);
    choice: unseen prompts first; then prompts not probed for `reprobe_epochs` epochs (oldest
            first), so no prompt is dropped for good (each is probed again within reprobe_epochs + 1
            epochs of its last probe); then the rest by score, highest first (ties in random order).
            A refill round (dynamic sampling's second and later) runs only when its prompts' mean
            score - the fraction of their groups expected to be kept - reaches `min_yield`: once the
            data is solved, rounds that would keep almost nothing are not generated.

Dynamic sampling still filters after generation; the data-mix weights act through the examples'
counts (prorl.data.mix). Under torchrun the record is global: every rank applies every rank's
observations in the same order after each step's sampling (one all-gather), and every rank computes
the same global choice from the same record and seed and takes its own slice, so no prompt goes to
two ranks in one round.

What it assumes, and when it can hurt: the Beta posterior treats a prompt's groups as draws of one p
and the prompts as draws of one population; the discount lets old evidence fade (and fading evidence
brings a prompt back up the order), but a prompt that becomes solvable late is only noticed when it
is re-probed (bounded by `reprobe_epochs`). Steps concentrate on fewer, harder prompts: the held-out
accuracy is the check that this does not overfit them.

`mode: exclude-solved` is open-instruct's rule, for comparison: a prompt whose group came back all
correct is excluded for good; the others are drawn uniformly.
"""

from __future__ import annotations

import math

import numpy as np

MODES = ("none", "pass-rate", "exclude-solved")
STATES = ("unseen", "mixed", "solved", "unsolved")


def mixed_probability(alpha: np.ndarray, beta: np.ndarray, n: int) -> np.ndarray:
    """P(a group of n Bernoulli(p) draws holds both outcomes) for p ~ Beta(alpha, beta),
    elementwise."""
    import torch

    def betaln(a, b):  # log B(a, b) in float64
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        return (torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)).numpy()

    log_b = betaln(alpha, beta)
    all_right = np.exp(betaln(alpha + n, beta) - log_b)
    all_wrong = np.exp(betaln(alpha, beta + n) - log_b)
    return np.clip(1.0 - all_right - all_wrong, 0.0, 1.0)


class PromptScheduler:
    """The per-prompt record and the choice of each round's prompts (module docstring). `size`
    prompts, indexed like `GroupSampler.kept`; `cfg` is the `scheduler` config section; `n` the
    group size."""

    def __init__(self, cfg, size: int, n: int, prompts_per_step: int, seed: int):
        self.cfg, self.size, self.n, self.seed = cfg, size, n, seed
        self.epoch_steps = max(math.ceil(size / max(prompts_per_step, 1)), 1)
        self.successes = np.zeros(size)  # discounted evidence, as of each prompt's last update
        self.failures = np.zeros(size)
        self.updated = np.zeros(size, dtype=np.int64)  # step of the last update
        self.probed = np.full(size, -1, dtype=np.int64)  # step of the last probe; -1: never
        self.excluded = np.zeros(size, dtype=bool)
        self.population = np.zeros(2)  # every prompt's evidence together: successes, failures
        self.population_updated = 0
        self.taken: set[int] = set()  # chosen in this step's earlier rounds
        # this rank's observations since the last merge
        self.pending: list[tuple[int, float, int]] = []
        self.reprobes = 0

    # -- the record --------------------------------------------------------------------------------
    def prior(self, step: int) -> tuple[float, float]:
        """Beta(k m, k (1 - m)): mean m = the population's discounted success rate
        (Laplace-smoothed), strength k = `prior_strength` (2: Beta(1, 1) before any evidence)."""
        s, f = self.population * self.cfg.discount ** max(step - self.population_updated, 0)
        m, k = (s + 1.0) / (s + f + 2.0), self.cfg.prior_strength
        return k * m, k * (1.0 - m)

    def posterior(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta) of every prompt: the prior plus its evidence, discounted for the steps
        since its last update."""
        w = self.cfg.discount ** np.maximum(step - self.updated, 0)
        a0, b0 = self.prior(step)
        return a0 + w * self.successes, b0 + w * self.failures

    def observe(self, prompt: int, rewards: list[float]) -> None:
        """A verified group of this rank: merged into the record at the next `merge`."""
        self.pending.append((prompt, float(sum(rewards)), len(rewards)))

    def merge(self, step: int, gathered: list[list[tuple[int, float, int]]]) -> None:
        """Apply every rank's observations (`gathered[r]` = rank r's `pending`), in rank order."""
        self.population *= self.cfg.discount ** max(step - self.population_updated, 0)
        self.population_updated = step
        for part in gathered:
            for prompt, successes, trials in part:
                w = self.cfg.discount ** max(step - self.updated[prompt], 0)
                self.successes[prompt] = w * self.successes[prompt] + successes
                self.failures[prompt] = w * self.failures[prompt] + trials - successes
                self.updated[prompt] = step
                self.population += (successes, trials - successes)
                if (
                    self.cfg.mode == "exclude-solved"
                    and successes >= self.cfg.solved_threshold * trials
                ):
                    self.excluded[prompt] = True
        self.pending = []

    # -- the choice --------------------------------------------------------------------------------
    def new_step(self) -> None:
        """Before each step's rounds (also a step the carry-over fills): nothing taken or counted
        yet."""
        self.taken, self.reprobes = set(), 0

    def select(self, k: int, *, step: int, round_: int, rank: int, world: int) -> list[int]:
        """This rank's k prompts of the round: its slice of one global choice of k x world
        prompts."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, step, round_, 7919]))
        want = k * world
        free = np.array(
            [i for i in range(self.size) if i not in self.taken and not self.excluded[i]]
        )
        if free.size == 0:  # everything taken (tiny data) or excluded: fall back to every prompt
            free = np.arange(self.size)
        chosen: list[int] = []
        stale_count = 0
        unseen = free[self.probed[free] < 0]
        chosen += rng.permutation(unseen)[:want].tolist()
        if self.cfg.mode == "pass-rate" and len(chosen) < want:
            rest = free[self.probed[free] >= 0]
            stale = rest[step - self.probed[rest] >= self.cfg.reprobe_epochs * self.epoch_steps]
            stale = stale[np.argsort(self.probed[stale], kind="stable")][: want - len(chosen)]
            stale_count = len(stale)
            chosen += stale.tolist()
        # random tie order
        left = rng.permutation(np.setdiff1d(free, np.array(chosen, dtype=np.int64)))
        if len(chosen) < want and left.size:
            if self.cfg.mode == "pass-rate":  # the most likely to give a mixed group
                alpha, beta = self.posterior(step)
                left = left[
                    np.argsort(-mixed_probability(alpha[left], beta[left], self.n), kind="stable")
                ]
            chosen += left[: want - len(chosen)].tolist()
        # fewer prompts than the round needs: repeat, as epochs of the data would
        while len(chosen) < want:
            chosen += rng.permutation(free)[: want - len(chosen)].tolist()
        refill = self.cfg.mode == "pass-rate" and round_ > 0
        if refill and self.expected_mixed(chosen, step) < self.cfg.min_yield:
            return []  # a refill round not worth its generation (the same decision on every rank)
        self.reprobes += stale_count
        self.taken.update(chosen)
        self.probed[np.array(chosen, dtype=np.int64)] = step
        return chosen[rank * k : (rank + 1) * k]

    def expected_mixed(self, prompts: list[int], step: int) -> float:
        """The mean P(mixed group) of these prompts under the record: the expected fraction kept."""
        alpha, beta = self.posterior(step)
        idx = np.array(prompts, dtype=np.int64)
        return float(mixed_probability(alpha[idx], beta[idx], self.n).mean()) if idx.size else 0.0

    # -- metrics and state -------------------------------------------------------------------------
    def counts(self, step: int) -> dict[str, int]:
        """Prompts by state: unseen; mixed (P(mixed group) >= 0.5); else solved or unsolved by the
        mean."""
        alpha, beta = self.posterior(step)
        seen = self.probed >= 0
        mixed = seen & (mixed_probability(alpha, beta, self.n) >= 0.5)
        solved = seen & ~mixed & (alpha / (alpha + beta) >= 0.5)
        return {
            "unseen": int((~seen).sum()),
            "mixed": int(mixed.sum()),
            "solved": int(solved.sum()),
            "unsolved": int((seen & ~mixed & ~solved).sum()),
            "excluded": int(self.excluded.sum()),
            "reprobes": self.reprobes,
        }

    def state_dict(self) -> dict:
        keys = ("successes", "failures", "updated", "probed", "excluded", "population")
        state = {k: getattr(self, k).tolist() for k in keys}
        return state | {
            "population_updated": self.population_updated,
            "pending": list(self.pending),
        }

    def load_state_dict(self, state: dict) -> None:
        if "alpha" in state:  # saved before the population prior: Beta(1, 1) + evidence
            state = _upgrade(state)
        if len(state["successes"]) != self.size:
            raise ValueError(
                "the scheduler's record holds "
                f"{len(state['successes'])} prompts, this run {self.size}"
            )
        for k, dtype in (("successes", float), ("failures", float), ("population", float)):
            setattr(self, k, np.array(state[k], dtype=dtype))
        for k in ("updated", "probed"):
            setattr(self, k, np.array(state[k], dtype=np.int64))
        self.population_updated = int(state["population_updated"])
        self.excluded = np.array(state["excluded"], dtype=bool)
        self.pending = [tuple(p) for p in state["pending"]]


def _upgrade(state: dict) -> dict:
    """A record saved as Beta(alpha, beta) over a Beta(1, 1) prior, as evidence (successes,
    failures)."""
    successes = [max(a - 1.0, 0.0) for a in state["alpha"]]
    failures = [max(b - 1.0, 0.0) for b in state["beta"]]
    population = [sum(successes), sum(failures)]
    updated = max(state["updated"], default=0)
    rest = {k: v for k, v in state.items() if k not in ("alpha", "beta")}
    return rest | {"successes": successes, "failures": failures, "population": population,
                   "population_updated": updated}  # fmt: skip
