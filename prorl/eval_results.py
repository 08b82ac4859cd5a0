"""What an evaluation reports (prorl/eval.py): the per-data-source table it prints, and
`results.json` (settings and every metric), `results.csv` (one row per data source plus `all`) and
`samples.jsonl` (one row per sample) in its output directory.
"""

from __future__ import annotations

import csv
import json
import os

from prorl.eval_metrics import pass_ks


def table_rows(results: dict) -> list[dict]:
    """One flat dict per data source, per file of a data source read from several, and `all` (the
    CSV rows)."""
    rows = [{"data_source": ds} | m for ds, m in results["by_source"].items()]
    rows += [{"data_source": name} | m for name, m in results.get("by_file", {}).items()]
    return rows + [{"data_source": "all"} | results["all"]]


def format_table(results: dict) -> str:
    """The plain-text per-data-source table (pass@j and mean_score in %)."""
    k = results["settings"]["k"]
    metrics = [f"pass@{j}" for j in pass_ks(k)] + ["mean_score"]
    rows = table_rows(results)
    width = max(len("data_source"), *(len(r["data_source"]) for r in rows))
    head = f"{'data_source':<{width}} {'prompts':>7} {'filtered':>8} " + " ".join(
        f"{m:>10}" for m in metrics
    )
    head += f" {'primary':>10} {'resp tok':>8} {'trunc %':>7} {'fail %':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{100 * r[m]:>10.1f}" if r.get(m) is not None else f"{'-':>10}" for m in metrics]
        tail = (
            f" {r['mean_response_tokens']:>8.1f} {100 * r['truncated_frac']:>7.1f} "
            f"{100 * (r['timeout_frac'] + r['error_frac']):>6.1f}"
            if r["samples"]
            else f" {'-':>8} {'-':>7} {'-':>6}"
        )
        lines.append(
            f"{r['data_source']:<{width}} {r['prompts']:>7} {r['filtered']:>8} "
            + " ".join(cells)
            + f" {r['primary']:>10}"
            + tail
        )
    return "\n".join(lines)


def append_samples(path: str, records: list[dict], step: int) -> None:
    """Append the trainer's validation `records` of `step` to the JSONL file `path`, one row a
    sample in prompt order (`trainer.val_save_samples`)."""
    with open(path, "a") as f:
        for r in sorted(records, key=lambda r: (r["index"], r.get("sample", 0))):
            f.write(json.dumps({"step": step, **r}) + "\n")


def write_results(results: dict, out_dir: str) -> list[str]:
    """results.json (all but the samples), results.csv, samples.jsonl in `out_dir`; returns the
    paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f) for f in ("results.json", "results.csv", "samples.jsonl")]
    with open(paths[0], "w") as f:
        json.dump({key: v for key, v in results.items() if key != "samples"}, f, indent=1)
    rows = table_rows(results)
    columns = list(dict.fromkeys(key for r in rows for key in r))
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    with open(paths[2], "w") as f:
        for r in results["samples"]:
            f.write(json.dumps(r) + "\n")
    return paths
