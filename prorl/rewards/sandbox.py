"""Run untrusted Python (model-written code) in an OS-level sandbox, with a hard wall-clock limit.

Backends, picked once per process (override with PRORL_SANDBOX=unshare|bwrap|none):

`unshare` (as root, the default there): util-linux `unshare` gives new mount, PID, network, IPC and
    UTS namespaces; a short sh script, still root inside, mounts private tmpfs over /tmp, /var/tmp and
    /dev/shm (so nothing written survives), a tmpfs over the home directory and over any directory that
    hides the Python installation from other users (then binds the installation back read-only), and
    `setpriv` drops to an unprivileged uid of its own (1e9 + the pid of the scoring process, so
    concurrent sandboxes never share a process count) with no capabilities and no_new_privs before
    exec'ing Python. As non-root it adds a user namespace (`--user --map-root-user`) and cannot change uid.
`bwrap` (non-root with bubblewrap installed, the default there): all namespaces, the host's / bound
    read-only, the home directory hidden, private tmpfs /tmp, `--die-with-parent`, `--new-session`.
`none` (neither works; a warning is logged): no namespaces — only what follows.

Always: a new session / process group; the environment emptied (PATH only); a private working
directory; rlimits on CPU seconds, address space, file size, open files, processes (per uid), core
dumps; stdout/stderr go to size-limited files, not pipes; on the wall-clock limit the whole process
group is SIGKILLed, and with a PID namespace every process in it dies with it; the sandbox is also
SIGKILLed if the process that started it dies (PR_SET_PDEATHSIG, `--kill-child`, `--die-with-parent`).

What it protects against (tested in tests/rewards/test_sandbox.py on the backends a machine has):
infinite loops, fork bombs, memory bombs, filling the disk, writing outside the working directory,
network access, reading the parent's environment (secrets), killing the parent process, and
background processes that try to outlive the run.
What it does NOT: kernel exploits (no seccomp filter; a container or VM is the answer for hostile
code); reading world-readable files of the host (the system is visible, read-only); with `bwrap` run
as root or with `unshare` as non-root, RLIMIT_NPROC counts all processes of the same uid (bwrap as root
does not enforce it at all, which is why root defaults to `unshare`); with `none`, network access,
daemons that leave the process group (as root they are found and killed by uid), and writes to
world-writable directories. CPU time is limited per process, not in total (the wall clock is the
total limit).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

BACKENDS = ("unshare", "bwrap", "none")
UID_BASE = 1_000_000_000
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0  # whole run, start-up included
    cpu_s: int = 6  # per process
    memory_bytes: int = 1 << 30  # address space per process
    file_bytes: int = 32 << 20  # largest file a process may write
    tmpfs_bytes: int = 64 << 20  # all files written together (namespace backends)
    nproc: int = 64  # processes + threads of the sandbox uid
    nofile: int = 256
    output_bytes: int = 16 << 20  # stdout / stderr read back at most


@dataclass
class Result:
    returncode: int | None  # None when killed on the wall clock
    stdout: bytes
    stderr: bytes
    timed_out: bool
    wall_s: float
    backend: str


# -- backend detection -------------------------------------------------------------------------------


def _probe(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def backend() -> str:
    """The sandbox backend of this process (cached): PRORL_SANDBOX, else the strongest that works."""
    forced = os.environ.get("PRORL_SANDBOX", "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"PRORL_SANDBOX must be one of {BACKENDS}, got {forced!r}")
        return forced
    root = os.geteuid() == 0
    unshare, bwrap = shutil.which("unshare"), shutil.which("bwrap")
    if root and unshare and shutil.which("setpriv") and _probe([unshare, *_unshare_flags(), "true"]):
        return "unshare"
    if bwrap and _probe([bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]):
        return "bwrap"
    if unshare and _probe([unshare, *_unshare_flags(), "true"]):
        return "unshare"
    log.warning(
        "code sandbox: no namespaces available (neither `unshare` nor bubblewrap works here); untrusted "
        "code runs with rlimits, a private directory and a process-group kill only. Install bubblewrap "
        "or allow user namespaces for network/filesystem isolation."
    )
    return "none"


def _unshare_flags() -> list[str]:
    flags = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--mount-proc", "--kill-child"]
    flags += ["--propagation", "private"]
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]
    return flags


# -- the Python installation and what hides it ----------------------------------------------------------


def _python_dirs() -> list[str]:
    """Directories the interpreter needs (prefix, base prefix, the real executable's installation)."""
    exe_root = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, exe_root)}
    # drop directories inside another listed one
    return sorted(d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs))


def _blocking_dir(path: str) -> str | None:
    """The top-most directory on `path` that other users cannot traverse, or None."""
    parts = path.strip(os.sep).split(os.sep)
    for i in range(1, len(parts) + 1):
        d = os.sep + os.sep.join(parts[:i])
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return d
        except OSError:
            return None
    return None


def _hidden_dirs(drop_uid: bool) -> list[str]:
    """Directories to cover with an empty tmpfs: the home directory, and (when dropping to another
    uid) the directories that would otherwise hide the Python installation from it."""
    hidden = set()
    home = os.path.expanduser("~")
    if home not in ("/", "") and os.path.isdir(home):
        hidden.add(os.path.realpath(home))
    if drop_uid:
        for d in _python_dirs():
            b = _blocking_dir(d)
            if b:
                hidden.add(b)
    return sorted(hidden)


# -- running -----------------------------------------------------------------------------------------------


def _preexec(limits: Limits, uid: int | None, pdeathsig: bool):
    def fn():
        if uid is not None:  # only on the `none` backend: drop to the sandbox uid here
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if pdeathsig:  # after any uid change, which would clear it
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        for res, value in (
            (resource.RLIMIT_CPU, limits.cpu_s),
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.file_bytes),
            (resource.RLIMIT_NPROC, limits.nproc),
            (resource.RLIMIT_NOFILE, limits.nofile),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(res, (value, value))

    return fn


def _unshare_command(
    code_dir: str, script: str, args: list[str], limits: Limits, uid: int | None
) -> list[str]:
    """The sh script that sets up mounts inside the new namespaces, then drops privileges and runs."""
    q = shlex.quote
    hold = "/var/tmp" if os.path.isdir("/var/tmp") else "/mnt"
    sh = ["set -e"]
    sh.append(f"mount -t tmpfs -o size=4m,mode=755,nosuid,nodev tmpfs {hold}")
    sh.append(f"mkdir {hold}/code && mount --bind -o ro {q(code_dir)} {hold}/code")
    pydirs = _python_dirs()
    hidden = _hidden_dirs(drop_uid=uid is not None)
    keep = [d for d in pydirs if any(d == h or d.startswith(h + os.sep) for h in hidden)]
    for i, d in enumerate(keep):
        sh.append(f"mkdir {hold}/py{i} && mount --bind -o ro {q(d)} {hold}/py{i}")
    for h in hidden:
        sh.append(f"mount -t tmpfs -o size=1m,mode=755,nosuid,nodev tmpfs {q(h)}")
    for i, d in enumerate(keep):
        sh.append(f"mkdir -p {q(d)} && mount --move {hold}/py{i} {q(d)}")
    sh.append(f"mount -t tmpfs -o size={limits.tmpfs_bytes},mode=1777,nosuid,nodev tmpfs /tmp")
    if os.path.isdir("/dev/shm"):
        sh.append("mount -t tmpfs -o size=1m,mode=755,nosuid,nodev tmpfs /dev/shm")
    sh.append("mkdir /tmp/work")
    run = [sys.executable, "-I", f"{hold}/code/{script}", f"{hold}/code", *args]
    env = ["env", "-i", f"PATH={SAFE_PATH}", "HOME=/tmp/work", "LANG=C.UTF-8"]
    if uid is not None:
        sh.append(f"chown {uid}:{uid} /tmp/work && cd /tmp/work")
        drop = [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ]
        # not exec: sh stays the namespace's init (pid 1) and keeps the parent-death signal that
        # `--kill-child` gave it, which a uid change would clear; when it dies, the kernel kills every
        # process in the namespace
        sh.append(" ".join(q(a) for a in [*env, *drop, *run]))
    else:
        sh.append("cd /tmp/work && exec " + " ".join(q(a) for a in [*env, *run]))
    return [shutil.which("unshare") or "unshare", *_unshare_flags(), "sh", "-c", "\n".join(sh)]


def _bwrap_command(code_dir: str, script: str, args: list[str], limits: Limits) -> list[str]:
    cmd = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    cmd += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for h in _hidden_dirs(drop_uid=False):
        cmd += ["--tmpfs", h]
    for d in _python_dirs():  # re-expose the installation if a hidden directory covered it
        cmd += ["--ro-bind", d, d]
    cmd += [
        "--size",
        str(limits.tmpfs_bytes),
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/var/tmp",
        "--tmpfs",
        "/dev/shm",
    ]
    cmd += ["--ro-bind", code_dir, "/var/tmp/code", "--dir", "/tmp/work", "--chdir", "/tmp/work"]
    cmd += ["--clearenv", "--setenv", "PATH", SAFE_PATH, "--setenv", "HOME", "/tmp/work"]
    cmd += ["--setenv", "LANG", "C.UTF-8"]
    return [*cmd, "--", sys.executable, "-I", f"/var/tmp/code/{script}", "/var/tmp/code", *args]


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (the `none` backend as root: catches daemons that left the group)."""
    for _ in range(3):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except OSError:
                pass
        if not found:
            return
        time.sleep(0.01)


def _read(path: str, limit: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit)


def run_python(
    files: dict[str, str | bytes],
    script: str,
    args: list[str] | None = None,
    limits: Limits | None = None,
    backend_name: str | None = None,
) -> Result:
    """Write `files` into a fresh private directory and run `python -I <dir>/<script> <dir> *args` there,
    sandboxed. The script sees that directory read-only at the path it gets as argv[1]; its working
    directory is a private, writable, size-limited one. Never raises for what the code does."""
    limits = limits or Limits()
    args = list(args or [])
    name = backend_name or backend()
    root = os.geteuid() == 0
    uid = UID_BASE + os.getpid() if root else None
    outer = tempfile.mkdtemp(prefix="prorl-sbx-")
    try:
        os.chmod(outer, 0o711)
        code_dir = os.path.join(outer, "code")
        os.mkdir(code_dir, 0o755)
        for fname, content in files.items():
            path = os.path.join(code_dir, fname)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
            os.chmod(path, 0o644)
        os.chmod(code_dir, 0o755)
        drop_in_preexec = None
        if name == "unshare":
            argv = _unshare_command(code_dir, script, args, limits, uid)
        elif name == "bwrap":
            argv = _bwrap_command(code_dir, script, args, limits)
        else:
            work = os.path.join(outer, "work")
            os.mkdir(work, 0o700)
            if root:
                if _blocking_dir(sys.executable) is None:
                    os.chown(work, uid, uid)
                    drop_in_preexec = uid
                else:
                    log.warning(
                        "code sandbox `none`: the interpreter is hidden from other users, so the "
                        "code runs as root"
                    )
            argv = [sys.executable, "-I", os.path.join(code_dir, script), code_dir, *args]
        out_path, err_path = os.path.join(outer, "stdout"), os.path.join(outer, "stderr")
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=os.path.join(outer, "work") if name == "none" else outer,
                env={"PATH": SAFE_PATH + ":/usr/sbin:/sbin"},
                start_new_session=True,
                close_fds=True,
                preexec_fn=_preexec(limits, drop_in_preexec, pdeathsig=True),
            )
            timed_out = False
            try:
                returncode = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                if drop_in_preexec is not None:
                    _kill_uid(drop_in_preexec)
        wall = time.monotonic() - start
        return Result(
            returncode,
            _read(out_path, limits.output_bytes),
            _read(err_path, limits.output_bytes),
            timed_out,
            wall,
            name,
        )
    finally:
        shutil.rmtree(outer, ignore_errors=True)
