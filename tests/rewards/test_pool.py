import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

import prorl.rewards as rewards
from prorl.rewards import sandbox
from prorl.rewards.pool import MAX_START_FAILURES, RewardPool
from prorl.rewards.sandbox import rootfs
from prorl.rewards.selftest import self_test


@pytest.fixture
def registered():
    saved = dict(rewards._REGISTRY)
    rewards.register("half", "reward_helpers:constant_half")
    rewards.register("echo", "reward_helpers:echo_extra")
    rewards.register("hang", "reward_helpers:sleep_forever")
    rewards.register("crash", "reward_helpers:hard_exit")
    rewards.register("raise", "reward_helpers:raises")
    rewards.register("range", "reward_helpers:out_of_range")
    yield
    rewards._REGISTRY.clear()
    rewards._REGISTRY.update(saved)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=1.5, preload=()) as p:
        yield p


@pytest.mark.tally("faults")
def test_batch_with_hangs_and_crashes_completes(registered, pool):
    sources = ["half", "hang", "echo", "crash", "raise", "range", "echo", "half"]
    responses = ["", "", "a", "", "", "", "a", ""]
    truths = [None, None, "a", None, None, None, "b", None]
    start = time.monotonic()
    res = pool.score_batch(sources, responses, truths)
    elapsed = time.monotonic() - start
    assert res.scores == [0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5]
    assert res.timed_out == [False, True, False, False, False, False, False, False]
    assert res.errored == [False, False, False, True, True, True, False, False]
    assert (
        "exit code 3" in res.errors[3]
        and "verifier bug" in res.errors[4]
        and "outside" in res.errors[5]
    )
    assert res.extras[2] == {"data_source": "echo"}
    assert res.metrics() == {"reward/timeout_frac": 1 / 8, "reward/error_frac": 3 / 8}
    assert elapsed < 10  # one timeout (1.5 s) plus replacing workers, not a hang
    # the pool is healthy afterwards: the replaced workers score normally
    again = pool.score_batch(["half"] * 4, [""] * 4, [None] * 4)
    assert again.scores == [0.5] * 4 and not any(again.errored + again.timed_out)


@pytest.mark.tally("faults")
def test_all_hang_still_completes(registered, pool):
    res = pool.score_batch(["hang"] * 3, [""] * 3, [None] * 3)
    assert res.timed_out == [True] * 3 and res.scores == [0.0] * 3


def test_async_and_math_in_workers():
    pytest.importorskip("math_verify")
    # math-verify uses signal.alarm: in the workers its own timeout works (no "threaded" error);
    # preloading keeps its import (~1 s) out of the items' clock
    with RewardPool(num_workers=1, timeout_s=30, preload=("math",)) as math_pool:
        fut = math_pool.score_batch_async(
            ["openai/gsm8k", "math"], ["\\boxed{0.5}", "\\boxed{3}"], ["\\frac12", "4"]
        )
        res = fut.result(timeout=60)
    assert res.scores == [1.0, 0.0] and not any(res.errored + res.timed_out), res.errors


def test_caller_errors_raise(registered, pool):
    with pytest.raises(LookupError):
        pool.score_batch(["nope"], [""], [None])
    rewards.register("lam", lambda r, g, e: 1.0)
    with pytest.raises(TypeError, match="module-level"):
        pool.score_batch(["lam"], [""], [None])
    with pytest.raises(ValueError):
        pool.score_batch(["half"], ["", ""], [None])


def test_math_in_a_thread_without_pool():
    pytest.importorskip("math_verify")
    out = []
    t = threading.Thread(
        target=lambda: out.append(rewards.score("math", "\\boxed{\\frac{2}{4}}", "0.5"))
    )
    t.start()
    t.join(60)
    assert out == [1.0]


def _processes_with(marker):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found += [int(pid)] if marker.encode() in f.read() else []
            except OSError:
                pass
    return found


@pytest.mark.tally("faults")
def test_pool_timeout_kills_the_code_sandbox_too(pool):
    # the worker is SIGKILLed on the pool's timeout while its sandbox runs: the sandbox must die
    # with it
    marker = f"prorl-pool-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        f"os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', '{marker}'])"
    )
    response = f"```python\n{code}\n```"
    gt = {"inputs": ["1\n"], "outputs": ["1\n"]}
    res = pool.score_batch(["code"], [response], [gt], [{"time_limit_s": 30}])
    assert res.timed_out == [True]
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = _processes_with(marker)
    for pid in leftover:
        os.kill(pid, 9)
    assert leftover == []
    # nor its private directory (the killed worker could not remove it; the pool removes its TMPDIR)
    assert all(os.path.isdir(w.tmpdir) for w in pool.workers)
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("prorl-sbx-")]


ALL_BUILTINS = ["math", "stem", "ifeval", "reasoning_gym/leg_counting", "code"]


def test_self_test_in_process():
    pytest.importorskip("math_verify")
    pytest.importorskip("reasoning_gym")
    assert self_test(ALL_BUILTINS) == {
        k: "ok" for k in ["code", "ifeval", "math", "reasoning_gym", "stem"]
    }


def test_self_test_with_pool():
    pytest.importorskip("math_verify")
    with RewardPool(num_workers=2, timeout_s=30, preload=("math",)) as p:
        assert self_test(["openai/gsm8k", "codeforces"], p) == {"math": "ok", "code": "ok"}


@pytest.mark.tally("faults")
def test_self_test_names_broken_verifiers(registered):
    rewards.register("math", "reward_helpers:constant_half")
    rewards.register("stem", "reward_helpers:raises")
    with pytest.raises(
        RuntimeError, match=r"(?s)math: known-right answer scored 0.5.*stem: error: RuntimeError"
    ):
        self_test(["math", "stem", "half"])
    assert self_test(["half"]) == {"half": "skipped: no sample"}


@pytest.mark.tally("faults")
def test_self_test_reports_the_sandbox_error(monkeypatch):
    # the interpreter cannot start inside the sandbox (what a venv under /tmp used to hit): the
    # message carries the sandbox's own error, not only "known-right answer scored 0.0"
    sandbox.backend(), rootfs.python_paths()  # detected with the real interpreter first
    monkeypatch.setattr(sandbox.sys, "executable", "/nonexistent/bin/python3")
    with pytest.raises(
        RuntimeError, match=r"code: error: SandboxError: .*/nonexistent/bin/python3"
    ):
        self_test(["code"])


def test_self_test_shows_a_verifier_s_diagnostics(registered):
    rewards.register("code", "reward_helpers:zero_with_stderr")
    with pytest.raises(
        RuntimeError, match=r"code: known-right answer scored 0.0 \(stderr: Traceback: boom\)"
    ):
        self_test(["code"])


def test_identical_items_are_verified_once(registered, pool, tmp_path):
    rewards.register("count", "reward_helpers:counting")
    log = str(tmp_path / "calls.txt")
    responses = ["yes", "no", "yes", "yes", "maybe", "no", "yes"]
    truth = {"log": log}
    res = pool.score_batch(
        ["count"] * 7, responses, [truth] * 7, [None, None, None, {"k": 1}, None, None, None]
    )
    assert res.scores == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    with open(log) as f:
        calls = sorted(f.read().split())
    # "yes" with extra None, "yes" with extra {"k": 1}, "no", "maybe": four distinct items
    assert calls == ["maybe", "no", "yes", "yes"]
    assert len(res.extras) == 7 and res.extras[0] is not res.extras[2]


# -- workers that fail to start; directories of killed runs ----------------------------------------

_DIE_AT_START = """
import os
path = os.environ.get("PRORL_TEST_DIE_AT_START")
if path and os.path.exists(path):
    left = int(open(path).read() or 0)
    if left > 0:
        open(path, "w").write(str(left - 1))
        os._exit(9)
"""


@pytest.fixture
def die_at_start(tmp_path, monkeypatch):
    """A file holding how many reward workers still to start will die during start-up (a
    sitecustomize on the workers' PYTHONPATH reads it)."""
    (tmp_path / "sitecustomize.py").write_text(_DIE_AT_START)
    counter = tmp_path / "deaths"
    counter.write_text("0")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PRORL_TEST_DIE_AT_START", str(counter))
    return counter


@pytest.mark.tally("faults")
def test_worker_dying_while_its_replacement_starts_is_retried(registered, die_at_start):
    with RewardPool(num_workers=1, timeout_s=5, preload=()) as p:
        assert p.score_batch(["half"], [""], [None]).scores == [0.5]
        # the next replacements die, but not too often
        die_at_start.write_text(str(MAX_START_FAILURES - 1))
        res = p.score_batch(["crash", "half", "half"], ["", "", "x"], [None] * 3)
        assert res.errored == [True, False, False] and res.scores == [0.0, 0.5, 0.5]
        assert die_at_start.read_text() == "0" and p.replaced == MAX_START_FAILURES


@pytest.mark.tally("faults")
def test_workers_that_keep_dying_at_start_give_a_clear_error(registered, die_at_start):
    die_at_start.write_text("100")
    with RewardPool(num_workers=1, timeout_s=5, preload=()) as p:
        with pytest.raises(
            RuntimeError, match=rf"failed to start {MAX_START_FAILURES} times in a row.*exit code 9"
        ):
            p.score_batch(["half"], [""], [None])
    assert int(die_at_start.read_text()) == 100 - MAX_START_FAILURES


_RUN = (
    "import json, time\n"
    "from prorl.rewards.pool import RewardPool\n"
    "p = RewardPool(num_workers=2, preload=())\n"
    "print(json.dumps([[w.proc.pid, w.tmpdir] for w in p.workers]), flush=True)\n"
    "time.sleep(120)\n"
)


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.tally("faults")
def test_dirs_of_killed_runs_are_removed_at_start_and_live_ones_kept(
    registered, tmp_path, monkeypatch
):
    # this test's pools and runs keep to tmp_path
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _RUN], stdout=subprocess.PIPE, env=env, start_new_session=True
        )
        for _ in range(2)
    ]
    killed, alive = runs
    try:
        (killed_workers, alive_workers) = [json.loads(r.stdout.readline()) for r in runs]
        # the run and its workers (each in a process group of its own), as the OOM killer or
        # scancel would
        for pgid in [killed.pid] + [pid for pid, _ in killed_workers]:
            os.killpg(pgid, signal.SIGKILL)
        killed.wait()
        assert _wait(lambda: all(_gone(pid) for pid, _ in killed_workers))
        assert all(os.path.isdir(d) for _, d in killed_workers)  # left behind

        with RewardPool(num_workers=1, timeout_s=5, preload=()) as p:
            assert [os.path.exists(d) for _, d in killed_workers] == [False, False]
            # another live run's
            assert [os.path.isdir(d) for _, d in alive_workers] == [True, True]
            assert p.score_batch(["half"], [""], [None]).scores == [0.5]

        # the trainer alone is killed: its workers see their pool vanish and remove their own
        # directories
        alive.kill()
        alive.wait()
        assert _wait(lambda: not any(os.path.exists(d) for _, d in alive_workers))
    finally:
        for r in runs:
            if r.poll() is None:
                os.killpg(r.pid, signal.SIGKILL)
            r.wait()
            r.stdout.close()
