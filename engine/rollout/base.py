"""The one generation interface every rollout backend implements.

    gen = NativeGenerator(model)            # or VLLMGenerator(...)
    params = SamplingParams(n=16, temperature=1.0, max_new_tokens=512, seed=s)
    out = gen.generate(prompt_token_ids, params)
    for s in out.samples: s.prompt_index, s.sample_index, s.token_ids, s.logprobs, s.finish_reason
    gen.update_weights(model.state_dict())  # after each optimizer step
    gen.generate(prompts, params, on_finished=lambda k: ...)  # k more samples done (progress)

`logprobs` are the sampler's log-probabilities of each sampled token under the temperature-scaled
distribution softmax(logits / T) over the whole vocabulary (before top-k / top-p truncation): the
same quantity the trainer recomputes, so their difference measures sampler/trainer drift. With
temperature 0 (greedy) they are taken at T = 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def host_available_bytes() -> int:
    """Memory the host can give now without swapping: /proc/meminfo's MemAvailable (free +
    reclaimable page cache), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0  # with (prompt index, sample index, token position) fixes every draw

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("SamplingParams: n and max_new_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k == 0:
            raise ValueError("SamplingParams: temperature >= 0, 0 < top_p <= 1, top_k > 0 or -1")


@dataclass
class Sample:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled; it is the last token) | "length"


@dataclass
class Rollouts:
    samples: list[Sample]

    def by_prompt(self) -> dict[int, list[Sample]]:
        groups: dict[int, list[Sample]] = {}
        for s in self.samples:
            groups.setdefault(s.prompt_index, []).append(s)
        return groups


class Generator:
    """Interface: `generate(prompt_token_ids, params, on_finished=None) -> Rollouts`
    (`on_finished(k)`: k more samples finished, as they finish, for progress reports),
    `update_weights(named_tensors)`, `close()` (release the engine; before the caller tears down its
    process group).

    `schedules_batch`: the engine batches and schedules requests itself within its own KV-cache
    budget (vLLM's continuous batching): callers hand it every prompt they have, not chunks sized to
    a KV cache."""

    schedules_batch = False

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, on_finished=None
    ) -> Rollouts:
        raise NotImplementedError

    def update_weights(self, named_tensors) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
