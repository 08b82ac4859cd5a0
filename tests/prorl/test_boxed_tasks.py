"""`boxed/<task>`: the arithmetic built-ins asked as a chat model is asked them."""

import re

import pytest

from prorl.data import builtin


@pytest.mark.parametrize("task", ["digit_sums", "chain_sums", "long_sums"])
def test_instructed_problems_are_the_same_problems(task):
    bare = builtin(task, n=30, seed=3, split="val")
    boxed = builtin(f"boxed/{task}", n=30, seed=3, split="val")
    for b, x in zip(bare, boxed):
        text = x.prompt[0]["content"]
        m = re.fullmatch(r"What is ([0-9 +]+)\? Put the final answer in \\boxed\{\}\.", text)
        assert m, text
        terms = [int(t) for t in m.group(1).split(" + ")]
        assert str(sum(terms)) == x.ground_truth == b.ground_truth  # the sum, computed here
        assert (x.data_source, x.extra) == (b.data_source, b.extra)
    with pytest.raises(ValueError, match="boxed/<one of those three>"):
        builtin("boxed/reasoning_gym/leg_counting", n=2)


@pytest.mark.parametrize("task", ["digit_sums", "chain_sums", "long_sums"])
def test_oneshot_problems_follow_one_worked_training_example(task):
    """`oneshot/<task>`: the `boxed/` question after one earlier turn, "What is 2 + 5 + 1? ..."
    answered "2 + 5 + 1 = 8. \\boxed{8}" (its sum right, computed here); 2+5+1 is a training
    problem of digit_sums, never one of its held-out ones."""
    boxed = builtin(f"boxed/{task}", n=30, seed=3, split="val")
    shot = builtin(f"oneshot/{task}", n=30, seed=3, split="val")
    for b, x in zip(boxed, shot):
        assert [m["role"] for m in x.prompt] == ["user", "assistant", "user"]
        assert x.prompt[-1] == b.prompt[0]
        assert (x.data_source, x.ground_truth, x.extra) == (b.data_source, b.ground_truth, b.extra)
        question = x.prompt[0]["content"]
        assert question == "What is 2 + 5 + 1? Put the final answer in \\boxed{}."
        m = re.fullmatch(r"2 \+ 5 \+ 1 = (\d+)\. \\boxed\{(\d+)\}", x.prompt[1]["content"])
        assert m and int(m.group(1)) == int(m.group(2)) == 2 + 5 + 1
    held_out = {x.prompt[0]["content"] for x in builtin("digit_sums", split="val")}
    assert "2+5+1=" not in held_out
    assert "2+5+1=" in {x.prompt[0]["content"] for x in builtin("digit_sums", split="train")}
