"""The `none` sandbox run as root must drop the code to an unprivileged uid; where it cannot (the
interpreter lies where other users cannot read it, e.g. under /root) the run is refused, naming the
fixes, unless PRORL_SANDBOX_ROOT_OK=1 says the machine is a throwaway container."""

import os
import shutil
import sys
import tempfile

import pytest

from prorl.rewards import sandbox

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="as another user `none` never runs code as root"
)


@pytest.fixture
def venv_700(monkeypatch):
    """This interpreter as a venv made in `mktemp -d` (mode 700, under /tmp) runs it:
    <folder>/bin/python, a symbolic link to the real one. Returns the folder."""
    folder = tempfile.mkdtemp()  # mode 700, as mktemp -d makes it
    os.mkdir(os.path.join(folder, "bin"))
    os.symlink(os.path.realpath(sys.executable), os.path.join(folder, "bin", "python"))
    monkeypatch.setattr(sys, "executable", os.path.join(folder, "bin", "python"))
    yield folder
    shutil.rmtree(folder)


@pytest.mark.tally("bad_inputs")
def test_none_as_root_with_a_hidden_interpreter_is_refused_naming_the_folder(monkeypatch, venv_700):
    monkeypatch.delenv("PRORL_SANDBOX_ROOT_OK", raising=False)
    with pytest.raises(sandbox.SandboxError) as err:
        sandbox.run_python(
            {"main.py": "import os; print(os.getuid())"}, "main.py", backend_name="none"
        )
    msg = str(err.value)
    assert "would run as root" in msg and "PRORL_SANDBOX_ROOT_OK=1" in msg and "bubblewrap" in msg
    # the real cause and its fix (before: "e.g. under /root", for a venv under /tmp)
    assert f"lies under {venv_700} (mode 700)" in msg and f"chmod o+x {venv_700}" in msg


def test_none_as_root_runs_as_root_only_when_allowed(monkeypatch, venv_700):
    monkeypatch.setenv("PRORL_SANDBOX_ROOT_OK", "1")
    res = sandbox.run_python(
        {"main.py": "import os; print(os.getuid())"}, "main.py", backend_name="none"
    )
    assert res.returncode == 0 and int(res.stdout) == 0  # allowed, and it is root
