import json

import pytest

from prorl import data
from prorl.rewards import score

ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "What is 2+2?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "4"},
    "extra_info": {"index": 0, "split": "train"},
}


def _jsonl(tmp_path, rows, name="d.jsonl"):
    """One line per row: a dict as JSON, a str or bytes as is."""
    path = tmp_path / name
    lines = [
        r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
        for r in rows
    ]
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


# a JSONL line with a Latin-1 byte (0xe9, "é") after 7,000 characters: a buffered read's offset is
# not the line's; the byte's position in its line, found independently of the loader
NOT_UTF8 = (
    json.dumps(dict(ROW, extra_info={"note": "x" * 7000}))
    .encode()
    .replace(b"x" * 10, b"caf\xe9 ", 1)
)
NOT_UTF8_AT = NOT_UTF8.index(b"\xe9")


def test_jsonl_verl_schema(tmp_path):
    (ex,) = data.load_file(_jsonl(tmp_path, [ROW]))
    assert (
        ex.prompt == ROW["prompt"] and ex.data_source == "openai/gsm8k" and ex.ground_truth == "4"
    )
    assert ex.extra == {"index": 0, "split": "train"} and ex.ability == "math"


def test_parquet_verl_schema(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        ROW,
        dict(
            ROW,
            prompt=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "1+1?"},
            ],
            reward_model={"style": "rule", "ground_truth": "2"},
        ),
    ]
    path = str(tmp_path / "d.parquet")
    # nested list<struct> / struct columns, as verl writes
    pq.write_table(pa.Table.from_pylist(rows), path)
    exs = data.load_file(path)
    assert [e.ground_truth for e in exs] == ["4", "2"]
    assert exs[1].prompt[0] == {"role": "system", "content": "Be brief."}
    assert exs[0].extra["index"] == 0


def test_round_trip_jsonl_and_parquet(tmp_path):
    exs = data.digit_sums(5, seed=1)
    data.write_jsonl(exs, str(tmp_path / "a.jsonl"))
    assert data.load_file(str(tmp_path / "a.jsonl")) == exs
    pytest.importorskip("pyarrow")
    data.write_parquet(exs, str(tmp_path / "a.parquet"))
    assert data.load_file(str(tmp_path / "a.parquet")) == exs


def test_trl_style_rows(tmp_path):
    (ex,) = data.load_file(
        _jsonl(tmp_path, [{"data_source": "math", "prompt": "1+1?", "ground_truth": "2"}])
    )
    assert (
        ex.prompt == [{"role": "user", "content": "1+1?"}]
        and ex.ground_truth == "2"
        and ex.extra == {}
    )


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "row, message",
    [
        (
            {k: v for k, v in ROW.items() if k != "data_source"},
            r"row 1: field 'data_source' is missing",
        ),
        (dict(ROW, data_source="nope/unknown"), r"row 1: field 'data_source' has no verifier"),
        ({k: v for k, v in ROW.items() if k != "prompt"}, r"row 1: field 'prompt' is missing"),
        (dict(ROW, prompt=[{"role": "user"}]), r"row 1: field 'prompt\[0\]'"),
        (dict(ROW, prompt=[]), r"row 1: field 'prompt' must be"),
        (
            {k: v for k, v in ROW.items() if k != "reward_model"},
            r"row 1: field 'reward_model' is missing",
        ),
        (
            dict(ROW, reward_model={"style": "rule"}),
            r"row 1: field 'reward_model.ground_truth' is missing",
        ),
        (dict(ROW, extra_info=[1]), r"row 1: field 'extra_info' must be an object"),
        ("{not json", r"row 1 \(line 2\): not valid JSON"),
        ("[1, 2]", r"row 1: a row must be an object"),
        (
            NOT_UTF8,
            rf"row 1 \(line 2\): not UTF-8 text: byte 0xe9 at byte {NOT_UTF8_AT} of the line",
        ),
        (dict(ROW, prompt=""), r"row 1: field 'prompt' has no text"),
        (
            dict(ROW, prompt=[{"role": "user", "content": " \n"}]),
            r"row 1: field 'prompt' has no text",
        ),
        (
            dict(ROW, reward_model={"ground_truth": ""}),
            r"row 1: field 'reward_model.ground_truth' is empty",
        ),
        (
            dict(ROW, reward_model={"ground_truth": []}),
            r"row 1: field 'reward_model.ground_truth' is empty",
        ),
        (
            {"data_source": "math", "prompt": "1+1?", "ground_truth": " "},
            r"row 1: field 'ground_truth' is empty",
        ),
        (
            dict(ROW, reward_model={"ground_truth": {"answer": "4"}}),
            r"row 1: field 'reward_model.ground_truth' must "
            r"be a string or number .*math verifier, got dict",
        ),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, row, message):
    path = _jsonl(tmp_path, [ROW, row])
    with pytest.raises(data.DataError, match=message) as err:
        data.load_file(path)
    assert path in str(err.value)


@pytest.mark.tally("bad_inputs")
def test_a_non_utf8_byte_in_a_json_file_names_its_line_and_offset(tmp_path):
    path = tmp_path / "d.json"
    path.write_bytes(b"[\n" + NOT_UTF8 + b"\n]\n")
    with pytest.raises(
        data.DataError, match=rf"line 2: not UTF-8 text: byte 0xe9 at byte {NOT_UTF8_AT} "
    ):
        data.load_file(str(path))


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_file_says_it_is_empty(tmp_path, text):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(data.DataError, match="the file is empty") as err:
        data.load_file(str(path))
    assert str(path) in str(err.value)


def test_a_math_ground_truth_may_be_a_number_or_a_list_of_answers(tmp_path):
    path = _jsonl(
        tmp_path,
        [
            dict(ROW, reward_model={"ground_truth": 4}),
            dict(ROW, reward_model={"ground_truth": ["4", 4.0]}),
        ],
    )
    assert [ex.ground_truth for ex in data.load_file(path)] == [4, ["4", 4.0]]


def test_dropped_prompts_are_counted_per_file(tmp_path):
    a = _jsonl(tmp_path, [ROW, ROW, ROW], name="a.jsonl")
    b = _jsonl(tmp_path, [ROW, ROW], name="b.jsonl")
    exs = data.load_mixture([a, b])
    assert [ex.source for ex in exs] == [a, a, a, b, b]
    assert data.dropped_by_source(exs, kept=[0, 2, 3, 4]) == {a: (1, 3)}
    assert data.dropped_by_source(exs, kept=[]) == {a: (3, 3), b: (2, 2)}
    assert data.dropped_by_source(data.digit_sums(2), kept=[1]) == {"the builtin task": (1, 2)}


def test_skip_bad_counts(tmp_path):
    report = data.LoadReport()
    path = _jsonl(tmp_path, [ROW, dict(ROW, data_source=3), ROW, "{oops", NOT_UTF8])
    exs = data.load_file(path, skip_bad=True, report=report)
    assert len(exs) == 2 and report.rows == 2 and report.skipped == 3 and len(report.errors) == 3


@pytest.mark.tally("bad_inputs")
def test_unknown_file_type_and_missing_file(tmp_path):
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(data.DataError, match="unknown data file type"):
        data.load_file(str(tmp_path / "d.csv"))
    with pytest.raises(FileNotFoundError):
        data.load_file(str(tmp_path / "missing.jsonl"))


def test_digit_sums_deterministic_split_and_answers():
    a, b = data.digit_sums(50, seed=3), data.digit_sums(50, seed=3)
    assert a == b and a != data.digit_sums(50, seed=4)
    train = {e.prompt[0]["content"] for e in data.digit_sums(split="train")}
    val = {e.prompt[0]["content"] for e in data.digit_sums(split="val")}
    assert len(train) == 800 and len(val) == 200 and not train & val
    for ex in a[:10]:
        x, y, z = (int(t) for t in ex.prompt[0]["content"].rstrip("=").split("+"))
        assert 0 <= min(x, y, z) and max(x, y, z) <= 9 and ex.ground_truth == str(x + y + z)
    assert len(data.digit_sums(2000, seed=0)) == 2000  # cycles through the 800 training problems


def test_digit_sums_solutions_score_with_the_math_verifier():
    pytest.importorskip("math_verify")
    for ex in data.digit_sums(5, seed=0, split="val"):
        assert score(ex.data_source, ex.extra["solution"], ex.ground_truth) == 1.0
        assert score(ex.data_source, "\\boxed{99}", ex.ground_truth) == 0.0


def test_reasoning_gym_builtin():
    pytest.importorskip("reasoning_gym")
    train = data.builtin("reasoning_gym/leg_counting", n=4, seed=0)
    val = data.builtin("reasoning_gym/leg_counting", n=4, seed=0, split="val")
    assert [e.prompt for e in train] == [
        e.prompt for e in data.builtin("reasoning_gym/leg_counting", n=4, seed=0)
    ]
    assert [e.prompt for e in train] != [e.prompt for e in val]
    ex = train[0]
    assert ex.data_source == "reasoning_gym/leg_counting" and ex.prompt[0]["role"] == "system"
    right = f"<answer>{ex.ground_truth}</answer>"
    assert score(ex.data_source, right, ex.ground_truth, ex.extra) == 1.0
    assert score(ex.data_source, "<answer>-1</answer>", ex.ground_truth, ex.extra) == 0.0
    json.dumps(ex.to_row())  # serialisable as is
    with pytest.raises(ValueError, match="unknown built-in"):
        data.builtin("nope")
