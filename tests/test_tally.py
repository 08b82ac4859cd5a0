"""The reliability report (tests/helpers/tally.py): a session of its own counts marked cases per
kind, and the README check fails on figures that differ from the report."""

import json
import os
import subprocess
import sys
import textwrap

import tally

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")

CASES = """
import pytest

@pytest.mark.tally("faults")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_fault(n):
    assert n != 3  # one of three fails

@pytest.mark.tally("bad_inputs")
def test_bad_input():
    pass

@pytest.mark.tally("bad_inputs")
def test_skipped():
    pytest.skip("not on this machine")

def test_unmarked():
    pass
"""

README = """- attacks tried / contained **18 / 18** on the `unshare` backend
- checkpoint and run faults tried / survived **35 / 35** (a damaged newest checkpoint)
- bad inputs tried / named **33 / 33** (file, row and key)
  `tests/rewards/test_pool.py`, the SIGKILL resume tests): 35 tried, 35 survived. Steps in which
"""


def _session(tmp_path, *args, cases=CASES):
    (tmp_path / "test_cases.py").write_text(cases)
    ini = (
        "[pytest]\ntestpaths = .\nmarkers =\n"
        "    tally(kind): counts this test in the reliability report\n"
    )
    (tmp_path / "pytest.ini").write_text(ini)
    env = dict(
        os.environ, PYTHONPATH=HELPERS, PRORL_RELIABILITY_REPORT=str(tmp_path / "report.json")
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tally", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_session_counts_tried_and_held_per_kind_and_the_check_compares_the_readme(tmp_path):
    proc = _session(tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]  # the failing case fails the session as usual
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["complete"]
    kinds = report["kinds"]
    assert (kinds["faults"]["tried"], kinds["faults"]["held"]) == (3, 2)
    assert kinds["faults"]["failed"] == ["test_cases.py::test_fault[3]"]
    # a skip is not tried
    assert (kinds["bad_inputs"]["tried"], kinds["bad_inputs"]["held"]) == (1, 1)
    assert kinds["bad_inputs"]["skipped"] == ["test_cases.py::test_skipped"]
    assert (kinds["attacks"]["tried"], kinds["attacks"]["held"]) == (0, 0)

    readme = tmp_path / "README.md"
    readme.write_text(README)
    files = ["--report", str(tmp_path / "report.json"), "--readme", str(readme)]
    assert tally.main([*files, "--check"]) == 1  # 18/18, 35/35 (twice), 33/33 stated
    problems = tally.differences(README, report)
    assert len(problems) == 4 and "faults: README.md says 35 / 35, the report 3 / 2" in problems
    assert tally.main([*files, "--write"]) == 0
    assert tally.main([*files, "--check"]) == 0
    text = readme.read_text()
    assert (
        "attacks tried / contained **0 / 0**" in text
        and "faults tried / survived **3 / 2**" in text
    )
    assert "bad inputs tried / named **1 / 1**" in text and ": 3 tried, 2 survived. Steps" in text
    assert text.replace("0 / 0", "18 / 18").count("\n") == README.count("\n")  # nothing else moved


def test_a_partial_session_does_not_replace_the_report_and_the_check_refuses_it(tmp_path):
    proc = _session(tmp_path, "-k", "bad_input")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert not (tmp_path / "report.json").exists()
    partial = tmp_path / "report.partial.json"
    assert not json.loads(partial.read_text())["complete"]
    readme = tmp_path / "README.md"
    readme.write_text(README)
    try:
        tally.main(["--report", str(partial), "--readme", str(readme), "--check"])
    except SystemExit as exc:
        assert "written by a partial session" in str(exc)
    else:
        raise AssertionError("a partial report was accepted")


def test_a_tally_marker_with_an_unknown_kind_is_a_usage_error(tmp_path):
    oops = textwrap.dedent("""
        import pytest

        @pytest.mark.tally("oops")
        def test_x():
            pass
        """)
    proc = _session(tmp_path, cases=oops)
    assert (
        proc.returncode != 0
        and "use @pytest.mark.tally(kind), kind one of attacks" in proc.stdout + proc.stderr
    )
