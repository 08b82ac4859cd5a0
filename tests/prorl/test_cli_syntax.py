"""What a user types on the command line works as documented (issue 40): a response-budget
schedule `{step:tokens}` (YAML 1.1 reads `3:32` as the sexagesimal 212), and one name for the
asynchronous-RL section, `rollout.async_rl.*`, in --help, --print-config and docs/ (the old
`rollout.async.*` still read, with a deprecation warning)."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from prorl.config import load_config
from prorl.train import main

ROOT = Path(__file__).resolve().parents[2]


def _printed(argv, capsys):
    assert main(["model.path=/m", *argv, "--print-config"]) == 0
    return OmegaConf.create(capsys.readouterr().out)


@pytest.mark.parametrize(
    "given, expected",
    [("{3:32}", {3: 32}), ("{3:32,10:64}", {3: 32, 10: 64}), ("{3: 32, 10: 64}", {3: 32, 10: 64})],
)
def test_a_response_schedule_on_the_command_line(given, expected, capsys):
    cfg = _printed([f"rollout.max_response_schedule={given}"], capsys)
    assert dict(cfg.rollout.max_response_schedule) == expected


def test_the_old_async_spelling_is_read_with_a_deprecation_warning(capsys):
    with pytest.warns(FutureWarning, match="rollout.async.steps_ahead is now spelt "
                      "rollout.async_rl.steps_ahead"):  # fmt: skip
        cfg = load_config("default", ["rollout.async.steps_ahead=2"])
    assert cfg.rollout.async_rl.steps_ahead == 2


def test_one_name_for_the_async_section_in_help_print_config_and_docs(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out + OmegaConf.to_yaml(_printed([], capsys))
    assert "rollout.async_rl.steps_ahead" in shown and "async_rl:" in shown
    texts = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
    texts["train.py"] = (ROOT / "prorl" / "train.py").read_text()
    old = {name: re.findall(r"rollout\.async\.\w+", text) for name, text in texts.items()}
    assert not any(old.values()), old


@pytest.mark.tally("bad_inputs")
def test_a_missing_optional_package_is_a_config_error_before_anything_starts(tmp_path, capsys):
    """logging.wandb_project without wandb installed: exit 2 naming the key and the package, the
    run directory not even created (was: a traceback after the models were loaded)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = tmp_path / "run"
    assert main([f"output_dir={out}", "logging.wandb_project=mine"]) == 2
    err = capsys.readouterr().err
    assert "logging.wandb_project='mine' needs the wandb package: pip install wandb" in err
    assert not out.exists()


@pytest.mark.tally("bad_inputs")
def test_a_flat_question_answer_parquet_trains_with_named_columns(tmp_path):
    """A (question, answer) parquet: refused without a data_source (naming data.default_source);
    with data.prompt_key / answer_key / default_source its rows are the verl rows they stand for."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from prorl import lifecycle
    from prorl.train import load_examples, parse_config

    path = tmp_path / "flat.parquet"
    pq.write_table(pa.table({"question": ["1+2?", "3+4?"], "answer": ["3", "7"]}), path)
    base = ["model.path=/m", f"data.train_files=[{path}]", "data.prompt_key=question"]
    cfg = parse_config(base)[0]
    with pytest.raises(lifecycle.Fatal, match="data_source' is missing .*data.default_source"):
        load_examples(cfg, "train")
    cfg = parse_config([*base, "data.answer_key=answer", "data.default_source=math"])[0]
    rows = load_examples(cfg, "train")
    assert [(e.prompt, e.data_source, e.ground_truth) for e in rows] == [
        ([{"role": "user", "content": "1+2?"}], "math", "3"),
        ([{"role": "user", "content": "3+4?"}], "math", "7"),
    ]
    cfg = parse_config([*base, "data.answer_key=solution", "data.default_source=math"])[0]
    with pytest.raises(lifecycle.Fatal, match="'solution' is missing .*the row has: answer"):
        load_examples(cfg, "train")


def test_the_installed_commands_and_evals_help_shows_defaults(capsys):
    """`pip install` puts prorl-train / prorl-eval / prorl-export / prorl-report on PATH (their
    entry points name each module's main); prorl.eval --help shows every default."""
    import importlib.metadata as md

    points = {e.name: e.value for e in md.entry_points(group="console_scripts")}
    for name in ("train", "eval", "export", "report"):
        assert points.get(f"prorl-{name}") == f"prorl.{name}:main", "reinstall: pip install -e ."
    from prorl import eval as prorl_eval

    with pytest.raises(SystemExit):
        prorl_eval.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "samples per prompt (default: 16)" in text and "(default: 0.95)" in text
