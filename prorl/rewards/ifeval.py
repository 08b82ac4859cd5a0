"""Instruction following: IFEval's verifiable instructions, reward = fraction of them satisfied.

The ground truth is an IFEval row's `{"instruction_id_list": [...], "kwargs": [{...}, ...]}` (a dict
or its JSON string; `None`-valued kwargs, as the Hugging Face copy pads them, are ignored). Only the
text after `</think>` is checked; an unclosed `<think>` satisfies nothing.

Why not a package: on PyPI, `ifeval` is an unrelated tool, `if-verifiable` (0.1.2, one author) needs
`datasets` and nltk's punkt data (a download at first use), and lm-eval's copy pulls the whole
harness. This file re-implements Google's checkers (github.com/google-research/google-research,
instruction_following_eval/instructions.py) with the same ids, kwargs and "strict" semantics, with
two simplifications: sentences are split by a regex (IFEval uses a longer regex that knows
abbreviations such as "Mr."), and the all-upper/all-lower checks do not also require the text to be
English. `language:response_language` needs `langdetect` and raises without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from prorl.rewards.extract import final_text


def _compare(count: int, relation: str, n: int) -> bool:
    if relation == "less than":
        return count < n
    if relation == "at least":
        return count >= n
    raise ValueError(f"ifeval: relation must be 'less than' or 'at least', got {relation!r}")


def count_words(text: str) -> int:
    return len(re.findall(r"\w+", text))


def count_sentences(text: str) -> int:
    parts = re.split(r"(?<=[.!?])\s+|\n+", text.strip())
    return sum(1 for p in parts if re.search(r"\w", p))


# -- the checkers: fn(text, **kwargs) -> bool, keyed by IFEval's instruction ids -------------------


def keywords_existence(text, keywords):
    return all(re.search(re.escape(k), text, flags=re.IGNORECASE) for k in keywords)


def keywords_frequency(text, keyword, frequency, relation):
    return _compare(
        len(re.findall(re.escape(keyword), text, flags=re.IGNORECASE)), relation, frequency
    )


def keywords_forbidden_words(text, forbidden_words):
    return not any(
        re.search(r"\b" + re.escape(w) + r"\b", text, flags=re.IGNORECASE) for w in forbidden_words
    )


def keywords_letter_frequency(text, letter, let_frequency, let_relation):
    return _compare(text.lower().count(letter.lower()), let_relation, let_frequency)


def response_language(text, language):
    try:
        import langdetect
    except ImportError as exc:
        raise ImportError(
            "ifeval 'language:response_language' needs langdetect: pip install langdetect"
        ) from exc
    try:
        return langdetect.detect(text) == language
    except langdetect.LangDetectException:
        return True  # IFEval's own choice: undetectable text passes


def number_sentences(text, num_sentences, relation):
    return _compare(count_sentences(text), relation, num_sentences)


def number_paragraphs(text, num_paragraphs):
    # paragraphs separated by the markdown divider * * *; an empty paragraph fails (as IFEval)
    paragraphs = re.split(r"\s?\*\*\*\s?", text)
    n = len(paragraphs)
    for i, p in enumerate(paragraphs):
        if not p.strip():
            if i in (0, len(paragraphs) - 1):
                n -= 1
            else:
                return False
    return n == num_paragraphs


def number_words(text, num_words, relation):
    return _compare(count_words(text), relation, num_words)


def nth_paragraph_first_word(text, num_paragraphs, nth_paragraph, first_word):
    paragraphs = [p for p in re.split(r"\n\n", text) if p.strip()]
    if len(paragraphs) != num_paragraphs or nth_paragraph > len(paragraphs):
        return False
    words = paragraphs[nth_paragraph - 1].strip().split()
    if not words:
        return False
    word = words[0].lstrip("'\"").rstrip(".,!?;:'\"").lower()
    return word == first_word.lower()


def number_placeholders(text, num_placeholders):
    return len(re.findall(r"\[.*?\]", text)) >= num_placeholders


def postscript(text, postscript_marker):
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker.lower()) + r".*$"
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


def number_bullet_lists(text, num_bullets):
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def constrained_response(text):
    options = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
    return any(o in text.strip() for o in options)


def number_highlighted_sections(text, num_highlights):
    n = sum(1 for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip())
    n += sum(
        1
        for h in re.findall(r"\*\*[^\n\*]*\*\*", text)
        if h.removeprefix("**").removesuffix("**").strip()
    )
    return n >= num_highlights


def multiple_sections(text, section_spliter, num_sections):
    sections = re.split(r"\s?" + re.escape(section_spliter) + r"\s?\d+\s?", text)
    return len(sections) - 1 >= num_sections


def json_format(text):
    value = text.strip()
    value = re.sub(r"^```(?:json|Json|JSON)?\s*", "", value)
    value = re.sub(r"\s*```$", "", value).strip()
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def title(text):
    return any(t.strip() for t in re.findall(r"<<([^\n]+)>>", text))


def two_responses(text):
    parts = text.split("******")
    valid = [p.strip() for p in parts if p.strip()]
    empty_inside = any(not p.strip() for p in parts[1:-1])
    return len(valid) == 2 and not empty_inside and valid[0] != valid[1]


def repeat_prompt(text, prompt_to_repeat):
    return text.strip().lower().startswith(prompt_to_repeat.strip().lower())


def end_checker(text, end_phrase):
    return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def capital_word_frequency(text, capital_frequency, capital_relation):
    return _compare(
        len([w for w in re.findall(r"\w+", text) if w.isupper()]),
        capital_relation,
        capital_frequency,
    )


def english_capital(text):
    return text.isupper()


def english_lowercase(text):
    return text.islower()


def no_comma(text):
    return "," not in text


def quotation(text):
    text = text.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


CHECKERS: dict[str, Callable[..., bool]] = {
    "keywords:existence": keywords_existence,
    "keywords:frequency": keywords_frequency,
    "keywords:forbidden_words": keywords_forbidden_words,
    "keywords:letter_frequency": keywords_letter_frequency,
    "language:response_language": response_language,
    "length_constraints:number_sentences": number_sentences,
    "length_constraints:number_paragraphs": number_paragraphs,
    "length_constraints:number_words": number_words,
    "length_constraints:nth_paragraph_first_word": nth_paragraph_first_word,
    "detectable_content:number_placeholders": number_placeholders,
    "detectable_content:postscript": postscript,
    "detectable_format:number_bullet_lists": number_bullet_lists,
    "detectable_format:constrained_response": constrained_response,
    "detectable_format:number_highlighted_sections": number_highlighted_sections,
    "detectable_format:multiple_sections": multiple_sections,
    "detectable_format:json_format": json_format,
    "detectable_format:title": title,
    "combination:two_responses": two_responses,
    "combination:repeat_prompt": repeat_prompt,
    "startend:end_checker": end_checker,
    "startend:quotation": quotation,
    "change_case:capital_word_frequency": capital_word_frequency,
    "change_case:english_capital": english_capital,
    "change_case:english_lowercase": english_lowercase,
    "punctuation:no_comma": no_comma,
}


def parse_ground_truth(ground_truth: Any) -> list[tuple[str, dict]]:
    """[(instruction_id, kwargs without None values)] from an IFEval row (dict or JSON string)."""
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    ids = ground_truth["instruction_id_list"]
    kwargs = ground_truth.get("kwargs") or [{} for _ in ids]
    if len(kwargs) != len(ids):
        raise ValueError(f"ifeval: {len(ids)} instruction ids but {len(kwargs)} kwargs")
    out = []
    for iid, kw in zip(ids, kwargs):
        if iid not in CHECKERS:
            raise ValueError(
                f"ifeval: unsupported instruction id {iid!r}; supported: {sorted(CHECKERS)}"
            )
        out.append((iid, {k: v for k, v in (kw or {}).items() if v is not None}))
    return out


def score(response: str, ground_truth: Any, extra: dict | None = None) -> dict:
    instructions = parse_ground_truth(ground_truth)
    if not instructions:
        raise ValueError("ifeval: the ground truth lists no instructions")
    text = final_text(response)
    followed = [bool(text.strip()) and CHECKERS[iid](text, **kw) for iid, kw in instructions]
    return {
        "score": sum(followed) / len(followed),
        "all_followed": all(followed),
        "followed": followed,
    }
