"""prorl.data: mixing files by weight (`path:weight` specs, `mix`) and chat-template prompt encoding
with over-long prompts filtered and counted (issue 6)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from prorl import data


def _examples(tag: str, n: int) -> list[data.Example]:
    return [
        data.Example([{"role": "user", "content": f"{tag}{i}"}], "math", str(i)) for i in range(n)
    ]


def _tags(examples) -> Counter:
    return Counter(ex.prompt[0]["content"].rstrip("0123456789") for ex in examples)


def test_parse_file_spec(tmp_path):
    assert data.parse_file_spec("a.jsonl") == ("a.jsonl", None)
    assert data.parse_file_spec("/d/a.parquet:2.5") == ("/d/a.parquet", 2.5)
    assert data.parse_file_spec("s3://bucket/a.jsonl") == ("s3://bucket/a.jsonl", None)
    for bad in ("a.jsonl:0", "a.jsonl:-1", "a.jsonl:nan", "a.jsonl:inf"):
        with pytest.raises(data.DataError, match="positive"):
            data.parse_file_spec(bad)
    odd = tmp_path / "odd:3"  # an existing file is taken whole, even with a numeric suffix
    odd.write_text("")
    assert data.parse_file_spec(str(odd)) == (str(odd), None)


def test_mix_shares_by_largest_remainder():
    a, b, c = _examples("a", 10), _examples("b", 3), _examples("c", 5)
    assert _tags(data.mix([(a, 3), (b, 1)], n=8)) == {"a": 6, "b": 2}
    # 10/3 each: remainders tie, the earlier sources get the extra ones
    assert _tags(data.mix([(a, 1), (b, 1), (c, 1)], n=10)) == {"a": 4, "b": 3, "c": 3}
    # 0.1*7 = 0.7 and 0.9*7 = 6.3: the larger remainder wins
    assert _tags(data.mix([(a, 0.1), (c, 0.9)], n=7)) == {"a": 1, "c": 6}
    assert len(data.mix([(a, 1), (b, 1)])) == 13  # n defaults to the sources' total size


def test_mix_repeats_and_subsamples_without_early_duplicates():
    a, b = _examples("a", 3), _examples("b", 10)
    out = data.mix([(a, 1), (b, 1)], n=12, seed=5)
    per_example = Counter(ex.prompt[0]["content"] for ex in out)
    assert all(per_example[f"a{i}"] == 2 for i in range(3))  # 6 from 3 examples: each exactly twice
    assert (
        sum(per_example[f"b{i}"] for i in range(10)) == 6
        and max(per_example[f"b{i}"] for i in range(10)) == 1
    )
    assert data.mix([(a, 1), (b, 1)], n=12, seed=5) == out  # deterministic
    assert data.mix([(a, 1), (b, 1)], n=12, seed=6) != out
    assert [ex.prompt[0]["content"][0] for ex in out] != sorted(
        ex.prompt[0]["content"][0] for ex in out
    )


@pytest.mark.tally("bad_inputs")
def test_mix_rejects_bad_sources():
    with pytest.raises(ValueError, match="no sources"):
        data.mix([])
    with pytest.raises(ValueError, match="positive"):
        data.mix([(_examples("a", 2), 0)])
    with pytest.raises(ValueError, match="no examples"):
        data.mix([(_examples("a", 2), 1), ([], 1)])


def test_load_mixture(tmp_path):
    pa, pb = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    data.write_jsonl(_examples("a", 4), pa)
    data.write_jsonl(_examples("b", 2), pb)
    # plain concatenation
    assert data.load_mixture([pa, pb]) == data.load_file(pa) + data.load_file(pb)
    assert _tags(data.load_mixture([f"{pa}:1", f"{pb}:1"], n=6, seed=1)) == {"a": 3, "b": 3}
    assert _tags(data.load_mixture([f"{pa}:1", f"{pb}:3"])) == {"a": 2, "b": 4}  # n = 6 rows in all
    # unweighted + n: by file size
    assert _tags(data.load_mixture([pa, pb], n=3)) == {"a": 2, "b": 1}
    with pytest.raises(data.DataError, match="give every file a weight or none"):
        data.load_mixture([f"{pa}:2", pb])


@pytest.fixture(scope="module")
def tokenizer():
    from prorl.warmstart import build_tokenizer

    return build_tokenizer()  # one token per character, ChatML template


def test_encode_prompts_applies_template_and_filters(tokenizer):
    from prorl.warmstart import encode_chat

    exs = [_examples("", 1)[0]] + [
        data.Example([{"role": "user", "content": "x" * m}], "math", "0") for m in (5, 9, 6)
    ]
    # ChatML around one user message: "<|im_start|>user\n" (1 + 5 tokens) + content + "<|im_end|>\n"
    # (2)
    # + "<|im_start|>assistant\n" (1 + 10): 19 tokens plus the content's characters
    full = [encode_chat(tokenizer, ex.prompt[0]["content"]) for ex in exs]
    assert [len(f) for f in full] == [20, 24, 28, 25]
    ids, kept, n_filtered = data.encode_prompts(exs, tokenizer, max_prompt_tokens=25)
    assert kept == [0, 1, 3] and n_filtered == 1
    # kept prompts whole, the long one dropped, not truncated
    assert ids == [full[0], full[1], full[3]]
    assert data.encode_prompts(exs, tokenizer) == (full, [0, 1, 2, 3], 0)
    assert data.encode_prompts(exs, tokenizer, max_prompt_tokens=10) == ([], [], 4)
    assert data.encode_prompts([], tokenizer, 10) == ([], [], 0)
    system = data.Example(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "math", "0"
    )
    (two,), _, _ = data.encode_prompts([system], tokenizer)
    assert (
        tokenizer.decode(two)
        == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.tally("bad_inputs")
def test_encode_prompts_needs_a_chat_template(tokenizer):
    no_template = copy.copy(tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        data.encode_prompts(_examples("a", 1), no_template, 100)
