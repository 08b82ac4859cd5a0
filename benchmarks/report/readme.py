"""Regenerate README.md's performance tables from benchmarks/results/*.csv (`--check`: fail if stale).

    python -m benchmarks readme [--check] [--readme README.md] [--results benchmarks/results]

Rewrites the text between `<!-- perf:begin -->` and `<!-- perf:end -->`. Per results CSV and machine
one table: the newest row of each (provider, mode, shape, metric); the metrics `VIEWS` picks; ratios
to a baseline provider only within the same invocation (same timestamp); the runs the rows come from
(command, machine, date, git revision); links to the benchmark's PNGs. Only numbers the CSVs hold
are printed. `--check` writes nothing and exits 1 when the block is stale or the markers are
missing.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import REPO_ROOT, RESULTS_DIR, newest, read_csv

BEGIN = "<!-- perf:begin -->"
END = "<!-- perf:end -->"
GENERATED = (
    "<!-- generated from benchmarks/results/*.csv by `python -m benchmarks readme`: do not edit -->"
)


@dataclass(frozen=True)
class View:
    """What one benchmark's table shows.

    primary: the metric shown as p50 (p20–p80) in the first value column (rows without it are
    skipped). extras: further metrics, p50 only, when any row has them. ratios: (provider, kind):
    `speedup` = the baseline's primary p50 / the row's (higher is better; the
      inverse when `higher_is_better`), `multiple` = the row's p50 / the baseline's.
    phases: when set, one row per (shape, provider): primary and extras from mode `total`, then one
      column per phase (mode) with that mode's primary p50.
    """

    primary: str = "time"
    extras: tuple[str, ...] = ("peak_extra_memory",)
    ratios: tuple[tuple[str, str], ...] = ()
    higher_is_better: bool = False
    phases: tuple[str, ...] = ()
    total: str = "step"


RL_PHASES = ("gen", "sync", "reward", "old_logp", "update", "other")
# in README order; benchmarks not named here get View() and follow in name order
VIEWS: dict[str, View] = {
    "rl_step": View(
        extras=("tokens_per_s", "peak_memory"),
        ratios=(("trl", "speedup"),),
        phases=RL_PHASES,
    ),
    "train_step": View(
        extras=("tokens_per_s", "peak_extra_memory"), ratios=(("transformers-padded", "speedup"),)
    ),
    "linear_logprob_entropy": View(ratios=(("naive", "speedup"), ("sgemm-floor", "multiple"))),
    "linear_ppo_loss": View(ratios=(("naive", "speedup"), ("sgemm-floor", "multiple"))),
    "ppo_loss": View(ratios=(("naive", "speedup"),)),
    "advantages": View(ratios=(("python-loop", "speedup"),)),
    "rewards": View(extras=("throughput",), ratios=(("naive", "speedup"),)),
    "rollout": View(extras=("tokens_per_s",), ratios=(("transformers", "speedup"),)),
    "collectives": View(
        primary="busbw",
        extras=("time",),
        ratios=(("nccl-tests", "multiple"),),
        higher_is_better=True,
    ),
    "embedded_default": View(
        primary="accuracy_after_mean_last3", extras=("accuracy_before", "accuracy_max", "wall_time")
    ),
    "async_rl": View(
        primary="train_time",
        extras=(
            "steps_per_min",
            "gen_tokens_per_s",
            "rollout_idle",
            "trainer_idle",
            "overlap_efficiency",
        )
        + ("final_val_accuracy", "val_accuracy_delta"),
        ratios=(("sync", "speedup"),),
    ),
    "prompt_scheduling": View(
        primary="gen_tokens_per_kept_group",
        extras=("kept_group_fraction", "val_accuracy", "wall_time"),
        ratios=(("dynamic-sampling", "multiple"),),
    ),
}

LABELS = {
    "time": "time",
    "peak_extra_memory": "peak extra memory",
    "peak_memory": "peak memory",
    "tokens_per_s": "throughput",
    "accuracy_after_mean_last3": "accuracy after (mean of last 3)",
    "accuracy_before": "accuracy before",
    "accuracy_max": "accuracy max",
    "wall_time": "wall time",
    "gen_tokens_per_kept_group": "generated tokens per kept group",
    "kept_group_fraction": "kept groups",
    "val_accuracy": "held-out accuracy (mean of last 3)",
    "train_time": "training time",
    "final_val_accuracy": "held-out accuracy (last step)",
    "val_accuracy_delta": "accuracy vs sync",
}


# --- Reading --------------------------------------------------------------------------------------


def threads_of(versions: str) -> str:
    words = versions.split()
    hits = [w for prefix in ("threads=", "OMP_NUM_THREADS=") for w in words if w.startswith(prefix)]
    return (hits or ["threads not recorded"])[0]


def descriptions() -> dict[str, str]:
    """Benchmark name -> the first line of its module docstring (read without importing it)."""
    found = {}
    for path in sorted(Path(__file__).resolve().parents[1].glob("*.py")):  # the benchmarks' folder
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem] = doc.strip().split("\n")[0]
    return found


# --- Formatting -----------------------------------------------------------------------------------


def num(x: float) -> str:
    """About 3 significant digits, thousands separated."""
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    if a == 0:
        return "0"
    return f"{x:#.3g}"


def spread(r: dict) -> str:
    if r["p20"] == r["p50"] == r["p80"]:
        return num(r["p50"])
    return f"{num(r['p50'])} ({num(r['p20'])}–{num(r['p80'])})"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def label(metric: str, unit: str) -> str:
    name = LABELS.get(metric, metric.replace("_", " "))
    return f"{name} ({unit})" if unit else name


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in body]
    return lines


def _ratio(view: View, kind: str, row: dict, base: dict | None) -> str:
    if base is None or row["p50"] == 0 or base["p50"] == 0:
        return "–"
    if kind == "multiple":
        return f"{row['p50'] / base['p50']:.2f}"
    x = row["p50"] / base["p50"] if view.higher_is_better else base["p50"] / row["p50"]
    return f"{num(x)}×"


@dataclass
class _Table:
    """What one benchmark's table on one machine shows: its (shape, mode, provider) rows."""

    view: View
    device: str
    new: dict  # harness.newest of the machine's rows
    by_run: dict  # (timestamp, shape, mode, provider, metric) -> row
    keys: list  # (shape, mode, provider) of the table's rows
    phases: list
    extras: list
    ratios: list

    def get(self, s, m, p, metric):
        return self.new.get((self.device, s, m, p, metric))

    def baseline(self, r: dict, s, m, b) -> dict | None:
        """Provider `b`'s row of the same invocation as `r` (ratios never compare runs)."""
        return self.by_run.get((r["timestamp"], s, m, b, self.view.primary))


KEY_COLUMNS = ("shape", "mode", "provider")


def _layout(view: View, device: str, rows: list[dict]) -> _Table | None:
    """The table's rows (keys whose primary metric exists) and the columns any of them has."""
    t = _Table(view, device, newest(rows), {}, [], [], [], [])
    run_key = lambda r: (r["timestamp"], r["shape"], r["mode"], r["provider"], r["metric"])
    t.by_run = {run_key(r): r for r in rows}
    shapes, modes, providers = ([*dict.fromkeys(r[k] for r in rows)] for k in KEY_COLUMNS)
    if view.phases:
        t.keys = [(s, view.total, p) for s in shapes for p in providers]
    else:
        t.keys = [(s, m, p) for s in shapes for m in modes for p in providers]
    t.keys = [k for k in t.keys if t.get(*k, view.primary)]
    if not t.keys:
        return None
    has_phase = lambda ph: any(t.get(s, ph, p, view.primary) for s, _, p in t.keys)
    t.phases = [ph for ph in view.phases if has_phase(ph)]
    t.extras = [e for e in view.extras if any(t.get(*k, e) for k in t.keys)]
    t.ratios = [
        (b, kind)
        for b, kind in view.ratios
        if any(t.baseline(t.get(s, m, p, view.primary), s, m, b) for s, m, p in t.keys)
    ]
    return t


def _unit(t: _Table, metric: str, phase: bool) -> str:
    """The unit of `metric` (of a phase: the primary's in that mode) in the first row having it."""
    if phase:
        cells = (t.get(s, metric, p, t.view.primary) for s, _, p in t.keys)
    else:
        cells = (t.get(*k, metric) for k in t.keys)
    return next(c["unit"] for c in cells if c)


def _cells(t: _Table, key) -> list[dict]:
    """The rows behind one table row's cells (for the run numbers)."""
    s, m, p = key
    cells = [t.get(*key, t.view.primary)] + [t.get(*key, e) for e in t.extras]
    cells += [t.get(s, ph, p, t.view.primary) for ph in t.phases]
    return [c for c in cells if c is not None]


def _head(t: _Table, show_shape: bool, show_mode: bool, many_runs: bool) -> list[str]:
    view = t.view
    head = (["shape"] if show_shape else []) + (["mode"] if show_mode else []) + ["provider"]
    prim_label = label(view.primary, t.get(*t.keys[0], view.primary)["unit"])
    head.append(f"{view.total} {prim_label}" if view.phases else prim_label)
    head += [f"speed-up vs {b}" if kind == "speedup" else f"÷ {b}" for b, kind in t.ratios]
    head += [f"{ph} ({_unit(t, ph, True)})" for ph in t.phases]
    head += [label(e, _unit(t, e, False)) for e in t.extras]
    return head + (["run"] if many_runs else [])


def _line(t: _Table, key, shown: tuple[bool, bool], runs: list[int]) -> list[str]:
    """One table row: the primary metric with its spread, ratios, phases, extras, run numbers."""
    (s, m, p), view = key, t.view
    r = t.get(s, m, p, view.primary)
    line = ([s] if shown[0] else []) + ([m] if shown[1] else []) + [p, spread(r)]
    line += [_ratio(view, kind, r, t.baseline(r, s, m, b)) for b, kind in t.ratios]
    values = [t.get(s, ph, p, view.primary) for ph in t.phases] + [t.get(*key, e) for e in t.extras]
    line += [num(v["p50"]) if v else "–" for v in values]
    return line + ([", ".join(str(n) for n in runs)] if runs else [])


def _notes(t: _Table) -> list[str]:
    view = t.view
    timed = any(t.get(*k, view.primary)["p20"] != t.get(*k, view.primary)["p80"] for k in t.keys)
    notes = [f"{view.primary}: p50 (p20–p80) of the timed repetitions; other columns p50."]
    notes = notes if timed else []
    for b, kind in t.ratios:
        if kind == "speedup":
            what = "the row's ÷ " + b + "'s" if view.higher_is_better else f"{b}'s ÷ the row's"
            notes.append(f"speed-up vs {b}: {what} {view.primary} p50, both from the same run.")
        else:
            notes.append(f"÷ {b}: the row's {view.primary} p50 ÷ {b}'s, both from the same run.")
    if view.phases:
        notes.append(f"Phase columns: p50 {view.primary} of each phase of the {view.total}.")
    return [" ".join(notes), ""] if notes else []


NOT_RECORDED = "command not recorded (row written before the CSV had it)"


def render_device(name: str, view: View, device: str, rows: list[dict]) -> list[str]:
    """The table and run list of one benchmark on one machine (rows: all its rows there)."""
    t = _layout(view, device, rows)
    if t is None:
        return []
    used = [_cells(t, k) for k in t.keys]
    runs: dict[tuple, dict] = {}  # (timestamp, command) -> its first row, in time order
    for r in sorted((c for u in used for c in u), key=lambda r: (r["timestamp"], r["command"])):
        runs.setdefault((r["timestamp"], r["command"]), r)
    number = {run: n for n, run in enumerate(runs, 1)}
    many = lambda i: len({k[i] for k in t.keys}) > 1
    shown = (many(0), not view.phases and many(1))  # the shape and mode columns
    out = [f"#### `{name}` on {device or 'an unrecorded machine'}", ""]
    if not shown[0]:
        mode = "" if shown[1] or view.phases else f"; mode `{t.keys[0][1]}`"
        out += [f"Shape: {t.keys[0][0]}{mode}.", ""]
    body = []
    for key, u in zip(t.keys, used):
        ns = sorted({number[(c["timestamp"], c["command"])] for c in u}) if len(runs) > 1 else []
        body.append(_line(t, key, shown, ns))
    out += _table(_head(t, *shown, len(runs) > 1), body) + [""] + _notes(t)
    out += ["Runs:" if len(runs) > 1 else "Run:", ""]
    for (stamp, command), r in runs.items():
        cmd = f"`{command}`" if command else NOT_RECORDED
        when = stamp[:16].replace("T", " ")
        tag = f"{number[(stamp, command)]}. " if len(runs) > 1 else "- "
        machine = f"{device}, {threads_of(r['versions'])}"
        out.append(f"{tag}{cmd} — {machine}, {when}, rev `{r['git_rev']}`")
    return out + [""]


def render(name: str, rows: list[dict], view: View | None = None) -> list[str]:
    """`render_device` for every machine of `rows` (`view`: default the benchmark's in VIEWS)."""
    view, out = view or VIEWS.get(name, View()), []
    for device in dict.fromkeys(r["device"] for r in rows):
        out += render_device(name, view, device, [r for r in rows if r["device"] == device])
    return out


def summary(name: str, rows: list[dict], view: View | None = None) -> str:
    """One invocation's rows as the README shows them, for the console."""
    from benchmarks.harness import command_line

    rows = [dict(r, command=r.get("command") or command_line()) for r in rows]
    return "\n".join(render(name, rows, view))


def pngs_of(names: list[str], results: Path) -> dict[str, list[Path]]:
    """Each PNG in `results` goes to the longest benchmark name its stem is or starts with + '_'."""
    out: dict[str, list[Path]] = {n: [] for n in names}
    for png in sorted(results.glob("*.png")):
        owners = [n for n in names if png.stem == n or png.stem.startswith(n + "_")]
        if owners:
            out[max(owners, key=len)].append(png)
    return out


# the command that writes a results PNG, by its stem; PNGs not named here are linked without one
PNG_SOURCES = {
    "{name}": "python -m benchmarks {name}",  # rl_step, collectives, ...: <csv stem>.png
    "{name}_time": "python -m benchmarks plot {name}",
    "{name}_memory": "python -m benchmarks plot {name}",
    "rl_step_scaling": "python -m benchmarks rl_step --scaling",
}


def _png_link(name: str, png: Path, base: str) -> str:
    link = f"[{png.name}]({base}/{png.name})"
    for stem, command in PNG_SOURCES.items():
        if png.stem == stem.format(name=name):
            return f"{link} (`{command.format(name=name)}`)"
    return link


def _render_folder(results: Path, readme: Path) -> list[str]:
    """The tables and plot links of the CSVs and PNGs directly in `results`."""
    found = {p.stem: read_csv(p) for p in sorted(results.glob("*.csv"))}
    found = {n: rows for n, rows in found.items() if rows}
    order = [n for n in VIEWS if n in found] + sorted(n for n in found if n not in VIEWS)
    docs = descriptions()
    pngs = pngs_of(order, results)
    base = Path(os.path.relpath(results.resolve(), Path(readme).resolve().parent)).as_posix()
    out = []
    for name in order:
        body = render(name, found[name])
        if not body:
            continue
        if docs.get(name):
            body[2:2] = [docs[name], ""]
        out += body
        if pngs[name]:
            links = [_png_link(name, p, base) for p in pngs[name]]
            out += ["Plots: " + ", ".join(links) + ".", ""]
    return out


# sub-folders of the results folder rendered after it, each under its own heading (their rows come
# from another machine: kept apart so that plots never mix machines)
SUBFOLDERS = {
    "gpu": "GPU runs (a lent H200; `bash benchmarks/gpu_check.sh`, which writes to benchmarks/results/gpu)",
}


def generate(results: Path = RESULTS_DIR, readme: Path = REPO_ROOT / "README.md") -> str:
    """The block between the markers (without them), from the CSVs in `results` and SUBFOLDERS."""
    results = Path(results)
    out = ["", GENERATED, ""]
    body = _render_folder(results, readme)
    for sub, heading in SUBFOLDERS.items():
        lines = _render_folder(results / sub, readme) if (results / sub).is_dir() else []
        if lines:
            body += [f"#### {heading}", "", *lines]
    out += body or ["No results yet.", ""]
    return "\n".join(out)


def splice(text: str, block: str) -> str:
    """`text` with the part between the markers replaced by `block`; ValueError without them."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + block.strip("\n") + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m benchmarks readme", description=doc)
    p.add_argument("--check", action="store_true", help="exit 1 if the block is stale; no writes")
    p.add_argument("--readme", default=str(REPO_ROOT / "README.md"))
    p.add_argument("--results", default=str(RESULTS_DIR), help="folder of the CSVs and PNGs")
    args = p.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    try:
        new = splice(text, generate(Path(args.results), readme))
    except ValueError as exc:
        print(f"{readme}: {exc}", file=sys.stderr)
        return 1
    if args.check and new != text:
        print(
            f"{readme}: the performance tables are stale; run `python -m benchmarks readme`",
            file=sys.stderr,
        )
        return 1
    if args.check:
        print(f"{readme}: the performance tables are up to date")
    elif new != text:
        readme.write_text(new)
        print(f"{readme}: performance tables regenerated")
    else:
        print(f"{readme}: already up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
