"""A verl-style reward function given by file path: `reward.function=path/to/file.py:compute_score`.

verl's custom reward (`custom_reward_function.path` / `.name`) is a plain Python file, not an
importable module, with the signature

    compute_score(data_source, solution_str, ground_truth, extra_info)
        -> float | {"score": float, ...}

and it replaces the built-in verifiers for every data source. `use_function(spec)` does the same
here: while it is set every data_source resolves to it (`prorl.rewards.lookup` gives the key
`function`).

Return conventions are verl's: a number (bool and int included), or a dict whose `score` is the
reward and whose other numeric entries are logged as metrics (`reward_extra/<key>/mean` in training,
`val-aux/<source>/<key>/mean@k` in validation, the per-source table of `prorl.eval`). Unlike the
built-in verifiers the score may lie outside [0, 1] (DAPO's -1 / +1 is common): it must only be
finite. As everywhere in prorl a sample counts as correct when its score reaches 1.

The reward workers (prorl/rewards/pool.py) are separate interpreters, and verifiers travel to them
by reference: `VerlFunction` is a small picklable object holding the file's absolute path and the
function's name, and each worker imports the file by path on first use. Errors name the file and the
function: at start (missing file, import error, no such function, a signature that cannot take
verl's four arguments) and when it raises or returns something else than a number or such a dict.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Any

VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
DEFAULT_NAME = "compute_score"  # verl's custom_reward_function.name default


class RewardFunctionError(ValueError):
    """A reward function that cannot be used; the message names the file and the function."""


def parse_spec(spec: str) -> tuple[str, str]:
    """(absolute path, function name) of "path/to/file.py[:name]" (name default compute_score)."""
    path, name = spec, DEFAULT_NAME
    head, sep, tail = spec.rpartition(":")
    if sep and not tail.endswith(".py") and head:
        path, name = head, tail
    if not path.endswith(".py"):
        raise RewardFunctionError(
            f"reward.function={spec!r}: expected 'path/to/file.py:function_name' (a Python file; "
            "for an importable module that registers verifiers use reward.plugins)"
        )
    return os.path.abspath(os.path.expanduser(path)), name


def _module_name(path: str) -> str:
    return "prorl_reward_fn_" + hashlib.sha1(path.encode()).hexdigest()[:12]


def load_function(path: str, name: str):
    """Import `path` (once per process) and return its callable `name`; RewardFunctionError
    otherwise."""
    where = f"reward function {name!r} in {path}"
    if not os.path.isfile(path):
        raise RewardFunctionError(f"{where}: the file does not exist")
    mod_name = _module_name(path)
    module = sys.modules.get(mod_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        # the file's own folder first, as `python file.py` would have it: its sibling imports work
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise RewardFunctionError(
                f"{where}: importing the file failed: {type(exc).__name__}: {exc}"
            ) from exc
        sys.modules[mod_name] = module
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardFunctionError(
            f"{where}: the file defines no {name!r} (it has: {', '.join(found) or 'none'})"
        )
    if not callable(fn):
        raise RewardFunctionError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(VERL_ARGS))
    except TypeError as exc:
        raise RewardFunctionError(
            f"{where}: its signature {inspect.signature(fn)} cannot take verl's arguments "
            f"({', '.join(VERL_ARGS)}, passed by name): {exc}"
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


class VerlFunction:
    """prorl's verifier interface `fn(response, ground_truth, extra)` over a verl `compute_score`
    file.

    Picklable by value (path and name only); the function is imported in each process on first
    call."""

    bounded = False  # scores need only be finite (verl's convention), not in [0, 1]

    def __init__(self, path: str, name: str = DEFAULT_NAME):
        self.path, self.name = path, name
        self._fn = None

    def __getstate__(self):
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state):
        self.__init__(state["path"], state["name"])

    def __repr__(self) -> str:
        return f"{self.path}:{self.name}"

    def __call__(self, response: str, ground_truth: Any, extra: dict | None = None):
        if self._fn is None:
            self._fn = load_function(self.path, self.name)
        extra = dict(extra or {})
        data_source = extra.get("data_source")
        try:
            result = self._fn(
                data_source=data_source,
                solution_str=response,
                ground_truth=ground_truth,
                extra_info=extra,
            )
        except Exception as exc:
            raise RuntimeError(
                f"reward function {self!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        return check_result(result, repr(self))


def check_result(result: Any, where: str) -> dict:
    """verl's return conventions: a finite number, or a dict with a finite `score` (other keys
    kept). Returns {"score": float, ...}; raises naming `where` otherwise."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(
                f"reward function {where} returned a dict without 'score': {result!r:.200}"
            )
        out = dict(result)
    else:
        out = {"score": result}
    value = out["score"]
    if hasattr(value, "item") and callable(value.item):  # a numpy or torch scalar
        value = value.item()
    if not isinstance(value, (int, float)) or not math.isfinite(value):  # a bool is an int
        raise ValueError(f"reward function {where} returned score {value!r}, not a finite number")
    out["score"] = float(value)
    return out


def numeric_extras(info: dict) -> dict[str, float]:
    """The entries of a verifier's extras that can be averaged as metrics (numbers and bools)."""
    out = {}
    for key, value in (info or {}).items():
        if hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (TypeError, ValueError):
                continue
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out
