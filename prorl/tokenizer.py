"""The tokenizer of a model directory, loaded the one way prorl loads it, checked against the model.

`PreTrainedTokenizerFast.from_pretrained(dir)` (not AutoTokenizer: docs/notes.md) needs
`tokenizer.json`; without it transformers raises a paragraph about slow tokenizers that names
neither the directory nor the file. `check_tokenizer` names them, and compares the tokenizer's size
with the model's `vocab_size`:

- fewer embedding rows than tokens: the ids from `vocab_size` up (often the chat template's special
  tokens) have no row, and the first prompt holding one crashes inside the engine (an IndexError).
  Refused, naming the ids.
- more than twice as many rows as tokens: refused too. Real models pad the vocabulary by well under
  1% (Qwen2.5: 151,936 rows for 151,665 tokens), so this is a model paired with another model's
  tokenizer; the extra rows cost LM-head compute and memory on every token, and sampled ids with no
  token (a run 480x over its tokenizer ran 240 s without completing a step). Pair the model with its
  own tokenizer.
"""

from __future__ import annotations

import json
import os

TOKENIZER_FILE = "tokenizer.json"
MAX_PADDING = 2.0  # vocab_size / tokens above which the pair is refused


def load_tokenizer(path: str):
    """The transformers fast tokenizer of model directory `path`; ValueError naming a missing
    file."""
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        raise ValueError(
            f"{os.path.join(path, TOKENIZER_FILE)} is missing: prorl needs the model's fast "
            "tokenizer beside its weights (save it with tokenizer.save_pretrained(DIR))"
        )
    return PreTrainedTokenizerFast.from_pretrained(path)


def vocab_problem(n_tokens: int, vocab_size: int, first_ids: list[tuple[int, str]]) -> str | None:
    """Why a tokenizer of `n_tokens` does not fit a model with `vocab_size` embedding rows, or None.
    `first_ids`: (id, token) of the first ids past the model's rows, for the message."""
    rows = f"{vocab_size} embedding rows (config.json vocab_size)"
    if n_tokens > vocab_size:
        shown = ", ".join(f"{i} {t!r}" for i, t in first_ids)
        return (
            f"the tokenizer has {n_tokens} tokens but the model only {rows}: ids "
            f"{vocab_size}..{n_tokens - 1} ({shown}) have no row; use the model's own tokenizer"
        )
    if vocab_size > MAX_PADDING * n_tokens:
        return (
            f"the model has {rows} for a tokenizer of {n_tokens} tokens: "
            f"{vocab_size / n_tokens:.0f}x, while real models pad by under 1%; this tokenizer is "
            "not the model's (the unused rows would cost LM-head time on every token)"
        )
    return None


def check_tokenizer(path: str) -> None:
    """ValueError naming `path` unless it holds a tokenizer that fits its model's vocabulary."""
    tokenizer = load_tokenizer(path)
    config = os.path.join(path, "config.json")
    with open(config) as f:  # already checked readable (check_hf_dir)
        vocab_size = json.load(f).get("vocab_size")
    if not isinstance(vocab_size, int):
        return
    n = len(tokenizer)
    past = list(range(vocab_size, min(n, vocab_size + 3)))
    problem = vocab_problem(n, vocab_size, list(zip(past, tokenizer.convert_ids_to_tokens(past))))
    if problem:
        raise ValueError(f"{config} and {TOKENIZER_FILE} do not fit: {problem}")
