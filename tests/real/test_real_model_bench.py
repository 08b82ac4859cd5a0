"""`python -m benchmarks real_model --quick` on SmolLM2-135M-Instruct: two tiny RL steps of the
smollm2_digit_sums preset, its rows, curves and docs section; and the wrong-answer classes.

Reference for the rows: the held-out answers the run saved (val_samples.jsonl), scored here by
reading the last `\\boxed{N}` and comparing N with the sum of the terms parsed from the prompt.
"""

import csv
import json
import re

import pytest

from benchmarks import real_model
from prorl.data import builtin

pytestmark = pytest.mark.slow  # a 135M model: about a minute

DROPPED = "boxed, wrong number, a term dropped or miscopied"
DOC = "# x\n\n<!-- real_model:begin -->\nold\n<!-- real_model:end -->\nkept\n"


@pytest.mark.parametrize(
    "response, finish, correct, kind",
    [
        ("5 + 2 + 6 = 13. \\boxed{13}", "stop", True, "correct"),
        ("5 + 2 + 6 = 15. \\boxed{15}", "stop", False, "boxed, wrong sum of the asked terms"),
        ("2 + 6 = 8. \\boxed{8}", "stop", False, DROPPED),
        ("\\boxed{12}", "stop", False, DROPPED),
        ("\\boxed{13} no, \\boxed{ }", "stop", False, "empty \\boxed{}"),
        ("5 + 2 + 6 = 13", "stop", False, "no \\boxed{}, right sum in the text"),
        ("13 is not it: 5 + 2 + 6 = 14", "stop", False, "no \\boxed{}, no right sum"),
        ("To solve this problem, we", "length", False, "cut at the token limit, no \\boxed{}"),
    ],
)
def test_wrong_answers_are_classified_by_their_last_box(response, finish, correct, kind):
    assert real_model.classify(response, finish, correct, "13", [5, 2, 6]) == kind


def _sum_asked(example) -> int:
    m = re.fullmatch(r"What is ([0-9 +]+)\? .*", example.prompt[-1]["content"])
    return sum(int(t) for t in m.group(1).split(" + "))


def _boxed_right(response: str, total: int) -> bool:
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", response)
    return bool(boxes) and boxes[-1].strip() == str(total)


def test_quick_run_writes_rows_curves_and_the_docs_section(smollm2_dir, tmp_path):
    doc, work, results = tmp_path / "real-model.md", tmp_path / "work", tmp_path / "results"
    doc.write_text(DOC)
    argv = ["--quick", "--work", str(work), "--results", str(results), "--doc", str(doc)]
    assert real_model.main([*argv, "--set", f"model.path={smollm2_dir}"]) == 0
    with open(results / "real_model.csv") as f:
        rows = [dict(r, step=int(r["step"]), value=float(r["value"])) for r in csv.DictReader(f)]
    pass1 = {r["step"]: r["value"] for r in rows if r["metric"] == "val_pass@1"}
    assert sorted(pass1) == [0, 2]  # before RL and after the two steps
    assert sorted(r["step"] for r in rows if r["metric"] == "score") == [1, 2]

    val = builtin("oneshot/digit_sums", n=2, seed=1, split="val")  # the quick run's held-out set
    lines = (work / "s1" / "val_samples.jsonl").read_text().splitlines()
    saved = [json.loads(line) for line in lines]
    for step in (0, 2):
        answers = [r for r in saved if r["step"] == step]
        assert len(answers) == 4  # 2 problems x 2 samples
        right = [_boxed_right(r["response"], _sum_asked(val[r["index"]])) for r in answers]
        assert pass1[step] == pytest.approx(sum(right) / 4)
        at_step = [r for r in rows if r["step"] == step]
        classes = {r["metric"]: r["value"] for r in at_step if r["metric"].startswith("answers/")}
        assert sum(classes.values()) == 4 and classes["answers/correct"] == sum(right)

    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- real_model:end -->\nkept\n")
    assert re.search(r"\| 1 \| 2 \| \d+\.\d → \d+\.\d", text), text
    assert (results / "real_model.png").stat().st_size > 10_000
