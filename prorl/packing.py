"""Packing a step's responses for the log-prob passes: each prompt once per group, no padding.

GRPO-style RL samples n responses per prompt, and a plain packed batch repeats the prompt n times; when
prompts are not much shorter than responses that is most of the tokens. Here a group is packed as
[prompt, response_1, ..., response_n]: the prompt's tokens go through the model once, and every response
attends to that one copy of the prompt's keys/values plus its own earlier tokens (engine/attention.py,
`shared_prefix_layout`). The math is the same as packing n full sequences: the prompt's activations are
identical in every copy, and in backward the gradient reaching the shared prompt is the sum over the
responses that read it (the `index_select` of the keys does that sum). Tested against the plain packing.

Outputs live in response-token space: entry t of a [R] tensor is the t-th response token of the step
(group-major, response-major, in order); `hidden_rows` says which packed position predicts it (the prompt's
last token for the first response token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prorl.engine.attention import shared_prefix_layout


@dataclass
class PackedBatch:
    """One forward's input. ids/position_ids [N]; cu_seqlens [S+1]; cu_seqlens_k/kv_index: None for plain
    packing, else the shared-prefix keys; hidden_rows [R] and labels [R]: the response tokens and the
    positions predicting them; resp_cu [num_responses+1]: response offsets in [R]."""

    ids: torch.Tensor
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    kv_index: torch.Tensor | None
    hidden_rows: torch.Tensor
    labels: torch.Tensor
    resp_cu: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()


def pack(entries: list[tuple[list[int], list[list[int]]]], share: bool, device=None) -> PackedBatch:
    """entries: (prompt ids, responses that continue it). share=False packs each prompt + response as a
    sequence of its own (the prompt repeated per response); share=True each entry's prompt once."""
    ids, rows, labels, resp_lengths = [], [], [], []
    if share:
        layout = shared_prefix_layout(
            [len(p) for p, _ in entries], [[len(r) for r in rs] for _, rs in entries]
        )
        for prompt, responses in entries:
            last = len(ids) + len(prompt) - 1  # the prompt's last token predicts each response's first
            ids += prompt
            for r in responses:
                start = len(ids)
                rows += [last] + list(range(start, start + len(r) - 1)) if r else []
                labels += r
                ids += r
                resp_lengths.append(len(r))
        pos = torch.tensor(layout["position_ids"])
        cu_q, cu_k = torch.tensor(layout["cu_q"]), torch.tensor(layout["cu_k"])
        kv_index = torch.tensor(layout["kv_index"], dtype=torch.long)
    else:
        cu = [0]
        for prompt, responses in entries:
            for r in responses:
                start = len(ids) + len(prompt)
                rows += list(range(start - 1, start - 1 + len(r)))
                labels += r
                ids += prompt + r
                cu.append(len(ids))
                resp_lengths.append(len(r))
        pos, cu_q, cu_k, kv_index = None, torch.tensor(cu), None, None
    resp_cu = torch.tensor([0] + resp_lengths).cumsum(0)

    def put(t, dtype=None):
        return None if t is None else t.to(device=device, dtype=dtype or t.dtype)

    return PackedBatch(
        ids=put(torch.tensor(ids, dtype=torch.long)),
        position_ids=put(pos, torch.long),
        cu_seqlens=put(cu_q, torch.int32),
        cu_seqlens_k=put(cu_k, torch.int32),
        kv_index=put(kv_index),
        hidden_rows=put(torch.tensor(rows, dtype=torch.long)),
        labels=put(torch.tensor(labels, dtype=torch.long)),
        resp_cu=put(resp_cu, torch.int32),
    )


def hidden_states(model, batch: PackedBatch) -> torch.Tensor:
    """The final-normed hidden states that predict the batch's response tokens: [R, D]."""
    hidden = model(
        batch.ids,
        batch.position_ids,
        batch.cu_seqlens,
        cu_seqlens_k=batch.cu_seqlens_k,
        kv_index=batch.kv_index,
    )
    return hidden.index_select(0, batch.hidden_rows)


def unit_tokens(prompt_length: int, response_lengths: list[int], share: bool) -> int:
    """Tokens one forward spends on a prompt and these of its responses."""
    return (prompt_length if share else prompt_length * len(response_lengths)) + sum(response_lengths)


def split_groups(
    prompt_lengths: list[int], response_lengths: list[list[int]], budget: int, share: bool = True
) -> list[tuple[int, int, int]]:
    """Units of work (group, first response, end response), in order: a group that exceeds `budget` tokens
    (`unit_tokens`) is split into runs of responses, each run with its own copy of the prompt; a single
    response longer than the budget is a unit of its own (budget <= 0: whole groups)."""
    units = []
    for g, (lp, lrs) in enumerate(zip(prompt_lengths, response_lengths)):
        start = 0
        for j in range(len(lrs)):
            if budget > 0 and j > start and unit_tokens(lp, lrs[start : j + 1], share) > budget:
                units.append((g, start, j))
                start = j
        units.append((g, start, len(lrs)))
    return units
