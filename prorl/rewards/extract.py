"""Pulling the final answer out of a model response: the one place every verifier shares.

Reasoning models write `<think> ... </think>` and then the answer. Only the text after the LAST
`</think>` is graded; a response that opens `<think>` and never closes it (cut by the length limit)
has no final answer at all, so it cannot be rewarded for something it only mused about.
"""

from __future__ import annotations

import re

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def final_text(response: str) -> str:
    """The text after the last `</think>`; the whole response if it never thinks; "" if it never
    stops."""
    if _THINK_CLOSE in response:
        return response.rsplit(_THINK_CLOSE, 1)[1]
    if _THINK_OPEN in response:
        return ""
    return response


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, braces
    balanced.

    Returns None when there is none or its braces never close.
    """
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\b", text)]
    for m in reversed(starts):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            continue  # unbalanced: try an earlier one
        if i > m.end():  # `\boxed 5`: the token up to whitespace or `$`
            token = re.match(r"[^\s$]+", text[i:])
            if token and token.group(0).rstrip(".,;"):
                return token.group(0).rstrip(".,;")
    return None


# the answer conventions of public math data (verl's data preprocessing and verifiers): GSM8K's
# "#### 72" and DAPO-Math's "Answer: 72" line
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_LINE = re.compile(r"(?i)\banswer\s*:\s*([^\n]+)")


def final_answer(text: str) -> str | None:
    """The final answer of a math response: the last `\\boxed{}`; else GSM8K's last `#### X`; else
    DAPO-Math's last `Answer: X` line (so verl-format data scores whatever convention its prompt
    asks for). Trailing `.` and `$` signs are dropped from the last two. None when there is no
    answer."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_LINE):
        found = pattern.findall(text)
        if found:
            answer = found[-1].strip().strip("$").rstrip(".").strip()
            return answer or None
    return None


def last_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last `<tag>...</tag>` in `text`, stripped; None when there is none."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


_FENCE = re.compile(r"```([\w+#.-]*)[^\n]*\n(.*?)```", flags=re.DOTALL)


def last_code_block(text: str) -> tuple[str, str] | None:
    """(language tag lower-cased, code) of the last fenced ``` block; None when there is none."""
    found = _FENCE.findall(text)
    if not found:
        return None
    lang, code = found[-1]
    return lang.lower(), code
