"""The kernels-only distribution (issue 40, item 19): `PRORL_PACKAGE=kernels pip install .` gives a
TRL / verl / OpenRLHF user `prorl.kernels` and its adapters with torch as the only requirement, no
trainer modules (kernels/ADAPTERS.md, "Installing the kernels alone"). Wheels are built from a copy
of the sources with the native build off (PRORL_TARGET_DEVICE=none), so this takes seconds; the
C++ build itself is checked by the README's set-up command."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _wheel(tmp_path: Path, package: str) -> zipfile.ZipFile:
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build")
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "CMakeLists.txt", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("prorl", "engine", "kernels"):
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    env = {**os.environ, "PRORL_PACKAGE": package, "PRORL_TARGET_DEVICE": "none"}
    out = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--no-index", "-w", str(out), str(src)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _metadata(wheel: zipfile.ZipFile) -> list[str]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return wheel.read(name).decode().splitlines()


@pytest.mark.slow
def test_the_kernels_only_wheel_holds_the_kernels_and_requires_only_torch(tmp_path):
    wheel = _wheel(tmp_path, "kernels")
    meta = _metadata(wheel)
    assert "Name: prorl-kernels" in meta
    assert [line for line in meta if line.startswith("Requires-Dist:")] == [
        "Requires-Dist: torch>=2.6"
    ]
    modules = {n for n in wheel.namelist() if n.endswith(".py")}
    # every Python file of the kernels folder, as prorl.kernels, and prorl's __init__: nothing else
    expected = {"prorl/__init__.py"} | {
        "prorl/kernels/" + p.relative_to(ROOT / "kernels").as_posix()
        for p in (ROOT / "kernels").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules == expected
    assert "prorl/kernels/csrc/ppo_loss.cpp" in wheel.namelist()  # sources of the native build
    assert not [n for n in wheel.namelist() if "entry_points" in n]  # no commands


@pytest.mark.slow
def test_the_full_wheel_still_holds_the_trainer_and_its_commands(tmp_path):
    wheel = _wheel(tmp_path, "prorl")
    names = set(wheel.namelist())
    assert {"prorl/train.py", "prorl/train_run.py", "prorl/engine/optim.py"} <= names
    assert "prorl/kernels/ppo_loss.py" in names
    assert "Name: prorl" in _metadata(wheel)
    (points,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "prorl-train = prorl.train:main" in wheel.read(points).decode()
