"""Shared-prompt packing equals running each prompt + response on its own (values and gradients)."""

from pathlib import Path

import pytest
import torch
from prorl.engine.model import load_hf

from prorl.packing import hidden_states, pack, split_groups, unit_tokens

TINY = str(Path(__file__).resolve().parents[2] / "prorl" / "assets" / "tiny-reasoner")


def entries(seed=0):
    g = torch.Generator().manual_seed(seed)

    def toks(k):
        return torch.randint(0, 100, (k,), generator=g).tolist()

    # prompts of 1..9 tokens; responses of 1..12 tokens, including a group of one response
    return [
        (toks(5), [toks(3), toks(12), toks(1), toks(7)]),
        (toks(1), [toks(4), toks(2)]),
        (toks(9), [toks(6)]),
    ]


def reference_logprobs(model, data):
    """Each prompt + response alone through the model (no packing), log_softmax in float64."""
    out = []
    for prompt, responses in data:
        for r in responses:
            seq = torch.tensor(prompt + r)
            logits = model.logits(model(seq)).double()  # [L, V]
            rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(r)]
            out.append(torch.log_softmax(rows, -1).gather(1, torch.tensor(r)[:, None]).squeeze(1))
    return torch.cat(out)


def packed_logprobs(model, data, share):
    batch = pack(data, share=share)
    logits = model.logits(hidden_states(model, batch)).double()
    return torch.log_softmax(logits, -1).gather(1, batch.labels[:, None]).squeeze(1), batch


@pytest.mark.parametrize("share", [True, False])
def test_packed_logprobs_and_grads_equal_unpacked(share):
    data = entries()
    weights = torch.randn(
        sum(len(r) for _, rs in data for r in rs), generator=torch.Generator().manual_seed(1)
    )

    model = load_hf(TINY, dtype=torch.float32, attention="sdpa")
    ref = reference_logprobs(model, data)
    (ref * weights).sum().backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}

    model.zero_grad()
    got, batch = packed_logprobs(model, data, share)
    (got * weights).sum().backward()

    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    for k, p in model.named_parameters():
        scale = ref_grads[k].abs().max()  # fp32 round-off of sums taken in another order
        assert (p.grad - ref_grads[k]).abs().max() <= 1e-5 * scale, k
    prompts = sum(len(p) for p, _ in data)
    responses = sum(len(r) for _, rs in data for r in rs)
    n_resp = sum(len(rs) for _, rs in data)
    assert batch.num_tokens == (
        prompts + responses
        if share
        else prompts + responses + sum(len(p) * (len(rs) - 1) for p, rs in data)
    )
    assert batch.resp_cu.tolist()[-1] == responses and len(batch.resp_cu) == n_resp + 1


def test_split_groups_respects_the_budget_and_covers_every_response():
    lp, lr = [4, 2], [[3, 3, 3, 3], [10, 1]]
    for share in (True, False):
        for budget in (0, 5, 8, 10, 100):
            units = split_groups(lp, lr, budget, share)
            covered = [(g, j) for g, a, b in units for j in range(a, b)]
            assert covered == [(g, j) for g in range(2) for j in range(len(lr[g]))]
            for g, a, b in units:
                if budget > 0 and b - a > 1:
                    assert unit_tokens(lp[g], lr[g][a:b], share) <= budget
    assert split_groups(lp, lr, 10, True) == [(0, 0, 2), (0, 2, 4), (1, 0, 1), (1, 1, 2)]
    assert split_groups(lp, lr, 0, True) == [(0, 0, 4), (1, 0, 2)]
