"""verl's relative output paths land under the run's output_dir, never in the current directory
(issue 40, item 20): verl resolves `trainer.default_local_dir` (by default
`checkpoints/<project_name>/<experiment_name>`) against the directory it is started in, so a verl
YAML run from a checkout wrote into it. prorl resolves a relative one against its `output_dir` when
given, else against runs/ (docs/verl.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prorl.train import parse_config

ROOT = Path(__file__).resolve().parents[2]

# a recipe-style verl YAML: verl's ppo_trainer.yaml underneath, so default_local_dir is verl's own
# default, checkpoints/${trainer.project_name}/${trainer.experiment_name}
RECIPE = """\
defaults:
  - ppo_trainer
  - _self_
algorithm:
  adv_estimator: grpo
actor_rollout_ref:
  model:
    path: /models/qwen
  rollout:
    n: 4
trainer:
  project_name: proj
  experiment_name: exp1
  total_training_steps: 3
"""


def _output_dir(tmp_path, monkeypatch, *argv):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    args = ["--verl-config", "recipe.yaml", "data.train_files=[/d/train.parquet]", *argv]
    return parse_config(args)[0].output_dir


def test_verls_default_run_dir_goes_under_runs_not_the_current_directory(tmp_path, monkeypatch):
    assert _output_dir(tmp_path, monkeypatch) == os.path.join("runs", "checkpoints/proj/exp1")


def test_a_relative_run_dir_is_resolved_against_output_dir(tmp_path, monkeypatch):
    base = str(tmp_path / "scratch")
    # verl's default from the file, then one given on the command line
    got = _output_dir(tmp_path, monkeypatch, f"output_dir={base}")
    assert got == os.path.join(base, "checkpoints/proj/exp1")
    got = _output_dir(tmp_path, monkeypatch, "trainer.default_local_dir=ck/e", f"output_dir={base}")
    assert got == os.path.join(base, "ck/e")


def test_an_absolute_run_dir_is_kept_and_home_expanded(tmp_path, monkeypatch):
    assert _output_dir(tmp_path, monkeypatch, "trainer.default_local_dir=/abs/run") == "/abs/run"
    got = _output_dir(tmp_path, monkeypatch, "trainer.default_local_dir=~/runs/x")
    assert got == os.path.join(os.path.expanduser("~"), "runs/x")


@pytest.mark.slow
def test_a_runs_outputs_land_under_output_dir_and_nothing_in_the_checkout(tmp_path):
    """The user's case end to end: `prorl-train` started in a checkout with verl's relative
    default_local_dir and an output_dir elsewhere (a 0-step run of the embedded default: its config,
    summary, final export and curves are written)."""
    checkout, base = tmp_path / "checkout", tmp_path / "scratch"
    checkout.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    args = [
        "trainer.default_local_dir=checkpoints/proj/exp1",
        f"output_dir={base}",
        "trainer.total_steps=0",
        "trainer.val_before_train=false",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "prorl.train", *args],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = base / "checkpoints" / "proj" / "exp1"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.txt").is_file()
    assert (run_dir / "checkpoints" / "final" / "config.json").is_file()
    assert list(checkout.iterdir()) == [], "the run wrote into the directory it was started in"
