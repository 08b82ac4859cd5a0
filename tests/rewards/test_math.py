"""Known-answer table for the math verifier (math-verify underneath)."""

import pytest

pytest.importorskip("math_verify")

from prorl.rewards import score  # noqa: E402
from prorl.rewards.extract import final_text, last_boxed  # noqa: E402

CASES = [
    # (response, gold, expected)
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac12}", "1/2", 1.0),
    ("$\\boxed{\\dfrac{3}{4}}$", "0.75", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{[1,2)}", "[1,2)", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{x=3}", "3", 1.0),
    ("\\boxed 7.", "7", 1.0),
    ("\\fbox{12}", "12", 1.0),
    ("already boxed gold \\boxed{5}", "\\boxed{5}", 1.0),
    ("two answers \\boxed{3} then \\boxed{4}", "4", 1.0),
    ("two answers \\boxed{3} then \\boxed{4}", "3", 0.0),  # only the last one counts
    ("\\boxed{4}", "3", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
    ("\\boxed{\\{1,2,3\\}}", "\\{1,2\\}", 0.0),
    ("\\boxed{-2}", "2", 0.0),
    # an answer that merely contains the gold is wrong: prefix, suffix, extra digits, wrong sign
    ("\\boxed{91}", "9", 0.0),
    ("\\boxed{19}", "9", 0.0),
    ("\\boxed{123}", "12", 0.0),
    ("\\boxed{12}", "123", 0.0),
    ("\\boxed{9000}", "9", 0.0),
    ("\\boxed{9.5}", "9", 0.0),
    ("\\boxed{0.9}", "9", 0.0),
    ("\\boxed{9x}", "9", 0.0),
    ("\\boxed{-9}", "9", 0.0),
    ("\\boxed{2}", "-2", 0.0),
    # units are text to math-verify and dropped: "9 cm" is 9 (so a wrong unit is not caught)
    ("\\boxed{9\\text{ cm}}", "9", 1.0),
    ("\\boxed{9\\text{ cm}}", "9\\text{ m}", 1.0),
    ("The answer is 0.5", "0.5", 0.0),  # no box: wrong format
    ("\\boxed{}", "0", 0.0),
    ("\\boxed{hello}", "5", 0.0),
    ("\\boxed{\\frac{1}{2", "0.5", 0.0),  # unbalanced braces
    # thinking: only the text after the last </think> counts
    ("<think>maybe \\boxed{3}</think> so \\boxed{4}", "4", 1.0),
    ("<think>maybe \\boxed{4}</think> so \\boxed{3}", "4", 0.0),
    ("<think>maybe \\boxed{4}</think> I give up", "4", 0.0),
    ("<think>truncated while thinking \\boxed{4}", "4", 0.0),
]


@pytest.mark.parametrize("response, gold, expected", CASES)
def test_math_table(response, gold, expected):
    assert score("math", response, gold) == expected


def test_list_of_golds_and_aliases():
    assert score("openai/gsm8k", "\\boxed{72}", "72") == 1.0
    assert score("lighteval/MATH", "\\boxed{\\pi}", ["2\\pi", "\\pi"]) == 1.0


def test_extraction_helpers():
    assert last_boxed("a \\boxed{\\frac{a}{b}} b") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{x} and \\boxed{ {y} }") == "{y}"
    assert last_boxed("no box") is None
    assert final_text("<think>a</think>b</think>c") == "c"
    assert final_text("plain") == "plain"
    assert final_text("<think>open") == ""
