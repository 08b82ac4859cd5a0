"""Give a top-level name that one of prorl's folders shadows back to the package that owns it.

The folders `kernels/` and `engine/` are installed as `prorl.kernels` and `prorl.engine`; under
their folder names they are nobody's. When the repository root is on `sys.path` (every `python -m`
run from the checkout, and pytest's `pythonpath`), Python's path finder sees the folder as a
regular package and returns it before any installed package of the same name, so `import kernels`
inside transformers would get prorl's ops. `hand_over`, called from the folder's `__init__` when it
is imported under its folder name, loads the next package of that name from the rest of `sys.path`
into `sys.modules`, where the import system picks it up once `__init__` returns.
"""

import importlib.util
import os
import sys
from importlib.machinery import PathFinder


def hand_over(name: str, init_file: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    sys.modules.pop(f"{name}._toplevel", None)  # this module, imported relative to the wrong name
    rest = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != root]
    spec = PathFinder.find_spec(name, rest)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r}: the folder {os.path.join(root, name)} is prorl's, imported "
            f"as prorl.{name}",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
