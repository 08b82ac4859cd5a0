import pytest

from prorl.rewards import score

CASES = [
    ("The answer is (C).", "C", 1.0),
    ("The answer is (C).", "B", 0.0),
    ("\\boxed{C}", "(C)", 1.0),
    ("\\boxed{\\text{B}}", "B", 1.0),
    ("\\boxed{B) 4.2 eV}", "B", 1.0),
    ("Answer: D", "D", 1.0),
    ("**Answer:** E", "E", 1.0),
    ("answer: option J", "J", 1.0),
    ("<answer>C</answer>", "C", 1.0),
    ("<think>The answer is A</think> The answer is B", "A", 0.0),
    ("<think>The answer is A</think> The answer is B", "B", 1.0),
    ("the answer is a guess", "A", 0.0),  # lowercase 'a' is a word, not a choice
    ("I pick C", "C", 0.0),  # no recognised answer format
    ("\\boxed{6.02\\times10^{23}}", "6.02 \\times 10^{23}", 1.0),
    ("\\boxed{Oxygen}", "oxygen", 1.0),
    ("\\boxed{\\text{Nitrogen}}", "oxygen", 0.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("0.5", "1/2", 0.0),
]


@pytest.mark.parametrize("response, gold, expected", CASES)
def test_stem_table(response, gold, expected):
    if "\\times" in gold or gold == "1/2":
        pytest.importorskip("math_verify")
    assert score("stem", response, gold) == expected


def test_choice_text_counts_when_choices_given():
    extra = {"choices": ["4.2 eV", "3 eV"]}
    assert score("gpqa", "\\boxed{4.2 eV}", "A", extra) == 1.0
    assert score("gpqa", "\\boxed{3 eV}", "A", extra) == 0.0
