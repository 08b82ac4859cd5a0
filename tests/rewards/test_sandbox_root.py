"""The `none` sandbox run as root must drop the code to an unprivileged uid; where it cannot (the
interpreter lies where other users cannot read it, e.g. under /root) the run is refused, naming the
fixes, unless PRORL_SANDBOX_ROOT_OK=1 says the machine is a throwaway container."""

import os

import pytest

from prorl.rewards import sandbox
from prorl.rewards.sandbox import rootfs

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="as another user `none` never runs code as root"
)


def test_none_as_root_with_a_hidden_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("PRORL_SANDBOX_ROOT_OK", raising=False)
    monkeypatch.setattr(rootfs, "hidden_from_others", lambda path: True)
    with pytest.raises(sandbox.SandboxError) as err:
        sandbox.run_python(
            {"main.py": "import os; print(os.getuid())"}, "main.py", backend_name="none"
        )
    msg = str(err.value)
    assert "would run as root" in msg and "PRORL_SANDBOX_ROOT_OK=1" in msg and "bubblewrap" in msg


def test_none_as_root_runs_as_root_only_when_allowed(monkeypatch):
    monkeypatch.setattr(rootfs, "hidden_from_others", lambda path: True)
    monkeypatch.setenv("PRORL_SANDBOX_ROOT_OK", "1")
    res = sandbox.run_python(
        {"main.py": "import os; print(os.getuid())"}, "main.py", backend_name="none"
    )
    assert res.returncode == 0 and int(res.stdout) == 0  # allowed, and it is root
