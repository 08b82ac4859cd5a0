"""One passing and one failing response for every IFEval instruction, plus the reward arithmetic."""

import json

import pytest

from prorl.rewards import score
from prorl.rewards.ifeval import CHECKERS, count_sentences, count_words

# (instruction id, kwargs, a response that follows it, one that does not)
CASES = [
    (
        "keywords:existence",
        {"keywords": ["apple", "Pie"]},
        "I baked an apple pie.",
        "I baked a pie.",
    ),
    (
        "keywords:frequency",
        {"keyword": "cat", "frequency": 2, "relation": "at least"},
        "Cat and cat.",
        "A cat.",
    ),
    (
        "keywords:frequency",
        {"keyword": "cat", "frequency": 2, "relation": "less than"},
        "A cat.",
        "Cat, cat.",
    ),
    (
        "keywords:forbidden_words",
        {"forbidden_words": ["very"]},
        "Everything is fine.",
        "It is Very good.",
    ),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 3, "let_relation": "at least"},
        "Zazzle",
        "Zebra",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "less than"},
        "One. Two!",
        "One. Two! Three?",
    ),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 2},
        "First.\n* * *\nSecond.".replace("* * *", "***"),
        "Only one paragraph.",
    ),
    (
        "length_constraints:number_words",
        {"num_words": 5, "relation": "at least"},
        "one two three four five",
        "one two three four",
    ),
    (
        "length_constraints:number_words",
        {"num_words": 5, "relation": "less than"},
        "one two three four",
        "one two three four five",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        'First we wait.\n\n"Then, we go.',
        "First we wait.\n\nNow we go.",
    ),
    (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "Dear [name], at [address].",
        "Dear [name].",
    ),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        "Hello.\nP.S. bye",
        "Hello. bye",
    ),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.P.S"},
        "Hi.\nP.P.S. more",
        "Hi.\nP.S. more",
    ),
    (
        "detectable_format:number_bullet_lists",
        {"num_bullets": 2},
        "* one\n- two",
        "* one\n* two\n* three",
    ),
    ("detectable_format:constrained_response", {}, "My answer is no.", "No."),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "*one* and **two**",
        "*one* only",
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "SECTION", "num_sections": 2},
        "SECTION 1\na\nSECTION 2\nb",
        "SECTION 1\na",
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": [1, 2]}\n```', "{'a': 1}"),
    ("detectable_format:title", {}, "<<My Title>>\nText", "<<>> no title"),
    (
        "combination:two_responses",
        {},
        "First answer.\n******\nSecond answer.",
        "Same.\n******\nSame.",
    ),
    (
        "combination:repeat_prompt",
        {"prompt_to_repeat": "Write a poem."},
        "write a poem. Roses...",
        "Roses...",
    ),
    (
        "startend:end_checker",
        {"end_phrase": "Any other questions?"},
        "Done. Any other questions?",
        "Any other questions? Done.",
    ),
    ("startend:quotation", {}, '"All quoted."', 'Not "all" quoted.'),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "USE CAPS here",
        "Use Caps here",
    ),
    ("change_case:english_capital", {}, "ALL CAPS, 123!", "ALL CAPS but one"),
    ("change_case:english_lowercase", {}, "all lower, 123!", "all lower but One"),
    ("punctuation:no_comma", {}, "No commas here.", "Commas, here."),
]


@pytest.mark.parametrize(
    "iid, kwargs, good, bad", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_each_instruction(iid, kwargs, good, bad):
    gt = {"instruction_id_list": [iid], "kwargs": [kwargs]}
    assert score("ifeval", good, gt) == 1.0
    assert score("ifeval", bad, gt) == 0.0


def test_every_checker_is_tested():
    tested = {c[0] for c in CASES} | {"language:response_language"}
    assert tested == set(CHECKERS)


def test_fraction_thinking_and_padding():
    gt = {
        "instruction_id_list": [
            "punctuation:no_comma",
            "change_case:english_lowercase",
            "startend:quotation",
        ],
        # the Hugging Face copy of IFEval pads every kwargs dict with None values
        "kwargs": [{"keywords": None}, {}, {"num_words": None}],
    }
    assert score("google/IFEval", "all lower, no quotes", gt) == pytest.approx(1 / 3)
    assert score("ifeval", '"all lower no comma"', json.dumps(gt)) == 1.0
    # only the text after </think> is checked; never stopping thinking satisfies nothing
    assert score("ifeval", '<think>Thinking, With Commas</think>"fine answer"', gt) == 1.0
    assert score("ifeval", '<think>"fine answer"', gt) == 0.0


def test_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="unsupported instruction id"):
        score("ifeval", "x", {"instruction_id_list": ["made:up"], "kwargs": [{}]})
    with pytest.raises(ValueError, match="relation"):
        score(
            "ifeval",
            "x",
            {
                "instruction_id_list": ["length_constraints:number_words"],
                "kwargs": [{"num_words": 3, "relation": "exactly"}],
            },
        )


def test_counters():
    assert count_words("Hello, world! It's 2 o'clock.") == 7  # \w+ tokens, as IFEval's tokenizer
    assert count_sentences("One. Two? Three!\nFour") == 4
