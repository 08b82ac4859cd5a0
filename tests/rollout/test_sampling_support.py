"""Which tokens the native sampler can draw, and how often: `sample_tokens` (the draw every decode
step of NativeGenerator makes) on a constructed distribution.

Support: a grid of 20,001 uniforms covers every token whose kept mass is above 1e-4, so the set of
tokens drawn is exactly the kept set. Frequencies: 40,000 draws from the sampler's own counter-based
uniforms against the renormalised kept distribution, by Pearson's chi-square at the 0.999 quantile
(the draws are deterministic: the test cannot flake). The reference distributions are written
here from the definitions (vLLM's / Hugging Face's): top-k keeps the k most likely tokens; top-p
keeps the smallest set of most likely tokens whose mass reaches p (the most likely token always),
over the top-k renormalised when both are set;
temperature T samples softmax(logits / T); greedy takes the argmax.
"""

import math

import pytest
import torch
from prorl.engine.rollout.base import SamplingParams
from prorl.engine.rollout.native import counter_uniform, sample_tokens

# probabilities at temperature 1, in a scrambled vocabulary order
PROBS = [0.05, 0.4, 0.02, 0.25, 0.15, 0.08, 0.03, 0.02]
LOGITS = torch.tensor(PROBS, dtype=torch.float64).log().float() + 3.0  # a shift changes nothing
BY_MASS = sorted(range(len(PROBS)), key=lambda i: -PROBS[i])  # [1, 3, 4, 5, 0, 6, 2, 7]
# the 0.999 quantile of chi-square with df degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def params(**kw):
    return SamplingParams(**{"max_new_tokens": 1, **kw})


def draw(p: SamplingParams, uniform: torch.Tensor) -> torch.Tensor:
    tokens, _ = sample_tokens(LOGITS.expand(len(uniform), -1).contiguous(), p, uniform)
    return tokens


def support(p: SamplingParams) -> set[int]:
    grid = (torch.arange(20001, dtype=torch.float64) + 0.5) / 20001
    return set(draw(p, grid).tolist())


def kept_distribution(temperature=1.0, top_k=-1, top_p=1.0) -> dict[int, float]:
    """The reference: softmax(log PROBS / T), top-k, the smallest top-p prefix, renormalised."""
    w = [p ** (1 / temperature) for p in PROBS]
    w = [x / sum(w) for x in w]
    order = sorted(range(len(w)), key=lambda i: -w[i])
    if top_k > 0:  # top-p then applies to the k kept, renormalised
        order = order[:top_k]
        w = [x / sum(w[i] for i in order) if i in order else 0.0 for i, x in enumerate(w)]
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += w[i]
        if mass >= top_p:
            break
    return {i: w[i] / sum(w[j] for j in kept) for i in kept}


def chi_square(tokens: torch.Tensor, want: dict[int, float]) -> float:
    n = len(tokens)
    counts = torch.bincount(tokens, minlength=len(PROBS)).tolist()
    assert {i for i, c in enumerate(counts) if c} <= set(want), "a token outside the support"
    return sum((counts[i] - n * q) ** 2 / (n * q) for i, q in want.items())


def uniforms(n=40000, seed=11) -> torch.Tensor:
    return counter_uniform(
        seed, torch.zeros(n, dtype=torch.int64), torch.arange(n), torch.zeros(1, dtype=torch.int64)
    )


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, {1}),  # the most likely token alone exceeds p: it is the only one drawn
        (0.39, {1}),
        (0.5, {1, 3}),
        (0.65, {1, 3}),  # 0.4 + 0.25 = 0.65 reaches p
        (0.7, {1, 3, 4}),
        (0.95, {1, 3, 4, 5, 0, 6}),
        (1.0, set(range(8))),
    ],
)
def test_top_p_draws_exactly_the_smallest_prefix_reaching_p(top_p, kept):
    assert set(kept_distribution(top_p=top_p)) == kept  # the reference agrees with the table
    assert support(params(top_p=top_p)) == kept


@pytest.mark.parametrize("top_k", [1, 2, 3, 7])
def test_top_k_draws_exactly_the_k_most_likely(top_k):
    assert support(params(top_k=top_k)) == set(BY_MASS[:top_k])


@pytest.mark.parametrize(
    "top_k, top_p", [(3, 0.75), (3, 0.45), (3, 0.55), (2, 0.6), (5, 0.9), (4, 0.99)]
)
def test_top_k_with_top_p_keeps_what_transformers_keeps(top_k, top_p):
    """Top-p over the top-k renormalised (transformers' TopK then TopP warpers; vLLM's
    apply_top_k_top_p): with k = 3 the kept mass is 0.8, and p = 0.75 keeps 2 of the 3,
    not all 3."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = LOGITS.double()[None]
    scores = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, scores))
    want = set(torch.isfinite(scores[0]).nonzero().flatten().tolist())
    assert set(kept_distribution(top_k=top_k, top_p=top_p)) == want
    assert support(params(top_k=top_k, top_p=top_p)) == want


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=3, top_p=0.75),
        dict(),
        dict(temperature=0.5),
        dict(temperature=1.7),
        dict(top_p=0.7),
        dict(top_p=0.3),
        dict(top_k=3),
        dict(top_k=5, temperature=0.6),
        dict(top_p=0.8, temperature=2.0),
    ],
)
def test_frequencies_follow_the_kept_distribution(kw):
    want = kept_distribution(**kw)
    tokens = draw(params(**kw), uniforms())
    if len(want) == 1:
        assert set(tokens.tolist()) == set(want)
        return
    stat = chi_square(tokens, want)
    assert stat < CHI2_999[len(want) - 1], (kw, stat)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_logprobs_are_the_full_vocabulary_softmax_at_the_temperature(temperature):
    """base.py: the sampler's log-prob of a token is under softmax(logits / T) over the whole
    vocabulary, before truncation (what the trainer recomputes)."""
    tokens, logp = sample_tokens(
        LOGITS.expand(5, -1).contiguous(), params(temperature=temperature, top_k=3), uniforms(5)
    )
    w = [p ** (1 / temperature) for p in PROBS]
    want = [math.log(w[t] / sum(w)) for t in tokens.tolist()]
    torch.testing.assert_close(
        logp.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-5
    )


def test_greedy_draws_the_argmax_whatever_the_uniform():
    tokens, logp = sample_tokens(
        LOGITS.expand(101, -1).contiguous(),
        params(temperature=0.0),
        torch.linspace(0, 1, 101, dtype=torch.float64),
    )
    assert set(tokens.tolist()) == {BY_MASS[0]}
    torch.testing.assert_close(
        logp.double(),
        torch.full((101,), math.log(PROBS[BY_MASS[0]]), dtype=torch.float64),
        rtol=0,
        atol=1e-5,
    )
