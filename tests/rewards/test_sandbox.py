"""Adversarial suite for the code sandbox's isolation, on every backend this machine has.

Each attack must be contained: the run ends within its wall-clock limit, the code sees no host file
outside the minimal root, nothing it wrote is left on the host, no process it started survives, and
this (the scoring) process is unharmed. On the `none` backend (no namespaces) only the protections
it claims are tested. Limits of the run as a whole (cgroups) are in test_sandbox_limits.py,
interpreter locations in test_sandbox_python.py. A backend the machine lacks is skipped, naming what
is missing.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from sandbox_helpers import ISOLATING, ROOT, need, planted_dirs, processes_with, run, why_not

from prorl.rewards import sandbox
from prorl.rewards.sandbox import cgroups, rootfs, tempdirs

ALL = (*ISOLATING, "none")


def test_default_backend_is_detected():
    assert sandbox.backend() in sandbox.BACKENDS
    if ROOT and sandbox._works("unshare") is None:
        assert sandbox.backend() == "unshare"


@pytest.mark.parametrize("backend", ALL)
def test_runs_and_reads_its_files(backend):
    res = run(
        "import sys, os\nprint(open(os.path.join(sys.argv[1], 'main.py')).read()[:6], sys.argv[2])",
        backend,
        args=["hello"],
    )
    assert res.returncode == 0 and res.stdout.decode().split() == ["import", "hello"], res.stderr
    assert res.backend == backend


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_infinite_loop_is_killed_on_the_wall_clock(backend):
    start = time.monotonic()
    res = run("while True:\n    pass", backend, sandbox.Limits(wall_s=1.0))
    assert res.timed_out and res.returncode is None
    assert time.monotonic() - start < 3


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_memory_bomb_fails_fast(backend):
    res = run("x = bytearray(8 << 30)\nprint('allocated')", backend)
    assert not res.timed_out and res.returncode != 0 and b"allocated" not in res.stdout
    assert b"MemoryError" in res.stderr


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_environment_secrets_are_not_visible(backend, monkeypatch):
    monkeypatch.setenv("PRORL_TEST_SECRET", "s3cret-value")
    res = run("import os\nprint(dict(os.environ))", backend)
    assert res.returncode == 0 and b"s3cret-value" not in res.stdout
    assert set(eval(res.stdout.decode())) <= {"PATH", "HOME", "LANG", "PWD", "LC_CTYPE"}


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_big_file_hits_the_file_size_limit(backend):
    limits = sandbox.Limits(wall_s=5.0, file_bytes=1 << 20)
    res = run(
        "f = open('big', 'wb')\nfor _ in "
        "range(100):\n    f.write(b'x' * (1 << 20))\nprint('wrote')",
        backend,
        limits,
    )
    assert not res.timed_out and b"wrote" not in res.stdout
    assert res.returncode != 0  # SIGXFSZ (or EFBIG)


@pytest.mark.tally("attacks")
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


# -- the host's file system ------------------------------------------------------------------------

_WRITE_EVERYWHERE = """
import json, sys
wrote = {}
for p in sys.argv[2:]:
    try:
        with open(p, 'wb') as f:
            for _ in range(8):  # 8 MiB each: a bounded stand-in for filling the host's disk
                f.write(b'x' * (1 << 20))
        wrote[p] = 'ok'
    except OSError as e:
        wrote[p] = e.strerror
print(json.dumps(wrote))
"""


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_writes_to_world_writable_host_dirs_do_not_persist(backend):
    # /var/lock (= /run/lock, on the root disk here) and any other world-writable host directory
    name = f"evil-{uuid.uuid4().hex}"
    with planted_dirs(mode=0o777) as open_dirs:
        targets = [os.path.join(d, name) for d in open_dirs]
        targets += [
            f"/var/lock/{name}",
            f"/run/lock/{name}",
            f"/run/{name}",
            f"/{name}",
            f"/var/tmp/{name}",
        ]
        targets += [
            f"/dev/shm/{name}",
            f"/tmp/{name}",
            os.path.join(os.path.dirname(__file__), name),
        ]
        try:
            res = run(_WRITE_EVERYWHERE, backend, sandbox.Limits(wall_s=10.0), args=targets)
            assert res.returncode == 0, res.stderr
            assert [p for p in targets if os.path.exists(p)] == [], json.loads(res.stdout)
        finally:
            for p in targets:
                if os.path.isfile(p):
                    os.remove(p)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_only_private_tmpfs_is_writable(backend):
    # every mount the code sees is read-only, except its private tmpfs (and the kernel's /proc,
    # devices)
    code = "print(open('/proc/self/mountinfo').read())"
    res = run(code, backend)
    assert res.returncode == 0, res.stderr
    mounts = []  # (mount point, per-mount options, file system type)
    for line in res.stdout.decode().strip().splitlines():
        left, _, right = line.partition(" - ")
        mounts.append((left.split()[4], left.split()[5].split(","), right.split()[0]))
    kernel_or_private = ("tmpfs", "proc", "devtmpfs", "devpts", "mqueue")
    assert [(p, fs) for p, opts, fs in mounts if "rw" in opts and fs not in kernel_or_private] == []
    assert ("/", ["ro"]) in [(p, opts[:1]) for p, opts, _ in mounts]


_READ_EVERYTHING = """
import json, os, sys
seen = {}
for p in sys.argv[2:]:
    try:
        seen[p] = sorted(os.listdir(p)) if os.path.isdir(p) else open(p).read()[:100]
    except OSError as e:
        seen[p] = None
print(json.dumps(seen))
"""


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_host_files_are_not_readable(backend):
    # a dataset with the expected outputs, and another run's checkpoint, world-readable, outside
    # home
    with planted_dirs() as dirs:
        secrets = []
        for d in dirs:
            data = os.path.join(d, "train.jsonl")
            with open(data, "w") as f:
                f.write(json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]}) + "\n")
            ckpt = os.path.join(d, "other-run", "checkpoints", "step_000100")
            os.makedirs(ckpt)
            with open(os.path.join(ckpt, "model.pt"), "w") as f:
                f.write("weights")
            for p in (d, data, os.path.dirname(ckpt), os.path.join(ckpt, "model.pt")):
                os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)
            secrets += [d, data, os.path.join(ckpt, "model.pt")]
        res = run(_READ_EVERYTHING, backend, args=secrets)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == {p: None for p in secrets}


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_root_holds_only_the_minimal_tree(backend):
    code = (
        "import json, os, sys\nprint(json.dumps({d: sorted(os.listdir(d)) for d in sys.argv[2:]}))"
    )
    res = run(code, backend, args=["/", "/etc", "/var", "/run"])
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    system = {os.path.basename(d) for d in rootfs.SYSTEM_DIRS if os.path.lexists(d)}
    interpreter = {p.split("/")[1] for p in rootfs.python_paths()}
    assert set(seen["/"]) <= system | interpreter | {
        "etc",
        "proc",
        "dev",
        "tmp",
        "var",
        "run",
        "sandbox",
    }
    assert set(seen["/etc"]) <= {os.path.basename(f) for f in rootfs.ETC_FILES}
    assert seen["/var"] == ["tmp"] and seen["/run"] == []


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_cannot_remount_or_unmount(backend):
    # no capability is left to the code (as uid 0 of a user namespace, or bwrap run as root), and a
    # nested user + mount namespace does not unlock the read-only mounts either
    code = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND = 32, 4096
out = []
out.append(libc.mount(None, b'/', None, MS_REMOUNT | MS_BIND, None))
out.append(libc.umount2(b'/sandbox/code', 2))
if libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
    out.append(libc.mount(None, b'/', None, MS_REMOUNT | MS_BIND, None))
    out.append(libc.mount(None, b'/usr', None, MS_REMOUNT | MS_BIND, None))
for p in sys.argv[2:]:
    try:
        open(p, 'w')
        out.append('wrote ' + p)
    except OSError:
        pass
print(out)
"""
    name = f"evil-{uuid.uuid4().hex}"
    targets = [f"/{name}", f"/usr/{name}", f"/sandbox/code/{name}"]
    try:
        res = run(code, backend, args=targets)
        assert res.returncode == 0, res.stderr
        assert eval(res.stdout.decode()) in ([-1, -1], [-1, -1, -1, -1])
        assert [p for p in targets if os.path.exists(p)] == []
    finally:
        for p in targets:
            if os.path.isfile(p):
                os.remove(p)


# -- network, sockets, processes -------------------------------------------------------------------


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_network_is_unreachable(backend):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = (
        "import socket, sys\ntry:\n    "
        "socket.create_connection(('127.0.0.1', int(sys.argv[2])), timeout=1)\n"
        "    print('connected')\nexcept OSError as e:\n    print('blocked', type(e).__name__)"
    )
    try:
        res = run(code, backend, args=[str(port)])
        assert b"blocked" in res.stdout, (res.stdout, res.stderr)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_host_unix_sockets_are_unreachable(backend):
    # a 0666 socket on the host's file system (like /run/docker.sock), and one in the abstract
    # namespace
    code = """
import socket, sys
for address in sys.argv[2:]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    try:
        s.connect(address.replace('@', '\\0', 1))
        print('connected', address)
    except OSError as e:
        print('blocked', e.errno)
"""
    with planted_dirs() as dirs:
        servers, addresses = [], []
        try:
            for d in dirs:
                path = os.path.join(d, "s.sock")
                s = socket.socket(socket.AF_UNIX)
                s.bind(path)
                os.chmod(path, 0o666)
                servers.append(s)
                addresses.append(path)
            s = socket.socket(socket.AF_UNIX)
            s.bind(f"\0prorl-test-{uuid.uuid4().hex}")
            servers.append(s)
            addresses.append("@" + s.getsockname()[1:].decode())
            for s in servers:
                s.listen(1)
                s.settimeout(0.1)
            res = run(code, backend, args=addresses)
            assert res.stdout.decode().split().count("blocked") == len(addresses), (
                res.stdout,
                res.stderr,
            )
            for s in servers:
                with pytest.raises(socket.timeout):
                    s.accept()
        finally:
            for s in servers:
                s.close()


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_cannot_kill_the_parent(backend):
    # the host process whose pid the code knows, then its own parent (killing that may end the run)
    code = (
        "import os, signal, sys\ntry:\n    "
        "os.kill(int(sys.argv[2]), signal.SIGKILL)\nexcept OSError:\n"
        "    print('tried', flush=True)\n"
        "try:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass"
    )
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        res = run(code, backend, args=[str(victim.pid)])
        assert b"tried" in res.stdout, res.stderr
        assert victim.poll() is None  # a host process whose pid the code knew is alive
    finally:
        victim.kill()
        victim.wait()


def _nproc_bounded(backend):
    # RLIMIT_NPROC bites for a non-root uid (not bwrap or `none` run as root); pids.max in any
    # backend
    return "pids" in cgroups.setup().parents or not ROOT or backend == "unshare"


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_fork_bomb_is_bounded_and_cleaned_up(backend):
    need(backend)
    if not _nproc_bounded(backend):
        pytest.skip(f"`{backend}` as root without a pids cgroup has no process limit")
    marker = f"prorl-bomb-{uuid.uuid4().hex}"
    # count how many processes the limit lets it start, then keep bombing until the wall clock
    code = (
        "import os, sys, time\nn = 0\nfor _ in range(1000):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == "
        "0:\n        time.sleep(60)\n        os._exit(0)\n"
        "    n += 1\nprint('forked', n, flush=True)\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        time.sleep(0.01)\n"
    )
    limits = sandbox.Limits(wall_s=2.0, nproc=32)
    res = run(code, backend, limits, args=[marker], files={marker: ""})
    assert res.timed_out
    forked = int(res.stdout.split()[1])
    assert forked < 32
    time.sleep(0.2)
    assert processes_with(marker) == []


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_background_process_does_not_outlive_the_run(backend):
    need(backend)
    if backend == "none" and not cgroups.setup().parents and not ROOT:
        pytest.skip("`none` without a cgroup only kills its process group")
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
    leftover = processes_with(marker)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert leftover == []


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


@pytest.mark.parametrize("backend", ISOLATING)
def test_sandbox_dies_with_the_process_that_started_it(backend, tmp_path):
    # a pool worker killed on its timeout must not leave its sandbox, cgroup or directory behind
    need(backend)
    marker = f"prorl-orphan-{uuid.uuid4().hex}"
    script = (
        "from prorl.rewards import sandbox\n"
        f"sandbox.run_python({{'main.py': 'while True: pass'}}, 'main.py', args=[{marker!r}],\n"
        f"                   limits=sandbox.Limits(wall_s=30), backend_name={backend!r})\n"
    )
    # its private directory goes under tmp_path: the killed starter cannot remove it
    env = dict(os.environ, TMPDIR=str(tmp_path))
    starter = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)

    # not the starter, nor its forks before they exec (ldd, the sandbox's first process)
    def sandboxed():
        return [
            p
            for p in processes_with(marker)
            if p != starter.pid and _cmdline(p) != _cmdline(starter.pid)
        ]

    deadline = time.monotonic() + 60  # generous: CI machines are small and may be busy
    while not sandboxed() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not sandboxed():
        starter.kill()
        pytest.fail(f"the sandbox never started: {starter.communicate()[1].decode()[-3000:]}")
    starter.kill()
    starter.communicate()
    deadline = time.monotonic() + 15
    while sandboxed() and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = {pid: (_cmdline(pid) or b"")[:300] for pid in sandboxed()}
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert leftover == {}
    # a later run here removes the dead starter's cgroup (once the killed processes are reaped), the
    # next start in its TMPDIR its directory
    parents = {parent for _, parent in cgroups.setup().parents.values()}

    def left():
        return [
            n for p in parents for n in os.listdir(p) if n.startswith(f"prorl-sbx-{starter.pid}-")
        ]

    deadline = time.monotonic() + 15
    while left() and time.monotonic() < deadline:
        assert run("pass", backend).returncode == 0
        time.sleep(0.1)
    assert left() == []
    assert [os.path.basename(p) for p in tempdirs.remove_stale("prorl-sbx-", str(tmp_path))] != []
    assert os.listdir(tmp_path) == []


def test_broken_sandbox_raises_naming_what_failed(monkeypatch):
    # e.g. the interpreter is not visible inside (what a venv under /tmp used to hit): a clear error
    backends = [b for b in ALL if why_not(b) is None]
    rootfs.python_paths()  # cached with the real interpreter first
    monkeypatch.setattr(sandbox.sys, "executable", "/nonexistent/bin/python3")
    for backend in backends:
        with pytest.raises(
            sandbox.SandboxError, match=rf"`{backend}`.*(/nonexistent/bin/python3|No such)"
        ):
            run("print(1)", backend)
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("prorl-sbx-")]


def test_private_directories_of_killed_runs_are_removed(tmp_path):
    stale = tmp_path / "prorl-sbx-dead"
    (stale / "code").mkdir(parents=True)
    live, fd = tempdirs.make_locked("prorl-sbx-", str(tmp_path))
    unlocked = tmp_path / "prorl-sbx-unlocked-but-in-use"  # by a run of a version that did not lock
    unlocked.mkdir()
    user = subprocess.Popen(["sleep", "30"], env=dict(os.environ, TMPDIR=str(unlocked)))
    deadline = time.monotonic() + 10  # until exec: before it the child's environment is still ours
    while f"TMPDIR={unlocked}".encode() not in open(f"/proc/{user.pid}/environ", "rb").read():
        assert time.monotonic() < deadline, "the sleep process never showed its TMPDIR"
        time.sleep(0.01)
    try:
        # all too young
        assert tempdirs.remove_stale("prorl-sbx-", str(tmp_path), min_age_s=600) == []
        assert tempdirs.remove_stale("prorl-sbx-", str(tmp_path)) == [str(stale)]
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live), unlocked.name])
    finally:
        os.close(fd)
        user.kill()
        user.wait()
    assert sorted(tempdirs.remove_stale("prorl-sbx-", str(tmp_path))) == sorted(
        [live, str(unlocked)]
    )
