"""End to end: `torchrun prorl/train.py` on 2 CPU processes with the shipped tiny reasoner.

Reward must go up on the easy built-in task with a fixed seed, and each recipe component must be
observable in metrics.jsonl: dynamic sampling, the interval reference reset, the scheduled length
penalty. A config error must fail fast with its message.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


@pytest.mark.tally("bad_inputs")
def test_config_error_fails_fast_with_its_message():
    proc = subprocess.run(
        [sys.executable, "prorl/train.py", "trainer.bogus=1"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown config key 'trainer.bogus'" in proc.stderr


@pytest.mark.slow
def test_two_process_run_improves_and_shows_every_component(tmp_path):
    out = tmp_path / "run"
    overrides = [
        f"output_dir={out}",
        "trainer.total_steps=8",
        "trainer.prompts_per_step=16",
        "trainer.val_every=4",
        "data.val_size=60",
        "rollout.n=8",
        "optim.lr=1e-4",
        "algorithm.reset.interval=3",
        "reward.length_k_on=2",
        "reward.length_k_off=2",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "prorl/train.py",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "critic/score/mean" in r]
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    # reward goes up: held-out greedy accuracy (starts at the warm-start's ~25% plateau)
    assert vals[-1] >= vals[0] + 0.15, vals
    # dynamic sampling: every step reports its rounds and the all-correct/all-wrong fractions
    assert all(
        r["dynamic_sampling/rounds"] >= 1 and "dynamic_sampling/frac_all_correct" in r
        for r in steps
    )
    # reference reset every 3 steps (the policy decides after steps 3 and 6)
    assert [r["ref/reset_reason"] for r in steps if r["ref/reset_reason"]] == [
        "interval",
        "interval",
    ]
    assert steps[-1]["ref/num_resets"] == 2
    # the cosine length penalty is on for steps 0-1 and 4-5 of the schedule, off for 2-3 and 6-7
    on = [r["reward/length_penalty/mean"] != 0 for r in steps]
    assert on == [True, True, False, False, True, True, False, False], on
    for name in ("config.yaml", "training_curves.png", "checkpoints/final/model.safetensors"):
        assert (out / name).exists(), name


@pytest.mark.slow
def test_fsdp_policy_matches_replicated(tmp_path):
    """model.fsdp=true (FSDP2-sharded policy and reference, unsharded sampler copy synced after
    every update) takes the same steps as the replicated default: same samples, same losses."""
    runs = {}
    for fsdp in ("false", "true"):
        out = tmp_path / f"fsdp-{fsdp}"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "prorl/train.py",
            f"output_dir={out}",
            f"model.fsdp={fsdp}",
            "trainer.total_steps=3",
            "trainer.prompts_per_step=8",
            "rollout.n=4",
            "trainer.val_every=0",
            "data.val_size=10",
            "trainer.save_every=0",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[fsdp] = [
            json.loads(line) for line in open(out / "metrics.jsonl") if "critic/score/mean" in line
        ]
    for a, b in zip(runs["false"], runs["true"], strict=True):
        for key in (
            "critic/score/mean",
            "response_length/mean",
            "actor/pg_loss",
            "actor/kl_mean",
            "actor/entropy",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (
                a["step"],
                key,
                a[key],
                b[key],
            )


@pytest.mark.tally("bad_inputs")
@pytest.mark.slow
def test_resume_refuses_incompatible_config_and_reports_harmless_changes(tmp_path):
    out = tmp_path / "run"
    base = [
        sys.executable,
        "prorl/train.py",
        f"output_dir={out}",
        "trainer.prompts_per_step=4",
        "rollout.n=4",
        "trainer.val_every=0",
        "data.val_size=4",
        "trainer.save_every=1",
    ]

    def run(*extra):
        return subprocess.run(
            [*base, *extra], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
        )

    first = run("trainer.total_steps=1")
    assert first.returncode == 0, first.stderr[-2000:]
    refused = run("trainer.total_steps=2", "rollout.n=2")
    assert refused.returncode == 4
    assert "rollout.n: 4 -> 2" in refused.stderr and "cannot resume" in refused.stderr
    allowed = run("trainer.total_steps=2", "optim.lr=1e-5")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert (
        "resuming with changed settings: optim.lr: 3e-05 -> 1e-05; trainer.total_steps: 1 -> 2"
        in allowed.stdout
    )
