"""Training data: verl's parquet schema, JSONL with the same fields, built-in generated task sets.

One row, whatever the file format (verl's schema; what `prorl.rewards.score` receives is in
brackets):

    data_source              str, selects the verifier            [data_source]
    prompt                   chat messages [{"role", "content"}, ...] (a plain string is taken as
                             one user message, TRL style)
    reward_model.ground_truth  anything JSON-serialisable          [ground_truth]
    extra_info               dict, optional                        [extra]
    ability                  str, optional (verl's domain tag)

Other column names (`RowFields`, from the data.* keys of the same names): `prompt_key` names the
prompt's column (`question`), `answer_key` a flat ground-truth column (`answer`), `default_source`
the data_source (and so the verifier) of rows that have none: a flat (question, answer) file trains
with `data.prompt_key=question data.answer_key=answer data.default_source=math`.

A row missing a field, with a wrong type, an empty prompt or ground truth, a NaN or infinite ground
truth, a math ground truth that is not a string or number, a chat role no template knows, a byte
that is not UTF-8, or a data_source no verifier is registered for is an error at load time naming
the file, the row and the field, never a surprise hours into a run - such a row can never score
(`skip_bad=True` drops such rows and counts them instead). An empty file is an error; so are rows
over `max_row_bytes` and duplicate keys (prorl/data_read.py reads the files).

Built-in task sets (no download; deterministic by seed):
- `digit_sums`: sums of three single-digit numbers, answer in `\\boxed{}`, scored by the math
  verifier; small enough for a ~0.5M-parameter model on a CPU (docs/notes.md). The 1,000 possible
  problems are split once, by a fixed permutation, into 800 train and 200 validation problems.
- `reasoning_gym/<task>`: any Reasoning Gym generator; validation rows come from a different seed
  (for tasks with few distinct problems the two may overlap).

Mixing files (`load_mixture`, `mix`). A file spec is `path` or `path:weight` (as in
`data.train_files=[math.parquet:3,code.parquet:1]`). Without weights the files are concatenated, in
order. With weights (all specs must then have one) the weights are SHARES of the mixture,
normalised, as Megatron's blend weights are: `n` examples (default: the files' total size) are
apportioned by largest remainder, and each file gives its share as seeded shuffled passes over its
rows (subsampled when its share is smaller than the file; repeated, every row once per pass, when
larger); the mixture is then shuffled so the domains interleave. A path that exists as given, or
whose text after the last `:` is not a number, is taken whole.

Tokenizing (`encode_prompts`): the model's chat template with the generation prompt, then the token
ids without added special tokens; a prompt over `max_prompt_tokens` is FILTERED and counted, never
truncated (a truncated problem statement is a different problem, and its reward is noise); the
trainer prints the count per data file (`dropped_by_source`; `Example.source` is the file a row came
from).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any

from prorl.chain_sums import chain_sums
from prorl.data_read import DEFAULT_MAX_ROW_BYTES, DataError, read_rows
from prorl.example import SPLITS, Example  # noqa: F401 (SPLITS: part of this module's interface)
from prorl.rewards import UnknownDataSourceError, lookup  # light: verifiers load lazily
from prorl.rewards.logic import dataset as logic_dataset


@dataclass
class LoadReport:
    rows: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # the first few, when skipping


# -- files -----------------------------------------------------------------------------------------


# the chat roles of prompts (transformers' templates)
ROLES = ("system", "user", "assistant", "tool")


def _non_finite(value: Any) -> bool:
    """A NaN or infinite float, alone or in a list (parquet and Python's json both produce them)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, list) and any(_non_finite(v) for v in value)


def _bad(where: str, field_name: str, problem: str) -> DataError:
    return DataError(f"{where}: field '{field_name}' {problem}")


@dataclass(frozen=True)
class RowFields:
    """The columns a row's parts are read from (module docstring): the prompt's, a flat ground
    truth's (empty: reward_model.ground_truth, or a `ground_truth` column), and the data_source of
    rows without one (empty: every row names its own)."""

    prompt_key: str = "prompt"
    answer_key: str = ""
    default_source: str = ""


def _parse_row(row: Any, where: str, check_data_source: bool, fields: RowFields) -> Example:
    """One row as an Example; DataError naming `where` (file and row) and the field when it is
    bad."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
    bad_text = _lone_surrogate(row)
    if bad_text is not None:
        raise _bad(
            where,
            bad_text,
            "holds a lone UTF-16 surrogate (a JSON escape such as \\ud800 without its pair): "
            "not text a tokenizer can take",
        )
    data_source = row.get("data_source")
    if data_source is None and fields.default_source:
        data_source = fields.default_source
    if not isinstance(data_source, str) or not data_source:
        problem = (
            "is missing (data.default_source names the verifier of rows without one)"
            if data_source is None
            else f"must be a string, got {data_source!r}"
        )
        raise _bad(where, "data_source", problem)
    verifier = None  # the registry key of the row's verifier, when checked
    if check_data_source:
        try:
            verifier = lookup(data_source)[0]
        except UnknownDataSourceError as exc:
            raise _bad(where, "data_source", f"has no verifier: {exc}") from None
    prompt = _prompt(row, where, fields.prompt_key)
    if fields.answer_key:  # a flat answer column, read as reward_model.ground_truth
        if fields.answer_key not in row:
            others = ", ".join(sorted(row))
            raise _bad(
                where, fields.answer_key, f"is missing (data.answer_key; the row has: {others})"
            )
        row = {**row, "reward_model": {"ground_truth": row[fields.answer_key]}}
    truth = _ground_truth(row, where, verifier)
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    elif isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError:
            raise _bad(where, "extra_info", "is a string that is not JSON") from None
    if not isinstance(extra, dict):
        raise _bad(where, "extra_info", f"must be an object, got {type(extra).__name__}")
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise _bad(where, "ability", "must be a string")
    return Example(prompt, data_source, truth, extra, ability)


def _lone_surrogate(row: dict) -> str | None:
    """The field (a dotted path) of the first string in `row` that is not valid Unicode text (a
    lone surrogate), or None. Iterative: a row may be nested deep."""
    todo: list[tuple[str, Any]] = [(str(k), v) for k, v in row.items()]
    while todo:
        name, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return name
        elif isinstance(value, dict):
            todo += [(f"{name}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return None


def _prompt(row: dict, where: str, prompt_key: str) -> list[dict[str, str]]:
    """The row's chat messages (a string is one user message), each {'role', 'content'}."""
    prompt = row.get(prompt_key)
    if prompt is None:
        others = ", ".join(sorted(k for k in row if k != prompt_key))
        problem = f"is missing (the row has: {others}; data.prompt_key names the prompt's field)"
        raise _bad(where, prompt_key, problem)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise _bad(where, prompt_key, "must be a non-empty list of chat messages or a string")
    for i, msg in enumerate(prompt):
        name = f"{prompt_key}[{i}]"
        if isinstance(msg, dict) and "content" not in msg:
            problem = f"has no 'content' (a message is {{'role', 'content'}}): {msg!r:.200}"
            raise _bad(where, name, problem)
        typed = isinstance(msg, dict) and isinstance(msg.get("role"), str)
        if not (typed and isinstance(msg.get("content"), str)):
            raise _bad(where, name, f"must be {{'role': str, 'content': str}}, got {msg!r:.200}")
        if msg["role"] not in ROLES:
            problem = (
                f"is {msg['role']!r:.60}, not one of {', '.join(ROLES)} (what chat templates know)"
            )
            raise _bad(where, f"{name}.role", problem)
    prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if not any(m["content"].strip() for m in prompt):
        raise _bad(where, prompt_key, "has no text (every message's content is empty)")
    return prompt


def _ground_truth(row: dict, where: str, verifier: str | None) -> Any:
    """reward_model.ground_truth (or a flat TRL-style ground_truth column): present, not empty,
    finite, and a string or number (or a list of them) for the math verifier."""
    reward_model = row.get("reward_model")
    truth_key = "reward_model.ground_truth"
    if reward_model is None and "ground_truth" in row:  # flat TRL-style column
        reward_model, truth_key = {"ground_truth": row["ground_truth"]}, "ground_truth"
    if not isinstance(reward_model, dict):
        problem = "is missing" if reward_model is None else "must be an object"
        raise _bad(where, "reward_model", problem)
    truth = reward_model.get("ground_truth")
    if truth is None:
        raise _bad(where, truth_key, "is missing")
    if (isinstance(truth, str) and not truth.strip()) or (
        isinstance(truth, (list, dict)) and not truth
    ):
        raise _bad(where, truth_key, "is empty: no response can match it")
    if _non_finite(truth):
        raise _bad(
            where, truth_key, f"is {truth!r:.60}: not a finite number, so no answer can equal it"
        )
    scalar = (str, int, float)
    scalars = isinstance(truth, list) and all(isinstance(t, scalar) for t in truth)
    if verifier == "math" and not (isinstance(truth, scalar) or scalars):
        raise _bad(
            where,
            truth_key,
            f"must be a string or number (or a list of them) for the math verifier, got "
            f"{type(truth).__name__} {truth!r:.100}",
        )
    return truth


def load_file(
    path: str,
    *,
    check_data_source: bool = True,
    skip_bad: bool = False,
    report: LoadReport | None = None,
    fields: RowFields = RowFields(),
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
) -> list[Example]:
    """Every row of `path` as an Example (its columns: `fields`). Raises DataError on the first bad
    row unless `skip_bad` (then bad rows are dropped and counted in `report`). A row over
    `max_row_bytes` is a bad row, refused before it is read into memory (prorl/data_read.py)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file (a directory, FIFO or device)")
    report = report if report is not None else LoadReport()
    out, seen = [], 0
    for i, row in read_rows(path, max_row_bytes):
        seen += 1
        try:
            if isinstance(row, DataError):
                raise row
            out.append(_parse_row(row, f"{path}: row {i}", check_data_source, fields))
            out[-1].source = path
            report.rows += 1
        except DataError as exc:
            if not skip_bad:
                raise
            report.skipped += 1
            if len(report.errors) < 10:
                report.errors.append(str(exc))
    if not seen:
        raise DataError(f"{path}: the file is empty (no rows)")
    return out


def write_jsonl(examples: list[Example], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex.to_row()) + "\n")


def write_parquet(examples: list[Example], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [ex.to_row() for ex in examples]
    for row in rows:  # free-form values as JSON text, so mixed types fit one parquet column
        if not isinstance(row["reward_model"]["ground_truth"], str):
            row["reward_model"]["ground_truth"] = json.dumps(row["reward_model"]["ground_truth"])
        row["extra_info"] = json.dumps(row["extra_info"])
    pq.write_table(pa.Table.from_pylist(rows), path)


# -- mixing and tokenizing -------------------------------------------------------------------------


def parse_file_spec(spec: str) -> tuple[str, float | None]:
    """`"path"` -> (path, None); `"path:weight"` -> (path, weight > 0). See "Mixing files" above."""
    if os.path.exists(spec) or ":" not in spec:
        return spec, None
    path, _, text = spec.rpartition(":")
    try:
        weight = float(text)
    except ValueError:
        return spec, None  # a ':' inside the path (s3://..., a Windows drive), not a weight
    if not math.isfinite(weight) or weight <= 0:
        raise DataError(f"{spec}: the weight after ':' must be a positive number, got {text!r}")
    return path, weight


def _shuffled_passes(items: list, n: int, rng: random.Random) -> list:
    """`n` items drawn as successive shuffled passes over `items`: no repeat before every item is
    used."""
    picked: list = []
    while len(picked) < n:
        order = items[:]
        rng.shuffle(order)
        picked += order[: n - len(picked)]
    return picked


def mix(
    sources: list[tuple[list[Example], float]], n: int | None = None, seed: int = 0
) -> list[Example]:
    """A shuffled mixture of `n` examples (default: the sources' total size) in which source i holds
    the share weight_i / sum(weights), apportioned by largest remainder (ties to the earlier
    source).

    Each source gives its count as seeded shuffled passes over its examples (subsampled or
    repeated); each source has its own random stream, so changing one weight does not redraw the
    others.
    """
    if not sources:
        raise ValueError("mix: no sources")
    weights = [float(w) for _, w in sources]
    for i, ((examples, _), w) in enumerate(zip(sources, weights)):
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"mix: source {i} has weight {w}; weights must be positive")
        if not examples:
            raise ValueError(f"mix: source {i} has no examples, so it cannot fill its share")
    total = sum(len(ex) for ex, _ in sources) if n is None else int(n)
    if total < 0:
        raise ValueError(f"mix: n must be >= 0, got {n}")
    quotas = [total * w / sum(weights) for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    out: list[Example] = []
    for i, ((examples, _), count) in enumerate(zip(sources, counts)):
        out += _shuffled_passes(examples, count, random.Random(f"prorl.data.mix:{seed}:{i}"))
    random.Random(f"prorl.data.mix:{seed}").shuffle(out)
    return out


def load_mixture(
    specs: list[str],
    *,
    n: int | None = None,
    seed: int = 0,
    check_data_source: bool = True,
    skip_bad: bool = False,
    report: LoadReport | None = None,
    fields: RowFields = RowFields(),
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
) -> list[Example]:
    """Examples of several files given as `path` or `path:weight` specs (see "Mixing files" above).

    All unweighted and `n` None: the plain concatenation, in order. All unweighted with `n`: a `mix`
    weighted by file size. Weighted: `mix(..., n, seed)`. Some weighted and some not: DataError.
    """
    parsed = [parse_file_spec(s) for s in specs]
    unweighted = [s for s, (_, w) in zip(specs, parsed) if w is None]
    if unweighted and len(unweighted) < len(specs):
        raise DataError(
            f"data files {unweighted} have no ':weight' "
            "while others do; give every file a weight or none"
        )
    loaded = [
        load_file(
            path,
            check_data_source=check_data_source,
            skip_bad=skip_bad,
            report=report,
            fields=fields,
            max_row_bytes=max_row_bytes,
        )
        for path, _ in parsed
    ]
    if unweighted and n is None:
        return [ex for examples in loaded for ex in examples]
    for (path, _), examples in zip(parsed, loaded):
        if not examples:
            raise DataError(f"{path}: no usable rows, so it cannot take part in a weighted mixture")
    weights = [len(ex) if w is None else w for (_, w), ex in zip(parsed, loaded)]
    return mix(list(zip(loaded, weights)), n, seed)


def encode_prompts(
    examples: list[Example], tokenizer, max_prompt_tokens: int | None = None
) -> tuple[list[list[int]], list[int], int]:
    """Prompt token ids for generation: the tokenizer's chat template with the generation prompt,
    then ids without added special tokens (the template already holds them).

    Returns (token id lists of the kept examples, their indices in `examples`, number filtered): an
    example whose prompt is longer than `max_prompt_tokens` is dropped and counted, never truncated.
    `tokenizer`: a transformers tokenizer with a chat template (load ours with
    `PreTrainedTokenizerFast.from_pretrained(model_dir)`, docs/notes.md).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja in the model directory); prorl prompts are chat messages"
        )
    if not examples:
        return [], [], 0
    template = lambda messages: tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    texts = [template(ex.prompt) for ex in examples]
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]  # batched: one call into Rust
    kept = [
        i
        for i, ids in enumerate(all_ids)
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens
    ]
    return [list(all_ids[i]) for i in kept], kept, len(examples) - len(kept)


def dropped_by_source(examples: list[Example], kept: list[int]) -> dict[str, tuple[int, int]]:
    """{data file (or "the builtin task"): (prompts dropped, prompts)} for the files that lost any,
    from `encode_prompts`' kept indices; rows a weighted mixture repeats count once per repeat."""
    kept_set, counts = set(kept), {}
    for i, ex in enumerate(examples):
        dropped, total = counts.get(ex.source or "the builtin task", (0, 0))
        counts[ex.source or "the builtin task"] = (dropped + (i not in kept_set), total + 1)
    return {src: c for src, c in counts.items() if c[0]}


def stop_token_ids(tokenizer, model_path: str | None = None) -> list[int]:
    """End-of-turn ids a sample stops at: the tokenizer's eos, ChatML's <|im_end|> when in the
    vocabulary, and the `eos_token_id` (int or list) of the model's generation_config.json. The one
    definition the trainer, the evaluator and the warm-start use."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if "<|im_end|>" in tokenizer.get_vocab():
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    gen_cfg = os.path.join(model_path, "generation_config.json") if model_path else None
    if gen_cfg and os.path.isfile(gen_cfg):
        with open(gen_cfg) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return sorted(set(ids))


# -- built-in task sets ----------------------------------------------------------------------------

# fixed forever: changing it would leak validation problems into training
DIGIT_SUMS_SPLIT_SEED = 20251129
DIGIT_SUMS_VAL_SIZE = 200


def _digit_sum_problems(split: str) -> list[tuple[int, int, int]]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    problems = [(a, b, c) for a in range(10) for b in range(10) for c in range(10)]
    random.Random(DIGIT_SUMS_SPLIT_SEED).shuffle(problems)
    return problems[:DIGIT_SUMS_VAL_SIZE] if split == "val" else problems[DIGIT_SUMS_VAL_SIZE:]


def digit_sums(n: int | None = None, seed: int = 0, split: str = "train") -> list[Example]:
    """`n` problems "a+b+c=" (a, b, c in 0..9) from `split`, shuffled by `seed` (all of them when n
    is None; cycling through fresh shuffles when n exceeds the split). ground_truth is the sum;
    extra_info["solution"] is a worked answer ("3+5=8, 8+7=15. \\boxed{15}") for a supervised
    warm-start."""
    problems = _digit_sum_problems(split)
    n = len(problems) if n is None else n
    out = []
    for a, b, c in _shuffled_passes(problems, n, random.Random(seed)):
        s = a + b + c
        solution = f"{a}+{b}={a + b}, {a + b}+{c}={s}. \\boxed{{{s}}}"
        out.append(
            Example(
                prompt=[{"role": "user", "content": f"{a}+{b}+{c}="}],
                data_source="math",
                ground_truth=str(s),
                extra={"split": split, "solution": solution, "task": "digit_sums"},
                ability="math",
            )
        )
    return out


def reasoning_gym_tasks(
    task: str, n: int, seed: int = 0, split: str = "train", config: dict | None = None
) -> list[Example]:
    """`n` problems of the Reasoning Gym generator `task`. The verifier regenerates each entry from
    extra_info["reasoning_gym"] (task, seed, size, index, config), so nothing lossy is stored."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    from reasoning_gym.utils import SYSTEM_PROMPTS  # imports reasoning_gym (~5 s), only when used

    split_seed = seed if split == "train" else seed + 1_000_003
    config = dict(config or {})
    ds = logic_dataset(task, split_seed, n, json.dumps(config, sort_keys=True))
    out = []
    for i in range(n):
        entry = ds[i]
        ref = {"task": task, "seed": split_seed, "size": n, "index": i, "config": config}
        out.append(
            Example(
                prompt=[
                    {"role": "system", "content": SYSTEM_PROMPTS["default"]},
                    {"role": "user", "content": entry["question"]},
                ],
                data_source=f"reasoning_gym/{task}",
                ground_truth=str(entry["answer"]),
                extra={"split": split, "reasoning_gym": ref},
                ability="logic",
            )
        )
    return out


def builtin(name: str, n: int | None = None, seed: int = 0, split: str = "train") -> list[Example]:
    """A built-in task set by name: "digit_sums", "chain_sums" and "long_sums"
    (prorl/chain_sums.py), "boxed/<one of those>" (`instructed`), "reasoning_gym/<task>"."""
    if name == "digit_sums":
        return digit_sums(n, seed, split)
    if name in ("chain_sums", "long_sums"):
        return chain_sums(n, seed, split, family=name)
    if name.startswith("reasoning_gym/"):
        return reasoning_gym_tasks(name.split("/", 1)[1], n if n is not None else 1000, seed, split)
    kind, _, base = name.partition("/")
    if kind in ("boxed", "oneshot") and base in ARITHMETIC:
        shot = ONE_SHOT if kind == "oneshot" else None
        return [instructed(ex, shot) for ex in builtin(base, n, seed, split)]
    raise ValueError(
        f"unknown built-in task set {name!r}; known: 'digit_sums', 'chain_sums', 'long_sums', "
        "'boxed/<one of those three>', 'oneshot/<one of those three>', 'reasoning_gym/<task>'"
    )


ARITHMETIC = ("digit_sums", "chain_sums", "long_sums")
BOXED_INSTRUCTION = "What is {terms}? Put the final answer in \\boxed{{}}."
# `oneshot/`'s worked example: a training-split digit_sums problem (2+5+1 is not held out), shown
# as a previous chat turn so that a small chat model sees the answer format once
ONE_SHOT = ((2, 5, 1), "2 + 5 + 1 = 8. \\boxed{8}")


def instructed(ex: Example, shot: tuple[tuple[int, ...], str] | None = None) -> Example:
    """An arithmetic problem "3+8+5=" as a pretrained chat model is asked it: "What is 3 + 8 + 5?
    Put the final answer in \\boxed{}." (the built-in prompts are bare for the shipped tiny
    reasoner, which has no instructions to follow), after `shot` = (terms, answer) asked and
    answered as an earlier turn when given. Same data source, answer and split."""
    terms = ex.prompt[-1]["content"].rstrip("=").split("+")
    content = BOXED_INSTRUCTION.format(terms=" + ".join(terms))
    turns = []
    if shot is not None:
        question = BOXED_INSTRUCTION.format(terms=" + ".join(map(str, shot[0])))
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": shot[1]}]
    return Example(
        [*turns, {"role": "user", "content": content}],
        ex.data_source,
        ex.ground_truth,
        dict(ex.extra),
        ex.ability,
    )


__all__ = [
    "DataError",
    "Example",
    "LoadReport",
    "builtin",
    "digit_sums",
    "dropped_by_source",
    "encode_prompts",
    "load_file",
    "load_mixture",
    "mix",
    "parse_file_spec",
    "reasoning_gym_tasks",
    "write_jsonl",
    "write_parquet",
]
