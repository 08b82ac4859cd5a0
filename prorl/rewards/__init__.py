"""Reward verifiers for the five ProRL domains, one registry keyed by `data_source`.

    score(data_source, response, ground_truth, extra=None) -> float in [0, 1]
    register(data_source, fn)  # fn(response, ground_truth, extra) -> float | {"score": float, ...}

Built-in keys: `math` (math-verify on the last `\\boxed{}`), `code` (tests in an OS-level sandbox),
`stem` (multiple-choice letter or boxed answer), `ifeval` (fraction of verifiable instructions met)
and `reasoning_gym` (the task's own `score_answer`; data sources are `reasoning_gym/<task>`).

Lookup order for a data_source: a reward function set with `use_function` (verl's custom
`compute_score` by file path, prorl/rewards/function.py) for every data_source; else the exact key;
then the common public dataset names in `ALIASES` (verl's data_source strings, so existing parquet
files work unchanged); then the longest registered
key that is a `/`-prefix of it (`reasoning_gym/leg_counting` -> `reasoning_gym`). An unknown
data_source is an error that lists every key, never a silent 0.

Built-ins are registered as "module:function" strings and imported on first use, so importing this
package costs nothing (math-verify takes ~1 s to import, reasoning-gym ~5 s). A registered verifier
may return a dict with a `score` key plus extras (logged, not used as reward); anything outside
[0, 1] or not finite raises, because a reward bug should stop a run, not bend it.

Verifiers run in a process pool off the training thread (`prorl.rewards.pool.RewardPool`), so a
user-registered `fn` must be a module-level function of an importable module (it is sent to the
workers by reference, like anything pickled); lambdas and closures are rejected by the pool.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

Verifier = Callable[[str, Any, "dict | None"], "float | dict"]

# key -> callable, or "module:function" imported on first use
_REGISTRY: dict[str, Verifier | str] = {
    "math": "prorl.rewards.maths:score",
    "code": "prorl.rewards.coding:score",
    "stem": "prorl.rewards.stem:score",
    "ifeval": "prorl.rewards.ifeval:score",
    "reasoning_gym": "prorl.rewards.logic:score",
}

# Public data_source names (verl's `default_compute_score` and the datasets ProRL drew from) that
# map onto a built-in key. Exact names; `ALIAS_PREFIXES` covers families such as aime24/aime25.
ALIASES: dict[str, str] = {
    # math
    "openai/gsm8k": "math",
    "gsm8k": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
    "math_dapo_reasoning": "math",
    "BytedTsinghua-SIA/DAPO-Math-17k": "math",
    "agentica-org/DeepScaleR-Preview-Dataset": "math",
    "deepscaler": "math",
    "AI-MO/aimo-validation-aime": "math",
    "AI-MO/aimo-validation-amc": "math",
    "HuggingFaceH4/aime_2024": "math",
    "opencompass/AIME2025": "math",
    "Hothan/OlympiadBench": "math",
    "hiyouga/geometry3k": "math",
    "amc": "math",
    "minerva": "math",
    "olympiad_bench": "math",
    # code
    "codecontests": "code",
    "deepmind/code_contests": "code",
    "apps": "code",
    "codeparrot/apps": "code",
    "taco": "code",
    "BAAI/TACO": "code",
    "likaixin/TACO-verified": "code",
    "codeforces": "code",
    "open-r1/codeforces": "code",
    "livecodebench": "code",
    "primeintellect": "code",
    "openai_humaneval": "code",  # test programs (prorl/rewards/test_program.py)
    "openai/openai_humaneval": "code",
    "evalplus/humanevalplus": "code",
    "humaneval": "code",
    "mbpp": "code",
    "google-research-datasets/mbpp": "code",
    "evalplus/mbppplus": "code",
    # STEM
    "stem": "stem",
    "gpqa": "stem",
    "Idavidrein/gpqa": "stem",
    "EricLu/SCP-116K": "stem",
    "TIGER-Lab/MMLU-Pro": "stem",
    "cais/mmlu": "stem",
    # instruction following (Google IFEval's instruction ids and kwargs)
    "google/IFEval": "ifeval",
    "IFEval": "ifeval",
    # logic
    "reasoning-gym": "reasoning_gym",
}
ALIAS_PREFIXES: tuple[tuple[str, str], ...] = (("aime", "math"), ("numina_", "math"))


# a verl-style reward function for every data_source (`use_function`), or None
_FUNCTION: Verifier | None = None


class UnknownDataSourceError(LookupError):
    """No verifier is registered for a data_source."""


def use_function(spec: str | None) -> Verifier | None:
    """Score every data_source with verl's `compute_score(data_source, solution_str, ground_truth,
    extra_info)` from a file: spec "path/to/file.py[:name]" (`reward.function`); None or "" unsets
    it. The file is imported now, so that a bad one fails at start (RewardFunctionError names
    it)."""
    global _FUNCTION
    if not spec:
        _FUNCTION = None
        return None
    from prorl.rewards.function import VerlFunction, load_function, parse_spec

    path, name = parse_spec(spec)
    load_function(path, name)
    _FUNCTION = VerlFunction(path, name)
    return _FUNCTION


def register(data_source: str, fn: Verifier | str) -> None:
    """Register `fn(response, ground_truth, extra) -> float | dict` for `data_source` (replaces
    any).

    `fn` may also be a "module:function" string, imported on first use. For the process pool, `fn`
    must be a module-level function of an importable module.
    """
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"data_source must be a non-empty string, got {data_source!r}")
    if not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
        raise TypeError(f"fn must be callable or a 'module:function' string, got {fn!r}")
    _REGISTRY[data_source] = fn


def registered_keys() -> list[str]:
    return sorted(_REGISTRY)


def lookup(data_source: str) -> tuple[str, Verifier | str]:
    """(registry key, entry) for `data_source`, without importing anything. Raises
    UnknownDataSourceError."""
    if _FUNCTION is not None:
        return "function", _FUNCTION
    if data_source in _REGISTRY:
        return data_source, _REGISTRY[data_source]
    alias = ALIASES.get(data_source)
    if alias is None:
        alias = next(
            (key for prefix, key in ALIAS_PREFIXES if data_source.startswith(prefix)), None
        )
    if alias is not None and alias in _REGISTRY:
        return alias, _REGISTRY[alias]
    parts = data_source.split("/")
    for n in range(len(parts) - 1, 0, -1):
        key = "/".join(parts[:n])
        if key in _REGISTRY:
            return key, _REGISTRY[key]
    raise UnknownDataSourceError(
        f"no reward verifier for data_source {data_source!r}. Registered keys: {registered_keys()} "
        f"(a key also matches '<key>/<anything>'), plus the public dataset names in "
        "prorl.rewards.ALIASES. Add one with prorl.rewards.register(data_source, fn)."
    )


def builtin_keys(data_sources) -> tuple[str, ...]:
    """Registry keys of the built-in verifiers behind `data_sources`: what reward workers can
    preload (a fresh worker knows only the built-ins; a user's verifier is imported with its first
    item)."""
    keys = {lookup(ds) for ds in data_sources}
    return tuple(
        sorted(k for k, entry in keys if isinstance(entry, str) and entry.startswith("prorl."))
    )


def load(entry: Verifier | str) -> Verifier:
    """The callable behind a registry entry (imports a "module:function" string)."""
    if callable(entry):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def resolve(data_source: str) -> Verifier:
    return load(lookup(data_source)[1])


def normalize_result(result: Any, data_source: str, bounded: bool = True) -> tuple[float, dict]:
    """A verifier's return value as (score in [0, 1], extras). Raises on anything else.
    `bounded=False` (a verl reward function, `entry.bounded`) only requires a finite score."""
    extras: dict = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(
                f"verifier for {data_source!r} returned a dict without 'score': {result!r}"
            )
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, bool):
        result = float(result)
    if not isinstance(result, (int, float)):
        raise TypeError(
            f"verifier for {data_source!r} returned {type(result).__name__}, not a number"
        )
    value = float(result)
    if not math.isfinite(value) or (bounded and not 0.0 <= value <= 1.0):
        raise ValueError(f"verifier for {data_source!r} returned {value}, outside [0, 1]")
    return value, extras


def score_with_info(
    data_source: str, response: str, ground_truth: Any, extra: dict | None = None
) -> tuple[float, dict]:
    """Like `score`, also returning the verifier's extras. `extra` gains `data_source` if absent."""
    key, entry = lookup(data_source)
    extra = dict(extra or {})
    extra.setdefault("data_source", data_source)
    bounded = getattr(entry, "bounded", True)
    return normalize_result(load(entry)(response, ground_truth, extra), data_source, bounded)


def score(data_source: str, response: str, ground_truth: Any, extra: dict | None = None) -> float:
    """Reward in [0, 1] of `response` against `ground_truth`, by the verifier of `data_source`.

    Runs in the calling process with no hard timeout; the trainer uses `RewardPool` instead.
    """
    return score_with_info(data_source, response, ground_truth, extra)[0]


__all__ = [
    "ALIASES",
    "ALIAS_PREFIXES",
    "UnknownDataSourceError",
    "load",
    "lookup",
    "register",
    "registered_keys",
    "resolve",
    "score",
    "score_with_info",
    "use_function",
]
