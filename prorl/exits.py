"""The trainer's exit codes and the error that carries one (prorl/lifecycle.py says what each
means): torch-free, so the command line answers a config error before torch is loaded."""

from __future__ import annotations

EXIT_CONFIG, EXIT_SELF_TEST, EXIT_RESUME, EXIT_OUTPUT_DIR, EXIT_STALLED, EXIT_PEER_LOST = (
    2,
    3,
    4,
    5,
    6,
    7,
)
EXIT_ROLLOUT_LOST = 8  # asynchronous RL: the rollout ranks stopped delivering (prorl/async_rl/)
EXIT_NONFINITE = 9  # a weight or optimizer state is NaN / infinite: nothing of it is saved


class Fatal(Exception):
    """Stop before (or instead of) training with a message and an exit code; raised on every
    rank."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
