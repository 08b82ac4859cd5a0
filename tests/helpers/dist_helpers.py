"""Helpers shared by the distributed engine tests: a tiny Qwen2-shaped decoder, packed batches, a
training step with the project's loss convention, and a runner that spawns gloo ranks (file://
rendezvous)."""

import io
import os
import queue as queue_module
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prorl.engine.model import Decoder, ModelConfig
from prorl.kernels import linear_logprob_entropy

# Qwen2 layout (qkv bias, tied embeddings). vocab 97 is odd: FSDP2 pads its dim-0 shards unevenly.
TINY_QWEN2 = ModelConfig(
    model_type="qwen2",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)
# one global batch: rank 0 of 2 gets sequences 0-1 (14 tokens), rank 1 2-3 (18)
LENGTHS = [5, 9, 7, 11]


def random_decoder(seed: int = 0, cfg: ModelConfig = TINY_QWEN2) -> Decoder:
    model = Decoder(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial norms and biases, so a wrong shard of either shows
        gen = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def packed_batch(
    step: int, seqs: slice | None = None, vocab: int = TINY_QWEN2.vocab_size, pad_multiple: int = 1
):
    """(input_ids [N], cu_seqlens [B+1] int32, labels [N]) of sequences `seqs` of step's global
    batch.

    labels[i] = the next token of the same sequence, -100 at each sequence's last token.
    pad_multiple: a sequence of token 0 with labels -100 is appended to make N a multiple of it (FP8
    GEMMs on CUDA).
    """
    gen = torch.Generator().manual_seed(1000 + step)
    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]
    ids = ids[seqs] if seqs is not None else ids
    pad = -sum(len(s) for s in ids) % pad_multiple
    labels = [torch.cat([s[1:], torch.tensor([-100])]) for s in ids]
    if pad:
        ids, labels = (
            ids + [torch.zeros(pad, dtype=torch.long)],
            labels + [torch.full((pad,), -100)],
        )
    cu = torch.tensor(
        [0, *torch.tensor([len(s) for s in ids]).cumsum(0).tolist()], dtype=torch.int32
    )
    return torch.cat(ids), cu, torch.cat(labels)


def global_token_count(step: int) -> int:
    return sum(n - 1 for n in LENGTHS)


def train_step(
    model, optimizer, step: int, seqs: slice | None = None, pad_multiple: int = 1
) -> torch.Tensor:
    """One optimizer step; loss = -sum(logp of this rank's tokens) / GLOBAL token count (the
    kernels' normalizer convention), so the per-rank losses sum to the single-process loss. Returns
    the loss."""
    ids, cu, labels = packed_batch(step, seqs, pad_multiple=pad_multiple)
    hidden = model(ids, cu_seqlens=cu)
    logp, _ = linear_logprob_entropy(hidden, model.lm_head_weight, labels, return_entropy=False)
    loss = -logp.float().sum() / global_token_count(step)
    loss.backward()
    optimizer.step()
    return loss.detach()


def rank_slice(rank: int, world: int) -> slice:
    half = len(LENGTHS) // world
    return slice(rank * half, (rank + 1) * half)


def _entry(rank, world, init_file, queue, fn, args):
    try:
        torch.set_num_threads(1)
        if init_file:
            dist.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
            )
        # as bytes: tensors sent as they are travel by shared memory that dies with this process
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report instead of leaving the parent waiting
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, tmp_path, *args, world: int = 2, init: bool = True, timeout_s: float = 300):
    """Run fn(rank, world, *args) in `world` spawned gloo processes; returns {rank: result}.

    fn must be importable (module level). A failure on any rank fails with that rank's traceback.
    init=False: no process group is created for fn (it makes its own). A rank that exits without
    reporting (os._exit, a crash) gets the result ("exited", exitcode).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(str(tmp_path), f"init-{os.urandom(4).hex()}") if init else None
    procs = [
        ctx.Process(target=_entry, args=(r, world, init_file, queue, fn, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.5)
            (results if status == "ok" else errors)[rank] = value
        except queue_module.Empty:
            for rank, p in enumerate(procs):
                if (
                    rank not in results
                    and rank not in errors
                    and p.exitcode is not None
                    and queue.empty()
                ):
                    results[rank] = ("exited", p.exitcode)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    if len(results) < world:
        raise AssertionError(
            f"ranks {sorted(set(range(world)) - set(results))} did not finish in {timeout_s} s"
        )
    return {
        r: torch.load(io.BytesIO(v), weights_only=False) if isinstance(v, bytes) else v
        for r, v in results.items()
    }
