"""The sandbox works wherever Python lives: a venv under /tmp, /var/tmp, the home directory or
elsewhere, and a user-site install (its packages are importable inside). Each case starts a fresh
interpreter from that place and runs the sandbox on every backend this machine has, then the code
verifier's self-test (which picks the default backend itself)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from sandbox_helpers import ISOLATING, REPO, host_places, why_not

BASE_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
BACKENDS = [b for b in (*ISOLATING, "none") if why_not(b) is None]

# runs in the interpreter under test: every backend, then the self-test; prints one JSON object
_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from prorl.rewards import sandbox
from prorl.rewards.selftest import self_test
code = sys.argv[3]
out = {}
for backend in json.loads(sys.argv[2]):
    try:
        res = sandbox.run_python({"main.py": code}, "main.py", backend_name=backend)
        out[backend] = [res.returncode, res.stdout.decode().strip(), res.stderr.decode()[-500:]]
    except sandbox.SandboxError as exc:
        out[backend] = [None, "", str(exc)]
try:
    out["self_test"] = self_test(["code"])
except RuntimeError as exc:
    out["self_test"] = str(exc)
print(json.dumps(out))
"""


def _probe(python, code, env=None):
    proc = subprocess.run(
        [python, "-c", _PROBE, REPO, json.dumps(BACKENDS), code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **(env or {})),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _places():
    home = os.path.expanduser("~")
    return {"tmp": "/tmp", "var-tmp": "/var/tmp", "home": home, "elsewhere": None}


@pytest.mark.parametrize("where", list(_places()))
def test_a_venv_anywhere_runs_code_items(where):
    parent = _places()[where] or host_places()[0]
    if not os.access(parent, os.W_OK):
        pytest.skip(f"{parent} is not writable here")
    top = tempfile.mkdtemp(prefix="prorl-venv-test-", dir=parent)
    try:
        os.chmod(top, 0o755)
        venv = os.path.join(top, "venv")
        subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
        python = os.path.join(venv, "bin", "python")
        out = _probe(python, "import sys; print(sys.prefix)")
        assert out.pop("self_test") == {"code": "ok"}
        assert out == {b: [0, venv, ""] for b in BACKENDS}
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_venv_reached_through_a_symlink_runs_code_items():
    top = tempfile.mkdtemp(prefix="prorl-venv-test-", dir="/var/tmp")
    links = tempfile.mkdtemp(prefix="prorl-venv-link-", dir=host_places()[0])
    try:
        os.chmod(top, 0o755)
        os.chmod(links, 0o755)
        subprocess.run(
            [BASE_PYTHON, "-m", "venv", "--without-pip", f"{top}/venv"], check=True, timeout=120
        )
        link = os.path.join(links, "venv")
        os.symlink(f"{top}/venv", link)
        out = _probe(os.path.join(link, "bin", "python"), "import sys; print(sys.prefix)")
        assert out.pop("self_test") == {"code": "ok"}
        assert out == {b: [0, link, ""] for b in BACKENDS}
    finally:
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(links, ignore_errors=True)


def test_user_site_packages_are_visible():
    top = tempfile.mkdtemp(prefix="prorl-usersite-test-", dir="/var/tmp")
    try:
        env = {"PYTHONUSERBASE": top}
        where = [BASE_PYTHON, "-c", "import site; print(site.getusersitepackages())"]
        site_dir = subprocess.run(
            where, capture_output=True, text=True, env=dict(os.environ, **env)
        ).stdout
        os.makedirs(site_dir.strip())
        with open(os.path.join(site_dir.strip(), "prorl_usersite_probe.py"), "w") as f:
            f.write("VALUE = 'from the user site'\n")
        out = _probe(BASE_PYTHON, "import prorl_usersite_probe as p; print(p.VALUE)", env)
        assert out.pop("self_test") == {"code": "ok"}
        assert out == {b: [0, "from the user site", ""] for b in BACKENDS}
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.tally("faults")
def test_a_venv_in_a_mode_700_folder_runs_on_the_namespace_backends():
    """`python -m venv "$(mktemp -d)"`: the venv's own folder is mode 700. The namespace backends'
    unprivileged uid could not start Python there ("env: '<venv>/bin/python': Permission denied"),
    so the default fell back to `none`, which refuses as root: the self-test failed."""
    venv = tempfile.mkdtemp(prefix="prorl-venv-700-")  # mode 700, as mktemp -d makes it
    try:
        subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
        assert os.stat(venv).st_mode & 0o777 == 0o700
        env = {"PRORL_SANDBOX_ROOT_OK": "0"}  # `none` as root refuses such an interpreter
        out = _probe(os.path.join(venv, "bin", "python"), "import sys; print(sys.prefix)", env)
        namespaces = [b for b in BACKENDS if b != "none"]
        if not namespaces:
            pytest.skip("no namespace backend works here")
        assert {b: out[b] for b in namespaces} == {b: [0, venv, ""] for b in namespaces}
        assert out["self_test"] == {"code": "ok"}  # the default is a namespace backend, not none
    finally:
        shutil.rmtree(venv, ignore_errors=True)


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("is_venv", [True, False])
def test_only_a_venv_s_hidden_folder_is_opened(monkeypatch, tmp_path, is_venv):
    """A mode-700 folder of the installation is shown through a stand-in only when it is a venv's
    own: another (a home directory used as an install prefix, holding ~/.ssh) stays a plain bind
    that the code's uid cannot enter, and a failed start names it with its fix."""
    from prorl.rewards import sandbox
    from prorl.rewards.sandbox import rootfs

    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / ".ssh").mkdir()
    os.symlink(os.path.realpath(sys.executable), prefix / "bin" / "python")
    if is_venv:
        (prefix / "pyvenv.cfg").write_text("home = /usr/bin\n")
    prefix.chmod(0o700)
    monkeypatch.setattr(rootfs, "python_paths", lambda: (str(prefix),))
    monkeypatch.setattr(sys, "executable", str(prefix / "bin" / "python"))
    (tmp_path / "code").mkdir()
    kinds = {m.target: m.kind for m in rootfs.plan(str(tmp_path / "code"), 1 << 20)}
    assert kinds[str(prefix)] == ("entries" if is_venv else "ro")
    hint = sandbox._hidden_interpreter(in_sandbox=True)
    if is_venv:
        assert hint is None
        # the stand-in shows the venv's own entries, never the rest of the folder
        assert [name for name, _ in rootfs._entries(str(prefix))] == ["bin", "pyvenv.cfg"]
    else:
        assert f"lies under {prefix} (mode 700)" in hint and f"chmod o+x {prefix}" in hint
