"""benchmarks/trl_real.py's arithmetic: the model-FLOP count against transformers' own parameter
count, and the time to TRL's accuracy on hand-made curves. The runs themselves take minutes on the
real model (docs/real-model.md); they are not run here."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import trl_real

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    tie_word_embeddings=True,
)


def test_model_flops_is_five_forwards_of_every_matmul_weight(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    # every weight but the norms' is a matmul's; the tied embedding once, as the head
    weights = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    prompt, response, samples = 30.0, 50.0, 4
    d, layers = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]
    attended = (prompt + response) / samples / 2
    per_token = 2 * weights + 4 * d * layers * attended  # QK^T and PV: 2 FLOPs x 2 per position
    expected = 5 * (prompt + response) * per_token  # generation, reference, forward + backward
    got = trl_real.model_flops(str(tmp_path), prompt, response, samples)
    assert got == pytest.approx(expected, rel=1e-12)


def _rows(curves: dict, shape: str = "s") -> list[dict]:
    rows = []
    for provider, points in curves.items():
        for k, (seconds, accuracy) in enumerate(points):
            base = dict(provider=provider, mode=f"eval@{2 * k}", shape=shape, name="trl_real")
            base.update(git_rev="r", timestamp="t", device="cpu", versions="v")
            rows.append(dict(base, metric="pass@1", p50=100 * accuracy))
            rows.append(dict(base, metric="train_wall", p50=seconds))
    return rows


def test_time_to_accuracy_is_prorls_first_evaluation_at_trls_final():
    trl = [(0.0, 0.2), (100.0, 0.3), (200.0, 0.4)]
    prorl = [(0.0, 0.2), (50.0, 0.35), (80.0, 0.45), (120.0, 0.5)]
    out = trl_real.time_to_accuracy(_rows({"trl": trl, "prorl": prorl}), None)
    by = {(r["provider"], r["metric"]): r["p50"] for r in out}
    assert by[("trl", "time_to_accuracy")] == 200.0
    assert by[("prorl", "time_to_accuracy")] == 80.0
    assert by[("prorl", "tta_ratio")] == pytest.approx(0.4)


def test_no_time_to_accuracy_when_trl_ends_where_it_started_or_prorl_never_gets_there():
    flat = [(0.0, 0.2), (100.0, 0.2)]
    out = trl_real.time_to_accuracy(_rows({"trl": flat, "prorl": [(0.0, 0.2), (40.0, 0.3)]}), None)
    assert math.isnan({r["metric"]: r["p50"] for r in out if r["provider"] == "prorl"}["tta_ratio"])
    up = [(0.0, 0.2), (100.0, 0.5)]
    out = trl_real.time_to_accuracy(_rows({"trl": up, "prorl": [(0.0, 0.2), (40.0, 0.3)]}), None)
    assert math.isnan({r["metric"]: r["p50"] for r in out if r["provider"] == "prorl"}["tta_ratio"])


def test_several_seeds_race_each_and_on_their_mean_curves():
    # seed 0: TRL ends at 0.4 after 200 s, prorl first reaches it at 60 s (0.3x);
    # seed 1: TRL ends at 0.2 = its start: nothing to race to
    runs = {
        "t seed=0": dict(
            trl=[(0, 0.2), (100, 0.3), (200, 0.4)], prorl=[(0, 0.2), (30, 0.3), (60, 0.4)]
        ),
        "t seed=1": dict(
            trl=[(0, 0.2), (110, 0.3), (220, 0.2)], prorl=[(0, 0.2), (30, 0.2), (60, 0.3)]
        ),
    }
    rows = [r for shape, curves in runs.items() for r in _rows(curves, shape)]
    out = trl_real.time_to_accuracy(rows, None)
    by = {(r["shape"], r["provider"], r["metric"]): r["p50"] for r in out}
    assert by[("t seed=0", "prorl", "tta_ratio")] == pytest.approx(0.3)
    assert math.isnan(by[("t seed=1", "prorl", "tta_ratio")])
    # the means: TRL (0, 0.2) (105, 0.3) (210, 0.3); prorl (0, 0.2) (30, 0.25) (60, 0.35)
    mean = "t seeds=0,1 mean"
    assert by[(mean, "trl", "time_to_accuracy")] == pytest.approx(210.0)
    assert by[(mean, "prorl", "time_to_accuracy")] == pytest.approx(60.0)
    assert by[(mean, "prorl", "tta_ratio")] == pytest.approx(60 / 210)


def test_a_prorl_run_alone_races_the_newest_trl_run_of_its_settings_in_the_csv(
    tmp_path, monkeypatch
):
    from types import SimpleNamespace

    from benchmarks import harness

    trl = [(0, 0.2), (100, 0.3), (200, 0.4)]
    older = [
        dict(r, timestamp="2026-01-01")
        for r in _rows({"trl": [(0, 0.2), (50, 0.5)]}, "t steps=2/4 seed=0")
    ]
    newer = [dict(r, timestamp="2026-02-01") for r in _rows({"trl": trl}, "t steps=2/4 seed=0")]
    other = _rows({"trl": [(0, 0.2), (10, 0.21)]}, "t steps=3 seed=0")  # another TRL budget
    csv = tmp_path / "trl_real.csv"
    harness.append_csv(
        csv, [dict(r, unit="", p20=r["p50"], p80=r["p50"]) for r in older + newer + other]
    )
    prorl = _rows({"prorl": [(0, 0.2), (30, 0.3), (60, 0.4), (90, 0.45)]}, "t steps=2/8 seed=0")
    out = trl_real.time_to_accuracy(prorl, SimpleNamespace(out=str(csv)))
    lines = {}
    trl_real.plot.curves = lambda found, *_: lines.update(
        found
    )  # the plot: TRL's earlier curve too
    trl_real._plot(csv, prorl + out, None)
    assert lines["trl seed 0"] == trl
    by = {(r["provider"], r["metric"]): r["p50"] for r in out}
    assert by[("trl", "time_to_accuracy")] == 200.0
    assert by[("prorl", "tta_ratio")] == pytest.approx(60 / 200)
    assert "TRL's curve measured 2026-02-01" in out[0]["note"]
