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
