"""Reports a policy's code can forge: `prorl.rewards.score` must score them 0 with a reason, never
raise, never hold much memory for them, and the reward pool must not count them as verifier errors.

The code runs in the harness's process, so it can write any bytes to the report's descriptor (the
harness's dup of the original stdout) and `os._exit(0)` before the harness writes its own."""

import json
import tracemalloc

import pytest
from sandbox_helpers import need

from prorl.rewards import code_report, sandbox, score_with_info
from prorl.rewards.pool import RewardPool

STDIO = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
CALL = {"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"}
MIB = 1 << 20


def reply(code):
    return f"```python\n{code}\n```"


def forged(payload_expr):
    """Code that writes `payload_expr` (bytes) to every writable descriptor above 2, then exits."""
    return (
        "import os\n"
        f"payload = {payload_expr}\n"
        "for fd in range(3, 32):\n"
        "    try:\n"
        "        os.write(fd, payload)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)"
    )


def literal(text):
    return forged(repr(text.encode()))


NULL_ERROR = '{"compile_error": null, "results": [{"out": %s, "error": %s}]}'
DEEP_LIST = "def add(a, b):\n    v = []\n    for _ in range(3000):\n        v = [v]\n    return v"
ATTACKS = {
    # the four reports of the issue, then more of our own
    "deep_report": (forged("b'[' * 200000 + b']' * 200000"), STDIO),
    "deep_return_value": (DEEP_LIST, CALL),
    "out_is_a_list": (literal(NULL_ERROR % ('["3"]', "null")), STDIO),
    "16_mib_of_empty_objects": (
        forged("b'{\"results\": [' + b'{},' * ((16 << 20) // 3) + b'{}]}'"),
        STDIO,
    ),
    "results_not_a_list": (forged('b\'{"compile_error": null, "results": {"0": "3"}}\''), STDIO),
    "report_is_a_list": (forged("b'[1, 2, 3]'"), STDIO),
    "compile_error_is_an_object": (
        forged('b\'{"compile_error": {"a": 1}, "results": []}\''),
        STDIO,
    ),
    "error_is_a_number": (literal(NULL_ERROR % ('"3"', "7")), STDIO),
    "more_results_than_tests": (
        forged(
            'b\'{"compile_error": null, "results": [{"out": "3", "error": null}, {"out": "3"}]}\''
        ),
        STDIO,
    ),
    "not_json": (forged("b'\\xff\\xfe{not json'"), STDIO),
    "nan_and_huge_numbers": (
        literal('{"results": [{"out": NaN, "error": null}], "x": 1e999}'),
        CALL,
    ),
    "lone_surrogate_in_code": ("print('\\ud800')\nprint(3)", STDIO),
}

# plain wrong answers, no reason given
WELL_FORMED = ("nan_and_huge_numbers", "lone_surrogate_in_code")


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("name", list(ATTACKS))
def test_forged_reports_score_zero_with_a_reason(name):
    need(sandbox.backend())
    code, truth = ATTACKS[name]
    tracemalloc.start()
    try:
        value, info = score_with_info("code", reply(code), truth)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert value == 0.0, info
    if name not in WELL_FORMED:
        assert info.get("invalid_report") or info.get("compile_error"), info
    # raw report (16 MiB) and its skeleton: no object per forged value (that was a 420 MiB peak)
    assert peak < 48 * MIB, f"peak {peak / MIB:.0f} MiB"


@pytest.mark.tally("attacks")
def test_forged_reports_are_not_verifier_errors_in_the_pool():
    # what a policy makes its code do must not move reward/error_frac: only the verifier's own
    # failures
    need(sandbox.backend())
    names = ["deep_report", "deep_return_value", "out_is_a_list", "16_mib_of_empty_objects"]
    responses = [reply(ATTACKS[n][0]) for n in names] + [reply("def add(a, b):\n    return a + b")]
    truths = [ATTACKS[n][1] for n in names] + [CALL]
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("code",)) as pool:
        res = pool.score_batch(["code"] * len(responses), responses, truths)
    assert res.scores == [0.0] * len(names) + [1.0], res.errors
    assert res.errored == [False] * len(responses) and res.metrics()["reward/error_frac"] == 0.0
    assert all(e.get("invalid_report") for e in res.extras[: len(names)]), res.extras


def test_honest_nested_return_values_still_pass():
    need(sandbox.backend())
    grid = [[[i, j] for j in range(3)] for i in range(3)]
    truth = {"inputs": [[3]], "outputs": [[grid]], "fn_name": "grid"}
    code = "def grid(n):\n    return [[[i, j] for j in range(n)] for i in range(n)]"
    assert score_with_info("code", reply(code), truth)[0] == 1.0
    # a string full of brackets is one value, not many
    truth = {"inputs": ["\n"], "outputs": ["[" * 50000 + "{" * 50000 + "\n"]}
    assert score_with_info("code", reply("print('[' * 50000 + '{' * 50000)"), truth)[0] == 1.0


def _depth(v):  # reference: nesting depth of a parsed JSON value, recursively
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


def _values(v):  # reference: values a parsed JSON document holds (containers, keys, scalars)
    if isinstance(v, list):
        return 1 + sum(map(_values, v))
    if isinstance(v, dict):
        return 1 + len(v) + sum(map(_values, v.values()))
    return 1


@pytest.mark.parametrize(
    "value",
    [
        [],
        "a string",
        {"a": [1, {"b": [[], [2, 3]]}], "c": ']]]}}}[[,,\\"['},
        [[[[["x"]]]], {"k": {"k": {"k": {}}}}],
        [1, 2, [3, [4, [5, [6]]]], "\\\\", '"quoted"', None, True, 1.5e300],
    ],
)
def test_depth_and_weight_scans_match_a_parsed_reference(value):
    raw = json.dumps(value).encode()
    assert code_report.weight(raw) + 1 >= _values(value)  # bounds what the parser builds
    skeleton = code_report.skeleton_of(raw)
    d = _depth(value)
    assert not code_report.depth_exceeds(skeleton, d)
    assert d == 0 or code_report.depth_exceeds(skeleton, d - 1)
