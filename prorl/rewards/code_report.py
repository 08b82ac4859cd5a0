"""Reading the code harness's report: bounded and validated before any use.

The report comes from inside the sandbox, where the policy's code shares the process with the
harness: it may write any bytes to the report's descriptor and exit. So, before anything looks at
it, the raw bytes are checked with linear-time byte scans, without building any object:

- size: at most `MAX_BYTES` (the sandbox reads no more than that; a cut report fails to parse);
- weight: at most `max_items` separators, brackets and quotes (`,` `:` `[` `{` `"`, counted by
  `bytes.count`). Every value the JSON parser would build, and every string literal the depth scan
  must skip, needs one, so this bounds both. The code verifier allows twice the weight of its
  expected outputs plus slack per test (for error tracebacks): a right answer weighs about what the
  expected one does, and a report of 16 MiB of `{}` items would otherwise become ~5 million dicts (a
  420 MiB peak);
- depth: at most `MAX_DEPTH` nested containers (a 200,000-deep report would raise RecursionError in
  the JSON parser, a 3,000-deep return value in the comparison).

Then it is parsed and its types checked: an object with `compile_error` (None or a string) and
`results`, one object per test with `error` (None or a string) and `out` (a string for stdin/stdout
tests; any JSON value for function calls). Anything else is an `InvalidReport`: the code verifier
scores it 0 and says why; it is the response's failure, not the verifier's (see prorl.rewards.pool).
"""

from __future__ import annotations

import json
import re

MAX_BYTES = 16 << 20
MAX_DEPTH = 100  # the report's own 3 levels ({"results": [{"out": ...}]}) included
# a JSON string literal, unrolled so that the scan is linear with no backtracking
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")
_ONE_KIND = bytes.maketrans(b"{}", b"[]")


class InvalidReport(ValueError):
    """The harness's report is malformed, too large or too deep; the message says which."""


def weight(raw: bytes) -> int:
    """Separators, brackets and quotes in `raw`: at least the number of values it parses into."""
    return sum(raw.count(c) for c in (b",", b":", b"[", b"{", b'"'))


def depth_exceeds(skeleton: bytes, limit: int) -> bool:
    """Whether brackets in `skeleton` (JSON text without string literals) nest deeper than `limit`,
    or do not balance. Each pass removes the innermost pairs: `limit` passes of C-speed replaces."""
    brackets = _NOT_BRACKET.sub(b"", skeleton).translate(_ONE_KIND)
    for _ in range(limit):
        if not brackets:
            return False
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            return True  # unbalanced
        brackets = shorter
    return bool(brackets)


def skeleton_of(raw: bytes) -> bytes:
    return _STRING.sub(b"", raw)


def parse(raw: bytes, total: int, mode: str, max_items: int) -> dict:
    """The report as {"compile_error": str | None, "results": [{"out", "error"}] * total}, checked
    as the module doc says. Raises InvalidReport."""
    if not raw.strip():
        raise InvalidReport("no report (the process exited before the harness wrote one)")
    if len(raw) > MAX_BYTES:
        raise InvalidReport(f"report of {len(raw)} bytes, over {MAX_BYTES}")
    items = weight(raw)
    if items > max_items:
        raise InvalidReport(
            f"report weighs {items} values, over the {max_items} this problem allows"
        )
    skeleton = skeleton_of(raw)
    if depth_exceeds(skeleton, MAX_DEPTH):
        raise InvalidReport(f"report nested deeper than {MAX_DEPTH} levels, or unbalanced")
    del skeleton
    try:
        report = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidReport(
            f"report is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise InvalidReport(f"report is a {type(report).__name__} without a `results` list")
    compile_error = report.get("compile_error")
    if compile_error is not None and not isinstance(compile_error, str):
        raise InvalidReport(f"`compile_error` is a {type(compile_error).__name__}")
    results = report["results"]
    if compile_error is None and len(results) != total:
        raise InvalidReport(f"report has {len(results)} results for {total} tests")
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not (r.get("error") is None or isinstance(r["error"], str)):
            raise InvalidReport(f"result {i} is not an object with `error` None or a string")
        if mode == "stdio" and not isinstance(r.get("out"), str) and r.get("error") is None:
            raise InvalidReport(
                f"result {i}: `out` is a {type(r.get('out')).__name__}, not a string"
            )
    return {"compile_error": compile_error, "results": results}


def item_budget(outputs: list) -> int:
    """`max_items` for a problem: twice the weight of its expected outputs, plus slack per test."""
    return 2 * weight(json.dumps(outputs).encode()) + 256 * len(outputs) + 4096
