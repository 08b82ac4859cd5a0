"""The sandbox's file system: a minimal root of read-only host paths and private scratch space.

Visible inside, and nothing else of the host:
- read-only: /usr and the other top-level system directories (/bin, /lib, ...; symlinks into /usr on
  merged-/usr systems), the dynamic loader's configuration and /etc/localtime, and the Python
  installation wherever it lives: sys.prefix / base_prefix / exec_prefix, the directory of every hop
  on the executable's symlink chain, the directories of its shared libraries and those of
  lib-dynload (ldd), and the user site directory when this process uses one (a folder of those
  that other users cannot enter, a venv made in `mktemp -d`, is a mode-755 tmpfs holding binds of
  its entries, so that the code's unprivileged uid can start Python);
- read-only at /sandbox/code: a copy of the run's own files on a tmpfs of its own (so that
  /proc/self/mountinfo names no host path that is not visible at the same place inside);
- private and size-limited (tmpfs): /tmp (the working directory is /tmp/work), /var/tmp, /dev/shm;
- a minimal /dev (null, zero, full, random, urandom), a /proc of the sandbox's own PID namespace,
  empty /run and /var (so /var/lock, /run/lock and the host's sockets do not exist).
The root itself and /dev are read-only. `plan` lists the mounts in order; `shell_script`
(util-linux, for the `unshare` backend) and `bwrap_args` (bubblewrap) turn the same list into
commands.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import site
import stat
import subprocess
import sys
from dataclasses import dataclass

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # what the loader and time zones read
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
CODE_DIR = "/sandbox/code"
WORK_DIR = "/tmp/work"
# paths the sandbox builds itself: the interpreter may live below the scratch ones, never at or
# above any
OWN_PATHS = ("/", "/proc", "/dev", "/sandbox", "/run", "/var", *SCRATCH, CODE_DIR)
_NO_INTERPRETER_BELOW = ("/proc", "/dev", "/sandbox")


class LayoutError(RuntimeError):
    """The Python installation cannot be placed in a minimal root (it overlaps the sandbox's own
    paths)."""


@dataclass(frozen=True)
class Mount:
    # "ro" (read-only bind of `source`), "copy" (of directory `source`, read-only), "entries"
    # (a read-only tmpfs, mode 755, holding read-only binds of directory `source`'s entries),
    # "symlink" (to `source`), "tmpfs", "dir", "proc", "dev"
    kind: str
    target: str
    source: str = ""
    size: int = 0  # tmpfs bytes


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def _library_dirs(executable: str) -> list[str]:
    """Directories of the shared libraries of the interpreter and its lib-dynload extensions
    (ldd)."""
    ldd = shutil.which("ldd")
    if not ldd:
        return []
    files = [executable]
    for d in sys.path:
        if d.endswith("lib-dynload") and os.path.isdir(d):
            files += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".so"))
    try:
        out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    dirs = set()
    for lib in re.findall(r"(/\S+) \(0x[0-9a-f]+\)", out):
        dirs.update({os.path.dirname(lib), os.path.dirname(os.path.realpath(lib))})
    return sorted(dirs)


def hidden_from_others(path: str) -> bool:
    """Whether a directory on `path` cannot be traversed by other users (the `none` backend's uid
    drop)."""
    return hidden_dir(path) is not None


def stand_in(path: str) -> bool:
    """Whether the sandbox shows directory `path` of the Python installation as a stand-in: a venv
    (`pyvenv.cfg`) whose folder other users cannot enter (`python -m venv "$(mktemp -d)"`, mode
    700), which would stop the code's unprivileged uid at its bind. The stand-in is a read-only
    tmpfs of mode 755 holding read-only binds of the venv's entries. Only a venv's folder: any
    other (a home directory used as an install prefix) may hold more than the installation."""
    try:
        hidden = not os.stat(path).st_mode & stat.S_IXOTH
    except OSError:
        return False
    return hidden and os.path.isfile(os.path.join(path, "pyvenv.cfg"))


def hidden_dir(path: str, in_sandbox: bool = False) -> str | None:
    """The first directory on `path` that other users cannot traverse (no o+x: /root, or a venv
    made in `mktemp -d`, mode 700), or None. `in_sandbox`: in the namespace backends' minimal root,
    where the parents of the Python installation's directories are made traversable and a venv's
    folder is a stand-in (`stand_in`), so only the directories at or inside those count."""
    parts = path.strip(os.sep).split(os.sep)
    for i in range(1, len(parts)):
        d = os.sep + os.sep.join(parts[:i])
        if in_sandbox and (stand_in(d) or not any(_inside(d, p) for p in python_paths())):
            continue
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return d
        except OSError:
            return None
    return None


def user_sites() -> list[str]:
    """The user site directory, when this process uses one (the sandbox adds it with
    site.addsitedir)."""
    if not site.ENABLE_USER_SITE:
        return []
    d = site.getusersitepackages()
    return [d] if d in sys.path and os.path.isdir(d) else []


@functools.cache
def python_paths() -> tuple[str, ...]:
    """Host directories the interpreter needs, outside the system directories, parents first."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *user_sites()]
    exe = os.path.abspath(sys.executable)
    for _ in range(40):  # each hop of a venv's python -> python3 -> /opt/.../python3.11 chain
        paths.append(os.path.dirname(exe))
        if not os.path.islink(exe):
            break
        exe = os.path.join(os.path.dirname(exe), os.readlink(exe))
    paths += _library_dirs(os.path.realpath(sys.executable))
    paths = {
        os.path.normpath(q) for p in paths if os.path.isdir(p) for q in (p, os.path.realpath(p))
    }
    covered = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)]

    # not already visible through a bind of a parent on the same file system
    def needed(p: str) -> bool:
        dev, real = os.stat(p).st_dev, os.path.realpath(p)
        # /lib/x86_64-linux-gnu, via the /lib symlink
        in_system = any(_inside(p, d) for d in SYSTEM_DIRS)
        if in_system and any(_inside(real, q) and os.stat(q).st_dev == dev for q in covered):
            return False
        return not any(q != p and _inside(p, q) and os.stat(q).st_dev == dev for q in paths)

    return tuple(sorted(p for p in paths if needed(p)))


def plan(code_dir: str, tmpfs_bytes: int) -> list[Mount]:
    """The mounts of a sandbox's root, in the order they must be made (parents before children)."""
    mounts = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            mounts.append(Mount("symlink", d, os.readlink(d)))
        elif os.path.isdir(d):
            mounts.append(Mount("ro", d, d))
    # a link to a file under /usr (zoneinfo) stays a link: no bind of a host path
    for f in ETC_FILES:
        real = os.path.realpath(f)
        if os.path.exists(f):
            under_usr = os.path.islink(f) and _inside(real, "/usr") and not os.path.islink("/usr")
            mounts.append(Mount("symlink", f, real) if under_usr else Mount("ro", f, real))
    mounts += [Mount("proc", "/proc"), Mount("dev", "/dev")]
    mounts += [Mount("tmpfs", d, size=tmpfs_bytes) for d in SCRATCH]
    mounts.append(Mount("dir", "/run"))
    for p in python_paths():  # after the scratch tmpfs, so that a venv under /tmp stays visible
        if any(_inside(own, p) for own in OWN_PATHS) or any(
            _inside(p, t) for t in _NO_INTERPRETER_BELOW
        ):
            raise LayoutError(
                f"the Python installation needs {p}, which overlaps the sandbox's own directories "
                f"({', '.join(OWN_PATHS)}); install Python elsewhere"
            )
        mounts.append(Mount("entries" if stand_in(p) else "ro", p, p))
    mounts += [
        Mount("copy", CODE_DIR, code_dir, size=_copy_bytes(code_dir)),
        Mount("dir", WORK_DIR),
    ]
    return mounts


def _copy_bytes(directory: str) -> int:
    """A tmpfs size that holds a copy of the files in `directory` (whole pages, plus room for
    inodes)."""
    sizes = [os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)]
    return sum(-(-n // 4096) * 4096 for n in sizes) + (64 << 10)


# What `python -m venv` makes in a venv's folder: the stand-in shows these and nothing else (a venv
# made in a project's own folder, `python -m venv .`, also holds its sources and secrets).
VENV_ENTRIES = ("bin", "include", "lib", "lib64", "pyvenv.cfg", "share")


def _entries(directory: str) -> list[tuple[str, str | None]]:
    """(name, symlink target or None) of each of a venv's own entries in `directory`, sorted."""
    out = []
    for name in sorted(set(os.listdir(directory)) & set(VENV_ENTRIES)):
        path = os.path.join(directory, name)
        out.append((name, os.readlink(path) if os.path.islink(path) else None))
    return out


_NO_FS = object()  # `_mount_commands`: the mount makes no file system (a directory's owner)


def _mount_commands(m: Mount, t: str, work_owner: int | None):
    """The sh commands that mount `m` at `t` (quoted), each with the file system to populate right
    after it (or None), and what the new file system needs created on it: (directories, files) for a
    fresh one, None for an existing tree (a bind, a copy), _NO_FS when no file system is mounted."""
    q = shlex.quote
    if m.kind == "ro":
        return [(f"mount --bind -o ro,nosuid,nodev {q(m.source)} {t}", None)], None
    if m.kind == "copy":
        return [
            (f"mount -t tmpfs -o size={m.size},mode=755,nosuid,nodev tmpfs {t}", None),
            (f"cp -R {q(m.source)}/. {t}/ && mount -o remount,ro,nosuid,nodev tmpfs {t}", None),
        ], None
    if m.kind == "tmpfs":
        return [(f"mount -t tmpfs -o size={m.size},mode=1777,nosuid,nodev tmpfs {t}", m.target)], (
            [],
            [],
        )
    if m.kind == "entries":
        steps = [(f"mount -t tmpfs -o size=64k,mode=755,nosuid,nodev tmpfs {t}", m.target)]
        dirs, files = [], []
        for name, link in _entries(m.source):
            src, dst = q(os.path.join(m.source, name)), f"{t}/{q(name)}"
            if link is not None:
                steps.append((f"ln -s {q(link)} {dst}", None))
                continue
            (dirs if os.path.isdir(os.path.join(m.source, name)) else files).append(dst)
            steps.append((f"mount --bind -o ro,nosuid,nodev {src} {dst}", None))
        steps.append((f"mount -o remount,ro,nosuid,nodev tmpfs {t}", None))
        return steps, (dirs, files)
    if m.kind == "proc":
        return [(f"mount -t proc -o nosuid,nodev,noexec proc {t}", None)], None
    if m.kind == "dev":
        steps = [(f"mount -t tmpfs -o size=64k,mode=755,nosuid,noexec tmpfs {t}", m.target)]
        steps += [(f"mount --bind /dev/{d} {t}/{d}", None) for d in DEVICES]
        links = {"fd": "/proc/self/fd", "stdin": "fd/0", "stdout": "fd/1", "stderr": "fd/2"}
        steps += [(f"ln -s {target} {t}/{name}", None) for name, target in links.items()]
        return steps, ([], [f"{t}/{d}" for d in DEVICES])
    if m.kind == "dir":
        owned = m.target == WORK_DIR and work_owner is not None
        return ([(f"chown {work_owner}:{work_owner} {t}", None)] if owned else []), _NO_FS
    raise ValueError(f"unknown mount kind {m.kind!r}")


def shell_script(mounts: list[Mount], new_root: str, work_owner: int | None) -> list[str]:
    """sh lines that build the root at `new_root` (run as root in new mount and PID namespaces) and
    make it the root (pivot_root; the host's tree is detached). `work_owner`: uid owning /tmp/work.

    Mount points are made with one `mkdir` and one `touch` per file system we mount (each process
    costs a few ms on a busy host), right after mounting it."""
    q = shlex.quote

    def at(path: str) -> str:
        return q(new_root + path)

    # file systems we mount -> (directories, files) to create on them; None: an existing tree (a
    # bind)
    fresh: dict[str, tuple[list[str], list[str]] | None] = {"/": ([], [])}
    steps: list[tuple[str, str | None]] = []  # (command, file system to populate right after it)
    for m in mounts:
        t = at(m.target)
        holder = fresh[max((p for p in fresh if p != m.target and _inside(m.target, p)), key=len)]
        if m.kind == "symlink":
            steps.append((f"ln -s {q(m.source)} {t}", None))
            continue
        if holder is not None:
            holder[0 if m.kind != "ro" or os.path.isdir(m.source) else 1].append(t)
        commands, made = _mount_commands(m, t, work_owner)
        steps += commands
        if made is not _NO_FS:
            fresh[m.target] = made

    def populate(fs: str) -> list[str]:
        dirs, files = fresh[fs] or ([], [])
        dirs = list(dict.fromkeys([*dirs, *(os.path.dirname(f) for f in files)]))
        mkdir = [f"mkdir -p {' '.join(dirs)}"] if dirs else []
        return mkdir + ([f"touch {' '.join(files)}"] if files else [])

    sh = [
        "set -e",
        "umask 022",
        f"mount -t tmpfs -o size=1m,mode=755,nosuid,nodev tmpfs {q(new_root)}",
    ]
    sh += populate("/")
    for command, fs in steps:
        sh += [command, *(populate(fs) if fs else [])]
    sh.append(f"mount -o remount,bind,ro,nosuid,noexec {at('/dev')}")
    sh.append(f"mount -o remount,bind,ro,nosuid,nodev {q(new_root)}")
    sh.append(f"cd {q(new_root)} && pivot_root . . && umount -l . && cd /")
    return sh


def bwrap_args(mounts: list[Mount], open_fd) -> list[str]:
    """bubblewrap options that build the same root; `open_fd(path)` opens a file whose content bwrap
    copies in (the files of a "copy" mount) and returns its descriptor."""
    args = []
    for m in mounts:
        if m.kind == "symlink":
            args += ["--symlink", m.source, m.target]
        elif m.kind == "ro":
            args += ["--ro-bind", m.source, m.target]
        elif m.kind == "copy":
            args += ["--perms", "0755", "--size", str(m.size), "--tmpfs", m.target]
            for name in sorted(os.listdir(m.source)):
                fd = open_fd(os.path.join(m.source, name))
                args += ["--perms", "0644", "--file", str(fd), f"{m.target}/{name}"]
            args += ["--remount-ro", m.target]
        elif m.kind == "entries":
            args += ["--perms", "0755", "--size", str(64 << 10), "--tmpfs", m.target]
            for name, link in _entries(m.source):
                dst = f"{m.target}/{name}"
                src = os.path.join(m.source, name)
                args += ["--symlink", link, dst] if link is not None else ["--ro-bind", src, dst]
            args += ["--remount-ro", m.target]
        elif m.kind == "tmpfs":
            args += ["--perms", "1777", "--size", str(m.size), "--tmpfs", m.target]
        elif m.kind == "dir":
            args += ["--dir", m.target]
        elif m.kind in ("proc", "dev"):
            args += [f"--{m.kind}", m.target]
        else:
            raise ValueError(f"unknown mount kind {m.kind!r}")
    return [*args, "--remount-ro", "/dev", "--remount-ro", "/"]
