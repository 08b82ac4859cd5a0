"""Smoke test of the train_step benchmark: tiny model and batch, temp CSV. Never asserts speed."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks import train_step

ARGS = "--quick --seqs 3 --lengths 5,12 --reps 1 --warmup 0 --threads 1".split()


def test_train_step_benchmark_smoke(tmp_path, run_main):
    # Two providers through the worker processes (each worker costs seconds of imports).
    out = tmp_path / "train_step.csv"
    args = ARGS + [
        "--providers",
        "prorl,transformers-padded",
        "--ckpt-dir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    rows = run_main(train_step.main, args, out, "speed-up vs transformers-padded")
    seen = {(r["provider"], r["metric"]) for r in rows}
    for provider in ("prorl", "transformers-padded"):
        for metric in ("time", "gflops", "tokens_per_s", "padding_fraction"):
            assert (provider, metric) in seen
    pad = {r["provider"]: float(r["p50"]) for r in rows if r["metric"] == "padding_fraction"}
    assert pad["prorl"] == 0.0 and pad["transformers-padded"] > 0.0
    assert all(re.search(r"loss=[0-9.]+", r["versions"]) for r in rows if r["metric"] == "time")


def test_train_step_providers_compute_the_same_loss(tmp_path):
    # Every provider built in this process: same weights, batch and loss, so each untimed loss (in
    # the note) matches transformers on the padded batch, the independent reference; one step runs.
    shape = train_step.make_shape("tiny", 3, 5, 12, "float32", str(tmp_path))
    # The FP8 rows: the same loss up to e4m3 quantisation of the block GEMMs (within 1%: a 5% error
    # on activations of random weights moves the loss far less), but not bf16's number; TE refuses
    # the CPU.
    losses = {}
    with pytest.raises(RuntimeError, match="prorl-fp8-te needs Transformer Engine"):
        train_step.build("prorl-fp8-te", "full", shape, torch.device("cpu"))
    for provider in train_step.PROVIDERS:
        step = train_step.build(provider, "full", shape, torch.device("cpu"))
        step.prepare()
        step.run()
        losses[provider] = float(re.search(r"loss=([-0-9.e]+)", step.note).group(1))
        if provider == "prorl-fp8":
            assert "fp8=torchao:tensorwise emulated_gemm" in step.note
    ref = losses["transformers-padded"]
    assert ref > 0.0
    for provider, loss in losses.items():
        tolerance = 1e-2 if provider == "prorl-fp8" else 1e-4
        assert abs(loss - ref) < tolerance * ref, (provider, loss, ref)
    assert losses["prorl-fp8"] != losses["prorl"]
