"""The issue's distributed test, launched for real: `torchrun --standalone --nproc_per_node=2`.

tests/dist_scripts/advantages_and_loss_two_ranks.py splits a batch over the two ranks and checks
that group_advantages / batch_whiten with process_group and the token-mean ppo_loss with the global
normaliser (loss and gradients) equal the single-process result on the whole batch and an
independent float64 reference; it exits non-zero on any mismatch. (test_distributed.py covers the
same ground with mp.spawn.)
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[1] / "dist_scripts" / "advantages_and_loss_two_ranks.py"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="gloo backend unavailable"
)
def test_torchrun_two_ranks_equal_single_process():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PRORL_KERNEL_BACKEND", None)  # the script picks its backends itself
    proc = subprocess.run(
        [shutil.which("torchrun"), "--standalone", "--nproc_per_node=2", str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-6000:]}"
    assert "OK: 2 ranks = one process" in proc.stdout, out[-6000:]
