"""An exported model carries generation_config.json (issue 40): `transformers` reads from it the
ids the run stopped its samples at (the tokenizer's eos and ChatML's <|im_end|>) and the sampling
the run validated with, so that generate() on the export stops where training did."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import ENV, ROOT
from transformers import GenerationConfig, PreTrainedTokenizerFast

from prorl.generation_config import write_generation_config

TINY_REASONER = str(Path(__file__).resolve().parents[2] / "prorl" / "assets" / "tiny-reasoner")


def test_eos_ids_and_validation_sampling_as_transformers_reads_them(tmp_path):
    tok = PreTrainedTokenizerFast.from_pretrained(TINY_REASONER)
    write_generation_config(str(tmp_path), tok, TINY_REASONER, {"val_temperature": 0.6,
                                                               "val_top_p": 0.95})  # fmt: skip
    gen = GenerationConfig.from_pretrained(tmp_path)
    expected = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        expected.add(tok.convert_tokens_to_ids("<|im_end|>"))
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert set(eos) == expected
    assert (gen.do_sample, gen.temperature, gen.top_p) == (True, 0.6, 0.95)


def test_the_base_models_file_is_kept_and_its_eos_ids_added(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for f in Path(TINY_REASONER).iterdir():
        if f.name.startswith("tokenizer") or f.name == "config.json":
            (base / f.name).write_bytes(f.read_bytes())
    (base / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 7, "temperature": 0.7, "top_p": 0.8, "do_sample": True})
    )
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    out = tmp_path / "out"
    out.mkdir()
    write_generation_config(str(out), tok, str(base), {"val_temperature": 0.0})
    gen = GenerationConfig.from_pretrained(out)
    assert 7 in gen.eos_token_id and tok.eos_token_id in gen.eos_token_id
    assert (gen.temperature, gen.top_p) == (0.7, 0.8)


@pytest.mark.slow
def test_a_run_by_epochs_exports_with_its_generation_config(tmp_path):
    """The user's way: `prorl/train.py trainer.total_epochs=2` on 24 prompts, 8 a step, stops after
    6 steps (verl's count); `checkpoints/final` and `python -m prorl.export` of its checkpoint both
    carry generation_config.json with the tokenizer's eos."""
    argv = [f"output_dir={tmp_path}", "trainer.total_epochs=2", "data.train_size=24",
            "trainer.prompts_per_step=8", "rollout.n=2", "rollout.max_response_tokens=4",
            "trainer.val_before_train=false", "trainer.val_every=0", "trainer.save_every=6",
            "logging.tensorboard=false", "data.val_size=2",
            "trainer.max_consecutive_skips=100"]  # fmt: skip
    res = subprocess.run([sys.executable, "prorl/train.py", *argv], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "timing_s/step" in r] == [1, 2, 3, 4, 5, 6]
    export = tmp_path / "exported"
    step = tmp_path / "checkpoints" / "step_00000006"
    res = subprocess.run([sys.executable, "-m", "prorl.export", str(step), str(export)], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    tok = PreTrainedTokenizerFast.from_pretrained(TINY_REASONER)
    for out in (tmp_path / "checkpoints" / "final", export):
        gen = GenerationConfig.from_pretrained(out)
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        assert tok.eos_token_id in eos and gen.do_sample is False  # validated greedily
