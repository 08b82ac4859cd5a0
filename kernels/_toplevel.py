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
from importlib.machinery import ModuleSpec, PathFinder


def hand_over(name: str, init_file: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    sys.modules.pop(f"{name}._toplevel", None)  # this module, imported relative to the wrong name
    rest = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != root]
    spec = PathFinder.find_spec(name, rest)
    if spec is None:
        # Nothing else provides the name: what Python makes of a plain folder of that name, an empty
        # namespace package (no __file__, no submodules), which transformers' availability checks
        # read as "not installed".
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = []
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if spec.loader is None:  # a namespace package: nothing to run
        return
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
