"""`torchrun prorl/train.py --config prorl_v2_1.5b` in miniature on 2 CPU ranks (gloo): the preset
file with size-only overrides on a bf16 checkpoint with an untied head
(tests/helpers/preset_helpers.py), the run killed with SIGKILL after its first checkpoint and
resumed, as a preempted cluster job would be.

- the resumed run continues exactly: every per-step metric and the final weights equal an
  uninterrupted run's (trainer.deterministic=true), with ProRL v1's optimizer reset on
  (`algorithm.reset.reset_optimizer=true`, the documented v1 option): the checkpoint the run
  resumes from (step 2) is saved right after a reset, with an AdamW of sharded FSDP2 parameters
  that holds no state (before the fix, the resumed run's step 3 differed: the saved state's step
  count was 1). The preset's own kept moments across a resume: test_hsdp.py (from step 1);
- a checkpoint saved right after a reference reset holds a reference equal to the policy bit for bit
  (read back here by torch.distributed.checkpoint into one process: DCP reshards 2 ranks -> 1);
- the final Hugging Face export loads in `transformers`, with its own (untied) LM head, and gives
  the exported weights' logits.
"""

import json
import os
import sys

import pytest
import torch
from preset_helpers import preset_env, preset_overrides, write_bf16_untied_checkpoint, write_data
from train_helpers import ROOT, complete_steps, kill_tree, wait_for

pytestmark = pytest.mark.slow

TOTAL = 4


def command(out, ckpt, train, val, nproc=2):
    import sys

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "prorl/train.py",
        "--config",
        "prorl_v2_1.5b",
        *preset_overrides(ckpt, train, val),
        f"trainer.total_steps={TOTAL}",
        "trainer.save_every=2",
        "trainer.keep_last=3",
        "algorithm.reset.reset_optimizer=true",  # see the module's docstring
        f"output_dir={out}",
    ]


def run(cmd, timeout=900):
    import subprocess

    return subprocess.run(
        cmd, cwd=ROOT, env=preset_env(), capture_output=True, text=True, timeout=timeout
    )


def step_rows(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(TOTAL + 1)), [r["step"] for r in rows]
    return {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))}
        for r in rows
    }


def checkpoint_models(step_dir, ckpt):
    """The policy and reference of a DCP checkpoint, loaded into plain fp32 Decoders in this
    process."""
    import torch.distributed.checkpoint as dcp
    from prorl.engine.checkpoint_state import ModelState
    from prorl.engine.model import load_hf

    models = {
        "model": load_hf(ckpt, dtype=torch.float32),
        "reference": load_hf(ckpt, dtype=torch.float32),
    }
    state = {k: ModelState(m) for k, m in models.items()}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return models


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    d = tmp_path_factory.mktemp("preset-run")
    ckpt = write_bf16_untied_checkpoint(str(d / "ckpt"))
    train, val = write_data(str(d))
    return ckpt, train, val


@pytest.mark.tally("faults")
def test_preset_killed_and_resumed_equals_uninterrupted(preset, tmp_path):
    import subprocess

    ckpt, train, val = preset
    a, b = tmp_path / "A", tmp_path / "B"
    proc = run(command(a, ckpt, train, val))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows_a = step_rows(a)
    resets = [s for s, r in rows_a.items() if r.get("ref/reset_reason")]
    assert resets == [2, 4], resets  # interval 2 in completed steps

    # B: SIGKILL of the whole tree (torchrun, ranks, reward workers) once step 2's checkpoint is
    # complete
    log = open(tmp_path / "B1.log", "w")
    proc = subprocess.Popen(
        command(b, ckpt, train, val),
        cwd=ROOT,
        env=preset_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert wait_for(lambda: 2 in complete_steps(b / "checkpoints"), proc, timeout=600)
    kill_tree(proc)
    assert complete_steps(b / "checkpoints")[-1] < TOTAL
    proc = run(command(b, ckpt, train, val))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "prorl: resumed from" in proc.stdout
    rows_b = step_rows(b)
    for step, row in rows_a.items():
        assert rows_b[step] == row, step

    # step 4's checkpoint was saved right after a reset: reference == policy, exactly
    saved = checkpoint_models(a / "checkpoints" / "step_00000004", ckpt)
    for (name, p), r in zip(saved["model"].named_parameters(), saved["reference"].parameters()):
        assert torch.equal(p, r), name
    policy = saved["model"]
    assert policy.lm_head_weight is not policy.embed_tokens.weight  # untied, and trained apart
    assert not torch.equal(policy.lm_head_weight, policy.embed_tokens.weight)

    # any checkpoint step as a Hugging Face model (python -m prorl.export), and prorl.eval on a step
    exported = tmp_path / "step4"
    proc = run(
        [
            sys.executable,
            "-m",
            "prorl.export",
            str(a / "checkpoints" / "step_00000004"),
            str(exported),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from prorl.engine.model import load_hf

    again = load_hf(str(exported), dtype=torch.float32)
    for (name, p), q in zip(again.named_parameters(), saved["model"].parameters()):
        assert torch.equal(p, q.to(torch.bfloat16).float()), name  # the run's dtype: bf16
    step_eval = a / "eval4"
    step4 = str(a / "checkpoints" / "step_00000004")
    cmd = [
        sys.executable,
        "-m",
        "prorl.eval",
        "--model",
        step4,
        "--builtin",
        "digit_sums",
        "--limit",
        "4",
    ]
    cmd += ["--k", "1", "--max-tokens", "40", "--num-workers", "1", "--out", str(step_eval)]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((step_eval / "results.json").read_text())["settings"]["model"].endswith(
        "step_00000004"
    )

    # the final exports of A and B are equal, and transformers reads them as what they are
    from safetensors.torch import load_file

    final_a, final_b = (
        load_file(x / "checkpoints" / "final" / "model.safetensors") for x in (a, b)
    )
    assert final_a.keys() == final_b.keys() and all(
        torch.equal(final_a[k], final_b[k]) for k in final_a
    )
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(a / "checkpoints" / "final"))
    assert not hf.config.tie_word_embeddings and hf.config.dtype == torch.bfloat16
    assert torch.equal(hf.lm_head.weight.detach(), final_a["lm_head.weight"])
    from prorl.engine.model import load_hf

    ours = load_hf(str(a / "checkpoints" / "final"), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    with torch.no_grad():
        want = hf.float()(ids).logits[0]
        got = ours.logits(ours(ids[0]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
