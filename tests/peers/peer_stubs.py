"""Import the peers' loss modules without their training stacks.

verl and OpenRLHF import, at module level, packages their loss code never calls (Ray, DeepSpeed,
flash-attn, vLLM, ...), which are not installed beside them (.ci/peers.sh installs both with
--no-deps). `stub_missing` puts an empty stand-in (a MagicMock module) in place of each one that is
NOT installed, so that the real loss modules import; the stand-ins are only there when the peer
itself is installed.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path
from unittest import mock

# what the modules under test import at module level, by peer
VERL_STUBS = ("ray", "codetiming")
OPENRLHF_STUBS = (
    "deepspeed",
    "flash_attn",
    "peft",
    "ray",
    "pylatexenc",
    "vllm",
    "aiohttp",
    "torchdata",
)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.names = set()

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module):
        pass


_FINDER = _StubFinder()


def stub_missing(peer: str, names) -> list[str]:
    """If `peer` is installed, stand in for each of `names` that is not; returns the names
    stubbed."""
    if importlib.util.find_spec(peer) is None:
        return []
    missing = [n for n in names if n in _FINDER.names or importlib.util.find_spec(n) is None]
    _FINDER.names.update(missing)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return missing


def adapters_snippet(name: str) -> str:
    """The code block after `<!-- snippet:NAME -->` in kernels/ADAPTERS.md, verbatim."""
    path = Path(__file__).resolve().parents[2] / "kernels" / "ADAPTERS.md"
    m = re.search(
        rf"<!-- snippet:{re.escape(name)} -->\s*```[a-z]*\n(.*?)```", path.read_text(), re.S
    )
    if m is None:
        raise LookupError(f"no snippet {name!r} in {path}")
    return m.group(1)
