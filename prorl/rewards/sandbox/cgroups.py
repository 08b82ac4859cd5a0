"""Limits for a sandbox as a whole: one cgroup per run with memory, process and CPU limits.

cgroup v2: `memory.max` (+ `memory.swap.max` 0), `pids.max`, `cpu.max`; v1: `memory.limit_in_bytes`
(+ `memory.memsw.limit_in_bytes`), `pids.max`, `cpu.cfs_quota_us`. Each controller is taken from v2
where it is enabled there, else from a v1 hierarchy, else it is missing (hybrid hosts mix both).

Where a run's cgroup goes (found once per process, nothing on the host is changed to make it
possible):
- v2: a cgroup that holds processes cannot give controllers to children, so the run's cgroup is a
  sibling of this process's own cgroup, inside its parent (the root cgroup itself is the exception).
  That parent must be writable by this process and have the controllers in `cgroup.subtree_control`:
  true for root on most hosts, and for users where a cgroup is delegated to them (systemd
  `Delegate=yes`, Slurm, `systemd-run --user --scope -p Delegate=yes`). Limits of enclosing cgroups
  (a job's) still apply.
- v1: a child of this process's own cgroup in each hierarchy, where writable (in practice, as root).

The run's first process joins the cgroup before it execs (`join`, in the child), so everything it
starts is inside. A run's cgroup is named `prorl-sbx-<pid>-<n>` after the process that made it; an
empty one left by a process that was killed (its sandbox dies with it) is removed by the next run.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import signal
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_PREFIX = "prorl-sbx-"
_STALE = re.compile(rf"{_PREFIX}(\d+)-\d+$")
_counter = itertools.count()


@dataclass(frozen=True)
class Setup:
    """Where this process's sandboxes get their cgroups: controller -> (version, parent
    directory)."""

    parents: dict[str, tuple[str, str]]
    reason: str  # why controllers are missing ("" when none is)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(c for c in CONTROLLERS if c not in self.parents)

    def describe(self) -> str:
        have = ", ".join(f"{c} (v{v[1:]})" for c, (v, _) in self.parents.items()) or "none"
        missing = f"; missing {', '.join(self.missing)}" if self.missing else ""
        return f"cgroup controllers: {have}{missing}"


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fstype, super options) of each cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
            out.append(
                (_unescape(fields[3]), _unescape(fields[4]), rfields[0], set(rfields[2].split(",")))
            )
    return out


def _own(proc_cgroup: str) -> dict[str, str]:
    """Controller ("" for the v2 hierarchy) -> this process's cgroup path, from
    /proc/self/cgroup."""
    out = {}
    for line in proc_cgroup.splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and not ctrls:
            out[""] = path
        for c in filter(None, ctrls.split(",")):
            out[c] = path
    return out


def _under(mount_root: str, mount_point: str, path: str) -> str | None:
    """Where cgroup `path` is in a hierarchy mounted at `mount_point` (None if outside its root)."""
    if mount_root == "/":
        return os.path.normpath(os.path.join(mount_point, path.lstrip("/")))
    if path == mount_root or path.startswith(mount_root + "/"):
        return os.path.normpath(os.path.join(mount_point, path[len(mount_root) :].lstrip("/")))
    return None


def _writable(d: str) -> bool:
    return os.access(d, os.W_OK | os.X_OK) and os.access(os.path.join(d, "cgroup.procs"), os.W_OK)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _v2_parent(mount_root: str, mount_point: str, path: str) -> tuple[str, set[str], str]:
    """The v2 cgroup sandboxes go in and the wanted controllers it gives them, or why there is
    none."""
    here = _under(mount_root, mount_point, path)
    if here is None:
        return "", set(), f"this process's cgroup {path} is outside the mounted hierarchy"
    # a cgroup that holds processes cannot give its children controllers: the own one only if it is
    # the root
    parent = here if here == os.path.normpath(mount_point) else os.path.dirname(here)
    try:
        enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split()) & set(
            CONTROLLERS
        )
    except OSError as exc:
        return "", set(), f"cannot read {parent}/cgroup.subtree_control ({exc.strerror})"
    if not _writable(parent):
        return "", set(), f"{parent} is not writable by uid {os.geteuid()}"
    if not enabled:
        return (
            "",
            set(),
            f"{parent}/cgroup.subtree_control enables none of {', '.join(CONTROLLERS)}",
        )
    return parent, enabled, ""


def find(proc_cgroup: str, mountinfo: str) -> Setup:
    """Where sandbox cgroups can go, from the text of /proc/self/cgroup and /proc/self/mountinfo."""
    own, mounts = _own(proc_cgroup), _mounts(mountinfo)
    parents: dict[str, tuple[str, str]] = {}
    reasons = []
    v2 = [m for m in mounts if m[2] == "cgroup2"]
    if v2 and "" in own:
        parent, enabled, why = _v2_parent(v2[0][0], v2[0][1], own[""])
        parents.update({c: ("v2", parent) for c in enabled})
        reasons += [why] if why else []
    for c in CONTROLLERS:
        if c in parents:
            continue
        for root, point, fstype, opts in mounts:
            if fstype == "cgroup" and c in opts and c in own:
                d = _under(root, point, own[c])
                if d and os.path.isdir(d):
                    if _writable(d):
                        parents[c] = ("v1", d)
                    else:
                        reasons.append(f"{d} is not writable by uid {os.geteuid()}")
                break
    if not mounts:
        reasons.append("no cgroup file system is mounted")
    missing = [c for c in CONTROLLERS if c not in parents]
    return Setup(parents, "; ".join(dict.fromkeys(reasons)) if missing else "")


@functools.cache
def setup() -> Setup:
    """This process's Setup (cached; PRORL_SANDBOX_CGROUP=0 turns cgroups off)."""
    if os.environ.get("PRORL_SANDBOX_CGROUP", "").strip() == "0":
        return Setup({}, "turned off by PRORL_SANDBOX_CGROUP=0")
    try:
        found = find(_read("/proc/self/cgroup"), _read("/proc/self/mountinfo"))
    except OSError as exc:
        return Setup({}, f"cannot read the cgroup layout ({exc})")
    parents, reasons = dict(found.parents), [found.reason] if found.reason else []
    for version, parent in set(parents.values()):  # writable on paper; can a cgroup be made there?
        probe = os.path.join(parent, f"{_PREFIX}{os.getpid()}-probe")
        try:
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError as exc:
            reasons.append(f"cannot create a cgroup in {parent} ({exc.strerror})")
            parents = {c: p for c, p in parents.items() if p != (version, parent)}
    return Setup(parents, "; ".join(reasons) if len(parents) < len(CONTROLLERS) else "")


class Cgroup:
    """One run's cgroup (a directory per hierarchy used), created with its limits.

    memory_bytes: memory.max of everything in it (anonymous memory and the tmpfs files it wrote);
    pids: tasks (processes + threads); cpu_cores: CPU time per wall-clock time.
    """

    def __init__(self, setup: Setup, memory_bytes: int, pids: int, cpu_cores: float):
        self.setup = setup
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.dirs: dict[tuple[str, str], str] = {}  # (version, parent) -> created directory
        try:
            for version, parent in dict.fromkeys(setup.parents.values()):
                _remove_stale(parent)
                d = os.path.join(parent, name)
                os.mkdir(d)
                self.dirs[version, parent] = d
            for c, key in setup.parents.items():
                d, v2 = self.dirs[key], key[0] == "v2"
                if c == "memory":
                    self._write(d, "memory.max" if v2 else "memory.limit_in_bytes", memory_bytes)
                    # no swapping out to get around it
                    swap = (
                        ("memory.swap.max", 0)
                        if v2
                        else ("memory.memsw.limit_in_bytes", memory_bytes)
                    )
                    self._write(d, *swap, optional=True)
                elif c == "pids":
                    self._write(d, "pids.max", pids)
                elif c == "cpu":
                    quota = max(1000, int(cpu_cores * CPU_PERIOD_US))
                    if v2:
                        self._write(d, "cpu.max", f"{quota} {CPU_PERIOD_US}")
                    else:
                        self._write(d, "cpu.cfs_period_us", CPU_PERIOD_US)
                        self._write(d, "cpu.cfs_quota_us", quota)
        except BaseException:
            self.remove()
            raise
        self._procs = [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    @staticmethod
    def _write(d: str, name: str, value, optional: bool = False) -> None:
        path = os.path.join(d, name)
        if optional and not os.path.exists(path):
            return
        with open(path, "w") as f:
            f.write(str(value))

    def join(self) -> None:
        """Move the calling process into the cgroup (called in the child, before exec)."""
        pid = str(os.getpid()).encode()
        for path in self._procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def oom_kills(self) -> int:
        """How many processes the kernel killed for the memory limit."""
        key = self.setup.parents.get("memory")
        if key is None or key not in self.dirs:
            return 0
        name = "memory.events" if key[0] == "v2" else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.dirs[key], name)).splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def memory_peak(self) -> int | None:
        """The most memory the run's cgroup held at once, by the kernel's own accounting (anonymous
        memory and the tmpfs files of every process in it): v1 `memory.max_usage_in_bytes`, v2
        `memory.peak` (Linux 5.19+). None without a memory cgroup or that file."""
        key = self.setup.parents.get("memory")
        if key is None or key not in self.dirs:
            return None
        name = "memory.peak" if key[0] == "v2" else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self.dirs[key], name)).split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def remove(self) -> None:
        """SIGKILL everything inside, wait until empty, remove the directories (a warning if it
        cannot)."""
        for d in self.dirs.values():
            _kill_and_remove(d)
        self.dirs = {}


def _kill_and_remove(d: str, wait_s: float = 5.0) -> bool:
    kill_file = os.path.join(d, "cgroup.kill")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pids = [int(p) for p in _read(os.path.join(d, "cgroup.procs")).split()]
        except FileNotFoundError:
            return True
        except OSError:
            pids = []
        if not pids:
            try:
                os.rmdir(d)
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if time.monotonic() > deadline:
                    log.warning("code sandbox: cannot remove cgroup %s (%s)", d, exc)
                    return False
        elif os.path.exists(kill_file):
            try:
                with open(kill_file, "w") as f:
                    f.write("1")
            except OSError:
                pass
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if time.monotonic() > deadline:
            log.warning("code sandbox: processes %s in cgroup %s survive SIGKILL", pids, d)
            return False
        time.sleep(0.005)


def _remove_stale(parent: str) -> None:
    """Remove empty run cgroups under `parent` whose creating process is gone (one that still holds
    processes is left alone: it may belong to a run in another PID namespace)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = _STALE.match(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            # its process lives (or a process with its pid does: kept, never removed wrongly)
            continue
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.rmdir(os.path.join(parent, name))
        except OSError:
            pass
