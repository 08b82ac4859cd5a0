"""Every command answers `--help` and a config error before torch and transformers are loaded
(issue 40, item 18): each case runs in a fresh interpreter, which reports its exit code and whether
`torch` / `transformers` were imported; the installed console commands (prorl-train, prorl-eval,
...) are run as a user runs them, with torch made unimportable."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("RANK", None)

PROBE = textwrap.dedent(
    """
    import contextlib, importlib, io, json, sys
    module, argv = sys.argv[1], sys.argv[2:]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = importlib.import_module(module).main(argv)
        except SystemExit as exc:
            rc = exc.code
    heavy = [m for m in ("torch", "transformers") if m in sys.modules]
    print(json.dumps({"rc": rc, "heavy": heavy, "out": out.getvalue(), "err": err.getvalue()}))
    """
)

CASES = [
    ("prorl.train", ["--help"], 0, "algorithm.reset.interval = 300"),
    ("prorl.train", ["trainer.total_steps=-1"], 2, "trainer.total_steps must be >= 0"),
    ("prorl.train", ["trainer.totl_steps=3"], 2, "did you mean 'trainer.total_steps'"),
    ("prorl.train", ["--config", "no_such_preset"], 2, "no_such_preset"),
    ("prorl.train", ["actor_rollout_ref.rollout.temprature=0.6"], 2, "rollout.temperature"),
    ("prorl.train", ["--print-config", "rollout.n=4"], 0, "'n': 4"),
    ("prorl.eval", ["--help"], 0, "samples per prompt (default: 16)"),
    ("prorl.eval", ["--model", "m"], 2, "give --data FILE"),
    ("prorl.export", ["--help"], 0, "--key {model,reference}"),
    ("prorl.export", ["only-one-argument"], 2, "the following arguments are required: out"),
    ("prorl.report", ["--help"], 0, "RUN_DIR"),
]


@pytest.mark.parametrize("module, argv, code, said", CASES, ids=lambda c: str(c)[:40])
def test_answered_before_torch_loads(module, argv, code, said, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, module, *argv],
        cwd=tmp_path,  # not the checkout: the installed package, as a user has it
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rc"] == code, got
    assert said in " ".join((got["out"] + got["err"]).split()), got
    assert got["heavy"] == [], f"{module} {argv} loaded {got['heavy']} before answering"


BLOCKER = """
import sys

class _NoHeavy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} imported before the command answered")

sys.meta_path.insert(0, _NoHeavy())
"""


@pytest.mark.parametrize(
    "command, argv, code",
    [
        ("prorl-train", ["--help"], 0),
        ("prorl-train", ["trainer.total_steps=-1"], 2),
        ("prorl-eval", ["--help"], 0),
        ("prorl-export", ["--help"], 0),
        ("prorl-report", ["--help"], 0),
    ],
)
def test_the_installed_commands_answer_without_torch(command, argv, code, tmp_path):
    """The console scripts pip installs, run from outside the checkout with a sitecustomize that
    makes torch and transformers unimportable: they answer all the same."""
    path = shutil.which(command, path=os.path.dirname(sys.executable) + os.pathsep + ENV["PATH"])
    if path is None:
        pytest.skip(f"{command} not installed: pip install -e .")
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**ENV, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [path, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == code, done.stderr[-2000:]
    assert "imported before the command answered" not in done.stderr


@pytest.mark.slow
def test_past_the_command_line_the_commands_load_their_work(tmp_path):
    """The work behind each command, imported once the arguments are checked, is there: an export
    of a folder that is no checkpoint and an evaluation of one that is no model end with their
    message and exit code 2, not an ImportError."""
    (tmp_path / "empty").mkdir()
    for argv, said in (
        (["prorl.export", str(tmp_path / "empty"), str(tmp_path / "out")], "not a complete"),
        (["prorl.eval", "--model", str(tmp_path / "empty"), "--builtin", "digit_sums"], "neither"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", *argv],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
