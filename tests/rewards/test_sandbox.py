"""Adversarial suite for the code sandbox, on every backend this machine has.

Each attack must be contained: the run ends within its wall-clock limit, nothing it wrote is left on
the host, no process it started survives, and this (the scoring) process is unharmed. On the `none`
backend (no namespaces) only the protections it claims are tested.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from prorl.rewards import sandbox

FAST = sandbox.Limits(wall_s=2.0, cpu_s=3)
ROOT = os.geteuid() == 0


def _available():
    out = []
    if ROOT and sandbox._probe(["unshare", *sandbox._unshare_flags(), "true"]):
        out.append("unshare")
    if sandbox._probe(["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]):
        out.append("bwrap")
    out.append("none")
    return out


BACKENDS = _available()
ISOLATING = [b for b in BACKENDS if b != "none"]
# the fork bomb needs RLIMIT_NPROC to bite: a non-root uid (bwrap run as root keeps uid 0 outside)
NPROC_ENFORCED = [b for b in BACKENDS if b == "unshare" or not ROOT]


def run(code, backend, limits=FAST, args=None):
    return sandbox.run_python({"main.py": code}, "main.py", args=args, limits=limits, backend_name=backend)


def _sandbox_processes(marker):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_default_backend_is_detected():
    assert sandbox.backend() in sandbox.BACKENDS
    if ROOT and "unshare" in BACKENDS:
        assert sandbox.backend() == "unshare"


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_and_reads_its_files(backend):
    res = run(
        "import sys, os\nprint(open(os.path.join(sys.argv[1], 'main.py')).read()[:6], sys.argv[2])",
        backend,
        args=["hello"],
    )
    assert res.returncode == 0 and res.stdout.decode().split() == ["import", "hello"], res.stderr
    assert res.backend == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_loop_is_killed_on_the_wall_clock(backend):
    start = time.monotonic()
    res = run("while True:\n    pass", backend, sandbox.Limits(wall_s=1.0))
    assert res.timed_out and res.returncode is None
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_bomb_fails_fast(backend):
    res = run("x = bytearray(8 << 30)\nprint('allocated')", backend)
    assert not res.timed_out and res.returncode != 0 and b"allocated" not in res.stdout
    assert b"MemoryError" in res.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_environment_secrets_are_not_visible(backend, monkeypatch):
    monkeypatch.setenv("PRORL_TEST_SECRET", "s3cret-value")
    res = run("import os\nprint(dict(os.environ))", backend)
    assert res.returncode == 0 and b"s3cret-value" not in res.stdout
    assert set(eval(res.stdout.decode())) <= {"PATH", "HOME", "LANG", "PWD", "LC_CTYPE"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_big_file_hits_the_file_size_limit(backend):
    limits = sandbox.Limits(wall_s=5.0, file_bytes=1 << 20)
    res = run(
        "f = open('big', 'wb')\nfor _ in range(100):\n    f.write(b'x' * (1 << 20))\nprint('wrote')",
        backend,
        limits,
    )
    assert not res.timed_out and b"wrote" not in res.stdout
    assert res.returncode != 0  # SIGXFSZ (or EFBIG)


@pytest.mark.parametrize("backend", ISOLATING)
def test_filling_the_disk_with_many_files_stays_in_a_small_tmpfs(backend):
    code = (
        "import os\nn = 0\ntry:\n    while True:\n"
        "        open(f'f{n}', 'wb').write(b'x' * (1 << 20)); n += 1\n"
        "except OSError as e:\n    print('full after', n, e.errno)"
    )
    res = run(code, backend, sandbox.Limits(wall_s=5.0, tmpfs_bytes=16 << 20))
    assert res.returncode == 0 and b"full after" in res.stdout, res.stderr
    assert int(res.stdout.split()[2]) <= 16  # bounded by the 16 MiB tmpfs, not the host disk


@pytest.mark.parametrize("backend", ISOLATING)
def test_writes_outside_the_work_dir_do_not_reach_the_host(backend):
    host_dir = tempfile.mkdtemp(prefix="prorl-host-")
    os.chmod(host_dir, 0o777)  # even a world-writable host directory
    name = f"evil-{uuid.uuid4().hex}"
    targets = [
        os.path.join(host_dir, name),
        f"/var/tmp/{name}",
        f"/dev/shm/{name}",
        f"/tmp/{name}",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), name),
    ]
    code = (
        "import sys\nfor p in sys.argv[2:]:\n    try:\n        open(p, 'w').write('x')\n"
        "    except OSError:\n        pass"
    )
    try:
        res = run(code, backend, args=targets)
        assert res.returncode == 0, res.stderr
        assert [p for p in targets if os.path.exists(p)] == []
    finally:
        for p in targets:
            if os.path.exists(p):
                os.remove(p)
        os.rmdir(host_dir)


@pytest.mark.parametrize("backend", ISOLATING)
def test_network_is_unreachable(backend):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = (
        "import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', int(sys.argv[2])), timeout=1)\n"
        "    print('connected')\nexcept OSError as e:\n    print('blocked', type(e).__name__)"
    )
    try:
        res = run(code, backend, args=[str(port)])
        assert b"blocked" in res.stdout, (res.stdout, res.stderr)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@pytest.mark.parametrize("backend", ISOLATING)
def test_cannot_kill_the_parent(backend):
    code = (
        "import os, signal, sys\nfor pid in (int(sys.argv[2]), os.getppid()):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nprint('tried')"
    )
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        res = run(code, backend, args=[str(victim.pid)])
        assert b"tried" in res.stdout, res.stderr
        assert victim.poll() is None  # a host process whose pid the code knew is alive
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize(
    "backend", [b for b in ISOLATING if b in NPROC_ENFORCED] + (["none"] if not ROOT else [])
)
def test_fork_bomb_is_bounded_and_cleaned_up(backend):
    marker = f"prorl-bomb-{uuid.uuid4().hex}"
    # count how many processes the limit lets it start, then keep bombing until the wall clock
    code = (
        "import os, sys, time\nn = 0\nfor _ in range(1000):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
        "    n += 1\nprint('forked', n, flush=True)\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        time.sleep(0.01)\n"
    )
    limits = sandbox.Limits(wall_s=2.0, nproc=32)
    res = sandbox.run_python(
        {"main.py": code, marker: ""}, "main.py", args=[marker], limits=limits, backend_name=backend
    )
    assert res.timed_out
    forked = int(res.stdout.split()[1])
    assert forked < 32
    time.sleep(0.2)
    assert _sandbox_processes(marker) == []


@pytest.mark.parametrize("backend", ISOLATING)
def test_background_process_does_not_outlive_the_run(backend):
    marker = f"prorl-daemon-{uuid.uuid4().hex}"
    code = (
        "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        argv = [sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[2]]\n"
        "        os.execv(sys.executable, argv)\n"
        "    os._exit(0)\nprint('daemonised')"
    )
    res = run(code, backend, args=[marker])
    assert b"daemonised" in res.stdout, res.stderr
    time.sleep(0.2)
    leftover = _sandbox_processes(marker)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert leftover == []


@pytest.mark.skipif("unshare" not in BACKENDS, reason="needs the unshare backend")
def test_sandbox_dies_with_the_process_that_started_it(tmp_path):
    # a pool worker killed on its timeout must not leave its sandbox running
    marker = f"prorl-orphan-{uuid.uuid4().hex}"
    script = (
        "from prorl.rewards import sandbox\n"
        f"sandbox.run_python({{'main.py': 'while True: pass'}}, 'main.py', args=[{marker!r}],\n"
        "                   limits=sandbox.Limits(wall_s=30), backend_name='unshare')\n"
    )
    # its private directory goes under tmp_path: the killed starter cannot remove it
    starter = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, TMPDIR=str(tmp_path)))

    def sandboxed():
        return [p for p in _sandbox_processes(marker) if p != starter.pid]

    deadline = time.monotonic() + 60  # generous: CI machines are small and may be busy
    while not sandboxed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandboxed(), "the sandbox never started"
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 15
    while sandboxed() and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = sandboxed()
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert leftover == []
