"""Bad data, config files and model directories (issue 29): each named with its file and row, key or
id, before any work; memory bounded while a data file is read (`data.max_row_bytes`)."""

import json
import math
import os
import shutil
import tracemalloc

import pytest

from prorl import data
from prorl.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_REASONER = os.path.join(ROOT, "prorl", "assets", "tiny-reasoner")
ROW = {"data_source": "math", "prompt": [{"role": "user", "content": "1+1="}], "ground_truth": "2"}
MiB = 2**20


def _write(tmp_path, name: str, blob: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(blob)
    return str(path)


def _lines(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _parquet(tmp_path, rows) -> str:
    pa = pytest.importorskip(
        "pyarrow", reason="parquet needs pyarrow (the rewards and test extras)"
    )
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _row(truth: bytes, more: bytes = b"") -> bytes:
    """A JSONL row with `truth` as its raw JSON ground truth (Python's json reads NaN and
    Infinity)."""
    return b'{"data_source": "math", "prompt": "x", ' + more + b'"ground_truth": ' + truth + b"}"


UNKNOWN_ROLE = dict(ROW, prompt=[{"role": "narrator", "content": "hi"}])
NO_CONTENT = dict(ROW, prompt=[{"role": "user", "text": "1+1="}])
# case -> (file name, its bytes, what the DataError says after the file's path)
BAD_FILES = {
    "Infinity ground truth (JSONL)": (
        "d.jsonl",
        _lines(ROW, _row(b"Infinity")),
        "row 1: field 'ground_truth' is inf",
    ),
    "NaN in a list of answers": (
        "d.jsonl",
        _lines(ROW, _row(b'["2", NaN]')),
        "field 'ground_truth' is ['2', nan]",
    ),
    "unknown role": (
        "d.jsonl",
        _lines(ROW, UNKNOWN_ROLE),
        "row 1: field 'prompt[0].role' is 'narrator', not one of system, user, assistant, tool",
    ),
    "message without content": (
        "d.jsonl",
        _lines(NO_CONTENT),
        "row 0: field 'prompt[0]' has no 'content'",
    ),
    "duplicate key (JSONL)": (
        "d.jsonl",
        _lines(ROW, _row(b'"2"', more=b'"ground_truth": "1", ')),
        "row 1 (line 2): key 'ground_truth' appears twice",
    ),
    "duplicate key (.json)": (
        "d.json",
        b'[{"data_source": "math", "data_source": "code", "prompt": "x"}]',
        "key 'data_source' appears twice",
    ),
    "truncated last line": (
        "d.jsonl",
        _lines(ROW) + json.dumps(ROW).encode()[:30],
        "row 1 (line 2): not valid JSON",
    ),
    "lone surrogate in a prompt": (
        "d.jsonl",
        _lines(ROW, dict(ROW, prompt=[{"role": "user", "content": "1+\ud800"}])),
        "row 1: field 'prompt[0].content' holds a lone UTF-16 surrogate",
    ),
    "5000-digit integer ground truth": (
        "d.jsonl",
        _lines(ROW, _row(b"7" * 5000)),
        "row 1 (line 2): a JSON value Python cannot read (Exceeds the limit (4300 digits)",
    ),
    "ground truth nested 100k deep (JSONL)": (
        "d.jsonl",
        _lines(_row(b"[" * 100_000 + b"]" * 100_000)),
        "row 0 (line 1): JSON nested too deep",
    ),
    "ground truth nested 100k deep (.json)": (
        "d.json",
        b"[" + _row(b"[" * 100_000 + b"]" * 100_000) + b"]",
        "JSON nested too deep",
    ),
    "CSV named .parquet": (
        "d.parquet",
        b"data_source,prompt,ground_truth\nmath,1+1=,2\n",
        "not a readable parquet file",
    ),
}


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_data_file_is_named_with_its_row(tmp_path, case):
    if case == "CSV named .parquet":
        pytest.importorskip("pyarrow", reason="parquet needs pyarrow (the rewards and test extras)")
    name, blob, message = BAD_FILES[case]
    path = _write(tmp_path, name, blob)
    with pytest.raises(data.DataError) as err:
        data.load_file(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)
    if case == "truncated last line":
        assert "a truncated file?" in str(err.value)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_data_path_that_is_no_file_is_named(tmp_path, kind):
    path = tmp_path / "x.jsonl"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(data.DataError, match="not a regular file") as err:
        data.load_file(str(path))
    assert str(err.value).startswith(f"{path}: ")


@pytest.mark.tally("bad_inputs")
def test_a_nan_ground_truth_in_parquet_names_the_file_and_row(tmp_path):
    path = _parquet(tmp_path, [dict(ROW, ground_truth=2.0), dict(ROW, ground_truth=math.nan)])
    with pytest.raises(
        data.DataError, match=r"row 1: field 'ground_truth' is nan: not a finite"
    ) as err:
        data.load_file(path)
    assert str(err.value).startswith(f"{path}: ")


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("case", ["BOM", "CRLF"])
def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path, case):
    blob = _lines(ROW, ROW)
    blob = b"\xef\xbb\xbf" + blob if case == "BOM" else blob.replace(b"\n", b"\r\n")
    examples = data.load_file(_write(tmp_path, "d.jsonl", blob))
    assert [ex.prompt for ex in examples] == [ROW["prompt"]] * 2


@pytest.mark.tally("bad_inputs")
def test_an_over_long_jsonl_row_is_refused_with_memory_bounded(tmp_path):
    """An 8 MiB row under a 1 MiB limit: named, and never read whole (Python's peak allocation stays
    near the limit; reading the line at once allocates its 8 MiB)."""
    big = dict(ROW, prompt="x" * (8 * MiB))
    path = _write(tmp_path, "d.jsonl", _lines(ROW, big, ROW))
    tracemalloc.start()
    try:
        with pytest.raises(data.DataError) as err:
            data.load_file(path, max_row_bytes=MiB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{path}: row 1 (line 2): {len(json.dumps(big)) + 1:,} bytes or more" in str(
        err.value
    ), str(err.value)
    assert "data.max_row_bytes=1,048,576" in str(err.value)
    assert peak < 4 * MiB, peak
    # the rows after it are read as usual
    kept = data.load_file(path, max_row_bytes=MiB, skip_bad=True)
    assert len(kept) == 2


@pytest.mark.tally("bad_inputs")
def test_an_over_long_row_of_a_json_file_is_refused(tmp_path):
    big = dict(ROW, prompt="é" * MiB)  # 2 MiB of UTF-8
    path = _write(tmp_path, "d.json", json.dumps([ROW, big], ensure_ascii=False).encode())
    with pytest.raises(
        data.DataError, match=r"row 1: 2,097,2\d\d bytes or more, over data.max_row_bytes"
    ):
        data.load_file(path, max_row_bytes=MiB)
    assert len(data.load_file(path, max_row_bytes=4 * MiB)) == 2


@pytest.mark.tally("bad_inputs")
def test_an_over_long_parquet_row_is_refused_before_it_becomes_python_objects(tmp_path):
    row = dict(ROW, prompt="1+1=")
    path = _parquet(tmp_path, [row, dict(row, prompt="x" * (2 * MiB)), row])
    with pytest.raises(
        data.DataError, match=r"row 1: 2,0\d\d,\d\d\d bytes or more, over data.max_row_bytes"
    ):
        data.load_file(path, max_row_bytes=MiB)
    assert len(data.load_file(path, max_row_bytes=MiB, skip_bad=True)) == 2
    assert len(data.load_file(path, max_row_bytes=4 * MiB)) == 3


# case -> (the YAML text, what the ConfigError says)
BAD_YAML = {
    "a list": ("- model\n- data\n", "must be a mapping of sections"),
    "broken YAML": ("trainer:\n  total_steps: [1,\n", "not valid YAML at line 3"),
    "an empty file": ("", "is empty"),
    "only comments": ("# trainer:\n#   total_steps: 3\n", "is empty"),
    "a key twice": (
        "trainer:\n  total_steps: 1\n  total_steps: 2\n",
        "found duplicate key total_steps",
    ),
    "an unknown key": ("trainer:\n  total_step: 3\n", "unknown config key 'trainer.total_step'"),
    "a wrong type": (
        "trainer:\n  total_steps: many\n",
        "bad config value for 'trainer.total_steps'",
    ),
    "a negative size": ("data:\n  val_size: -5\n", "data.val_size=-5 must be >= 0"),
    "a zero size": ("data:\n  max_prompt_tokens: 0\n", "data.max_prompt_tokens=0 must be >= 1"),
    "a zero top_k": ("rollout:\n  top_k: 0\n", "rollout.top_k=0 must be -1 (off) or >= 1"),
    "a zero row limit": ("data:\n  max_row_bytes: 0\n", "data.max_row_bytes=0 must be >= 1"),
}


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("case", list(BAD_YAML))
def test_a_bad_config_file_is_named(tmp_path, case):
    text, message = BAD_YAML[case]
    path = tmp_path / "run.yaml"
    model = (
        "model:\n  path: builtin:tiny-reasoner\n" if case not in ("a list", "broken YAML") else ""
    )
    body = text if case in ("an empty file", "only comments") else model + text
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert message in str(err.value), str(err.value)
    if (
        case not in ("an unknown key", "a wrong type")
        and "size" not in case
        and "top_k" not in case
    ):
        if "row limit" not in case:
            assert str(path) in str(err.value)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("case", ["BOM", "CRLF"])
def test_a_config_file_with_a_bom_or_crlf_is_read(tmp_path, case):
    text = "model:\n  path: builtin:tiny-reasoner\ntrainer:\n  total_steps: 7\n"
    blob = b"\xef\xbb\xbf" + text.encode() if case == "BOM" else text.replace("\n", "\r\n").encode()
    (tmp_path / "run.yaml").write_bytes(blob)
    assert load_config(str(tmp_path / "run.yaml")).trainer.total_steps == 7


@pytest.mark.tally("bad_inputs")
def test_a_key_given_twice_on_the_command_line_is_named_and_the_last_wins(capsys):
    from prorl.train import parse_config

    cfg, _, _ = parse_config(
        ["trainer.total_steps=3", "rollout.n=4", "trainer.total_steps=5", "rollout.n=4"]
    )
    assert cfg.trainer.total_steps == 5 and cfg.rollout.n == 4
    err = capsys.readouterr().err
    assert (
        "prorl: warning: config keys given more than once on the command line, the last wins: "
        in err
    )
    assert "trainer.total_steps = '3' then '5' ('5' is used)" in err and "rollout.n" not in err, err


def _model_dir(tmp_path, vocab_size=None, drop=None) -> str:
    path = tmp_path / "model"
    shutil.copytree(TINY_REASONER, path)
    if vocab_size is not None:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab_size}))
    if drop:
        os.remove(path / drop)
    return str(path)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "case, kw, message",
    [
        ("no tokenizer.json", {"drop": "tokenizer.json"}, "tokenizer.json is missing"),
        # the shipped tokenizer has 100 tokens (ids 0..99: 98 characters, '<unk>' is 99)
        ("vocab below the tokenizer", {"vocab_size": 98},
         "ids 98..99 (98 '~', 99 '<unk>') have no row"),
        ("vocab 480x the tokenizer", {"vocab_size": 48000},
         "embedding rows (config.json vocab_size) for a tokenizer of 100 tokens: 480x"),
    ],
)  # fmt: skip
def test_a_model_dir_with_no_tokenizer_or_another_model_s_is_named(tmp_path, case, kw, message):
    from prorl.tokenizer import check_tokenizer

    path = _model_dir(tmp_path, **kw)
    with pytest.raises(ValueError) as err:
        check_tokenizer(path)
    assert str(err.value).startswith(path) and message in str(err.value), str(err.value)
    check_tokenizer(TINY_REASONER)  # the shipped pair fits (100 tokens, 100 rows)
