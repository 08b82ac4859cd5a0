"""Regenerate docs/results.md's performance tables from benchmarks/results/*.csv (`--check`: stale?)

    python -m benchmarks readme [--check] [--doc docs/results.md] [--results benchmarks/results]

Rewrites docs/results.md (or `--doc`) between `<!-- perf:begin -->` and `<!-- perf:end -->`: per CSV
and machine a table of the newest rows (`VIEWS`), the runs behind them, links to the PNGs. Details:
docs/benchmarks.md.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import REPO_ROOT, RESULTS_DIR, argparser, command_line, newest, read_csv

BEGIN = "<!-- perf:begin -->"
END = "<!-- perf:end -->"
DOC = REPO_ROOT / "docs" / "results.md"  # the markdown file whose block is written
GENERATED = (
    "<!-- generated from benchmarks/results/*.csv by `python -m benchmarks readme`: do not edit -->"
)


@dataclass(frozen=True)
class View:
    """What one benchmark's table shows.

    primary: the metric shown as p50 (p20–p80) in the first value column (rows without it are
    skipped). extras: further metrics, p50 only, when any row has them. ratios: (provider, kind):
    `speedup` = the baseline's primary p50 / the row's (higher is better; the inverse when
    `higher_is_better`), `multiple` = the row's p50 / the baseline's. phases: when set, one row per
    (shape, provider): primary and extras from mode `total`, then one column per phase (mode) with
    that mode's primary p50.
    """

    primary: str = "time"
    extras: tuple[str, ...] = ("peak_extra_memory",)
    ratios: tuple[tuple[str, str], ...] = ()
    higher_is_better: bool = False
    phases: tuple[str, ...] = ()
    total: str = "step"


RL_PHASES = ("gen", "sync", "reward", "old_logp", "update", "other")
ASYNC_EXTRAS = ("steps_per_min", "gen_tokens_per_s", "rollout_idle", "trainer_idle")
ASYNC_EXTRAS += ("overlap_efficiency", "final_val_accuracy", "val_accuracy_delta")
FLOORS = (("naive", "speedup"), ("sgemm-floor", "multiple"))
# in the document's order; benchmarks not named here get View() and follow in name order
VIEWS: dict[str, View] = {
    "rl_step": View(
        extras=("tokens_per_s", "peak_memory"), ratios=(("trl", "speedup"),), phases=RL_PHASES
    ),
    "trl_real": View(
        extras=("mfu", "peak_memory"), ratios=(("trl", "speedup"),), phases=("gen", *RL_PHASES[2:])
    ),
    "train_step": View(
        extras=("tokens_per_s", "peak_extra_memory"), ratios=(("transformers-padded", "speedup"),)
    ),
    "linear_logprob_entropy": View(ratios=FLOORS),
    "linear_ppo_loss": View(ratios=FLOORS),
    "ppo_loss": View(ratios=(("naive", "speedup"),)),
    "advantages": View(ratios=(("python-loop", "speedup"),)),
    "rewards": View(extras=("throughput",), ratios=(("naive", "speedup"),)),
    "rollout": View(extras=("tokens_per_s",), ratios=(("transformers", "speedup"),)),
    "collectives": View("busbw", ("time",), (("nccl-tests", "multiple"),), higher_is_better=True),
    "embedded_default": View(
        primary="accuracy_after_mean_last3", extras=("accuracy_before", "accuracy_max", "wall_time")
    ),
    "async_rl": View("train_time", ASYNC_EXTRAS, (("sync", "speedup"),)),
    "prompt_scheduling": View(
        primary="gen_tokens_per_kept_group",
        extras=("kept_group_fraction", "val_accuracy", "wall_time"),
        ratios=(("dynamic-sampling", "multiple"),),
    ),
}

LABELS = {
    "peak_extra_memory": "peak extra memory",
    "peak_memory": "peak memory",
    "tokens_per_s": "throughput",
    "accuracy_after_mean_last3": "accuracy after (mean of last 3)",
    "gen_tokens_per_kept_group": "generated tokens per kept group",
    "kept_group_fraction": "kept groups",
    "val_accuracy": "held-out accuracy (mean of last 3)",
    "train_time": "training time",
    "final_val_accuracy": "held-out accuracy (last step)",
    "val_accuracy_delta": "accuracy vs sync",
}  # any other metric: its name with spaces for underscores
KEY_COLUMNS = ("shape", "mode", "provider")
NOT_RECORDED = "command not recorded (row written before the CSV had it)"


def num(x: float) -> str:
    """About 3 significant digits, thousands separated."""
    for bound, form in ((100, ",.0f"), (10, ".1f"), (1, ".2f")):
        if abs(x) >= bound:
            return f"{x:{form}}"
    return "0" if x == 0 else f"{x:#.3g}"


def spread(r: dict) -> str:
    if r["p20"] == r["p50"] == r["p80"]:
        return num(r["p50"])
    return f"{num(r['p50'])} ({num(r['p20'])}–{num(r['p80'])})"


def label(metric: str, unit: str) -> str:
    name = LABELS.get(metric, metric.replace("_", " "))
    return f"{name} ({unit})" if unit else name


class _Table:
    """One benchmark's table on one machine: its (shape, mode, provider) rows (those with the
    primary metric) and the phase, extra and ratio columns any of them has."""

    def __init__(self, view: View, device: str, rows: list[dict]):
        self.view, self.device, self.new = view, device, newest(rows)
        run_key = lambda r: (r["timestamp"], r["shape"], r["mode"], r["provider"], r["metric"])
        self.by_run = {run_key(r): r for r in rows}
        shapes, modes, providers = ([*dict.fromkeys(r[k] for r in rows)] for k in KEY_COLUMNS)
        modes = [view.total] if view.phases else modes
        keys = [(s, m, p) for s in shapes for m in modes for p in providers]
        self.keys = [k for k in keys if self.get(*k, view.primary)]
        has_phase = lambda ph: any(self.get(s, ph, p, view.primary) for s, _, p in self.keys)
        self.phases = [ph for ph in view.phases if has_phase(ph)]
        self.extras = [e for e in view.extras if any(self.get(*k, e) for k in self.keys)]
        has_base = lambda b: any(self.baseline(self.get(*k, view.primary), k, b) for k in self.keys)
        self.ratios = [(b, kind) for b, kind in view.ratios if has_base(b)]

    def get(self, s, m, p, metric):
        return self.new.get((self.device, s, m, p, metric))

    def baseline(self, r: dict, key, b) -> dict | None:
        """Provider `b`'s row of the same invocation as `r` (ratios never compare runs)."""
        return self.by_run.get((r["timestamp"], key[0], key[1], b, self.view.primary))

    def unit(self, metric: str, phase: bool) -> str:
        """The unit of `metric` (a phase: the primary's in that mode) in the first row having it."""
        if phase:
            cells = (self.get(s, metric, p, self.view.primary) for s, _, p in self.keys)
        else:
            cells = (self.get(*k, metric) for k in self.keys)
        return next(c["unit"] for c in cells if c)

    def cells(self, key) -> list[dict]:
        """The rows behind one table row's cells (for the run numbers)."""
        (s, _, p), primary = key, self.view.primary
        cells = [self.get(*key, primary)] + [self.get(*key, e) for e in self.extras]
        return [c for c in cells + [self.get(s, ph, p, primary) for ph in self.phases] if c]

    def head(self, show_shape: bool, show_mode: bool, many_runs: bool) -> list[str]:
        view = self.view
        head = ["shape"] * show_shape + ["mode"] * show_mode + ["provider"]
        primary = label(view.primary, self.get(*self.keys[0], view.primary)["unit"])
        head.append(f"{view.total} {primary}" if view.phases else primary)
        head += [f"speed-up vs {b}" if kind == "speedup" else f"÷ {b}" for b, kind in self.ratios]
        head += [f"{ph} ({self.unit(ph, True)})" for ph in self.phases]
        return head + [label(e, self.unit(e, False)) for e in self.extras] + ["run"] * many_runs

    def line(self, key, shown: tuple[bool, bool], runs: list[int]) -> list[str]:
        """One table row: the primary metric and its spread, ratios, phases, extras, run numbers."""
        (s, m, p), view = key, self.view
        r = self.get(s, m, p, view.primary)
        line = [s] * shown[0] + [m] * shown[1] + [p, spread(r)]
        line += [_ratio(view, kind, r, self.baseline(r, key, b)) for b, kind in self.ratios]
        values = [self.get(s, ph, p, view.primary) for ph in self.phases]
        values += [self.get(*key, e) for e in self.extras]
        line += [num(v["p50"]) if v else "–" for v in values]
        return line + ([", ".join(str(n) for n in runs)] if runs else [])

    def notes(self) -> list[str]:
        view, prim = self.view, (self.get(*k, self.view.primary) for k in self.keys)
        timed = any(r["p20"] != r["p80"] for r in prim)
        notes = [f"{view.primary}: p50 (p20–p80) of the timed repetitions; other columns p50."]
        notes = notes if timed else []
        for b, kind in self.ratios:
            if kind == "speedup":
                what = f"the row's ÷ {b}'s" if view.higher_is_better else f"{b}'s ÷ the row's"
                notes.append(f"speed-up vs {b}: {what} {view.primary} p50, both from the same run.")
            else:
                notes.append(
                    f"÷ {b}: the row's {view.primary} p50 ÷ {b}'s, both from the same run."
                )
        if view.phases:
            notes.append(f"Phase columns: p50 {view.primary} of each phase of the {view.total}.")
        return [" ".join(notes), ""] if notes else []


def _ratio(view: View, kind: str, row: dict, base: dict | None) -> str:
    if base is None or row["p50"] == 0 or base["p50"] == 0:
        return "–"
    if kind == "multiple":
        return f"{row['p50'] / base['p50']:.2f}"
    x = row["p50"] / base["p50"] if view.higher_is_better else base["p50"] / row["p50"]
    return f"{num(x)}×"


def render_device(name: str, view: View, device: str, rows: list[dict]) -> list[str]:
    """The table and run list of one benchmark on one machine (rows: all its rows there)."""
    t = _Table(view, device, rows)
    if not t.keys:
        return []
    used = [t.cells(k) for k in t.keys]
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
        body.append(t.line(key, shown, ns))
    head = t.head(*shown, len(runs) > 1)
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    out += ["", *t.notes(), "Runs:" if len(runs) > 1 else "Run:", ""]
    for (stamp, command), r in runs.items():
        cmd = f"`{command}`" if command else NOT_RECORDED
        tag = f"{number[(stamp, command)]}. " if len(runs) > 1 else "- "
        words = r["versions"].split()
        threads = [w for p in ("threads=", "OMP_NUM_THREADS=") for w in words if w.startswith(p)]
        machine = f"{device}, {(threads or ['threads not recorded'])[0]}"
        out.append(f"{tag}{cmd} — {machine}, {stamp[:16].replace('T', ' ')}, rev `{r['git_rev']}`")
    return out + [""]


def render(name: str, rows: list[dict], view: View | None = None) -> list[str]:
    """`render_device` for every machine of `rows` (`view`: default the benchmark's in VIEWS)."""
    view, out = view or VIEWS.get(name, View()), []
    for device in dict.fromkeys(r["device"] for r in rows):
        out += render_device(name, view, device, [r for r in rows if r["device"] == device])
    return out


def summary(name: str, rows: list[dict], view: View | None = None) -> str:
    """One invocation's rows as docs/results.md shows them, for the console."""
    rows = [dict(r, command=r.get("command") or command_line()) for r in rows]
    return "\n".join(render(name, rows, view))


# the command that writes a results PNG, by its stem; PNGs not named here are linked without one
PNG_SOURCES = {
    "{name}": "python -m benchmarks {name}",  # rl_step, collectives, ...: <csv stem>.png
    "{name}_time": "python -m benchmarks plot {name}",
    "{name}_memory": "python -m benchmarks plot {name}",
    "rl_step_scaling": "python -m benchmarks rl_step --scaling",
}


def _render_folder(results: Path, doc: Path) -> list[str]:
    """The tables and plot links of the CSVs and PNGs directly in `results`: each PNG goes to the
    longest benchmark name its stem is or starts with + '_'."""
    from benchmarks.__main__ import available  # the first lines of the benchmarks' docstrings

    found = {p.stem: read_csv(p) for p in sorted(results.glob("*.csv"))}
    found = {n: rows for n, rows in found.items() if rows}
    order = [n for n in VIEWS if n in found] + sorted(n for n in found if n not in VIEWS)
    pngs: dict[str, list[Path]] = {n: [] for n in order}
    for png in sorted(results.glob("*.png")):
        owners = [n for n in order if png.stem == n or png.stem.startswith(n + "_")]
        if owners:
            pngs[max(owners, key=len)].append(png)
    docs = {name: doc for name, (_, doc) in available().items()}
    base = Path(os.path.relpath(results.resolve(), Path(doc).resolve().parent)).as_posix()
    out = []
    for name in order:
        body = render(name, found[name])
        if not body:
            continue
        if docs.get(name):
            body[2:2] = [docs[name], ""]
        out += body
        links = []
        for png in pngs[name]:
            sources = (c for stem, c in PNG_SOURCES.items() if png.stem == stem.format(name=name))
            command = next(sources, None)
            link = f"[{png.name}]({base}/{png.name})"
            links.append(f"{link} (`{command.format(name=name)}`)" if command else link)
        out += ["Plots: " + ", ".join(links) + ".", ""] if links else []
    return out


# sub-folders of the results folder rendered after it, each under its own heading (their rows come
# from another machine: kept apart so that plots never mix machines)
SUBFOLDERS = {
    "gpu": "GPU runs (a lent H200; `bash benchmarks/gpu_check.sh`, which writes to "
    "benchmarks/results/gpu)",
}


def generate(results: Path = RESULTS_DIR, doc: Path = DOC) -> str:
    """The block between the markers (without them), from the CSVs in `results` and SUBFOLDERS."""
    body = _render_folder(results, doc)
    for sub, heading in SUBFOLDERS.items():
        lines = _render_folder(results / sub, doc) if (results / sub).is_dir() else []
        body += [f"#### {heading}", "", *lines] if lines else []
    return "\n".join(["", GENERATED, "", *(body or ["No results yet.", ""])])


def splice(text: str, block: str) -> str:
    """`text` with the part between the markers replaced by `block`; ValueError without them."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + block.strip("\n") + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparser("readme", __doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the block is stale; no writes")
    p.add_argument("--doc", default=str(DOC), help="the markdown file with the block to write")
    p.add_argument("--results", default=str(RESULTS_DIR), help="folder of the CSVs and PNGs")
    args = p.parse_args(argv)
    doc = Path(args.doc)
    text = doc.read_text()
    try:
        new = splice(text, generate(Path(args.results), doc))
    except ValueError as exc:
        print(f"{doc}: {exc}", file=sys.stderr)
        return 1
    if args.check and new != text:
        stale = "the performance tables are stale; run `python -m benchmarks readme`"
        print(f"{doc}: {stale}", file=sys.stderr)
        return 1
    if args.check:
        print(f"{doc}: the performance tables are up to date")
    elif new != text:
        doc.write_text(new)
        print(f"{doc}: performance tables regenerated")
    else:
        print(f"{doc}: already up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
