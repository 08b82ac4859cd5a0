"""`python -m benchmarks <name> [args...]` runs benchmarks/<name>.py's `main(args)`; `--list` lists them.

A benchmark is any module in this folder with a top-level `main` function, except the harness itself.
Listing reads each module's docstring without importing it (no torch import just to list).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_NOT_BENCHMARKS = {"__init__", "__main__", "harness"}


def available() -> dict[str, str]:
    """name -> first docstring line, for every module here that defines `main`."""
    found = {}
    for path in sorted(_HERE.glob("*.py")):
        if path.stem in _NOT_BENCHMARKS or path.stem.startswith("_"):
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            found[path.stem] = (ast.get_docstring(tree) or "").strip().split("\n")[0]
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: python -m benchmarks <name> [--quick] [--threads N] [--out CSV] [...]\n")
        for name, doc in names.items():
            print(f"  {name:<26} {doc}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; one of: {', '.join(names)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"benchmarks.{name}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
