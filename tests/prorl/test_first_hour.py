"""What a new user (from verl, with their own model and data) meets in the first hour: the defaults
that apply to their model, config keys that help, data fields that can be named, the command line's
--help and --print-config, both launch forms, no held-out set when none is given, and a refused
resume that touches nothing of the run."""

import json
import subprocess
import sys

import pytest
from train_helpers import ENV, ROOT, TINY

from prorl import data
from prorl.config import Config, ConfigError, ModelConfig, load_config, reference
from prorl.config_runtime import non_default
from prorl.train import parse_config


def test_without_config_a_users_model_gets_the_recipe_defaults():
    cfg, preset, _ = parse_config(["model.path=/models/mine"])
    assert preset is None
    recipe = Config(model=ModelConfig(path="/models/mine"))
    assert cfg.rollout.max_response_tokens == recipe.rollout.max_response_tokens == 8192
    assert (
        cfg.optim.lr == 2e-6
        and cfg.algorithm.reset.interval == 300
        and cfg.algorithm.kl_coef == 1e-4
    )
    assert non_default(cfg) == {}
    # the no-argument run (and runs that only resize it) keep the embedded default
    cfg, preset, _ = parse_config(["trainer.total_steps=3"])
    assert (
        preset == "default"
        and cfg.rollout.max_response_tokens == 40
        and cfg.model.path == "builtin:tiny-reasoner"
    )


@pytest.mark.tally("bad_inputs")
def test_renamed_and_misspelt_keys_are_named():
    with pytest.raises(
        ConfigError, match="'algorithm.reset_interval' is now 'algorithm.reset.interval'"
    ):
        load_config("default", ["algorithm.reset_interval=3"])
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_steps'"):
        load_config("default", ["trainer.total_step=3"])


def test_a_bare_value_for_a_list_key_is_a_one_element_list():
    cfg = load_config(None, ["model.path=/m", "data.train_files=/d/train.parquet"])
    assert cfg.data.train_files == ["/d/train.parquet"]


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.temperature=inf", "rollout.temperature=inf must be a finite number"),
        ("trainer.save_every=-3", "save_every and trainer.val_every must be >= 0"),
        ("rollout.n=1", "rollout.n=1 leaves every group all-equal"),
        ("algorithm.kl_estimator=k9", "algorithm.kl_estimator='k9' is not one of k1, k2, k3"),
    ],
)
def test_bad_values_are_refused_up_front(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", [override])


def test_reference_lists_every_key_with_its_help():
    text = reference()
    for key in (
        "model.path",
        "data.prompt_key",
        "algorithm.reset.kl_floor",
        "optim.max_grad_norm",
        "logging.tensorboard",
    ):
        assert f"  {key} = " in text, key
    assert "[reinforce++-baseline | grpo | dr-grpo]" in text  # the kernels' own modes


@pytest.mark.tally("bad_inputs")
def test_prompt_key_names_the_prompt_field(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        json.dumps(
            {"data_source": "math", "question": "1+1?", "reward_model": {"ground_truth": "2"}}
        )
    )
    with pytest.raises(
        data.DataError, match="field 'prompt' is missing .*the row has: data_source, question"
    ):
        data.load_file(str(path))
    (ex,) = data.load_file(str(path), fields=data.RowFields(prompt_key="question"))
    assert ex.prompt == [{"role": "user", "content": "1+1?"}]


def run(args, timeout=300):
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_help_and_print_config():
    help_text = run([sys.executable, "prorl/train.py", "--help"]).stdout
    assert "algorithm.reset.interval = 300" in help_text
    shown = run([sys.executable, "-m", "prorl.train", "--print-config", "rollout.n=4"])
    assert (
        shown.returncode == 0
        and "'n': 4" in shown.stdout
        and "max_response_tokens: 40" in shown.stdout
    )


@pytest.mark.slow
def test_module_form_no_validation_without_val_files_and_an_untouched_refused_resume(tmp_path):
    """`torchrun -m prorl.train` works like the path form. With training files but no validation
    files nothing is validated (a warning says so), not the builtin task. A refused resume
    (rollout.n changed) exits 4 and leaves the run's config.yaml and metrics as they were."""
    train = tmp_path / "train.jsonl"
    data.write_jsonl(data.builtin("digit_sums", n=40, seed=0, split="train"), str(train))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "prorl.train",
    ]
    args = [
        *TINY,
        f"output_dir={out}",
        f"data.train_files=[{train}]",
        "trainer.total_steps=1",
        "rollout.n=4",
    ]
    first = run([*cmd, *args])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "no data.val_files: nothing is validated" in first.stdout
    assert "held-out accuracy before RL" not in first.stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1] and not any(k.startswith("val") for k in rows[0])
    config_before, metrics_before = (
        (out / "config.yaml").read_text(),
        (out / "metrics.jsonl").read_text(),
    )
    refused = run(
        [sys.executable, "-m", "prorl.train", *args[:-1], "rollout.n=2", "trainer.total_steps=2"]
    )
    assert refused.returncode == 4, refused.stderr[-2000:]
    assert "rollout.n: 4 -> 2" in refused.stderr
    assert (out / "config.yaml").read_text() == config_before
    assert (out / "metrics.jsonl").read_text() == metrics_before
