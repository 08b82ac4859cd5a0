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
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_verl_schema(tmp_path):
    (ex,) = data.load_file(_jsonl(tmp_path, [ROW]))
    assert ex.prompt == ROW["prompt"] and ex.data_source == "openai/gsm8k" and ex.ground_truth == "4"
    assert ex.extra == {"index": 0, "split": "train"} and ex.ability == "math"


def test_parquet_verl_schema(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        ROW,
        dict(
            ROW,
            prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
            reward_model={"style": "rule", "ground_truth": "2"},
        ),
    ]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)  # nested list<struct> / struct columns, as verl writes
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
    (ex,) = data.load_file(_jsonl(tmp_path, [{"data_source": "math", "prompt": "1+1?", "ground_truth": "2"}]))
    assert ex.prompt == [{"role": "user", "content": "1+1?"}] and ex.ground_truth == "2" and ex.extra == {}


@pytest.mark.parametrize(
    "row, message",
    [
        ({k: v for k, v in ROW.items() if k != "data_source"}, r"row 1: field 'data_source' is missing"),
        (dict(ROW, data_source="nope/unknown"), r"row 1: field 'data_source' has no verifier"),
        ({k: v for k, v in ROW.items() if k != "prompt"}, r"row 1: field 'prompt' is missing"),
        (dict(ROW, prompt=[{"role": "user"}]), r"row 1: field 'prompt\[0\]'"),
        (dict(ROW, prompt=[]), r"row 1: field 'prompt' must be"),
        ({k: v for k, v in ROW.items() if k != "reward_model"}, r"row 1: field 'reward_model' is missing"),
        (dict(ROW, reward_model={"style": "rule"}), r"row 1: field 'reward_model.ground_truth' is missing"),
        (dict(ROW, extra_info=[1]), r"row 1: field 'extra_info' must be an object"),
        ("{not json", r"row 1 \(line 2\): not valid JSON"),
        ("[1, 2]", r"row 1: a row must be an object"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, row, message):
    path = _jsonl(tmp_path, [ROW, row])
    with pytest.raises(data.DataError, match=message) as err:
        data.load_file(path)
    assert path in str(err.value)


def test_skip_bad_counts(tmp_path):
    report = data.LoadReport()
    path = _jsonl(tmp_path, [ROW, dict(ROW, data_source=3), ROW, "{oops"])
    exs = data.load_file(path, skip_bad=True, report=report)
    assert len(exs) == 2 and report.rows == 2 and report.skipped == 2 and len(report.errors) == 2


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
