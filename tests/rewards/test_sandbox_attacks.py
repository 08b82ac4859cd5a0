"""Attacks on the kernel surface and the machinery around a run (a red team's third round), on every
backend this machine has: keyrings, user namespaces, other syscall ABIs, ptrace, devices, rlimits,
signals, what /proc shows, symlinks in scratch, and memory held in tmpfs plus many processes.

The seccomp filter (`sandbox.seccomp`) applies to every backend, `none` included; what needs
namespaces is tested on the isolating backends only. Each test checks the outcome (the key is not
read back, the host process lives, the host file is intact), not only that a call failed."""

import json
import os
import platform
import subprocess
import sys
import uuid

import pytest
from sandbox_helpers import ISOLATING, need, need_cgroup, planted_dirs, run

from prorl.rewards import sandbox
from prorl.rewards.sandbox import rootfs

ALL = (*ISOLATING, "none")
MIB = 1 << 20
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
NR = {  # x86_64, aarch64 (asm/unistd_64.h, asm-generic/unistd.h)
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "clone": (56, 220),
    "clone3": (435, 435),
    "unshare": (272, 97),
}


def skip_if_code_runs_as_root(backend):
    """`none` run as root keeps the code root when the interpreter is hidden from other users (under
    /root): no protection is claimed there."""
    exe = (sys.executable, os.path.realpath(sys.executable))
    if backend == "none" and os.geteuid() == 0 and any(map(rootfs.hidden_from_others, exe)):
        pytest.skip(
            "`none` as root with an interpreter hidden from other users runs the code as root"
        )


def nr(name):
    machine = platform.machine()
    if machine not in ("x86_64", "aarch64"):
        pytest.skip(f"syscall numbers are written out for x86_64 and aarch64, not {machine}")
    return NR[name][0 if machine == "x86_64" else 1]


# keyrings: @u (-4), @us (-5), @s (-3), and the process / thread keyrings (-2, -1)
_ADD_KEYS = (
    LIBC + "out = dict()\nfor ring in (-4, -5, -3, -2, -1):\n"
    "    k = libc.syscall({add_key}, b'user', b'prorl-attack', b'ANSWER-FROM-RUN-1', 17, ring)\n"
    "    out[ring] = (k, ctypes.get_errno())\nprint(out)\n"
)
_READ_KEYS = (
    LIBC + "buf = ctypes.create_string_buffer(64)\nfound = []\nfor ring in (-4, -5, -3):\n"
    "    k = libc.syscall({keyctl}, 10, ring, b'user', b'prorl-attack', 0)  # KEYCTL_SEARCH\n"
    "    if k > 0 and libc.syscall({keyctl}, 11, k, buf, 64) > 0:  # KEYCTL_READ\n"
    "        found.append(buf.value.decode())\n"
    "k = libc.syscall({request_key}, b'user', b'prorl-attack', None, 0)\n"
    "if k > 0 and libc.syscall({keyctl}, 11, k, buf, "
    "64) > 0:\n    found.append(buf.value.decode())\n"
    "print('found', found)\n"
)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_keyrings_do_not_carry_between_runs(backend):
    # run 1 stores an answer in every keyring it can name, run 2 (same uid: same scorer) looks for
    # it
    calls = {n: nr(n) for n in ("add_key", "keyctl", "request_key")}
    first = run(_ADD_KEYS.format(**calls), backend)
    assert first.returncode == 0, first.stderr
    added = eval(first.stdout.decode())
    assert all(k == -1 for k, _ in added.values()), added
    second = run(_READ_KEYS.format(**calls), backend)
    assert second.returncode == 0, second.stderr
    assert second.stdout.decode().strip() == "found []", second.stdout


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_no_user_namespace_by_unshare_clone_or_the_unshare_tool(backend):
    code = LIBC + (
        "import subprocess, threading\nout = dict()\n"
        "r = subprocess.run(['unshare', '-r', 'id', '-u'], capture_output=True, text=True)\n"
        "out['tool'] = r.stdout.strip() or 'failed'\n"
        "pid = libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD\n"
        "if pid == 0:\n    os._exit(0)\n"
        "out['clone'] = -1 if pid < 0 else 'child'\n"
        "args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17)  # struct clone_args\n"
        "pid = libc.syscall({clone3}, args, 88)\n"
        "if pid == 0:\n    os._exit(0)\n"
        "out['clone3'] = (pid, ctypes.get_errno())\n"
        "t = threading.Thread(target=lambda: "
        "None)\nt.start()\nt.join()  # glibc falls back to clone\n"
        "out['thread'] = 'ok'\n"
        "out['unshare'] = libc.unshare(0x10000000)  # "
        "last: it would move this process\nprint(out)\n"
    ).format(clone=nr("clone"), clone3=nr("clone3"))
    res = run(code, backend)
    assert res.returncode == 0, res.stderr
    out = eval(res.stdout.decode())
    assert out == {
        "unshare": -1,
        "clone": -1,
        "clone3": (-1, 38),
        "tool": "failed",
        "thread": "ok",
    }, out


def _x86_64_only():
    if platform.machine() != "x86_64":
        pytest.skip("the i386 (int 0x80) and x32 syscall ABIs exist on x86_64 only")


# i386 getpid (nr 20) through int 0x80 from a 64-bit process: the numbers of another table
_INT80 = LIBC + (
    "import mmap\nm = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "m.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20; int 0x80; ret\n"
    "addr = ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
    "print('returned', ctypes.CFUNCTYPE(ctypes.c_int)(addr)(), flush=True)\n"
)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("abi", ["i386", "x32"])
@pytest.mark.parametrize("backend", ALL)
def test_other_syscall_abis_are_killed(backend, abi):
    # a filter that checked numbers only would let i386's 286 (add_key there) or x32's through
    _x86_64_only()
    code = (
        _INT80
        if abi == "i386"
        else LIBC + "print('returned', libc.syscall(0x40000000 | 248), flush=True)"
    )
    res = run(code, backend)
    assert b"returned" not in res.stdout and res.returncode != 0, (res.stdout, res.stderr)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_ptrace_and_process_memory_access_are_denied(backend):
    code = LIBC + (
        "import sys, time\npid = os.fork()\nif pid == 0:\n    time.sleep(5)\n    os._exit(0)\n"
        "others = [os.getppid() if a == 'parent' else int(a) for a in sys.argv[2:]]\n"
        "out = []\nfor target in [pid, *others]:\n"
        "    out.append(libc.ptrace(16, target, 0, 0))  # PTRACE_ATTACH\n"
        "    buf = ctypes.create_string_buffer(8)\n"
        "    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)\n"
        "    out.append(libc.process_vm_readv(target, iov, 1, iov, 1, 0))\n"
        "out.append(libc.ptrace(0, 0, 0, 0))  # PTRACE_TRACEME\nos.kill(pid, 9)\nprint(out)\n"
    )
    # its child; where a PID namespace holds it also its parent and init (on `none` those are the
    # scorer and the machine's init, which a broken filter would let a root run stop)
    res = run(code, backend, args=[] if backend == "none" else ["parent", "1"])
    assert res.returncode == 0, res.stderr
    assert eval(res.stdout.decode()) == [-1] * (3 if backend == "none" else 7)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_no_host_devices_and_no_new_ones(backend):
    code = (
        "import json, os\nout = {'dev': sorted(os.listdir('/dev'))}\n"
        "for p in ('/dev/mem', '/dev/kmsg', '/dev/vda', '/dev/sda', '/dev/nvme0n1', '/dev/tty0'):\n"
        "    try:\n        os.close(os.open(p, os.O_RDONLY))\n        out[p] = 'opened'\n"
        "    except OSError:\n        pass\n"
        "try:\n    os.mknod('/tmp/mem', 0o20600, os.makedev(1, 1))\n    out['mknod'] = 'made'\n"
        "    os.close(os.open('/tmp/mem', os.O_RDONLY))\n    out['mknod'] = 'opened'\n"
        "except OSError:\n    pass\nprint(json.dumps(out))\n"
    )
    res = run(code, backend)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    basic = {"null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr", "shm"}
    assert set(out.pop("dev")) <= basic | {"tty", "pts", "ptmx", "core"}  # bwrap adds a pty set
    assert out == {}, out


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_rlimits_cannot_be_raised(backend):
    skip_if_code_runs_as_root(backend)
    limits = sandbox.Limits(wall_s=5.0, nproc=48, nofile=200, file_bytes=8 * MIB)
    code = (
        "import resource\nout = []\n"
        "for r in ('RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_NOFILE', 'RLIMIT_FSIZE', 'RLIMIT_CPU'):\n"
        "    res = getattr(resource, r)\n    soft, hard = resource.getrlimit(res)\n"
        "    try:\n        resource.setrlimit(res, (hard * 2, hard * 2))\n        out.append(r)\n"
        "    except (ValueError, OSError):\n        pass\n"
        "hard = [resource.getrlimit(getattr(resource, "
        "r))[1] for r in ('RLIMIT_NOFILE', 'RLIMIT_FSIZE')]\n"
        "print(out, *hard)\n"
    )
    res = run(code, backend, limits)
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode().split() == ["[]", "200", str(8 * MIB)]


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_signals_do_not_reach_the_scorer(backend):
    # every process the code may signal (-1), a host pid it was told, and the scorer's pid, which a
    # root scorer's sandbox uid (1e9 + pid) gives away. Only where a PID namespace holds the code:
    # on `none` the code may run as the scorer's user, or as root (an interpreter under /root),
    # where kill(-1) kills every process of the machine.
    code = (
        "import os, signal, sys\nprint('signalling', flush=True)\n"
        "for sig in (signal.SIGTERM, signal.SIGKILL):\n"
        "    for target in (-1, int(sys.argv[2]), os.getuid() - 10**9):\n"
        "        try:\n            os.kill(target, "
        "sig)\n        except OSError:\n            pass\n"
        "print('survived')"
    )
    need(backend)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        res = run(code, backend, args=[str(victim.pid)])
        # a process of the scorer's uid whose pid it knew, and this one
        assert victim.poll() is None
        # the code may end its own run (bwrap's `timeout` is not the namespace's init), nothing else
        assert b"signalling" in res.stdout, (res.returncode, res.stderr)
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_symlinks_in_scratch_do_not_reach_host_files(backend):
    # links planted in the working directory, pointing at a host file and directory: the clean-up
    # after the run must not follow them (and the isolating backends must not even resolve them)
    skip_if_code_runs_as_root(backend)
    with planted_dirs() as (d, *_):
        victim = os.path.join(d, "victim")
        with open(victim, "w") as f:
            f.write("intact")
        code = (
            "import os, sys\nfor name, target in (('f', sys.argv[2]), ('d', sys.argv[3])):\n"
            "    os.symlink(target, name)\n"
            "try:\n    open('f', 'w').write('overwritten')\nexcept OSError:\n    pass\n"
            "os.makedirs('deep/er', "
            "exist_ok=True)\nos.symlink(sys.argv[3], 'deep/er/link')\nprint('planted')"
        )
        res = run(code, backend, args=[victim, d])
        assert b"planted" in res.stdout, res.stderr
        assert sorted(os.listdir(d)) == ["victim"]
        with open(victim) as f:
            assert f.read() == "intact"


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_proc_shows_no_mount_script_and_no_host_paths(backend):
    # pid 1 used to be `sh -c <the whole mount script>` and mountinfo named the run's host directory
    code = (
        "import json, os\nout = {'cmdlines': [], "
        "'mountinfo': open('/proc/self/mountinfo').read()}\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n        "
        "out['cmdlines'].append(open(f'/proc/{pid}/cmdline', 'rb').read().decode())\n"
        "    except OSError:\n        pass\nprint(json.dumps(out))\n"
    )
    res = run(code, backend)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    everything = "\n".join(out["cmdlines"]) + out["mountinfo"]
    for secret in ("prorl-sbx-", "pivot_root", "mount ", "--ro-bind", "--tmpfs"):
        assert secret not in everything, secret
    for line in out["mountinfo"].splitlines():  # what each mount shows of its source: nothing new
        root, point = line.split()[3:5]
        assert root in ("/", "/newroot") or point.endswith(root) or point.startswith("/dev/"), line


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_the_scorers_environment_and_arguments_are_not_visible(backend, monkeypatch):
    secret = f"prorl-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("PRORL_TEST_SECRET", secret)
    code = (
        "import os\nseen = b''\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    for f in ('environ', 'cmdline'):\n        try:\n"
        "            seen += open(f'/proc/{pid}/{f}', 'rb').read()\n"
        "        except OSError:\n            pass\n"
        "print(seen.decode(errors='replace'))"
    )
    res = run(code, backend)
    assert res.returncode == 0, res.stderr
    text = res.stdout.decode(errors="replace")
    assert secret not in text and "pytest" not in text and sys.argv[0] not in text


# fills the three private tmpfs (16 MiB files until full), then forks 6 processes that each touch
# `per` MiB and hold it; prints the MiB held in tmpfs and how many processes held their memory
# together
_TMPFS_AND_PROCESSES = """
import os, sys, time
tmp = 0
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    try:
        for n in range(1000):
            with open(f"{d}/fill{n}", "wb") as f:
                for _ in range(16):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    tmp += 1
    except OSError:
        pass
kids = []
for _ in range(6):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            b = bytearray(int(sys.argv[2]) << 20)
            for j in range(0, len(b), 4096):
                b[j] = 1
            os.write(w, b"1")
        except MemoryError:
            os.write(w, b"0")
        time.sleep(60)
        os._exit(0)
    os.close(w)
    kids.append((pid, r))
held = [os.read(r, 1) == b"1" for _, r in kids]
time.sleep(0.3)
alive = [os.waitpid(pid, os.WNOHANG) == (0, 0) for pid, _ in kids]
print(tmp, sum(h and a for h, a in zip(held, alive)), flush=True)
"""


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_tmpfs_and_many_processes_share_one_memory_limit(backend):
    # the cgroup counts tmpfs pages and every process: what the run held at once, by its own count
    # and by the cgroup's peak, stays under the limit (summing processes' RSS over-counts: shared
    # pages)
    need(backend)
    need_cgroup("memory")
    limit, per = 256 * MIB, 64
    limits = sandbox.Limits(wall_s=15.0, memory_bytes=limit, tmpfs_bytes=32 * MIB)
    res = run(_TMPFS_AND_PROCESSES, backend, limits, args=[str(per)])
    assert res.stdout.strip(), res.stderr
    tmp_mib, held = map(int, res.stdout.split())
    assert tmp_mib >= 64  # the tmpfs filled (3 × 32 MiB, less what the limit cut)
    assert (tmp_mib + held * per) * MIB <= limit, res.stdout
    assert res.oom_kills > 0
    assert res.memory_peak_bytes is not None and 0 < res.memory_peak_bytes <= limit


_SOCKETS = (
    "import socket\nout = {}\n"
    "for name in ('AF_INET', 'AF_INET6', 'AF_NETLINK', 'AF_PACKET', 'AF_VSOCK', 'AF_UNIX'):\n"
    "    try:\n"
    "        socket.socket(getattr(socket, name), socket.SOCK_DGRAM).close()\n"
    "        out[name] = 'open'\n"
    "    except OSError as e:\n"
    "        out[name] = e.errno\n"
    "a, b = socket.socketpair()\nout['socketpair'] = 'open'\nprint(out)\n"
)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_no_socket_family_but_unix(backend):
    """Before: AF_VSOCK listened in a port space shared with the host (and, on `none`, AF_INET
    reached the network)."""
    res = run(_SOCKETS, backend)
    assert res.returncode == 0, res.stderr
    got = eval(res.stdout.decode())
    refused = dict.fromkeys(("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_VSOCK"), 97)
    assert got == {**refused, "AF_UNIX": "open", "socketpair": "open"}


_DISK = LIBC + (
    "import errno, mmap\nout = []\n"
    "libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]\n"
    "for fd in (1, os.open('big', os.O_RDWR | os.O_CREAT)):\n"
    "    # FALLOC_FL_KEEP_SIZE, 2 GiB: ext4 did not apply RLIMIT_FSIZE to it\n"
    "    out.append((libc.fallocate(fd, 1, 0, 2**31), ctypes.get_errno()))\n"
    "fd = os.open('sparse', os.O_RDWR | os.O_CREAT)\n"
    "try:\n    os.ftruncate(fd, 2**31)\n    out.append('truncated')\n"
    "except OSError as e:\n    out.append(e.errno)\n"
    "os.ftruncate(fd, 4096)\nm = mmap.mmap(fd, 4096)\nm[:] = b'x' * 4096\nm.close()\n"
    "try:\n    m = mmap.mmap(fd, 2**31)\n    out.append('mapped')\n"
    "except (OSError, ValueError) as e:\n    out.append('refused')\n"
    "n = 0\ntry:\n"
    "    while n < 100000:\n"
    "        with open(f'f{n}', 'wb') as f:\n            f.write(b'y' * 4096)\n"
    "        n += 1\n"
    "except OSError as e:\n    out.append(e.errno)\n"
    "print(out, n)\n"
)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ISOLATING)
def test_disk_use_is_bounded_for_every_way_of_allocating(backend):
    """fallocate on the stdout file the host opened (and on a scratch file) is refused; a 2 GiB
    ftruncate passes RLIMIT_FSIZE (32 MiB) as EFBIG; an mmap cannot write past the file; many
    small files fill the size-limited scratch tmpfs (64 MiB: ENOSPC) and stop there."""
    limits = sandbox.Limits(wall_s=20.0, cpu_s=20)
    res = run(_DISK, backend, limits=limits)
    assert res.returncode == 0, res.stderr
    out, files = res.stdout.decode().rsplit(" ", 1)
    assert eval(out) == [(-1, 95), (-1, 95), 27, "refused", 28], res.stdout  # EFBIG, ENOSPC
    assert int(files) * 4096 <= limits.tmpfs_bytes


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("backend", ALL)
def test_stdout_and_stderr_show_no_host_path(backend):
    """Before: readlink /proc/self/fd/1 gave <TMPDIR>/prorl-sbx-.../stdout."""
    code = "import os\nprint([os.readlink(f'/proc/self/fd/{fd}') for fd in (1, 2)])\n"
    res = run(code, backend)
    assert res.returncode == 0, res.stderr
    assert eval(res.stdout.decode()) == ["/memfd:stdout (deleted)", "/memfd:stderr (deleted)"]
