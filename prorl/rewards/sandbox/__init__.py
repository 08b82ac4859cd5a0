"""Run untrusted Python (model-written code) in an OS-level sandbox, like a contest judge.

A run sees a minimal root (`rootfs`): read-only system directories and the Python installation
(wherever it lives: a venv under /tmp, conda under /opt, a user site), its own files read-only at
/sandbox/code, private size-limited tmpfs scratch (/tmp, /var/tmp, /dev/shm), empty /run and /var;
no other host file, socket or writable directory. Limits apply to the run as a whole through a
cgroup (`cgroups`: memory.max, pids.max, cpu.max; v2, or v1 on older hosts) where this process can
create one, and always per process through rlimits (CPU seconds, address space, file size, open
files, processes of the uid, no core dumps). The cgroup's memory counts the tmpfs files a run writes
as well as every process's memory (`Result.memory_peak_bytes` is its own peak). A seccomp filter
(`seccomp`), installed by the interpreter before any sandboxed code runs, denies keyrings, new user
namespaces, mounts, ptrace and other kernel surface a judge never needs, on every backend. The
environment is emptied (PATH, HOME, LANG); stdout/stderr go to size-limited memory files (memfd:
no host path in /proc/self/fd, no host disk, charged to the run's memory cgroup); on the wall clock
the whole run is SIGKILLed; it dies with its starter. /proc inside shows no host path: the
namespace's pid 1 is `timeout` (unshare) or bwrap reading its options from a file, and the run's
files are a tmpfs copy.

Backends, picked once per process by trying each in turn (override with
PRORL_SANDBOX=unshare|bwrap|none): `unshare` (root: the default) util-linux `unshare` gives mount,
PID, network, IPC, UTS and cgroup namespaces, a sh script builds the root with `mount` +
`pivot_root` (the host's tree is detached), `setpriv` drops to a uid of its own (1e9 + the scorer's
pid) with no capabilities and no_new_privs; as non-root it adds a user namespace and the code is its
uid 0 (the caller outside), every capability dropped. `bwrap` (non-root: the default) bubblewrap
builds the same root in the same namespaces; the code keeps the caller's uid, no capabilities.
`none` (nothing else works; logged): no namespaces.

What each guarantees (tests/rewards/test_sandbox*.py check it on the backends a machine has):

    mode                   host files  host writes  net/sockets signals   whole-run limits
    unshare, root          none        none         none        own pids  cgroup, else rlimits (1)
    bwrap / unshare, user  none        none         none        own pids  deleg. cgroup, else (1)(2)
    bwrap run as root      none        none         none        own pids  cgroup, else (1)(3)
    none                   readable    world-wr.    reachable   (4)       cgroup, else (1)(2)

All modes: the seccomp filter (keyrings, user namespaces, ptrace, ...; none on architectures other
than x86_64 and aarch64, with a warning), rlimits that the code cannot raise (4: `none` as root
keeps the code root when the interpreter is hidden from other users, e.g. under /root: such a run is
refused unless PRORL_SANDBOX_ROOT_OK=1, since the code could then raise them, and signal or write
anything root can, including every process of the machine).

"host files: none" means nothing outside the minimal root (datasets, checkpoints, home directories,
/run's sockets); "host writes: none": every writable place is a private tmpfs, gone after the run.
(1) rlimits only: memory per process (`memory_bytes` × up to `nproc` processes), CPU seconds per
process and the wall clock; a warning is logged when a controller is missing. (2) RLIMIT_NPROC
counts every process of the calling user. (3) no process limit: uid 0 is exempt from RLIMIT_NPROC.
Not protected against by any mode: kernel exploits through the syscalls the filter allows (a VM is
the answer for hostile code), side channels, what the system directories themselves hold (keep data
out of /usr).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import resource
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass

from prorl.rewards.sandbox import cgroups, rootfs, seccomp, tempdirs
from prorl.rewards.sandbox.rootfs import CODE_DIR, WORK_DIR

log = logging.getLogger(__name__)

BACKENDS = ("unshare", "bwrap", "none")
UID_BASE = 1_000_000_000
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
TMP_PREFIX = "prorl-sbx-"
SETUP_TIMEOUT_S = 30.0  # a sandbox that has not started Python by then is broken
# tasks a backend runs beside Python: unshare + sh + timeout, bwrap × 2 + timeout
_HELPERS = {"unshare": 3, "bwrap": 3, "none": 0}
# Runs inside, as `python -I -c _BOOT <status fd> <filter hex> <user sites> <script> <code dir>
# args...`: installs the seccomp filter (before any sandboxed code), says that Python started (what
# tells a broken sandbox from failing code), adds the user site, runs the script.
_BOOT = (
    "import os, runpy, site, sys\n"
    + seccomp.INSTALL
    + "if sys.argv[2]:\n    _seccomp(bytes.fromhex(sys.argv[2]))\n"
    "os.write(int(sys.argv[1]), b'1'); os.close(int(sys.argv[1]))\n"
    "for d in filter(None, sys.argv[3].split(os.pathsep)): site.addsitedir(d)\n"
    "sys.argv = sys.argv[4:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code in it); the message says what failed."""


@dataclass(frozen=True)
class Limits:
    # the run, from when Python runs inside (set-up and interpreter start excluded)
    wall_s: float = 5.0
    cpu_s: int = 6  # CPU seconds per process
    memory_bytes: int = 1 << 30  # the whole run (cgroup) and the address space of each process
    cpu_cores: float = 1.0  # CPU time per wall-clock time of the whole run (cgroup)
    file_bytes: int = 32 << 20  # largest file a process may write
    tmpfs_bytes: int = 64 << 20  # size of each private tmpfs (namespace backends)
    nproc: int = 64  # processes + threads (the run's cgroup, and RLIMIT_NPROC of the uid)
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
    cgroup: str = "none"  # the controllers that limited the whole run, e.g. "memory,pids,cpu"
    oom_kills: int = 0  # processes killed for the run's memory limit
    # the run's peak by its cgroup's accounting (tmpfs included)
    memory_peak_bytes: int | None = None


# -- backends --------------------------------------------------------------------------------------


def _unshare_flags() -> list[str]:
    flags = ["--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup", "--fork", "--kill-child"]
    flags += ["--propagation", "private"]
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]
    return flags


def _candidates() -> list[str]:
    root = os.geteuid() == 0
    order = ["unshare", "bwrap"] if root else ["bwrap", "unshare"]
    have = {
        "unshare": shutil.which("unshare") and shutil.which("setpriv"),
        "bwrap": shutil.which("bwrap"),
    }
    return [b for b in order if have[b]]


def _works(name: str) -> str | None:
    """None if a trivial run on backend `name` succeeds, else why not."""
    try:
        res = run_python(
            {"main.py": "print('ok')"}, "main.py", limits=Limits(wall_s=60), backend_name=name
        )
    except (SandboxError, OSError) as exc:
        return str(exc)
    return None if res.returncode == 0 and res.stdout == b"ok\n" else f"exit code {res.returncode}"


@functools.cache
def backend() -> str:
    """The sandbox backend of this process (cached): PRORL_SANDBOX, else the strongest that
    works."""
    forced = os.environ.get("PRORL_SANDBOX", "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"PRORL_SANDBOX must be one of {BACKENDS}, got {forced!r}")
        return forced
    failures = []
    for name in _candidates():
        why = _works(name)
        if why is None:
            if failures:
                log.warning("code sandbox: using `%s`; %s", name, "; ".join(failures))
            break
        failures.append(f"`{name}` does not work here: {why}")
    else:
        name = "none"
        log.warning(
            "code sandbox: no namespaces (%s); untrusted code sees the host's files and network "
            "and runs with rlimits, a private directory and a process-group kill only. Install "
            "bubblewrap or allow user namespaces.",
            "; ".join(failures) or "neither util-linux unshare+setpriv nor bubblewrap is installed",
        )
    cg = cgroups.setup()
    if cg.missing:
        log.warning(
            "code sandbox: no cgroup for %s (%s): those limits are per process (memory: address "
            "space × up to nproc processes; CPU: seconds per process and the wall clock), not for "
            "the run as a whole",
            ", ".join(cg.missing),
            cg.reason,
        )
    return name


@functools.cache
def _filter_hex() -> str:
    """The seccomp program every run installs, hex-encoded for the interpreter's argv ("" when
    none)."""
    if not seccomp.wanted():
        log.warning("code sandbox: the seccomp filter is turned off by PRORL_SANDBOX_SECCOMP=0")
        return ""
    prog = seccomp.program()
    if prog is None:
        log.warning(
            "code sandbox: no seccomp filter for %s (written for %s): sandboxed code can use "
            "keyrings and create user namespaces",
            platform.machine(),
            ", ".join(seccomp.AUDIT_ARCH),
        )
        return ""
    return prog.hex()


def describe() -> dict[str, str]:
    """What this process's sandbox enforces: backend, seccomp filter, cgroup controllers (with the
    reason if some lack)."""
    cg = cgroups.setup()
    return {
        "backend": backend(),
        "seccomp": "on" if _filter_hex() else "off",
        "cgroup": cg.describe(),
        "cgroup_missing_reason": cg.reason,
    }


# -- one run ---------------------------------------------------------------------------------------


def _preexec(limits: Limits, uid: int | None, cgroup: cgroups.Cgroup | None):
    starter = os.getpid()

    def fn():
        if cgroup is not None:  # first, while still allowed to write cgroup.procs
            cgroup.join()
        if uid is not None:  # only on the `none` backend: drop to the sandbox uid here
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, after setuid
        if os.getppid() != starter:  # it died before the signal was armed
            os._exit(1)
        for res, value in (
            (resource.RLIMIT_CPU, limits.cpu_s),
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.file_bytes),
            (resource.RLIMIT_NPROC, limits.nproc),
            (resource.RLIMIT_NOFILE, limits.nofile),
            (resource.RLIMIT_CORE, 0),
            # a reward worker's data bound (its soft limit) is not the sandbox's: memory_bytes is
            (resource.RLIMIT_DATA, resource.getrlimit(resource.RLIMIT_DATA)[1]),
        ):
            resource.setrlimit(res, (value, value))

    return fn


def _unshare_command(outer: str, code_dir: str, python: list[str], limits: Limits, uid: int | None):
    # the new root's mount point (on the host, an empty directory)
    os.mkdir(os.path.join(outer, "root"))
    sh = rootfs.shell_script(
        rootfs.plan(code_dir, limits.tmpfs_bytes), os.path.join(outer, "root"), uid
    )
    env = ["env", "-i", f"PATH={SAFE_PATH}", f"HOME={WORK_DIR}", "LANG=C.UTF-8"]
    drop = ["setpriv", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    if uid is not None:
        drop[1:1] = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    # pid 1 of the namespace must keep the parent-death signal that `--kill-child` gave it (when pid
    # 1 dies the kernel kills every process in the namespace), which a uid change would clear: sh
    # execs `timeout` (still root; exec keeps the signal), whose child drops privileges. That also
    # replaces pid 1's command line, the mount script, by an innocuous one. Without `timeout`, sh
    # stays pid 1.
    deadline = _own_deadline(limits)
    run = [*deadline, *drop, *env, *python]
    sh.append(
        f"cd {WORK_DIR} && {'exec ' if deadline else ''}" + " ".join(shlex.quote(a) for a in run)
    )
    return [shutil.which("unshare") or "unshare", *_unshare_flags(), "sh", "-c", "\n".join(sh)]


def _bwrap_command(outer: str, code_dir: str, python: list[str], limits: Limits, fds: list[int]):
    """bwrap's command line; its options go in a file it reads (`--args`), so that the command line
    of the namespace's pid 1 (bwrap) does not spell out the host paths it mounts. Descriptors bwrap
    must inherit are appended to `fds`."""

    def open_fd(path: str) -> int:
        fds.append(os.open(path, os.O_RDONLY))
        return fds[-1]

    opts = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    opts += rootfs.bwrap_args(rootfs.plan(code_dir, limits.tmpfs_bytes), open_fd)
    opts += [
        "--chdir",
        WORK_DIR,
        "--clearenv",
        "--setenv",
        "PATH",
        SAFE_PATH,
        "--setenv",
        "HOME",
        WORK_DIR,
    ]
    opts += ["--setenv", "LANG", "C.UTF-8"]
    path = os.path.join(outer, "bwrap-args")
    with open(path, "wb") as f:
        f.write(b"".join(a.encode() + b"\0" for a in opts))
    args_fd = open_fd(path)
    return [
        shutil.which("bwrap") or "bwrap",
        "--args",
        str(args_fd),
        "--",
        *_own_deadline(limits),
        *python,
    ]


def _own_deadline(limits: Limits) -> list[str]:
    """coreutils `timeout` inside the namespaces: a run outlives its wall clock by at most 10 s even
    if its starter dies at the instant the parent-death signal is not armed yet (unshare arms it for
    its child only after forking it)."""
    timeout = shutil.which("timeout")
    if not timeout or not timeout.startswith(("/usr/", "/bin/")):  # must be inside the minimal root
        return []
    return [timeout, "-s", "KILL", f"{limits.wall_s + 10:g}"]


def _hidden_interpreter(in_sandbox: bool = False) -> str | None:
    """What keeps an unprivileged user from running this interpreter (a folder on its path,
    symlinks' targets included, without o+x; `in_sandbox`: in the namespace backends' minimal root),
    with the fix; or None."""
    for path in (sys.executable, os.path.realpath(sys.executable)):
        d = rootfs.hidden_dir(path, in_sandbox)
        if d:
            mode = stat.S_IMODE(os.stat(d).st_mode)
            return (
                f"the interpreter {path} lies under {d} (mode {mode:o}), which other users cannot "
                f"enter: `chmod o+x {d}` lets the sandbox's unprivileged user start it"
            )
    return None


def _none_workdir(work: str, uid: int | None) -> int | None:
    """The `none` backend's working directory; returns the uid to drop to (as root), if any."""
    os.mkdir(work, 0o700)
    if uid is None:
        return None
    hidden = _hidden_interpreter()
    if hidden:
        if os.environ.get("PRORL_SANDBOX_ROOT_OK") != "1":
            raise SandboxError(
                f"code sandbox `none` as root: {hidden}, so the code cannot drop to an "
                "unprivileged uid and would run as root (able to signal or write anything on the "
                "machine). "
                "Install Python or the venv where other users can read it (/opt, /usr/local, "
                "chmod o+rx on its folders), make a namespace sandbox work (install bubblewrap, "
                "allow user namespaces), or, in a throwaway container, set PRORL_SANDBOX_ROOT_OK=1"
            )
        log.warning("code sandbox `none`: PRORL_SANDBOX_ROOT_OK=1: the code runs as root")
        return None
    os.chown(work, uid, uid)
    return uid


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (the `none` backend as root: catches daemons that left the
    group)."""
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


def _python_started(fd: int, timeout_s: float) -> bool:
    """Wait until Python inside reports (True), or the sandbox ends or hangs before it does
    (False)."""
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready) and os.read(fd, 1) == b"1"
    finally:
        os.close(fd)


def _read(fd: int, limit: int) -> bytes:
    """The first `limit` bytes of memory file `fd` (the code's stdout or stderr); closes `fd`."""
    try:
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


@functools.cache
def _remove_stale_dirs() -> None:
    """Once per process: private directories of runs whose process was SIGKILLed (those younger than
    10 minutes are kept: older versions made them without a lock)."""
    tempdirs.remove_stale(TMP_PREFIX, min_age_s=600)


def run_python(
    files: dict[str, str | bytes],
    script: str,
    args: list[str] | None = None,
    limits: Limits | None = None,
    backend_name: str | None = None,
) -> Result:
    """Run `python -I <dir>/<script> <dir> *args` in a sandbox, `<dir>` holding `files` (read-only).

    The working directory is a private, writable, size-limited one. Never raises for what the code
    does; raises SandboxError when the sandbox itself cannot be set up or cannot start Python."""
    limits = limits or Limits()
    args = list(args or [])
    name = backend_name or backend()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    root = os.geteuid() == 0
    uid = UID_BASE + os.getpid() if root else None
    _remove_stale_dirs()
    outer, lock = tempdirs.make_locked(TMP_PREFIX)
    launch = None
    try:
        os.chmod(outer, 0o711)
        code_dir = _write_code(outer, files)
        started_r, status = os.pipe()  # Python writes one byte to `status` when it runs inside
        inner = code_dir if name == "none" else CODE_DIR
        sites = os.pathsep.join(rootfs.user_sites())
        python = [sys.executable, "-I", "-c", _BOOT, str(status), _filter_hex(), sites]
        python += [f"{inner}/{script}", inner, *args]
        launch = _Launch(outer, python, [status], cwd=outer)
        try:
            _prepare(launch, name, code_dir, limits, uid)
        except (rootfs.LayoutError, OSError, SandboxError) as exc:
            for fd in (*launch.inherit, started_r):
                os.close(fd)
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"cannot set up the `{name}` sandbox: {exc}") from exc
        return _run(launch, name, limits, started_r)
    finally:
        if launch is not None and launch.cgroup is not None:
            launch.cgroup.remove()
        shutil.rmtree(outer, ignore_errors=True)
        os.close(lock)


def _write_code(outer: str, files: dict[str, str | bytes]) -> str:
    """`files` in `<outer>/code`, readable by the sandbox's user, not writable; returns the
    directory."""
    code_dir = os.path.join(outer, "code")
    os.mkdir(code_dir, 0o755)
    for fname, content in files.items():
        path = os.path.join(code_dir, fname)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        os.chmod(path, 0o644)
    os.chmod(code_dir, 0o755)
    return code_dir


@dataclass
class _Launch:
    """How the sandbox's first process starts (`argv` in `cwd`, inheriting the descriptors
    `inherit`) and what bounds and cleans up after it; `outer` is the run's private directory."""

    outer: str
    argv: list[str]  # the Python command, until `_prepare` wraps it in the backend's
    inherit: list[int]
    cwd: str  # `outer`, or the `none` backend's working directory
    drop_uid: int | None = None  # the `none` backend as root: the uid it runs as, killed after
    cgroup: cgroups.Cgroup | None = None
    cgroup_parents: str = "none"  # the controllers that limit the whole run


def _prepare(launch: _Launch, name: str, code_dir: str, limits: Limits, uid: int | None) -> None:
    """The backend's command around the Python one, and the run's cgroup when one can be made."""
    outer = launch.outer
    if name == "unshare":
        launch.argv = _unshare_command(outer, code_dir, launch.argv, limits, uid)
    elif name == "bwrap":
        launch.argv = _bwrap_command(outer, code_dir, launch.argv, limits, launch.inherit)
    else:
        launch.cwd = os.path.join(outer, "work")
        launch.drop_uid = _none_workdir(launch.cwd, uid)
    setup = cgroups.setup()
    launch.cgroup_parents = ",".join(setup.parents) or "none"
    if setup.parents:
        pids = limits.nproc + _HELPERS[name]
        launch.cgroup = cgroups.Cgroup(setup, limits.memory_bytes, pids, limits.cpu_cores)


def _run(launch: _Launch, name: str, limits: Limits, started_r: int) -> Result:
    """Start the sandbox, wait for Python inside and then for the code (its wall clock), kill what
    is left of it, and read its output."""
    # memory files, not files under the host's TMPDIR: readlink of /proc/self/fd/1 showed the host
    # path, and fallocate on it took the host's disk
    out, err = os.memfd_create("stdout"), os.memfd_create("stderr")
    try:
        proc = subprocess.Popen(
            launch.argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=launch.cwd,
            env={"PATH": SAFE_PATH + ":/usr/sbin:/sbin"},
            start_new_session=True,
            close_fds=True,
            pass_fds=launch.inherit,
            preexec_fn=_preexec(limits, launch.drop_uid, launch.cgroup),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        for fd in (started_r, out, err):
            os.close(fd)
        raise SandboxError(f"cannot start the `{name}` sandbox ({launch.argv[0]}): {exc}") from exc
    finally:
        for fd in launch.inherit:
            os.close(fd)
    started, returncode, timed_out, start = _wait(proc, started_r, limits.wall_s, launch.drop_uid)
    wall = time.monotonic() - start
    stdout, stderr = _read(out, limits.output_bytes), _read(err, limits.output_bytes)
    if not started:
        what = f"within {SETUP_TIMEOUT_S:g} s" if timed_out else f"(exit code {returncode})"
        detail = stderr.decode(errors="replace").strip()[-2000:] or "no error output"
        # the code's unprivileged uid cannot enter a folder (the namespace backends show a venv's
        # own folder as a stand-in that it can: `rootfs.stand_in`)
        hidden = _hidden_interpreter(in_sandbox=name != "none")
        if os.geteuid() == 0 and hidden:
            detail += f"; the cause: {hidden}"
        raise SandboxError(f"the `{name}` sandbox did not start Python {what}: {detail}")
    cgroup = launch.cgroup
    return Result(
        returncode,
        stdout,
        stderr,
        timed_out,
        wall,
        name,
        launch.cgroup_parents,
        cgroup.oom_kills() if cgroup else 0,
        cgroup.memory_peak() if cgroup else None,
    )


def _wait(proc, started_r: int, wall_s: float, drop_uid: int | None):
    """Wait for Python to start inside, then for the code on its wall clock (the sandbox's own
    set-up is not counted); then SIGKILL the sandbox's session (and, `none` as root, every process
    of its uid). Returns (started, returncode or None, timed out, the time the code's clock
    started)."""
    start = time.monotonic()
    started = _python_started(started_r, SETUP_TIMEOUT_S)
    timed_out = False
    try:
        if started:
            start = time.monotonic()
            returncode = proc.wait(timeout=wall_s)
        else:  # set-up failed (it is exiting) or hangs
            returncode = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        timed_out, returncode = True, None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if drop_uid is not None:
            _kill_uid(drop_uid)
    return started, returncode, timed_out, start


__all__ = ["BACKENDS", "Limits", "Result", "SandboxError", "backend", "describe", "run_python"]
