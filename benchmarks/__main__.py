"""`python -m benchmarks <name> [args...]` runs benchmarks/<name>.py's `main`; `--list` lists them.

A benchmark is a module here with a top-level `main` (a function, or `main = BENCHMARK.main`);
`COMMANDS` adds sub-folders' commands. Listing reads the docstrings without importing (no torch).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_NOT_BENCHMARKS = {"__init__", "__main__", "harness"}
COMMANDS = {"readme": "benchmarks.report.readme", "gpu_profile_step": "benchmarks.gpu.profile_step"}


def available() -> dict[str, tuple[str, str]]:
    """name -> (module, first docstring line), for every module here that defines `main` and
    COMMANDS."""
    modules = {p.stem: f"benchmarks.{p.stem}" for p in sorted(_HERE.glob("*.py"))}
    found = {}
    for name, module in {**modules, **COMMANDS}.items():
        if name in _NOT_BENCHMARKS or name.startswith("_"):
            continue
        tree = ast.parse((_HERE.parent / (module.replace(".", "/") + ".py")).read_text())
        names = {getattr(n, "name", None) for n in tree.body}  # functions
        names |= {getattr(t, "id", None) for n in tree.body for t in getattr(n, "targets", ())}
        if "main" in names:
            found[name] = (module, (ast.get_docstring(tree) or "").strip().split("\n")[0])
    return dict(sorted(found.items()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: python -m benchmarks <name> [--quick] [--threads N] [--out CSV] [...]\n")
        for name, (_, doc) in names.items():
            print(f"  {name:<26} {doc}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; one of: {', '.join(names)}", file=sys.stderr)
        return 2
    return importlib.import_module(names[name][0]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
