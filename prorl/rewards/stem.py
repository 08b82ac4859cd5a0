"""STEM: a multiple-choice letter (A-J, as in GPQA / MMLU-Pro) or a boxed answer, binary reward.

Gold a single letter A-J (also "(C)", "C."): the response's choice is, from the text after
`</think>`, the last `\\boxed{}` that holds a letter ("C", "(C)", "\\text{C}", "C) 4.2 eV"), else
the last "answer is C" / "Answer: (C)" phrase, else the last `<answer>` tag. If `extra["choices"]`
lists the option texts, boxing the gold option's text instead of its letter also counts. Gold
anything else: the last `\\boxed{}` must equal it — math-verify equivalence (numbers, LaTeX), or the
same text ignoring case, spaces and `\\text{}`.
"""

from __future__ import annotations

import re
from typing import Any

from prorl.rewards.extract import final_text, last_boxed, last_tag

LETTERS = "ABCDEFGHIJ"
_GOLD_LETTER = re.compile(r"^\(?([A-J])[).:]?$")
_LETTER_IN_BOX = re.compile(r"^(?:\\text(?:bf)?\{)?\s*\(?([A-J])\b\)?[}.:)]*(?:\s|$)")
# "answer is C", "Answer: (C)", "**Answer:** C", "answer: option C"; the letter itself is
# case-sensitive so that "the answer is a ..." is not read as A.
_ANSWER_PHRASE = re.compile(
    r"(?i:answer)\s*(?:(?i:is)|:)?[\s:*]*(?:(?i:option)\s*)?\(?([A-J])(?![\w'])"
)


def gold_letter(ground_truth: Any) -> str | None:
    m = _GOLD_LETTER.match(str(ground_truth).strip())
    return m.group(1) if m else None


def _plain(text: str) -> str:
    text = re.sub(r"\\text(?:bf|rm)?\{([^{}]*)\}", r"\1", text)
    return re.sub(r"[\s$]+", "", text).lower().rstrip(".")


def chosen_letter(text: str) -> str | None:
    """The multiple-choice letter a response's final text commits to, or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        m = _LETTER_IN_BOX.match(boxed.strip())
        if m:
            return m.group(1)
    found = _ANSWER_PHRASE.findall(text)
    if found:
        return found[-1]
    tagged = last_tag(text, "answer")
    if tagged is not None:
        m = _LETTER_IN_BOX.match(tagged.strip())
        if m:
            return m.group(1)
    return None


def _equal_answers(answer: str, gold: str) -> bool:
    if _plain(answer) == _plain(gold):
        return True
    try:
        from prorl.rewards.maths import is_equivalent
    except ImportError:
        return False
    return is_equivalent(answer, gold)


def score(response: str, ground_truth: Any, extra: dict | None = None) -> dict:
    text = final_text(response)
    letter = gold_letter(ground_truth)
    if letter is not None:
        choice = chosen_letter(text)
        if choice is None:
            choices = (extra or {}).get("choices")
            boxed = last_boxed(text)
            idx = LETTERS.index(letter)
            if choices and boxed is not None and idx < len(choices):
                return {
                    "score": float(_plain(boxed) == _plain(str(choices[idx]))),
                    "format_ok": True,
                }
            return {"score": 0.0, "format_ok": False}
        return {"score": float(choice == letter), "format_ok": True}
    answer = last_boxed(text)
    if answer is None:
        return {"score": 0.0, "format_ok": False}
    return {"score": float(_equal_answers(answer, str(ground_truth))), "format_ok": True}
