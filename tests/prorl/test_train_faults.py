"""Faults around `prorl/train.py` that must end with a clear message and nothing corrupted (issue 8): an
unusable output directory (not writable, too little disk, in use by another run), Ctrl-C without
torchrun, and torchrun itself killed (its workers must not train on unseen)."""

import contextlib
import os
import signal

import pytest
from train_helpers import TINY, complete_steps, launch, process_tree, run, train_command, wait_for, wait_gone

LONG = [*TINY, "trainer.total_steps=200"]  # never reached: every test here stops the run early
# train.py with a disk that has 1 KiB free (shutil.disk_usage replaced before prorl is imported)
DISK_FULL = (
    "import collections, shutil, sys; "
    "usage = collections.namedtuple('usage', 'total used free'); "
    "shutil.disk_usage = lambda path: usage(2**40, 2**40, 1024); "
    "from prorl.train import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize("case", ["file_in_the_way", "read_only", "disk_full"])
def test_unusable_output_dir_fails_before_training(tmp_path, case):
    expected = "is not writable"
    if case == "disk_full":
        out, expected = tmp_path / "run", "not enough free disk space"
    elif case == "file_in_the_way":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "run"  # a regular file where a directory must be made
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        (tmp_path / "ro").mkdir(mode=0o555)
        out = tmp_path / "ro" / "run"
    cmd = train_command(out, [], nproc=None)
    if case == "disk_full":
        cmd[1:2] = ["-c", DISK_FULL]  # instead of prorl/train.py
    proc = run(cmd, timeout=120)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert expected in proc.stderr and str(out) in proc.stderr, proc.stderr[-3000:]
    assert "held-out accuracy before RL" not in proc.stdout  # no validation, no step
    if case != "disk_full":
        assert "reward self-test" not in proc.stdout  # nothing was loaded or started


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_and_a_second_run_on_the_dir_is_refused(tmp_path):
    """One process, no torchrun: a terminal's Ctrl-C reaches its whole process group, reward workers
    included; the step still finishes with its verifiers, is saved, and the process exits 0."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(train_command(out, LONG, nproc=None), log)
    assert wait_for(lambda: complete_steps(out / "checkpoints"), proc), log.read_text()[-3000:]

    second = run(train_command(out, LONG, nproc=None), timeout=300)
    assert second.returncode == 5, second.stderr[-3000:]
    assert f"{out} is in use by another run (pid {proc.pid} " in second.stderr, second.stderr[-3000:]

    tree = process_tree(proc.pid)
    assert len(tree) >= 2, tree  # the trainer and its reward worker
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    stopped = [line for line in text.splitlines() if line.startswith("prorl: stopped by SIGINT after step")]
    assert stopped and "Traceback" not in text, text[-3000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert complete_steps(out / "checkpoints")[-1] == step
    assert not wait_gone(tree, timeout=10), "a reward worker is left behind"


@pytest.mark.slow
def test_workers_of_a_killed_torchrun_stop_after_their_step(tmp_path):
    """`kill -9` of torchrun alone: its workers live in sessions of their own and would train on, unseen;
    they notice the lost parent after the step, save it and exit."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(train_command(out, LONG), log)
    assert wait_for(lambda: complete_steps(out / "checkpoints"), proc), log.read_text()[-3000:]
    tree = process_tree(proc.pid)
    proc.kill()
    proc.wait()
    assert not wait_gone(tree, timeout=60), "workers still running a minute after torchrun died"
    text = log.read_text()
    stopped = [line for line in text.splitlines() if line.startswith("prorl: stopped by the loss of torch")]
    assert stopped, text[-3000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert complete_steps(out / "checkpoints")[-1] == step


def _rank_worker(tree, rank: int) -> int:
    """The pid of torchrun's worker for `rank` (its environment says RANK=rank)."""
    for pid in tree:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (
            b"prorl/train.py" in cmd
            and f"RANK={rank}".encode() in env
            and b"-m\0torch.distributed.run" not in cmd
        ):
            return pid
    raise AssertionError(f"no worker for rank {rank} in {tree}")


@pytest.mark.slow
def test_a_frozen_rank_is_named_and_ends_the_run_cleanly(tmp_path):
    """SIGSTOP of one rank's trainer: the other says what it waits for (trainer.wait_warning_s), then ends
    with exit code 7 and a plain message once its collective times out (trainer.collective_timeout_s), the
    last complete checkpoint untouched - instead of waiting silently for 600 s and dying in a traceback."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    overrides = [*LONG, "trainer.collective_timeout_s=20", "trainer.wait_warning_s=4"]
    proc = launch(train_command(out, overrides), log)
    assert wait_for(lambda: complete_steps(out / "checkpoints"), proc), log.read_text()[-3000:]
    frozen = _rank_worker(process_tree(proc.pid), 1)
    os.kill(frozen, signal.SIGSTOP)
    saved = complete_steps(out / "checkpoints")
    try:
        proc.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # torchrun has killed it (a stopped process dies)
            os.kill(frozen, signal.SIGCONT)
    text = log.read_text()
    assert "prorl: rank 0 has waited" in text and "for the other ranks (" in text, text[-3000:]
    assert "prorl: rank 0: the other ranks stopped answering" in text, text[-3000:]
    assert "exitcode: 7" in text or proc.returncode != 0, text[-3000:]
    assert complete_steps(out / "checkpoints")[: len(saved)] == saved
