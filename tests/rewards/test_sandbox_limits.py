"""Limits of a sandbox run as a whole (cgroups): many processes or threads must not add up to more
than the run's memory or CPU. Measured independently of the mechanism: memory by the Pss of the
run's processes as seen from the host, CPU by the process's own CPU time per wall-clock time. Where
this machine cannot give a run a cgroup the tests skip, naming why; the v2 file layout is also
checked against a fake cgroup tree (this machine may only have v1)."""

import os
import threading
import time
import uuid

import pytest
from sandbox_helpers import ISOLATING, need_cgroup, processes_with, run

from prorl.rewards import sandbox
from prorl.rewards.sandbox import cgroups

ALL = (*ISOLATING, "none")
MIB = 1 << 20

# 16 processes each touching 64 MiB, then holding it; reports how many held it at once
_MANY_PROCESSES = """
import os, sys, time
kids = []
for _ in range(16):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            b = bytearray(64 << 20)
            for j in range(0, len(b), 4096):
                b[j] = 1
            os.write(w, b'1')
        except MemoryError:
            os.write(w, b'0')
        time.sleep(60)
        os._exit(0)
    os.close(w)
    kids.append((pid, r))
held = [os.read(r, 1) == b'1' for _, r in kids]
time.sleep(0.3)
alive = [os.waitpid(pid, os.WNOHANG) == (0, 0) for pid, _ in kids]
print(sum(h and a for h, a in zip(held, alive)), flush=True)
"""


def _pss_bytes(pids):
    """Anonymous + shared-memory Pss of `pids` (file pages such as libpython are the host's page
    cache)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                fields = dict(line.split()[:2] for line in f if line.startswith("Pss_"))
            total += (int(fields.get("Pss_Anon:", 0)) + int(fields.get("Pss_Shmem:", 0))) * 1024
        except (OSError, ValueError):
            pass
    return total


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_many_processes_share_one_memory_limit(backend):
    need_cgroup("memory")
    marker = f"prorl-mem-{uuid.uuid4().hex}"
    # 16 × 64 MiB = 1 GiB wanted; RLIMIT_AS alone (per process) would allow it all
    limit = 256 * MIB
    peak, done = [0], threading.Event()

    def watch():  # the run's memory as the host sees it
        while not done.is_set():
            peak[0] = max(peak[0], _pss_bytes(processes_with(marker)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        res = run(
            _MANY_PROCESSES, backend, sandbox.Limits(wall_s=6.0, memory_bytes=limit), args=[marker]
        )
    finally:
        done.set()
        watcher.join()
    held_together = int(res.stdout.split()[0]) if res.stdout.strip() else 0
    assert held_together * 64 * MIB <= limit, res.stdout
    assert 0 < peak[0] <= limit * 1.1, f"peak {peak[0] / MIB:.0f} MiB"
    assert "memory" in res.cgroup and res.oom_kills > 0
    assert processes_with(marker) == []


# as many spinning threads as the limits allow (up to 200) for 1.5 s; prints CPU seconds per second
_MANY_THREADS = """
import threading, time
stop = time.monotonic() + 1.5
def spin():
    while time.monotonic() < stop:
        pass
started = 0
c0, w0 = time.process_time(), time.monotonic()
for _ in range(200):
    try:
        threading.Thread(target=spin, daemon=True).start()
        started += 1
    except RuntimeError:
        break
spin()
print(started, round((time.process_time() - c0) / (time.monotonic() - w0), 3))
"""


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_many_threads_share_one_cpu_limit(backend):
    need_cgroup("cpu")
    res = run(_MANY_THREADS, backend, sandbox.Limits(wall_s=6.0, cpu_cores=0.25))
    assert res.returncode == 0, res.stderr
    started, cores = res.stdout.split()
    assert int(started) >= 4
    # a quarter core, however many threads
    assert float(cores) <= 0.25 * 1.25 + 0.05, f"{cores} cores"


def _fake_tree(tmp_path, enabled="memory pids cpu"):
    """A cgroup v2 layout: this process in /user.slice/session.scope, sandboxes to go in
    /user.slice."""
    root = tmp_path / "cg"
    scope = root / "user.slice" / "session.scope"
    scope.mkdir(parents=True)
    for d in (root, root / "user.slice", scope):
        (d / "cgroup.procs").write_text("")
    (root / "cgroup.subtree_control").write_text("memory pids cpu io\n")
    (root / "user.slice" / "cgroup.subtree_control").write_text(enabled + "\n")
    mountinfo = (
        f"30 23 0:26 / {root} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
    )
    return root, "0::/user.slice/session.scope\n", mountinfo


def test_v2_layout_limits_go_next_to_the_own_cgroup(tmp_path):
    root, proc_cgroup, mountinfo = _fake_tree(tmp_path)
    setup = cgroups.find(proc_cgroup, mountinfo)
    parent = str(root / "user.slice")
    assert (
        setup.parents == {c: ("v2", parent) for c in ("memory", "pids", "cpu")}
        and setup.missing == ()
    )
    cg = cgroups.Cgroup(setup, memory_bytes=256 * MIB, pids=66, cpu_cores=0.5)
    (d,) = cg.dirs.values()
    assert os.path.dirname(d) == parent and os.path.basename(d).startswith(
        f"prorl-sbx-{os.getpid()}-"
    )
    read = {f: open(os.path.join(d, f)).read() for f in ("memory.max", "pids.max", "cpu.max")}
    assert read == {"memory.max": str(256 * MIB), "pids.max": "66", "cpu.max": "50000 100000"}


def test_v2_layout_without_controllers_says_why(tmp_path):
    root, proc_cgroup, mountinfo = _fake_tree(tmp_path, enabled="io")
    setup = cgroups.find(proc_cgroup, mountinfo)
    assert setup.parents == {} and setup.missing == ("memory", "pids", "cpu")
    assert (
        f"{root}/user.slice/cgroup.subtree_control enables none of memory, pids, cpu"
        in setup.reason
    )


def test_hybrid_layout_takes_v1_controllers(tmp_path):
    # v2 mounted without controllers (they are bound to v1 hierarchies), as on this project's CI VMs
    v1 = {c: tmp_path / c for c in ("memory", "pids", "cpu")}
    for d in v1.values():
        (d / "job").mkdir(parents=True)
        (d / "job" / "cgroup.procs").write_text("")
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.subtree_control").write_text("")
    proc_cgroup = "4:memory:/job\n8:pids:/job\n1:cpu:/job\n0::/\n"
    lines = [
        f"{30 + i} 23 0:{40 + i} / {d} rw - cgroup cgroup rw,{c}"
        for i, (c, d) in enumerate(v1.items())
    ]
    mountinfo = "\n".join(lines) + "\n"
    mountinfo += f"41 23 0:38 / {tmp_path / 'unified'} rw,relatime - cgroup2 cgroup2 rw\n"
    setup = cgroups.find(proc_cgroup, mountinfo)
    assert setup.parents == {c: ("v1", str(d / "job")) for c, d in v1.items()}
    cg = cgroups.Cgroup(setup, memory_bytes=64 * MIB, pids=10, cpu_cores=2.0)
    files = {c: os.listdir(cg.dirs["v1", str(d / "job")]) for c, d in v1.items()}
    assert "memory.limit_in_bytes" in files["memory"] and "pids.max" in files["pids"]
    assert (
        open(os.path.join(cg.dirs["v1", str(v1["cpu"] / "job")], "cpu.cfs_quota_us")).read()
        == "200000"
    )


def test_cgroups_of_dead_starters_are_removed():
    setup = cgroups.setup()
    if not setup.parents:
        pytest.skip(f"no cgroup for sandboxes here: {setup.reason}")
    # the largest pid: not running (checked)
    dead = int(open("/proc/sys/kernel/pid_max").read()) - 1
    with pytest.raises(ProcessLookupError):
        os.kill(dead, 0)
    parents = {parent for _, parent in setup.parents.values()}
    stale = [os.path.join(parent, f"prorl-sbx-{dead}-0") for parent in parents]
    for d in stale:
        os.mkdir(d)
    try:
        assert run("print('ok')", sandbox.backend()).returncode == 0
        assert [d for d in stale if os.path.exists(d)] == []
    finally:
        for d in stale:
            if os.path.isdir(d):
                os.rmdir(d)
