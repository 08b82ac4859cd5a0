"""Packing a step's responses for the log-prob passes: each prompt once per group, no padding.

GRPO-style RL samples n responses per prompt, and a plain packed batch repeats the prompt n times;
when prompts are not much shorter than responses that is most of the tokens. Here a group is packed
as [prompt, response_1, ..., response_n]: the prompt's tokens go through the model once, and every
response attends to that one copy of the prompt's keys/values plus its own earlier tokens
(engine/attention.py, `shared_prefix_layout`). The math is the same as packing n full sequences: the
prompt's activations are identical in every copy, and in backward the gradient reaching the shared
prompt is the sum over the responses that read it (the `index_select` of the keys does that sum).
Tested against the plain packing.

Outputs live in response-token space: entry t of a [R] tensor is the t-th response token of the step
(group-major, response-major, in order); `hidden_rows` says which packed position predicts it (the
prompt's last token for the first response token).

The step's side: `StepBatch` flattens the kept groups once (per response and per response token),
and the planner cuts it into passes:

    batch = StepBatch.of(groups, n, device)
    plan = plan_update(batch, mini_batches=M, budget=B, share=True, agg=..., max_new=T,
                       lockstep=fsdp)
    for mini in plan:
        for micro in mini.passes:  # None: a dummy pass (under FSDP every rank runs as many passes)
            ... micro.packed, batch.tokens.slice(micro) ...  # its tokens' sampler log-probs, pi_old

A pass holds whole groups, or runs of one group's responses when a group alone exceeds the token
budget (`split_groups`), packed up to `budget` tokens (`token_budget_chunks`); each mini-batch
carries the GLOBAL loss normaliser of its aggregation (every rank's tokens or sequences: one
all-reduce).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from prorl.algorithm import loss_normalizer, token_budget_chunks
from prorl.engine.attention import shared_prefix_layout
from prorl.engine.distributed import all_reduce


@dataclass
class PackedBatch:
    """One forward's input. ids/position_ids [N]; cu_seqlens [S+1]; cu_seqlens_k/kv_index: None for
    plain packing, else the shared-prefix keys; hidden_rows [R] and labels [R]: the response tokens
    and the positions predicting them; resp_cu [num_responses+1]: response offsets in [R].
    max_seqlen_q/k: the longest sequence and key run, host ints known when packing (flash-attn
    needs them: computed from the device tensors they would cost a host sync per forward)."""

    ids: torch.Tensor
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    kv_index: torch.Tensor | None
    hidden_rows: torch.Tensor
    labels: torch.Tensor
    resp_cu: torch.Tensor
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()


def pack(
    entries: list[tuple[list[int], list[list[int]]]], share: bool, device=None, labels=None
) -> PackedBatch:
    """entries: (prompt ids, responses that continue it). share=False packs each prompt + response
    as a sequence of its own (the prompt repeated per response); share=True each entry's prompt
    once. labels: the responses' tokens as one int64 host tensor [R], if the caller has it
    (`StepBatch.response_ids`). The index tensors are built with torch ops on the host, then moved
    to `device`: the preset's 2.2M response tokens per rank and step in 181 passes took 3.6 s
    with per-token Python lists, 0.8 s so (`python -m benchmarks packing`, this CPU)."""
    flat = itertools.chain.from_iterable
    lp = torch.tensor([len(p) for p, _ in entries], dtype=torch.long)  # [G]
    counts = torch.tensor([len(rs) for _, rs in entries], dtype=torch.long)
    lr = torch.tensor([len(r) for _, rs in entries for r in rs], dtype=torch.long)  # [S]
    group = torch.repeat_interleave(torch.arange(len(entries)), counts)  # [S] response -> entry
    if labels is None:
        labels = torch.tensor(list(flat(flat(rs for _, rs in entries))), dtype=torch.long)  # [R]
    resp_cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lr, 0)])
    prompts = torch.tensor(list(flat(p for p, _ in entries)), dtype=torch.long)
    if share:
        layout = shared_prefix_layout(lp.tolist(), [[len(r) for r in rs] for _, rs in entries])
        cu_q, cu_k, kv_index = layout["cu_q"], layout["cu_k"], layout["kv_index"]
        pos, longest = layout["position_ids"], (layout["max_q"], layout["max_k"])
        start = cu_q[layout["segment_of_response"]]  # [S] each response's first row
        prompt_seg = torch.arange(len(entries)) + torch.cumsum(counts, 0) - counts  # [G]
        last = (cu_q[prompt_seg] + lp - 1)[group]  # [S] its prompt's last row
    else:
        seq = lp[group] + lr  # [S] each response with its own copy of the prompt
        cu_q = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(seq, 0)])
        start, pos, cu_k, kv_index = cu_q[:-1] + lp[group], None, None, None
        last = start - 1
        longest = (int(seq.max()) if len(seq) else 0,) * 2
        # each response's copy of its prompt
        prompts = prompts[_concat_ranges((torch.cumsum(lp, 0) - lp)[group], lp[group])]
    # [R] the row of each response token; the row predicting it is the one before (for a response's
    # first token its prompt's last: under sharing the row before is the previous response's)
    resp_rows = _concat_ranges(start, lr)
    is_response = torch.zeros(int(cu_q[-1]), dtype=torch.bool)
    is_response[resp_rows] = True
    ids = torch.empty(int(cu_q[-1]), dtype=torch.long)
    ids[resp_rows], ids[~is_response] = labels, prompts
    rows = resp_rows - 1
    first = lr > 0
    rows[resp_cu[:-1][first]] = last[first]

    def put(t, dtype=None):
        return None if t is None else t.to(device=device, dtype=dtype or t.dtype)

    return PackedBatch(
        ids=put(ids),
        position_ids=put(pos, torch.long),
        cu_seqlens=put(cu_q, torch.int32),
        cu_seqlens_k=put(cu_k, torch.int32),
        kv_index=put(kv_index),
        hidden_rows=put(rows),
        labels=put(labels),
        resp_cu=put(resp_cu, torch.int32),
        max_seqlen_q=longest[0],
        max_seqlen_k=longest[1],
    )


def _concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """arange(s, s + n) for each (s, n), concatenated: int64 [sum(lengths)]."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()))


def padded(batch: PackedBatch, multiple: int) -> PackedBatch:
    """`batch` with a dummy sequence of token 0 appended so that its token count is a multiple of
    `multiple` (Transformer Engine's FP8 GEMMs; engine/fp8.py). The dummy is a sequence of its own
    (it attends to nothing else and nothing attends to it) and no response row reads it, so
    log-probs and gradients are those of `batch`."""
    n = batch.num_tokens
    pad = -n % multiple
    if pad == 0:
        return batch
    device = batch.ids.device
    extra = torch.arange(n, n + pad, device=device)
    ids = torch.cat([batch.ids, torch.zeros(pad, dtype=batch.ids.dtype, device=device)])
    cu = batch.cu_seqlens
    cu = torch.cat([cu, (cu[-1] + pad).view(1).to(cu.dtype)])
    position_ids = cu_k = kv_index = None
    if batch.position_ids is not None:
        position_ids = torch.cat(
            [batch.position_ids, torch.arange(pad, device=device).to(batch.position_ids.dtype)]
        )
    if batch.cu_seqlens_k is not None:
        ck = batch.cu_seqlens_k
        cu_k = torch.cat([ck, (ck[-1] + pad).view(1).to(ck.dtype)])
        kv_index = torch.cat([batch.kv_index, extra.to(batch.kv_index.dtype)])
    longest = [None if m is None else max(m, pad) for m in (batch.max_seqlen_q, batch.max_seqlen_k)]
    return dataclasses.replace(
        batch,
        ids=ids,
        position_ids=position_ids,
        cu_seqlens=cu,
        cu_seqlens_k=cu_k,
        kv_index=kv_index,
        max_seqlen_q=longest[0],
        max_seqlen_k=longest[1],
    )


def hidden_states(model, batch: PackedBatch, pad_multiple: int = 1) -> torch.Tensor:
    """The final-normed hidden states that predict the batch's response tokens: [R, D].
    pad_multiple: run the model on `padded(batch, pad_multiple)` (the padding's rows are not
    returned)."""
    batch = padded(batch, pad_multiple) if pad_multiple > 1 else batch
    hidden = model(
        batch.ids,
        batch.position_ids,
        batch.cu_seqlens,
        cu_seqlens_k=batch.cu_seqlens_k,
        kv_index=batch.kv_index,
        max_seqlen=batch.max_seqlen_q,
        max_seqlen_k=batch.max_seqlen_k,
    )
    return hidden.index_select(0, batch.hidden_rows)


def unit_tokens(prompt_length: int, response_lengths: list[int], share: bool) -> int:
    """Tokens one forward spends on a prompt and these of its responses."""
    return (prompt_length if share else prompt_length * len(response_lengths)) + sum(
        response_lengths
    )


def split_groups(
    prompt_lengths: list[int], response_lengths: list[list[int]], budget: int, share: bool = True
) -> list[tuple[int, int, int]]:
    """Units of work (group, first response, end response), in order: a group that exceeds `budget`
    tokens (`unit_tokens`) is split into runs of responses, each run with its own copy of the
    prompt; a single response longer than the budget is a unit of its own (budget <= 0: whole
    groups)."""
    units = []
    for g, (lp, lrs) in enumerate(zip(prompt_lengths, response_lengths)):
        start = 0
        for j in range(len(lrs)):
            if budget > 0 and j > start and unit_tokens(lp, lrs[start : j + 1], share) > budget:
                units.append((g, start, j))
                start = j
        units.append((g, start, len(lrs)))
    return units


# -- the step's batch and its passes ---------------------------------------------------------------


@dataclass
class TokenInputs:
    """The update's inputs per response token: [R] for the step, [hi - lo] for a micro-batch
    (`slice`).

    sampler_logp fp32: the sampler's log-probs; stored_old fp32: the pi_old stored with carried-over
    groups (NaN for groups sampled this step); mask bool: valid tokens. advantage, ref_logp,
    old_logp fp32: filled in by the update (prorl/update.py), None before."""

    sampler_logp: torch.Tensor
    stored_old: torch.Tensor
    mask: torch.Tensor
    advantage: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None

    def slice(self, micro: MicroBatch) -> TokenInputs:
        """The micro-batch's tokens [micro.lo, micro.hi) of every field."""
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return TokenInputs(*(None if v is None else v[micro.lo : micro.hi] for v in values))

    def pi_old(self, current: torch.Tensor) -> torch.Tensor:
        """pi_old of these tokens, the rule's one home: for carried-over groups the log-probs stored
        under the policy that sampled them, one update ago (`Updater.store_old_logprobs`); for
        groups sampled this step `current`, the log-probs of the policy before this update (which
        sampled them)."""
        return torch.where(torch.isnan(self.stored_old), current, self.stored_old)


@dataclass
class StepBatch:
    """One step's kept groups flattened once. S responses (group-major), R response tokens.

    groups: the groups (prompt and response ids); rewards [S] fp32 (shaped, what is trained on; NaN
    for groups not shaped yet, e.g. a carry-over whose log-probs are taken before the next step);
    lengths [S] (host); resp_cu [S+1] (host) and cu [S+1] int32 (device): response offsets in [R];
    tokens: the per-token inputs [R]; response_ids [R] int64 (host): the response tokens, converted
    from the groups' lists once for every pass's `pack`."""

    groups: list
    n: int
    rewards: torch.Tensor
    lengths: list[int]
    resp_cu: list[int]
    cu: torch.Tensor
    tokens: TokenInputs
    response_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, groups: list, n: int, device) -> StepBatch:
        import itertools

        lengths = [len(t) for g in groups for t in g.responses]
        resp_cu = [0, *itertools.accumulate(lengths)]

        def tokens(values):  # [R] fp32 from per-response lists
            return torch.tensor([x for v in values for x in v], dtype=torch.float32, device=device)

        nan = float("nan")
        stored_old = tokens(
            g.old_logps[j] if g.old_logps is not None else [nan] * len(t)
            for g in groups
            for j, t in enumerate(g.responses)
        )
        return cls(
            groups=groups,
            n=n,
            rewards=torch.tensor(
                [
                    r
                    for g in groups
                    for r in (g.shaped if g.shaped is not None else [nan] * len(g.responses))
                ],
                dtype=torch.float32,
                device=device,
            ),
            lengths=lengths,
            resp_cu=resp_cu,
            cu=torch.tensor(resp_cu, dtype=torch.int32, device=device),
            tokens=TokenInputs(
                sampler_logp=tokens(lp for g in groups for lp in g.sampler_logps),
                stored_old=stored_old,
                mask=torch.ones(resp_cu[-1], dtype=torch.bool, device=device),
            ),
            response_ids=torch.tensor(
                list(itertools.chain.from_iterable(t for g in groups for t in g.responses)),
                dtype=torch.long,
            ),
        )

    @property
    def device(self) -> torch.device:
        return self.rewards.device

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """[S] per-response values -> [R], each repeated over its response's tokens."""
        return torch.repeat_interleave(
            values, torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        )


@dataclass
class MicroBatch:
    """One forward/backward: its packed input and its response tokens' range [lo, hi) in the step's
    [R]."""

    packed: PackedBatch
    lo: int
    hi: int


@dataclass
class MiniBatch:
    """One optimizer step: its passes and the global loss normaliser of its aggregation (0-d)."""

    normalizer: torch.Tensor
    passes: list[MicroBatch | None]  # this rank's; may be empty where other ranks have tokens
    groups: tuple[int, int] = (0, 0)  # this rank's groups [g0, g1) in it

    @property
    def empty(self) -> bool:
        """No response token on any rank: every rank skips this optimizer step."""
        return float(self.normalizer) <= 0


def plan_passes(batch: StepBatch, g0: int, g1: int, *, budget: int, share: bool, lockstep: bool):
    """Groups g0..g1 of `batch` as passes of at most `budget` tokens (module docstring). `lockstep`
    (every rank runs as many passes - FSDP: every forward all-gathers, every backward
    reduce-scatters): the list is padded with None - dummy passes - up to the largest count over
    ranks (one all-reduce)."""
    groups, n = batch.groups, batch.n
    prompt_lens = [len(g.prompt_ids) for g in groups[g0:g1]]
    response_lens = [[len(t) for t in g.responses] for g in groups[g0:g1]]
    units = split_groups(prompt_lens, response_lens, budget, share)
    sizes = [unit_tokens(prompt_lens[g], response_lens[g][a:b], share) for g, a, b in units]
    passes: list[MicroBatch | None] = []
    for c0, c1 in token_budget_chunks(sizes, budget):
        chunk = [(g0 + g, a, b) for g, a, b in units[c0:c1]]
        entries = [(groups[g].prompt_ids, groups[g].responses[a:b]) for g, a, b in chunk]
        (g_first, a_first, _), (g_last, _, b_last) = chunk[0], chunk[-1]
        lo, hi = batch.resp_cu[g_first * n + a_first], batch.resp_cu[g_last * n + b_last]
        labels = None if batch.response_ids is None else batch.response_ids[lo:hi]
        passes.append(MicroBatch(pack(entries, share, batch.device, labels), lo, hi))
    if lockstep:
        most = int(
            all_reduce(
                torch.tensor(len(passes), device=batch.device), "max", what="the pass counts"
            )
        )
        passes += [None] * (most - len(passes))
    return passes


def plan_update(
    batch: StepBatch,
    *,
    mini_batches: int,
    budget: int,
    share: bool,
    agg: str,
    max_new: int,
    lockstep: bool,
) -> list[MiniBatch]:
    """The update's M mini-batches (each rank's groups split in M consecutive runs, so mini-batch m
    is the m-th run of every rank), each with its passes and its global loss normaliser."""
    groups, n = batch.groups, batch.n
    per = max(-(-len(groups) // mini_batches), 1)
    out = []
    for m in range(mini_batches):
        g0, g1 = min(m * per, len(groups)), min((m + 1) * per, len(groups))
        lo, hi = batch.resp_cu[g0 * n], batch.resp_cu[g1 * n]
        local = loss_normalizer(
            agg, batch.tokens.mask[lo:hi], batch.cu[g0 * n : g1 * n + 1] - lo, max_new
        )
        normalizer = all_reduce(local, what=f"mini-batch {m}'s loss normaliser").float()
        out.append(MiniBatch(normalizer, [], (g0, g1)))
        # else no response token in this mini-batch on any rank: nothing to do
        if float(normalizer) > 0:
            out[-1].passes = plan_passes(
                batch, g0, g1, budget=budget, share=share, lockstep=lockstep
            )
    return out
