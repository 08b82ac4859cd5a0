"""A command-line module's attributes served from the module that does its work, on first use.

`prorl.train`, `prorl.eval` and `prorl.export` parse their command line without importing torch
(so that `--help` and config errors answer at once); their work lives in `*_run` modules, whose
functions users still import from the short name (`from prorl.train import load_examples`).
"""

from __future__ import annotations

import importlib


def forwarder(name: str, target: str):
    """A module-level `__getattr__` for module `name` that returns the attributes of module
    `target`, imported on the first look-up. Dunder names are refused without importing (the import
    system asks for `__path__` and the like); an AttributeError raised while importing `target` is
    re-raised as an ImportError, which would otherwise read as "no attribute" here."""

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        try:
            module = importlib.import_module(target)
        except AttributeError as exc:
            raise ImportError(f"importing {target} failed: {exc}") from exc
        try:
            return getattr(module, attr)
        except AttributeError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    return __getattr__
