"""Math: the final answer - the last `\\boxed{}`, else GSM8K's `#### X`, else DAPO-Math's `Answer:
X` line (the conventions verl's data asks for) - checked with math-verify against a LaTeX gold
answer.

Binary reward. No answer after `</think>` (or an unclosed `<think>`) scores 0: the format is part of
the task. math-verify (HuggingFace) parses both sides to sympy and compares numerically and
symbolically, so `\\frac{1}{2}` = `0.5`, `\\frac{\\sqrt2}{2}` = `\\frac{1}{\\sqrt2}`, `\\{1,2\\}` =
`\\{2,1\\}`, `1,000` = `1000`, `x=3` = `3`. Gold answers are LaTeX (`sqrt(2)/2` as plain text does
not parse); a gold that already contains `\\boxed{}` is used as written, otherwise it is read as
`$gold$`.

math-verify times out with `signal.alarm`, which only works on a process's main thread; called from
any other thread this module turns its timeouts off (the pool's hard timeout then bounds it).
"""

from __future__ import annotations

import threading
from typing import Any

from prorl.rewards.extract import final_answer, final_text

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the math reward needs math-verify: pip install "
        "'prorl[rewards]' (or: pip install math-verify)"
    ) from exc

PARSE_TIMEOUT_S = 5


def _timeouts() -> dict:
    if threading.current_thread() is threading.main_thread():
        return {}
    return {"parsing_timeout": None}


def parse_gold(gold: str) -> list:
    gold = str(gold).strip()
    text = gold if "\\boxed" in gold else f"${gold}$"
    return parse(
        text,
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        **({"parsing_timeout": PARSE_TIMEOUT_S} | _timeouts()),
    )


def parse_answer(answer: str) -> list:
    return parse(
        f"\\boxed{{{answer}}}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        **({"parsing_timeout": PARSE_TIMEOUT_S} | _timeouts()),
    )


def is_equivalent(answer: str, gold: str) -> bool:
    """Whether LaTeX `answer` equals LaTeX `gold` (math-verify; gold first, it is not symmetric)."""
    gold_parsed, answer_parsed = parse_gold(gold), parse_answer(answer)
    if not gold_parsed or not answer_parsed:
        return False
    timeout = {} if not _timeouts() else {"timeout_seconds": None}
    return bool(verify(gold_parsed, answer_parsed, **timeout))


def score(response: str, ground_truth: Any, extra: dict | None = None) -> dict:
    """1.0 if the final answer after `</think>` (the last boxed one, else GSM8K's `#### X`, else an
    `Answer: X` line: extract.final_answer) equals `ground_truth` (a LaTeX string, or a list of
    acceptable ones), else 0.0."""
    answer = final_answer(final_text(response))
    if answer is None:
        return {"score": 0.0, "format_ok": False}
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    ok = any(is_equivalent(answer, str(g)) for g in golds)
    return {"score": float(ok), "format_ok": True}
