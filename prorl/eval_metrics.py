"""The evaluation metrics of per-sample records: unbiased pass@k (Chen et al. 2021), the mean
verifier score, response lengths and verifier failures, per data source and over all prompts
(prorl/eval.py's module docstring says what each means); maj@k (majority voting) for data
sources the math verifier scores. Pure functions of the records, so the
trainer's validation can summarise records gathered from several ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict

from prorl.rewards import lookup
from prorl.rewards.extract import final_answer, final_text

CONTINUOUS_KEYS = ("reasoning_gym", "ifeval")  # verifier keys whose headline metric is mean_score


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k) (exact
    integers, one rounding)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(k: int) -> list[int]:
    """The j of the reported pass@j: 1, the powers of two below k, and k."""
    ks = [1]
    while ks[-1] * 2 < k:
        ks.append(ks[-1] * 2)
    return ks + ([k] if k > 1 else [])


def majority_correct(samples: list[dict]) -> bool:
    """maj@k of one prompt (math): the most frequent final answer of its samples (the last
    \\boxed{}, GSM8K's ####, an Answer: line; after the last </think>) is a correct one; a tie goes
    to the answer that reached the count first; no answer at all is wrong."""
    counts: dict[str, int] = {}
    correct: dict[str, bool] = {}
    best = None
    for r in sorted(samples, key=lambda r: r.get("sample", 0)):
        answer = final_answer(final_text(r.get("response", "")))
        if answer is None:
            continue
        answer = " ".join(answer.split())
        counts[answer] = counts.get(answer, 0) + 1
        correct[answer] = correct.get(answer, False) or bool(r["correct"])
        if best is None or counts[answer] > counts[best]:
            best = answer
    return best is not None and correct[best]


def primary_metric(data_source: str) -> str:
    return "mean_score" if lookup(data_source)[0] in CONTINUOUS_KEYS else "pass@1"


def _group_metrics(records: list[dict], k: int) -> dict:
    """Metrics of the samples of one group of prompts (each prompt with exactly k records)."""
    by_prompt: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_prompt[r["index"]].append(r)
    bad = {i: len(rs) for i, rs in by_prompt.items() if len(rs) != k}
    if bad:
        first = dict(list(bad.items())[:5])
        raise ValueError(f"every prompt needs k={k} samples; these (index: count) differ: {first}")
    out: dict = {"prompts": len(by_prompt), "samples": len(records)}
    if not records:
        return out | {f"pass@{j}": None for j in pass_ks(k)} | {"mean_score": None}
    correct = [sum(r["correct"] for r in rs) for rs in by_prompt.values()]
    for j in pass_ks(k):
        out[f"pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct) / len(correct)
    out[f"avg@{k}"] = out["pass@1"]  # the mean correctness of k samples: pass@1's estimate
    sources = {r["data_source"] for r in records}
    if all("response" in r for r in records) and all(lookup(d)[0] == "math" for d in sources):
        out[f"maj@{k}"] = sum(majority_correct(rs) for rs in by_prompt.values()) / len(by_prompt)
    n = len(records)
    out["mean_score"] = sum(r["score"] for r in records) / n
    out["mean_response_tokens"] = sum(r["response_tokens"] for r in records) / n
    out["truncated_frac"] = sum(r["finish_reason"] == "length" for r in records) / n
    out["timeout_frac"] = sum(r["timed_out"] for r in records) / n
    out["error_frac"] = sum(r["errored"] for r in records) / n
    # a verl reward's extras
    for key in sorted({key for r in records for key in r.get("extras") or {}}):
        vals = [r["extras"][key] for r in records if key in (r.get("extras") or {})]
        out[f"extra/{key}"] = sum(vals) / len(vals)
    return out


def source_val_metrics(source: str, m: dict, k: int) -> dict[str, float]:
    """The trainer's validation metrics of one data source's summary `m`, named as verl names them:
    `val-core/<source>/reward/mean@k` (mean score), `val-core/<source>/pass@j`, a reward function's
    extra `acc` as `val-core/<source>/acc/mean@k` and any other extra as
    `val-aux/<source>/<key>/mean@k`."""
    out = {f"val-core/{source}/reward/mean@{k}": m["mean_score"] or 0.0}
    for name, value in m.items():
        if name.startswith("pass@"):
            out[f"val-core/{source}/{name}"] = value
        elif name.startswith("extra/"):
            key = name.removeprefix("extra/")
            out[f"{'val-core' if key == 'acc' else 'val-aux'}/{source}/{key}/mean@{k}"] = value
    return out


def summarize(records: list[dict], k: int, filtered: dict[str, int] | None = None) -> dict:
    """{"by_source": {data_source: metrics}, "by_file": {"source (file)": metrics}, "all": metrics}
    from per-sample records (keys `index`, `data_source`, `score`, `correct`, `timed_out`,
    `errored`, `finish_reason`, `response_tokens`, optionally `file`); by_file holds the files of a
    data source read from several.
    `filtered`: prompts dropped per data source (reported beside the metrics)."""
    filtered = filtered or {}
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["data_source"]].append(r)
    by_source = {}
    for ds in sorted(set(groups) | set(filtered)):
        by_source[ds] = {"primary": primary_metric(ds), "filtered": filtered.get(ds, 0)}
        by_source[ds] |= _group_metrics(groups.get(ds, []), k)
    overall = {"primary": "pass@1", "filtered": sum(filtered.values())} | _group_metrics(records, k)
    files: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        if r.get("file"):
            files[(r["data_source"], r["file"])].append(r)
    by_file = {}  # a data source read from several files: one row per file too
    for (ds, file), rs in sorted(files.items()):
        if sum(d == ds for d, _ in files) > 1:
            by_file[f"{ds} ({file})"] = {"primary": primary_metric(ds), "filtered": 0}
            by_file[f"{ds} ({file})"] |= _group_metrics(rs, k)
    return {"by_source": by_source, "by_file": by_file, "all": overall}
