"""The code verifier: extraction, test formats, partial credit, limits (the sandbox: own suite)."""

import json
import os

import pytest
from sandbox_helpers import planted_dirs

from prorl.rewards import sandbox, score, score_with_info
from prorl.rewards.coding import TIME_LIMIT_S, load_tests, stdout_matches, value_matches

STDIO = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5\n"]}
CALL = {"inputs": [[1, 2], [5, 7]], "outputs": [[3], [12]], "fn_name": "add"}


def reply(code, lang="python"):
    return f"<think>I will write code.</think>Solution:\n```{lang}\n{code}\n```\n"


SUM = "a, b = map(int, input().split())\nprint(a + b)"


@pytest.mark.parametrize(
    "code, expected",
    [
        (SUM, 1.0),
        (
            "import sys\na, b = map(int, sys.stdin.buffer.readline().split())\n"
            "sys.stdout.buffer.write(str(a + b).encode() + b'\\n')",
            1.0,
        ),
        (
            "import os, sys\na, b = map(int, "
            "sys.stdin.read().split())\nos.write(1, f'{a + b}\\n'.encode())",
            1.0,
        ),
        ("a, b = map(int, input().split())\nprint(a + b)\nexit(0)", 1.0),
        # fraction passed
        ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", 2 / 3),
        ("a, b = map(int, input().split())\nif a == 3: raise ValueError\nprint(a + b)", 2 / 3),
        ("print(", 0.0),  # compile error
        ("print(3)", 1 / 3),
    ],
)
def test_stdio(code, expected):
    assert score("code", reply(code), STDIO) == pytest.approx(expected)


def test_extraction():
    assert score("code", reply(SUM, lang=""), STDIO) == 1.0
    assert score("code", reply(SUM, lang="py"), STDIO) == 1.0
    assert score("code", reply(SUM, lang="cpp"), STDIO) == 0.0  # python only
    assert score("code", SUM, STDIO) == 0.0  # no fenced block
    # the last block counts, and only after </think>
    two = reply("print(0)") + reply(SUM)
    assert score("code", two, STDIO) == 1.0
    assert score("code", f"<think>```python\n{SUM}\n```</think>no code", STDIO) == 0.0
    assert score("code", f"<think>```python\n{SUM}\n```", STDIO) == 0.0


def test_function_call_styles():
    assert score("code", reply("def add(a, b):\n    return a + b"), CALL) == 1.0
    assert (
        score(
            "code", reply("class Solution:\n    def add(self, a, b):\n        return a + b"), CALL
        )
        == 1.0
    )
    assert score("code", reply("def add(a, b):\n    return 3"), CALL) == 0.5
    assert score("code", reply("def plus(a, b):\n    return a + b"), CALL) == 0.0
    # tuples vs lists, floats within 1e-6, unwrapped outputs
    gt = {"inputs": [[2], [3]], "outputs": [[[1, 2]], 0.3333333], "fn_name": "f"}
    code = "def f(n):\n    return (1, 2) if n == 2 else 1 / n"
    assert score("code", reply(code), gt) == 1.0


def test_input_formats():
    # APPS row: input_output as a JSON string; the whole ground truth as a JSON string
    assert score("apps", reply(SUM), {"input_output": json.dumps(STDIO)}) == 1.0
    assert score("taco", reply(SUM), json.dumps(STDIO)) == 1.0
    # Codeforces / DeepCoder list of cases, also under official_tests
    cases = [{"input": "1 2\n", "output": "3"}, {"input": "2 2\n", "output": "4\n"}]
    assert score("codeforces", reply(SUM), cases) == 1.0
    assert score("codeforces", reply(SUM), {"official_tests": cases}) == 1.0
    # LiveCodeBench functional: one JSON value per input line, fn_name from extra
    lcb = [{"input": "[1, 2, 3]\n2", "output": "[2, 4, 6]", "testtype": "functional"}]
    code = "class Solution:\n    def scale(self, xs, k):\n        return [x * k for x in xs]"
    assert score("livecodebench", reply(code), lcb, {"fn_name": "scale"}) == 1.0
    with pytest.raises(ValueError, match="fn_name"):
        load_tests(lcb)
    with pytest.raises(ValueError, match="no test cases"):
        load_tests({"inputs": [], "outputs": []})


def test_time_limit():
    assert TIME_LIMIT_S == 5.0
    value, info = score_with_info(
        "code", reply("while True:\n    pass"), STDIO, {"time_limit_s": 1.0}
    )
    assert value == 0.0 and info["timed_out"]
    # a slow LAST test still zeroes the whole run (total limit, not per test)
    code = "import time\na, b = map(int, input().split())\nif a == 10: time.sleep(30)\nprint(a + b)"
    assert score("code", reply(code), STDIO, {"time_limit_s": 1.0}) == 0.0


@pytest.mark.tally("attacks")
def test_code_cannot_see_expected_outputs():
    code = "import sys, os\nprint(open(os.path.join(sys.argv[1], 'tests.json')).read())"
    value, info = score_with_info("code", reply(code), STDIO)
    assert value == 0.0 and info["passed"] == 0


@pytest.mark.tally("attacks")
def test_code_cannot_read_the_dataset_on_the_host(monkeypatch):
    # reward hacking seen in a run: the solution found the (world-readable) dataset file outside the
    # home directory and printed the expected outputs, computing nothing
    if sandbox.backend() == "none":
        pytest.skip("the `none` backend does not hide the host's files (no namespaces here)")
    with planted_dirs() as dirs:
        data = os.path.join(dirs[0], "train.jsonl")
        with open(data, "w") as f:
            f.write(json.dumps(STDIO) + "\n")
        os.chmod(data, 0o644)
        cheat = (
            f"import json\nrow = json.loads(open({data!r}).readline())\n"
            "print(row['outputs'][row['inputs'].index(input() + '\\n')])"
        )
        value, info = score_with_info("code", reply(cheat), STDIO)
        assert value == 0.0 and info["passed"] == 0
        # where the file is visible, the cheat works
        monkeypatch.setattr(sandbox, "backend", lambda: "none")
        assert score("code", reply(cheat), STDIO) == 1.0


def test_output_comparison():
    assert stdout_matches("3  \n\n", "3")
    assert stdout_matches("1 2\n3", ["1 2", "3"])
    assert stdout_matches("0.3333333", "0.333333333")
    assert not stdout_matches("0.34", "0.33")
    assert not stdout_matches("1 2", "1 2 3")
    assert value_matches(3, [3]) and value_matches([1, 2], [[1, 2]]) and not value_matches(True, 1)
