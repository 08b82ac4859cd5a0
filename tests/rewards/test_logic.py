import json

import pytest

pytest.importorskip("reasoning_gym")

import reasoning_gym  # noqa: E402

from prorl.rewards import score  # noqa: E402


@pytest.fixture(scope="module")
def entries():
    return list(reasoning_gym.create_dataset("leg_counting", size=3, seed=7))


def _wrong(answer):
    return str(int(answer) + 1)


def test_entry_as_ground_truth(entries):
    for e in entries:
        assert score("reasoning_gym/leg_counting", f"<answer>{e['answer']}</answer>", e) == 1.0
        assert (
            score("reasoning_gym/leg_counting", f"<answer>{_wrong(e['answer'])}</answer>", e) == 0.0
        )
        # JSON string of the entry; task read from metadata.source_dataset
        assert score("reasoning_gym", f"<answer>{e['answer']}</answer>", json.dumps(e)) == 1.0


def test_format_and_thinking(entries):
    e = entries[0]
    ds = "reasoning_gym/leg_counting"
    assert score(ds, f"The answer is {e['answer']}", e) == 0.0  # no tags
    assert score(ds, f"<answer>0</answer> no, <answer>{e['answer']}</answer>", e) == 1.0  # last tag
    assert score(ds, f"<think><answer>{e['answer']}</answer></think><answer>0</answer>", e) == 0.0
    assert score(ds, f"<think><answer>{e['answer']}</answer>", e) == 0.0  # never stopped thinking


def test_generator_reference_regenerates(entries):
    ref = {"task": "leg_counting", "seed": 7, "size": 3, "index": 1}
    e = entries[1]
    assert (
        score(
            "reasoning_gym/leg_counting",
            f"<answer>{e['answer']}</answer>",
            e["answer"],
            {"reasoning_gym": ref},
        )
        == 1.0
    )
    assert (
        score("reasoning_gym/leg_counting", f"<answer>{e['answer']}</answer>", json.dumps(ref))
        == 1.0
    )
    assert score("reasoning_gym/leg_counting", "<answer>-1</answer>", ref) == 0.0


def test_plain_answer_string():
    assert score("reasoning_gym/basic_arithmetic", "<answer>12</answer>", "12") == 1.0
    assert score("reasoning_gym/basic_arithmetic", "<answer>13</answer>", "12") == 0.0


def test_partial_scores_and_raising_score_answer():
    e = reasoning_gym.create_dataset("prime_factorization", size=1, seed=0)[0]
    assert score("reasoning_gym/prime_factorization", f"<answer>{e['answer']}</answer>", e) == 1.0
    # its score_answer raises on non-integers: the answer is wrong, not the verifier
    assert score("reasoning_gym/prime_factorization", "<answer>zzz</answer>", e) == 0.0


def test_unknown_task_is_an_error():
    with pytest.raises(ValueError, match="cannot tell the task"):
        score("reasoning_gym", "<answer>1</answer>", "1")
