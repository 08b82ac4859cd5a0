"""The rows of a data file (.parquet, .jsonl, .json), read in bounded memory, failures named.

`read_rows(path, max_row_bytes)` yields (row number from 0, row) pairs, or (row number, DataError)
for a row that cannot be read, so that `prorl.data.load_file` can stop at it or skip and count it.
What a row may hold is checked there (`_parse_row`); here is what a file may hold:

- a row larger than `max_row_bytes` (`data.max_row_bytes`) is refused before it is built: JSONL is
  read line by line with a bounded `readline`, and the rest of an over-long line is skipped in
  bounded chunks; parquet is read in record batches and each row's Arrow size (`slice(i, 1).nbytes`,
  the bytes of its values) is checked before it becomes Python objects. One 50 MB prompt row once
  drove a process to 17.4 GB (tokenized, templated and sampled from). A .json file is one document,
  read whole: its over-long rows are refused after parsing, before they go further (use JSONL for
  large files);
- a JSON object with a key twice (json keeps the last silently) names the key;
- a UTF-8 byte-order mark at the start of a JSONL file is skipped (Windows tools write one); CRLF
  line ends are whitespace to JSON;
- a last line cut off mid-row (no newline at its end) says the file looks truncated;
- a file named .parquet that is not parquet (a CSV, say) is named as such;
- JSON nested too deep for the parser, or an integer of over 4,300 digits (Python's limit on
  converting one), is named with its row instead of a RecursionError or ValueError.
"""

from __future__ import annotations

import json

DEFAULT_MAX_ROW_BYTES = 16 * 2**20  # 16 MiB: code rows with their test cases run to a few MB
_SKIP_CHUNK = 2**20
_BOM = b"\xef\xbb\xbf"


class DataError(ValueError):
    """A row that cannot be used; the message names file, row and field."""


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def loads(text: str):
    """json.loads that refuses an object with a key twice (_DuplicateKey)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def not_utf8(line: bytes, exc: UnicodeDecodeError, offset: int | None = None) -> str:
    """'not UTF-8: byte 0x.. at byte N' for a decode error at `offset` of `line` (default
    exc.start)."""
    offset = exc.start if offset is None else offset
    return f"not UTF-8 text: byte 0x{line[offset]:02x} at byte {offset}"


def _unreadable_json(exc: BaseException) -> str:
    """What valid JSON that Python cannot build says: nested too deep, or an integer of more digits
    than Python converts (sys.get_int_max_str_digits())."""
    if isinstance(exc, RecursionError):
        return "JSON nested too deep to read (arrays or objects inside each other)"
    return f"a JSON value Python cannot read ({str(exc).split(';')[0]})"


def _too_big(size: int, limit: int) -> str:
    return (
        f"{size:,} bytes or more, over data.max_row_bytes={limit:,} (raise it if such rows are "
        "meant)"
    )


def read_rows(path: str, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES):
    """(row number from 0, row or DataError) pairs of a .parquet, .jsonl or .json file."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        yield from _parquet_rows(path, max_row_bytes)
    elif lower.endswith((".jsonl", ".jsonl.txt")):
        yield from _jsonl_rows(path, max_row_bytes)
    elif lower.endswith(".json"):
        yield from _json_rows(path, max_row_bytes)
    else:
        raise DataError(f"{path}: unknown data file type (use .parquet, .jsonl or .json)")


def _jsonl_rows(path: str, limit: int):
    with open(path, "rb") as f:  # bytes: a non-UTF-8 byte is reported with its line and offset
        i = 0
        while raw := f.readline(limit + 2):  # + the line end (CRLF)
            where = f"{path}: row {i} (line {i + 1})"
            if i == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            if len(raw.rstrip(b"\r\n")) > limit:
                size = len(raw)
                while not raw.endswith(b"\n") and (raw := f.readline(_SKIP_CHUNK)):
                    size += len(raw)  # the rest of the line, in bounded chunks
                yield i, DataError(f"{where}: {_too_big(size, limit)}")
                i += 1
                continue
            row = _json_line(raw, where, last=not raw.endswith(b"\n"))
            if row is not None:  # a blank line is no row
                yield i, row
            i += 1


def _json_line(raw: bytes, where: str, last: bool):
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return DataError(f"{where}: {not_utf8(raw, exc)} of the line")
    if not line.strip():
        return None
    try:
        return loads(line)
    except _DuplicateKey as exc:
        return DataError(
            f"{where}: key {exc.key!r} appears twice in one object (which one is meant?)"
        )
    except json.JSONDecodeError as exc:
        cut = " - the last line has no newline at its end: a truncated file?" if last else ""
        return DataError(f"{where}: not valid JSON ({exc}){cut}")
    except (ValueError, RecursionError) as exc:
        return DataError(f"{where}: {_unreadable_json(exc)}")


def _json_rows(path: str, limit: int):
    with open(path, "rb") as f:
        blob = f.read()
    try:
        rows = loads(blob.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        line_start = blob.rfind(b"\n", 0, exc.start) + 1
        line = blob.count(b"\n", 0, exc.start) + 1
        where = not_utf8(blob[line_start:], exc, exc.start - line_start)
        raise DataError(f"{path}: line {line}: {where} of the line") from None
    except _DuplicateKey as exc:
        raise DataError(
            f"{path}: key {exc.key!r} appears twice in one object (which one is meant?)"
        ) from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{path}: {_unreadable_json(exc)}") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json data file must hold a list of rows")
    # the file is in memory already; an over-long row goes no further
    for i, row in enumerate(rows):
        size = len(json.dumps(row, ensure_ascii=False).encode())
        yield i, DataError(f"{path}: row {i}: {_too_big(size, limit)}") if size > limit else row


def _parquet_rows(path: str, limit: int):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from exc
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=64)
        i = 0
        for batch in batches:
            if batch.nbytes <= limit:  # the whole batch fits: so does every row
                for row in batch.to_pylist():
                    yield i, row
                    i += 1
                continue
            for j in range(batch.num_rows):
                one = batch.slice(j, 1)  # a view: its nbytes are the bytes of this row's values
                yield (
                    i,
                    DataError(f"{path}: row {i}: {_too_big(one.nbytes, limit)}")
                    if one.nbytes > limit
                    else (one.to_pylist()[0]),
                )
                i += 1
    # not parquet (a CSV named .parquet), truncated, damaged
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(
            f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})"
        ) from None
