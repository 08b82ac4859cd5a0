"""torchrun, with the trainer's exit code as the exit status a scheduler sees.

    python -m prorl.launch --standalone --nproc_per_node=2 prorl/train.py [overrides ...]

Takes exactly torchrun's arguments (it runs torchrun's own launcher in this process). Under
`torchrun` the documented exit codes of `prorl/train.py` (prorl/lifecycle.py: 2 config, 3 reward
self-test, 4 resume, 5 output directory, 6 stalled, 7 peer lost, 8 rollout ranks lost) reach the
shell only inside torchrun's per-rank summary: torchrun itself exits 1 whenever a worker fails.
Slurm, Kubernetes and CI read the process's exit status, so this launcher returns the code the
failed workers returned (`exit_status`):

- the code of the first failure (its time, to the second, then the lowest rank), ranked by what
  causes rather than follows a failure: a code the worker returned itself; then a death by a signal
  other than SIGTERM (SIGKILL: the OOM killer, say); then 7 (the rank saw its peer vanish: the
  peer's code is the cause); last SIGTERM (what the agent sends the other workers once one has
  failed - the trainer itself exits 0 on SIGTERM);
- a worker killed by signal N gives 128 + N (the shell's convention: 137 for SIGKILL); the launcher
  itself stopped by signal N gives 128 + N as well;
- 0 when every worker returned 0 (a run stopped by SIGTERM that saved its checkpoint included).

On several nodes each node's launcher reports its own workers: the node whose rank failed first
returns the cause, the others what their ranks saw (often 7, or a signal from the shutdown).
"""

from __future__ import annotations

import signal
import sys

from prorl.exits import EXIT_PEER_LOST


def exit_status(failures: dict[int, tuple[int, float]]) -> int:
    """The exit status for the failed workers `failures` ({global rank: (exit code, timestamp)}; a
    negative code is death by that signal). See the module docstring for the rule."""
    if not failures:
        return 0

    def rank(code: int) -> int:  # 0 causes ... 3 follows
        if code == -signal.SIGTERM:
            return 3
        return 2 if code == EXIT_PEER_LOST else 1 if code < 0 else 0

    first = min(failures, key=lambda r: (rank(failures[r][0]), failures[r][1], r))
    code = failures[first][0]
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        failures = {rank: (f.exitcode, f.timestamp) for rank, f in exc.failures.items()}
        status = exit_status(failures)
        per_rank = ", ".join(f"rank {r}: {c}" for r, (c, _) in sorted(failures.items()))
        print(
            f"prorl.launch: exit status {status} ({per_rank}; codes: prorl/lifecycle.py)",
            file=sys.stderr,
        )
        return status
    except SignalException as exc:
        print(f"prorl.launch: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
