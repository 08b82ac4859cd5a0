"""Entry point of the ProRL v2 trainer: `torchrun prorl/train.py [--config FILE] [dotted.key=value ...]`.

PLACEHOLDER. The trainer (issue 7) is not built yet. Until it is, this entry point runs a demo of the
fused op the trainer is built on, `prorl.kernels.linear_logprob_entropy`, under torchrun: every rank
computes per-token log-probs and entropies of a random LM head on its own tokens with the op (native
backend on CPU, Triton on CUDA), checks them against the unfused float64 reference, and rank 0 prints
the agreement, the time, and the logits memory the op did not allocate. It exits non-zero on a mismatch.
"""

import os
import sys
import time

# `torchrun prorl/train.py` puts prorl/ itself first on sys.path; drop it so that files in this folder
# never shadow top-level modules. The package is imported through the installation (README).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from prorl.kernels import linear_logprob_entropy, linear_logprob_entropy_reference, resolve_backend  # noqa: E402


def main(argv: list[str]) -> int:
    if argv:
        print(f"prorl/train.py: the trainer is not implemented yet (issue 7); ignoring arguments {argv}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    )
    device = device or torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    # A Qwen2.5-0.5B-sized LM head (D=896, V=151936) on 256 tokens per rank.
    n, d, v = 256, 896, 151936
    gen = torch.Generator().manual_seed(1234 + rank)
    hidden = torch.randn(n, d, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) * d**-0.5).to(device).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    labels[-1] = -100  # the last token of a sequence has no next-token target

    start = time.perf_counter()
    logp, ent = linear_logprob_entropy(hidden, weight, labels)
    (logp.sum() + 0.01 * ent.sum()).backward()
    elapsed = time.perf_counter() - start

    ref_logp, ref_ent = linear_logprob_entropy_reference(hidden.detach(), weight.detach(), labels)
    err = torch.stack([(logp.double() - ref_logp).abs().max(), (ent.double() - ref_ent).abs().max()])
    if world > 1:
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("prorl: the ProRL v2 trainer is not built yet (issue 7); running the fused-op demo instead.")
        print(
            f"  linear_logprob_entropy[{resolve_backend(device)}] on {world} rank(s) x {n} tokens, "
            f"D={d}, V={v}: forward+backward {elapsed:.2f} s on rank 0"
        )
        print(f"  max |error| vs float64 reference: logp {err[0]:.2e}, entropy {err[1]:.2e}")
        print(
            f"  logits never materialised: {n * v * 4 / 2**20:.0f} MiB of fp32 [N, V] per rank not allocated"
        )
    ok = bool(err.max() < 1e-3)
    if world > 1:
        dist.destroy_process_group()
    if not ok:
        print("prorl: demo FAILED: the op disagrees with the reference", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
