"""Runs INSIDE the sandbox: executes solution.py on every test input and reports what it produced.

argv[1] is the read-only directory holding solution.py and tests.json ({"mode": "stdio" | "call" |
"program", "fn_name": str | None, "inputs": [...]}). Expected outputs never enter the sandbox in the
stdio and call modes, so whatever the solution does to this harness (it shares the process) it
cannot report a right answer it did not compute; in "program" mode (HumanEval's test program, whose
asserts hold the expected values) the one input is that program. Standard input and output are
swapped at the file-descriptor level for each test, so `input()`, `sys.stdin.buffer`, `print`,
`sys.stdout.buffer.write` and `os.write(1, ...)` all work. The report is one JSON object written to
the original stdout at the end:
{"compile_error": str | None, "results": [{"out": str | value, "error": str | None}, ...]}.
Standard library only: it runs under `python -I`.
"""

import builtins
import json
import os
import sys
import traceback

MAX_OUT = 1 << 20  # characters of one test's output kept


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def main():
    code_dir = sys.argv[1]
    report_fd = os.dup(1)
    with open(os.path.join(code_dir, "tests.json"), encoding="utf-8") as f:
        spec = json.load(f)
    with open(os.path.join(code_dir, "solution.py"), encoding="utf-8") as f:
        source = f.read()
    report = {"compile_error": None, "results": []}
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        report["compile_error"] = f"{type(exc).__name__}: {exc}"
        code = None
    if code is not None:
        sys.setrecursionlimit(10000)
        if spec["mode"] == "call":
            report["results"] = run_calls(code, spec)
        elif spec["mode"] == "program":
            report["results"] = [run_program(code, spec)]
        else:
            report["results"] = [run_stdio(code, inp, i) for i, inp in enumerate(spec["inputs"])]
    os.write(report_fd, json.dumps(report).encode())


def _redirect(i, stdin_text):
    in_path, out_path = f"stdin_{i}", f"stdout_{i}"
    with open(in_path, "w", encoding="utf-8") as f:
        f.write(stdin_text)
    in_fd = os.open(in_path, os.O_RDONLY)
    out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(in_fd, 0)
    os.dup2(out_fd, 1)
    os.close(in_fd)
    os.close(out_fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    return out_path


def _collect(out_path):
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the solution may have closed it
        pass
    with open(out_path, encoding="utf-8", errors="replace") as f:
        out = f.read(MAX_OUT)
    os.remove(out_path)
    return out


def run_stdio(code, stdin_text, i):
    if isinstance(stdin_text, list):
        stdin_text = "\n".join(map(str, stdin_text))
    out_path = _redirect(i, str(stdin_text))
    error = None
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit:
        pass
    except BaseException:  # noqa: BLE001 - the test failed; keep going
        error = traceback.format_exc(limit=3)[-2000:]
    return {"out": _collect(out_path), "error": error}


def run_calls(code, spec):
    _redirect("call", "")
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(code, namespace)
    except BaseException:  # noqa: BLE001
        err = traceback.format_exc(limit=3)[-2000:]
        return [{"out": None, "error": err} for _ in spec["inputs"]]
    name = spec["fn_name"]
    fn = namespace.get(name)
    if fn is None and isinstance(namespace.get("Solution"), type):
        fn = getattr(namespace["Solution"](), name, None)
    if not callable(fn):
        return [{"out": None, "error": f"no function {name!r}"} for _ in spec["inputs"]]
    results = []
    for args in spec["inputs"]:
        try:
            value = fn(*args) if isinstance(args, list) else fn(args)
            results.append({"out": _jsonable(value), "error": None})
        except BaseException:  # noqa: BLE001
            results.append({"out": None, "error": traceback.format_exc(limit=3)[-2000:]})
    return results


def run_program(code, spec):
    """A test program (HumanEval's `check(candidate)`, or asserts): run after the solution in its
    namespace, then `check(<entry point>)` if it defines `check`. out True when nothing raised."""
    _redirect("program", "")
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(code, namespace)
        exec(compile(spec["inputs"][0], "test.py", "exec"), namespace)
        check = namespace.get("check")
        if callable(check) and spec["fn_name"]:
            if spec["fn_name"] not in namespace:
                return {"out": None, "error": f"no function {spec['fn_name']!r}"}
            check(namespace[spec["fn_name"]])
    except BaseException:  # noqa: BLE001 - a failed assert is a failed test
        return {"out": None, "error": traceback.format_exc(limit=3)[-2000:]}
    return {"out": True, "error": None}


if __name__ == "__main__":
    main()
