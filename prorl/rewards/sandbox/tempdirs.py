"""Private temporary directories that are removed even when their owner is SIGKILLed.

Each directory is created with an exclusive `flock` held on it for as long as its owner lives: the
process that made it, or the child it handed the descriptor to (a reward worker). A later start
calls `remove_stale` to delete the ones nobody holds any more. A lock, not a pid, tells whether the
owner is alive: it cannot be confused by a reused pid or by a run in another PID namespace sharing
/tmp. A directory whose lock is free is still kept while a process has it as TMPDIR (a run of a
version that did not lock its directories).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time


def make_locked(prefix: str, parent: str | None = None) -> tuple[str, int]:
    """A new directory `<parent>/<prefix>XXXXXXXX` (mode 0700) and a descriptor holding its lock.

    The lock lives until every copy of the descriptor is closed (close it, or let the process
    die)."""
    parent = parent or tempfile.gettempdir()
    # made under a hidden name and renamed once locked, so `remove_stale` never sees it unlocked
    staging = tempfile.mkdtemp(prefix="." + prefix, dir=parent)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    path = os.path.join(parent, os.path.basename(staging)[1:])
    os.rename(staging, path)
    return path, fd


def remove_stale(prefix: str, parent: str | None = None, min_age_s: float = 0.0) -> list[str]:
    """Delete this user's `<parent>/<prefix>*` directories whose lock nobody holds; returns them.

    min_age_s: keep directories modified more recently (for short-lived ones that older versions
    made without a lock and use as neither TMPDIR nor anything else a scan could see)."""
    parent = parent or tempfile.gettempdir()
    removed, in_use = [], None
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if (
                not stat.S_ISDIR(st.st_mode)
                or st.st_uid != os.geteuid()
                or time.time() - st.st_mtime < min_age_s
            ):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            in_use = _tmpdirs_in_use() if in_use is None else in_use
            if path in in_use:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:  # held: its owner is alive
            pass
        finally:
            os.close(fd)
    return removed


def _tmpdirs_in_use() -> set[str]:
    """TMPDIR of every process this one may inspect."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for var in env.split(b"\0"):
            if var.startswith(b"TMPDIR="):
                found.add(os.fsdecode(var[7:]).rstrip("/"))
    return found
