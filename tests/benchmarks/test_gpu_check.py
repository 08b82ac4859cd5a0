"""benchmarks/gpu_check.sh on the CPU: it refuses at once without a GPU, and its runner
(benchmarks/gpu/ check.py) reports each step's outcome, cuts limits to the budget and fails the run
when a step fails. The GPU steps themselves run only on a GPU machine; here their commands are
replaced by small ones."""

import glob
import json
import os
import subprocess
import sys
import time
import types

from benchmarks.gpu import check, plan

ROOT = check.ROOT


def test_without_a_gpu_it_exits_non_zero_at_once_saying_why(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no GPU here" in proc.stderr and "nothing was run" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "out").exists()  # nothing written either


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_steps_report_ok_fail_timeout_and_skips_and_the_run_fails(tmp_path):
    steps = [
        check.Step("fine", 8, _py("print('3 passed')"), "prints"),
        check.Step("broken", 8, _py("import sys; print('boom'); sys.exit(3)"), "exits 3"),
        check.Step(
            "hangs", 1.5, _py("import time; print('waiting', flush=True); time.sleep(60)"), "sleeps"
        ),
        check.Step(
            "absent",
            30,
            _py("raise SystemExit(9)"),
            "never runs",
            skip="flash-attn is not installed",
        ),
        check.Step("late", 50, _py("print('x')"), "over budget"),
    ]
    said = []
    t0 = time.monotonic()
    # a 12 s budget: enough for the short steps (the hang is cut at 1.5 s), not for the 50 s one
    rows = check.run_steps(steps, str(tmp_path), time.monotonic() + 12, said.append)
    assert time.monotonic() - t0 < 12  # the hang was killed at its limit
    got = {r.name: (r.status, r.note) for r in rows}
    assert got["fine"] == ("ok", "3 passed")
    assert got["broken"] == ("FAIL", "exit 3: boom")
    assert got["hangs"][0] == "TIMEOUT" and "2 s limit" in got["hangs"][1]
    assert got["absent"] == ("skipped", "flash-attn is not installed")
    assert got["late"][0] == "skipped" and "left of the budget" in got["late"][1]
    assert (tmp_path / "logs" / "broken.log").read_text() == "boom\n"
    assert "    | boom" in said  # a failed step's log tail is printed
    table = check.summary(rows, steps)
    assert "| broken | FAIL |" in table and "| absent | skipped | 0 | never runs |" in table
    assert table.endswith("1 ok, 1 FAIL, 1 TIMEOUT, 2 skipped; failed: broken, hangs")
    assert check.exit_code(rows) == 1
    assert check.exit_code([r for r in rows if r.name in ("fine", "absent", "late")]) == 0


def test_only_and_skip_select_steps_by_name():
    steps = [check.Step(n, 10, ["true"], n) for n in ("a", "b", "c")]
    chosen = check.select(steps, only="a, c", skip="c")
    assert [s.skip is None for s in chosen] == [True, False, False]
    assert "GPU_CHECK_ONLY" in chosen[1].skip


def test_the_plan_names_files_that_exist_and_says_why_it_skips(tmp_path):
    """Every path a step runs is in the tree (a rename fails here, not on the lent GPU), the
    crash-prone steps come first, and without torchao or the config's wheels the steps that need
    them are skipped."""
    full = {
        "cuda": True,
        "torchao": "0.18.0",
        "omegaconf": "2.4.0",
        "math_verify": "0.9.0",
        "vllm": None,
    }
    steps = plan.plan(sys.executable, full, str(tmp_path))
    names = [s.name for s in steps]
    assert names[:3] == ["async_rl", "preset", "preset_fp8"] == list(plan.NEVER_RUN)
    assert "async-k1" in steps[0].cmd and "--sync-run" not in steps[0].cmd
    for step in steps:
        for arg in step.cmd:
            if arg.startswith(("tests/", "benchmarks/", "prorl/")) and arg.endswith((".py", ".sh")):
                assert os.path.exists(os.path.join(ROOT, arg)) or arg == plan.GPU_RULES, (
                    step.name,
                    arg,
                )
        assert step.skip is None or step.name in ("gpu_rules", "gpu_other"), (step.name, step.skip)
    covered = {a for s in steps for a in s.cmd if a.startswith("tests/gpu/")}
    on_disk = {
        os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests/gpu/test_*.py"))
    }
    assert on_disk <= covered, on_disk - covered  # every GPU test file runs
    bare = plan.plan(
        sys.executable, {"cuda": True, "torchao": None, "torchao_error": "No module"}, str(tmp_path)
    )
    skips = {s.name: s.skip for s in bare}
    assert "torchao is not importable (No module)" in skips["fp8_cuda"] and skips["preset_fp8"]
    assert "omegaconf, math_verify not importable" in skips["preset"] and skips["main_job"]
    assert skips["cuda_paths"] is None
    install = plan.install_steps(sys.executable)
    assert install[0].name == "install" and "--no-index" in install[0].cmd[-1]
    json.dumps([vars(s) for s in steps])  # the plan is plain data


def test_main_runs_install_then_plan_and_writes_the_summary(tmp_path, monkeypatch):
    """The whole runner on a pretend GPU machine: the probe's answer, the install and the plan
    replaced."""
    monkeypatch.setattr(check, "glob", types.SimpleNamespace(glob=lambda pattern: ["/dev/nvidia0"]))
    monkeypatch.setattr(check, "CUDA_PROBE", 'print(\'["pretend", "13.0", true]\')')
    monkeypatch.setattr(
        check, "PROBE", "import json; print(json.dumps({'cuda': True, 'torch': 'pretend'}))"
    )
    monkeypatch.setattr(
        plan, "install_steps", lambda python: [check.Step("install", 10, _py("print(1)"), "i")]
    )
    steps = [
        check.Step("good", 10, _py("print('fine')"), "g"),
        check.Step("bad", 10, _py("exit(4)"), "b"),
    ]
    monkeypatch.setattr(plan, "plan", lambda python, env, results: steps)
    out = tmp_path / "out"
    assert check.main([str(out)]) == 1
    saved = json.loads((out / "gpu_check_summary.json").read_text())
    assert saved["machine"]["torch"] == "pretend"
    assert [(r["name"], r["status"]) for r in saved["rows"]] == [
        ("install", "ok"),
        ("good", "ok"),
        ("bad", "FAIL"),
    ]
    assert saved["stack"].startswith("certified stack: torch pretend")
    md = (out / "gpu_check_summary.md").read_text()
    assert md.startswith("certified stack: torch pretend") and "| bad | FAIL |" in md
    assert "=== summary" in (out / "gpu_check.log").read_text()
    steps.pop()
    assert check.main([str(tmp_path / "again")]) == 0
    failing_install = [check.Step("install", 10, _py("exit(1)"), "i")]
    monkeypatch.setattr(plan, "install_steps", lambda python: failing_install)
    assert check.main([str(tmp_path / "third")]) == 1
    assert not (
        tmp_path / "third" / "logs" / "good.log"
    ).exists()  # nothing runs after a failed install


def test_the_probe_says_why_an_installed_package_does_not_import(tmp_path):
    """A package that is installed but whose compiled part is missing (flash-attn built for another
    CUDA) gets its error in the machine record; one that is not installed gets none."""
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("import flash_attn_2_cuda_missing_part\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, "-c", check.PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["flash_attn"] is None and "flash_attn_2_cuda_missing_part" in out["flash_attn_error"]
    assert out["transformer_engine"] is None and "transformer_engine_error" not in out


class FakeClock:
    """time.monotonic() stand-in: a step "takes" the seconds the test gives it, advanced when the
    runner announces the step's start (its command itself returns at once)."""

    def __init__(self, takes: dict[str, float]):
        self.now, self.takes = 1000.0, takes

    def __call__(self) -> float:
        return self.now

    def say(self, line: str) -> None:
        if line.startswith("=== [") and "] start" in line:
            self.now += self.takes[line[5 : line.index("]")]]


def test_a_step_starts_only_with_its_whole_limit_left(tmp_path):
    """With 60 s left, a step of limit 70 is skipped (not started under a cut limit, where a slow
    pass would read as TIMEOUT), the next one of limit 60 runs, and the run passes."""
    takes = {"first": 90, "cut": 5, "fits": 20, "last": 1}
    clock = FakeClock(takes)
    steps = [
        check.Step("first", 100, _py("pass"), "a"),
        check.Step("cut", 70, _py("pass"), "b"),
        check.Step("fits", 60, _py("pass"), "c"),
        check.Step("last", 41, _py("pass"), "d"),
    ]
    rows = check.run_steps(steps, str(tmp_path), clock.now + 150, clock.say, clock)
    got = {r.name: r.status for r in rows}
    assert got == {"first": "ok", "cut": "skipped", "fits": "ok", "last": "skipped"}
    notes = {r.name: r.note for r in rows}
    assert notes["cut"].startswith("60 s left") and "needs up to 70 s" in notes["cut"]
    assert notes["last"].startswith("40 s left")
    assert [r.seconds for r in rows] == [90, 0, 20, 0]
    assert check.exit_code(rows) == 0


def test_the_never_run_steps_run_even_when_every_step_takes_its_whole_limit(tmp_path):
    """The install and the never-run steps (async RL on CUDA, the preset on NCCL, FP8) fit the
    deadline at their full limits: on the worst clock they still all run, and what follows is
    skipped, not cut."""
    env = {"cuda": True, "torchao": "0.18.0", "omegaconf": "2.4.0", "math_verify": "0.9.0"}
    steps = plan.install_steps(sys.executable) + plan.plan(sys.executable, env, str(tmp_path))
    for step in steps:
        step.cmd = _py("pass")
    clock = FakeClock({s.name: s.limit_s for s in steps})
    rows = check.run_steps(steps, str(tmp_path), clock.now + check.DEADLINE_S, clock.say, clock)
    ran = [r.name for r in rows if r.status == "ok"]
    assert ran[:4] == ["install", *plan.NEVER_RUN]
    assert all(r.status in ("ok", "skipped") for r in rows)
    assert sum(r.seconds for r in rows) <= check.DEADLINE_S


def test_the_summary_names_the_stack_it_certified():
    """The device image's torch without vLLM / TE / flash-attn is said to be that, not the pinned
    `gpu` extra of setup.py (torch 2.13.0, vLLM 0.32.0, TE 2.20.2, flash-attn 2.8.3.post2)."""
    pinned = check.pinned_gpu_stack()
    want = {"torch": "2.13.0", "vllm": "0.32.0", "transformer-engine": "2.20.2"}
    assert pinned == {**want, "flash-attn": "2.8.3.post2"}
    image = {"torch": "2.11.0+cu130", "cuda_version": "13.0", "gpu": "NVIDIA H200", "vllm": None}
    line = check.stack_line(image, pinned)
    assert line.startswith("certified stack: torch 2.11.0+cu130 (CUDA 13.0) on NVIDIA H200")
    assert "vllm absent, transformer-engine absent, flash-attn absent" in line
    assert "not the pinned `gpu` extra: torch 2.13.0, vllm 0.32.0" in line
    full = {"torch": "2.13.0", "cuda_version": "12.9", "vllm": "0.32.0"}
    full.update(transformer_engine="2.20.2", flash_attn="2.8.3.post2")
    line = check.stack_line(full, pinned)
    assert "vllm 0.32.0, transformer-engine 2.20.2" in line and line.endswith("extra exactly")
