"""Shared-prompt packing equals running each prompt + response on its own (values and gradients)."""

from pathlib import Path

import pytest
import torch
from prorl.engine.model import load_hf

from prorl.packing import hidden_states, pack, padded, split_groups, unit_tokens

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


def plain_pack(data, share):
    """The packed layout written out token by token (the module docstring's definition): ids, the
    row predicting each response token, segment offsets, and for sharing each segment's keys and
    the positions."""
    ids, rows, cu, cu_k, keys, pos = [], [], [0], [0], [], []
    for prompt, responses in data:
        if share:
            p0 = len(ids)
            ids += prompt
            cu.append(len(ids))
            keys += list(range(p0, p0 + len(prompt)))
            cu_k.append(len(keys))
            pos += list(range(len(prompt)))
            for r in responses:
                r0 = len(ids)
                rows += [p0 + len(prompt) - 1] + list(range(r0, r0 + len(r) - 1)) if r else []
                ids += r
                cu.append(len(ids))
                keys += list(range(p0, p0 + len(prompt))) + list(range(r0, r0 + len(r)))
                cu_k.append(len(keys))
                pos += list(range(len(prompt), len(prompt) + len(r)))
        else:
            for r in responses:
                s0 = len(ids)
                ids += prompt + r
                rows += list(range(s0 + len(prompt) - 1, s0 + len(prompt) - 1 + len(r)))
                cu.append(len(ids))
    return ids, rows, cu, cu_k, keys, pos


@pytest.mark.parametrize("share", [True, False])
def test_pack_builds_the_layout_of_its_definition(share):
    """Every index tensor equals the token-by-token layout, an empty response included, and the
    longest sequence and key run are handed on as host ints (flash-attn's max_seqlen, no sync)."""
    data = [*entries(3), ([7, 8, 9], [[], [4, 5], [6]])]
    ids, rows, cu, cu_k, keys, pos = plain_pack(data, share)
    batch = pack(data, share=share)
    assert batch.ids.tolist() == ids and batch.hidden_rows.tolist() == rows
    assert batch.cu_seqlens.tolist() == cu
    assert batch.labels.tolist() == [t for _, rs in data for r in rs for t in r]
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert batch.max_seqlen_q == max(lengths)
    if share:
        assert batch.cu_seqlens_k.tolist() == cu_k and batch.kv_index.tolist() == keys
        assert batch.position_ids.tolist() == pos
        assert batch.max_seqlen_k == max(b - a for a, b in zip(cu_k, cu_k[1:]))
    else:
        assert batch.kv_index is None and batch.max_seqlen_k == max(lengths)
    # with the response tokens handed over as one tensor (StepBatch.response_ids): the same
    labels = torch.tensor([t for _, rs in data for r in rs for t in r])
    assert torch.equal(pack(data, share=share, labels=labels).ids, batch.ids)
    wide = padded(batch, 64)  # a 64-token dummy sequence would be the longest
    assert wide.max_seqlen_q == max(max(lengths), -batch.num_tokens % 64)


def test_hidden_states_hands_the_model_the_longest_lengths():
    seen = {}

    def model(ids, pos, cu, **kwargs):
        seen.update(kwargs)
        return torch.zeros(ids.numel(), 4)

    batch = pack(entries(), share=True)
    hidden_states(model, batch)
    cu, cu_k = batch.cu_seqlens, batch.cu_seqlens_k
    assert seen["max_seqlen"] == int(cu.diff().max()) == 12  # the 12-token response
    assert seen["max_seqlen_k"] == int(cu_k.diff().max()) == 17  # it reads its 5-token prompt
