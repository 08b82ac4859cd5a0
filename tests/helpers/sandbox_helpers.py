"""Sandbox test helpers: the backends that work here, host places to plant files, processes."""

import contextlib
import functools
import os
import shutil
import tempfile

import pytest

from prorl.rewards import sandbox
from prorl.rewards.sandbox import cgroups

ROOT = os.geteuid() == 0
FAST = sandbox.Limits(wall_s=2.0, cpu_s=3)
ISOLATING = ("unshare", "bwrap")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def why_not(backend: str) -> str | None:
    """None if `backend` works on this machine, else what is missing."""
    if backend == "none":
        return None
    if backend == "unshare" and not (shutil.which("unshare") and shutil.which("setpriv")):
        return "util-linux unshare/setpriv are not installed"
    if backend == "bwrap" and not shutil.which("bwrap"):
        return "bubblewrap (bwrap) is not installed"
    return sandbox._works(backend)


def need(backend: str) -> None:
    why = why_not(backend)
    if why:
        pytest.skip(f"the `{backend}` backend does not work here: {why}")


def need_cgroup(*controllers: str) -> None:
    setup = cgroups.setup()
    missing = [c for c in controllers if c not in setup.parents]
    if missing:
        pytest.skip(f"needs a cgroup with the {', '.join(missing)} controller(s): {setup.reason}")


def run(code, backend, limits=FAST, args=None, files=None):
    need(backend)
    files = {"main.py": code, **(files or {})}
    return sandbox.run_python(files, "main.py", args=args, limits=limits, backend_name=backend)


def host_places() -> list[str]:
    """Writable host directories outside /tmp, /var/tmp, /dev/shm and the home directory, where a
    dataset, a checkpoint or a socket of another run could be (the old sandbox hid only those
    four)."""
    home = os.path.realpath(os.path.expanduser("~"))
    out = []
    for d in ("/srv", "/opt", "/run", "/run/lock", "/var/lock", REPO):
        real = os.path.realpath(d)
        hidden = any(
            real == h or real.startswith(h + "/") for h in ("/tmp", "/var/tmp", "/dev/shm", home)
        )
        known = real in map(os.path.realpath, out)
        if os.path.isdir(d) and os.access(d, os.W_OK) and not hidden and not known:
            out.append(d)
    if not out:
        pytest.skip(
            "no writable host directory outside /tmp, /var/tmp, /dev/shm and home to plant files in"
        )
    return out


@contextlib.contextmanager
def planted_dirs(mode=0o755):
    """A fresh directory in each of `host_places()`, removed afterwards."""
    dirs = [tempfile.mkdtemp(prefix="prorl-test-", dir=d) for d in host_places()]
    try:
        for d in dirs:
            os.chmod(d, mode)
        yield dirs
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def processes_with(marker: str) -> list[int]:
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
