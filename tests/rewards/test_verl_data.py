"""Rows in verl's own format (as its examples/data_preprocess scripts write them) score through
prorl's verifiers with the answer convention their prompts ask for: GSM8K's "#### 72", MATH's
\\boxed{}, DAPO-Math's "Answer: 72" line, AIME, and PRIME-format code tests. Each row goes through
prorl.data's row parser and prorl.rewards.score; a right and a wrong response per row."""

import json

import pytest

import prorl.rewards as rewards
from prorl import data

GSM8K_Q = "Natalia sold 48 clips in April and half as many in May. How many in all?"
GSM8K = {  # verl examples/data_preprocess/gsm8k.py
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": GSM8K_Q + ' Let\'s think step by step and output the '
                'final answer after "####".'}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": "... #### 72", "question": GSM8K_Q},
}  # fmt: skip
MATH = {  # verl examples/data_preprocess/math_dataset.py (lighteval/MATH)
    "data_source": "DigitalLearningGmbH/MATH-lighteval",
    "prompt": [{"role": "user", "content": "What is 1/2 + 1/4? Let's think step by step and "
                "output the final answer within \\boxed{}."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"},
    "extra_info": {"split": "test", "index": 3},
}  # fmt: skip
DAPO_PROMPT = (
    "Solve the following math problem step by step. "
    "The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer "
    "is the answer to the problem.\n\nWhat is 6 * 7?\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
DAPO = {  # BytedTsinghua-SIA/DAPO-Math-17k as verl's DAPO recipe reads it
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content": DAPO_PROMPT}],
    "ability": "MATH",
    "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "42"},
    "extra_info": {"index": "a1b2"},
}
AIME = {**MATH, "data_source": "aime24", "reward_model": {"style": "rule", "ground_truth": "204"}}
CODE_TESTS = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
CODE = {  # PRIME / verl's code sets: tests as a JSON string
    "data_source": "codecontests",
    "prompt": "Read two integers and print their sum. Write Python in a ```python block.",
    "ability": "code",
    "reward_model": {"style": "rule", "ground_truth": json.dumps(CODE_TESTS)},
}
SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"

CASES = [
    (GSM8K, "48 / 2 = 24 clips in May, 48 + 24 = 72.\n#### 72", "48 + 24 = 70.\n#### 70"),
    (MATH, "1/2 + 1/4 = 3/4, so the answer is \\boxed{\\frac{3}{4}}.", "\\boxed{\\frac{2}{4}}"),
    (DAPO, "6 * 7 = 42.\nAnswer: 42", "6 * 7 = 48.\nAnswer: 48"),
    (AIME, "... so the answer is \\boxed{204}.", "\\boxed{205}"),
    (CODE, f"Here:\n{SUM}", SUM.replace("a + b", "a - b")),
]


@pytest.mark.parametrize("row, right, wrong", CASES, ids=[c[0]["data_source"] for c in CASES])
def test_verl_rows_score_with_their_own_answer_convention(tmp_path, row, right, wrong):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (ex,) = data.load_file(str(path))
    assert rewards.score(ex.data_source, right, ex.ground_truth, ex.extra) == 1.0
    assert rewards.score(ex.data_source, wrong, ex.ground_truth, ex.extra) == 0.0
