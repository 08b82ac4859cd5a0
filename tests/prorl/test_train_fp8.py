"""End to end: `torchrun --nproc_per_node=1 prorl/train.py model.fp8=torchao model.dtype=bfloat16
model.fsdp=true` on the embedded task against the same run in bf16, 10 steps each (~30 s each
here; the two run side by side)."""

import json
import sys

import pytest
import torch
from train_helpers import kill_tree, launch, run, train_command

pytest.importorskip("torchao.float8", reason="needs torchao: pip install 'prorl[fp8]'")

OVERRIDES = [
    "model.dtype=bfloat16",
    "model.fsdp=true",
    "trainer.total_steps=10",
    "trainer.prompts_per_step=16",
    "trainer.val_every=10",
    "data.val_size=50",
    "trainer.save_every=0",
    "trainer.deterministic=true",
]


def _runs(tmp_path, extras):
    """{name: (log, val accuracies, mean sampler/trainer log-prob mismatch, steps)} of one run per
    `extras` item (name: overrides), all at the same time: each is one single-threaded process."""
    procs = {}
    for name, extra in extras.items():
        cmd = train_command(tmp_path / name, OVERRIDES + extra, nproc=1)
        procs[name] = launch(cmd, tmp_path / f"{name}.log")
    out = {}
    try:
        for name, proc in procs.items():
            proc.wait(timeout=900)
            log = (tmp_path / f"{name}.log").read_text()
            assert proc.returncode == 0, log[-6000:]
            metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(line) for line in metrics]
            val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
            steps = [r for r in rows if "rollout/logprob_mismatch" in r]
            mismatch = sum(r["rollout/logprob_mismatch"] for r in steps) / len(steps)
            out[name] = log, val, mismatch, len(steps)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc)
    return out


@pytest.mark.slow
def test_fp8_run_learns_like_the_bf16_run(tmp_path):
    fp8 = ["model.fp8=torchao", "trainer.save_every=10"]
    runs = _runs(tmp_path, {"bf16": [], "fp8": fp8})
    _, bf16_val, bf16_mismatch, bf16_steps = runs["bf16"]
    log, fp8_val, fp8_mismatch, fp8_steps = runs["fp8"]
    assert "fp8: torchao tensorwise: 14 Linear layers of the policy and the reference" in log
    assert bf16_steps == fp8_steps == 10
    assert fp8_val[0] == bf16_val[0]  # the same start (validation samples with the bf16 sampler)
    # held-out accuracy rises in both (bf16 measured here: 26% -> 42% in 10 steps), by similar
    # amounts
    assert bf16_val[-1] - bf16_val[0] >= 0.08 and fp8_val[-1] - fp8_val[0] >= 0.08
    assert abs(fp8_val[-1] - bf16_val[-1]) <= 0.08
    # the trainer's log-probs are FP8, the sampler's bf16: their mismatch grows (measured 5.9e-4 vs
    # 4.7e-4)
    assert fp8_mismatch > bf16_mismatch
    # export: the run's final HF directory and `prorl.export` of its step-10 DCP checkpoint hold the
    # same plain bf16 weights, loadable by transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "fp8" / "checkpoints"
    proc = run(
        [
            sys.executable,
            "-m",
            "prorl.export",
            str(ckpt / "step_00000010"),
            str(tmp_path / "export"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    final, exported = (
        load_file(str(d / "model.safetensors")) for d in (ckpt / "final", tmp_path / "export")
    )
    assert list(final) == list(exported) and {t.dtype for t in exported.values()} == {
        torch.bfloat16
    }
    assert all(torch.equal(final[k], exported[k]) for k in final)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.bfloat16)
    assert torch.equal(
        hf.model.layers[0].mlp.up_proj.weight, exported["model.layers.0.mlp.up_proj.weight"]
    )
    # resume: the same command with more steps continues from the step-10 checkpoint of the FP8
    # layers
    proc = run(
        train_command(tmp_path / "fp8", OVERRIDES + fp8 + ["trainer.total_steps=12"], nproc=1)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "fp8" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "critic/score/mean" in r][-3:] == [10, 11, 12]


def _reset_worker(rank, world):
    """In a world of one (gloo): an FP8 trainer's reference after a reset, its sampler, its KL."""
    import scaled_mm_standin

    scaled_mm_standin.install()  # CUDA's _scaled_mm rules, should any GEMM here run the real kernel
    from prorl.engine.fp8 import fp8_layers
    from test_trainer_recipe import LossSpy, make, sampled, update
    from tiny_trainer import tiny_parts

    overrides = ["model.fp8=torchao", "model.fsdp=true", "model.dtype=bfloat16", "optim.lr=3e-3"]
    overrides.append("trainer.micro_batch_tokens=64")  # several micro-batches per mini-batch
    with tiny_parts() as setup, pytest.MonkeyPatch.context() as mp:
        trainer = make(setup, [*overrides, "algorithm.kl_coef=1.0"])
        models = trainer.models
        layers = [
            len(fp8_layers(m)) for m in (models.policy, models.reference, models.sampler_model)
        ]
        update(trainer, sampled(trainer, k=2))  # the policy moves away from the reference
        # FP8 all-gather: after each optimizer step the weights' scales are those of the new weights
        weight = trainer.policy.layers[0].mlp.up_proj.weight
        amax = float(weight.full_tensor().abs().max())
        precomputed = weight._local_tensor._precomputed_scale  # where torchao keeps it
        scales = (float(precomputed), float(torch.finfo(torch.float8_e4m3fn).max / amax))
        trainer.reset_reference()
        spy = LossSpy(mp)
        update(trainer, sampled(trainer, k=2))
        kl = [(float(m["kl_mean"]), float(m["kl_loss"])) for _, _, (_, m) in spy.calls]
        exact = [
            torch.equal(logp.detach().float(), kw["ref_logp"].float())
            for (logp, *_), kw, _ in spy.calls
        ]
        trainer.models.close()
    return layers, kl, exact, scales


@pytest.mark.slow
def test_fp8_reference_is_converted_so_the_kl_is_exactly_zero_after_a_reset(tmp_path):
    """docs/recipe.md §7 with FP8 and micro-batches: the reference runs the policy's conversion, so
    right after a reset the two compute the same log-probs bit for bit and the KL term is 0 (a bf16
    reference would leave the FP8 quantisation error as a KL that never vanishes); the sampler stays
    unconverted."""
    from dist_helpers import run_ranks

    layers, kl, exact, scales = run_ranks(_reset_worker, tmp_path, world=1)[0]
    assert layers == [14, 14, 0]
    assert scales[0] == pytest.approx(scales[1], rel=1e-6)
    assert len(kl) > 1 and all(k == (0.0, 0.0) for k in kl) and all(exact)  # in every micro-batch


def _real_gemm_worker(rank, world):
    """In a world of one (gloo): one update of an FP8 trainer (torchao) with `model.fp8_emulate`
    false, then true, under CUDA's `_scaled_mm` rules, on micro-batches of whatever token counts
    the sampler produced. {emulate: (fp8 summary, calls, max weight change, pg_loss)}."""
    import scaled_mm_standin
    from test_trainer_recipe import make, sampled, update
    from tiny_trainer import tiny_parts

    from prorl import packing
    from prorl.metrics import StepAccumulator, step_metrics

    scaled_mm_standin.install()
    calls = {}
    real_mm, real_hidden = torch._scaled_mm, packing.hidden_states

    def counted_mm(*args, **kwargs):
        calls["gemms"] += 1
        return real_mm(*args, **kwargs)

    def recorded_hidden(model, batch, pad_multiple=1):
        calls["tokens"].append(batch.num_tokens)
        return real_hidden(model, batch, pad_multiple)

    torch._scaled_mm, packing.hidden_states = counted_mm, recorded_hidden
    overrides = ["model.fp8=torchao", "model.fsdp=true", "model.dtype=bfloat16"]
    overrides += ["trainer.micro_batch_tokens=96", "trainer.deterministic=true"]
    # the CPU's _scaled_mm takes ~5 ms per token of a GEMM: one prompt's 2 sequences, and no
    # separate old-log-prob or reference pass (one mini-batch: the training pass gives pi_old)
    overrides += ["rollout.n=2", "trainer.recompute_old_logp=false", "algorithm.kl_coef=0"]
    out = {}
    with tiny_parts() as setup:
        for emulate in ("false", "true"):
            calls = {"gemms": 0, "tokens": []}
            trainer = make(setup, [*overrides, f"model.fp8_emulate={emulate}"])
            weight = trainer.policy.layers[0].mlp.up_proj.weight
            before = weight.full_tensor().clone()
            acc = StepAccumulator()
            update(trainer, sampled(trainer, k=1), acc)
            moved = float((weight.full_tensor() - before).abs().max())
            pg_loss = step_metrics(acc.reduce())["actor/pg_loss"]
            out[emulate] = trainer.models.fp8_summary, calls, moved, pg_loss
            trainer.models.close()
    return out


@pytest.mark.slow
def test_fp8_trainer_with_real_fp8_gemms_obeys_cudas_shape_rules(tmp_path):
    """`model.fp8_emulate=false` runs torchao's real `_scaled_mm` (what a GPU runs) under CUDA's
    rules (tests/helpers/scaled_mm_standin.py): the packed micro-batches have token counts that are
    not multiples of 16, which CUDA refuses in the weight-gradient GEMM unless the trainer pads them
    (`FP8Training.token_multiple`). The update moves the weights, with the emulated run's loss (the
    emulation matches the real GEMM within one bf16 ulp: tests/engine/test_fp8.py)."""
    from dist_helpers import run_ranks

    runs = run_ranks(_real_gemm_worker, tmp_path, world=1)[0]
    summary, calls, moved, pg_loss = runs["false"]
    assert "in FP8 GEMMs" in summary and "emulated" not in summary
    assert any(n % 16 for n in calls["tokens"]), calls["tokens"]  # odd counts were trained on
    assert calls["gemms"] > 0 and moved > 0
    _, emulated_calls, _, emulated_loss = runs["true"]
    assert emulated_calls["gemms"] == 0 and emulated_calls["tokens"] == calls["tokens"]
    assert pg_loss == pytest.approx(emulated_loss, rel=1e-2, abs=1e-4)


def test_fp8_emulate_key():
    from prorl.engine.fp8 import FP8Training

    from prorl.config import ConfigError, load_config

    base = ["model.fp8=torchao", "model.fsdp=true"]
    for value, want in (("auto", None), ("true", True), ("false", False)):
        cfg = load_config("default", [*base, f"model.fp8_emulate={value}"])
        assert FP8Training.of(cfg.model).emulate is want
    assert load_config("default", base).model.fp8_emulate == "auto"
    with pytest.raises(ConfigError, match="model.fp8_emulate"):
        load_config("default", [*base, "model.fp8_emulate=sometimes"])
