"""`python -m prorl.launch`: torchrun whose exit status is the trainer's documented exit code
(torchrun itself exits 1 whenever a worker fails, so a scheduler never sees 2, 4, 5, 6 or 7)."""

import re
import signal
import sys

import pytest
from train_helpers import run

from prorl.launch import exit_status

# a config error that only the ranks can find: 3 prompts per step do not split over 2 ranks
# (check_world)
UNEVEN = ["prorl/train.py", "trainer.prompts_per_step=3", "trainer.mini_batches=1"]


@pytest.mark.tally("faults")
def test_a_two_rank_config_error_reaches_the_shell_as_exit_2(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    launch = [sys.executable, "-m", "prorl.launch", "--standalone", "--nproc_per_node=2"]
    args = [*UNEVEN, f"output_dir={tmp_path / 'run'}"]
    plain = run([*torchrun, *args], timeout=300)
    # the problem
    assert plain.returncode == 1 and "exitcode  : 2" in plain.stderr, plain.stderr[-3000:]
    proc = run([*launch, *args], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "trainer.prompts_per_step=3 is not a multiple of the 2 ranks" in proc.stderr
    # both ranks fail the check; the agent may SIGTERM one before it exits on its own (-15)
    assert re.search(
        r"prorl\.launch: exit status 2 \(rank 0: (2|-15), rank 1: (2|-15);", proc.stderr
    ), proc.stderr[-3000:]


def test_the_exit_status_rule():
    """The rule of prorl/launch.py's docstring, case by case: the first failure's code, a returned
    code before a signal before 7 (a rank that lost its peer) before SIGTERM (the agent stopping the
    others), 128 + N for a death by signal N, 0 for no failure."""
    assert exit_status({}) == 0
    assert exit_status({0: (2, 100.0), 1: (2, 100.0)}) == 2
    assert exit_status({0: (7, 100.0), 1: (4, 105.0)}) == 4  # rank 0 only saw rank 1 go
    assert exit_status({0: (7, 100.0), 1: (-signal.SIGKILL, 101.0)}) == 128 + 9
    assert exit_status({0: (7, 100.0)}) == 7
    assert exit_status({0: (1, 103.0), 1: (6, 101.0)}) == 6  # the earlier failure
    assert exit_status({1: (5, 100.0), 0: (2, 100.0)}) == 2  # a tie: the lower rank
    # rank 0 stopped by the agent
    assert exit_status({0: (-signal.SIGTERM, 100.0), 1: (2, 100.0)}) == 2
    assert exit_status({0: (-signal.SIGTERM, 100.0), 1: (7, 101.0)}) == 7
    assert exit_status({0: (-signal.SIGTERM, 100.0)}) == 128 + 15
