"""RL that makes a real model better on the CPU: SmolLM2-135M-Instruct, held-out pass@1 / pass@4.

    OMP_NUM_THREADS=1 python -m benchmarks real_model [--seeds 1,2] [--jobs 2] [--work DIR]
    python -m benchmarks real_model --quick        # smoke test: 1 seed x 2 tiny steps (~1 min)
    python -m benchmarks real_model --report-only  # rows, curves and section of the runs in --work

Every run is `python prorl/train.py --config smollm2_digit_sums seed=S` on one thread (the preset:
prorl/configs/smollm2_digit_sums.yaml; the model: `python -m prorl.model_dir from-gguf`). Its
validation samples (trainer.val_save_samples) give the wrong answers' classes before and after RL.
Writes real_model.csv (seed, step, metric, value), real_model.md, real_model.png, and the section
between the markers in docs/real-model.md (`--doc`). Details: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks import harness
from benchmarks.plot import pyplot, save
from prorl.config import load_config

NAME, PRESET = "real_model", "smollm2_digit_sums"
DOC = harness.REPO_ROOT / "docs" / "real-model.md"
BEGIN, END = "<!-- real_model:begin -->", "<!-- real_model:end -->"
METRICS = {  # CSV metric -> metrics.jsonl key
    "val_pass@1": "val/accuracy",
    "val_pass@4": "val/pass@4",
    "train_pass_rate": "dynamic_sampling/pass_rate",  # every sampled answer, T 1.0
    "score": "critic/score/mean",  # the kept groups'
    "kl": "actor/kl_mean",
    "entropy": "actor/entropy",
    "response_length": "response_length/mean",
    "step_time": "timing_s/step",
}
QUICK = ["trainer.total_steps=2", "trainer.val_every=2", "data.val_size=2"]
QUICK += ["trainer.val_samples=2", "data.train_size=8", "trainer.prompts_per_step=2"]
QUICK += ["rollout.n=4", "rollout.max_response_tokens=24", "algorithm.dynamic_sampling=false"]
CLASSES = (  # the classes of a validation answer, in the table's order
    "correct",
    "boxed, wrong sum of the asked terms",
    "boxed, wrong number, a term dropped or miscopied",
    "empty \\boxed{}",
    "no \\boxed{}, right sum in the text",
    "no \\boxed{}, no right sum",
    "cut at the token limit, no \\boxed{}",
)


def classify(response: str, finish_reason: str, correct: bool, truth: str, terms=()) -> str:
    """One of CLASSES: the last `\\boxed{...}`'s content decides (empty, or a wrong number: an
    arithmetic slip when the answer's opening "a + b + c =" restates the asked `terms`, else a
    miscopied problem); without one, whether the text was cut by the token limit, or else states
    the right sum as its last number (a format failure) or not."""
    if correct:
        return CLASSES[0]
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", response)
    if boxes:
        if not boxes[-1].strip():
            return CLASSES[3]
        restated = re.match(r"\s*(\d+(?:\s*\+\s*\d+)*)\s*=", response)
        copied = restated and [int(t) for t in restated.group(1).split("+")] == list(terms)
        return CLASSES[1] if copied else CLASSES[2]
    if finish_reason == "length":
        return CLASSES[6]
    numbers = re.findall(r"-?\d+", response)
    return CLASSES[4] if numbers and numbers[-1] == truth else CLASSES[5]


def asked_terms(example) -> list[int]:
    """The terms of an instructed problem, "What is 3 + 8 + 5? ..." (its last message)."""
    m = re.match(r"What is ([0-9 +]+)\?", example.prompt[-1]["content"])
    return [int(t) for t in m.group(1).split("+")] if m else []


def answer_classes(run: Path) -> dict[int, Counter]:
    """{validation step: Counter of CLASSES} from the run's val_samples.jsonl; the ground truths
    are the held-out problems the trainer drew (its config's task, size and seed)."""
    from omegaconf import OmegaConf

    from prorl import data

    path = run / "val_samples.jsonl"
    if not path.exists():
        return {}
    cfg = OmegaConf.load(run / "config.yaml")
    size = cfg.data.val_size or None  # as prorl/train.py's load_examples draws them
    val = data.builtin(cfg.data.builtin_task, n=size, seed=cfg.seed, split="val")
    out: dict[int, Counter] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        ex = val[r["index"]]
        kind = classify(
            r["response"], r["finish_reason"], r["correct"], ex.ground_truth, asked_terms(ex)
        )
        out.setdefault(int(r["step"]), Counter())[kind] += 1
    return out


def rows_of(seed: int, run: Path) -> list[dict]:
    """The long-format rows (seed, step, metric, value) of one run: METRICS from metrics.jsonl,
    and per validation the count of each answer class (metric `answers/<class>`)."""
    out = []
    for r in harness.read_metrics(run):
        step = int(r.get("step", 0))
        out += [
            dict(seed=seed, step=step, metric=m, value=float(r[k]))
            for m, k in METRICS.items()
            if k in r
        ]
    for step, counts in answer_classes(run).items():
        out += [
            dict(seed=seed, step=step, metric=f"answers/{c}", value=float(counts[c]))
            for c in CLASSES
        ]
    return out


def series(rows: list[dict], seed: int, metric: str) -> list[tuple[int, float]]:
    return sorted(
        (r["step"], r["value"]) for r in rows if r["seed"] == seed and r["metric"] == metric
    )


def run_seeds(seeds: list[int], work: Path, extra: list[str], parallel: int) -> None:
    """Train one run per seed, `parallel` at a time, one thread each (a run restarts from
    scratch); once all have ended, raises with a failed run's log tail."""
    io = dict(cwd=harness.REPO_ROOT, env=dict(os.environ, **harness.TRAIN_ENV))
    pending, running, failed = list(seeds), {}, []
    while pending or running:
        while pending and len(running) < parallel:
            seed = pending.pop(0)
            out = work / f"s{seed}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            log = open(out / "train.log", "w")
            run = ["--config", PRESET, f"output_dir={out}", f"seed={seed}", *extra]
            cmd = harness.train_command(None, *run)
            running[seed] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **io), log)
            print(f"{NAME}: started seed {seed} -> {out}", flush=True)
        time.sleep(1.0)
        for seed, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[seed]
            status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
            print(
                f"{NAME}: seed {seed} {status}; log {work / f's{seed}' / 'train.log'}", flush=True
            )
            failed += [seed] if proc.returncode else []
    if failed:  # after the other seeds have finished: their runs are reported either way
        tail = (work / f"s{failed[0]}" / "train.log").read_text()[-3000:]
        raise RuntimeError(f"seeds {failed} failed; the first's log ends:\n{tail}")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def markdown(rows: list[dict], seeds: list[int]) -> str:
    """Per seed, held-out pass@1 and pass@4 before RL and at the last validation (and the best
    pass@1), the training steps logged; then the answer classes at the first and the last
    validation, summed over the seeds validated after RL (a run that stopped before its second
    validation has no "after")."""
    head = "| seed | steps | pass@1 % before → after (best) | pass@4 % before → after |"
    lines, changes = [head, "|---|---|---|---|"], []
    first, last = Counter(), Counter()
    for s in seeds:
        p1, p4 = series(rows, s, "val_pass@1"), series(rows, s, "val_pass@4")
        if not p1:
            continue
        trained = max([st for st, _ in series(rows, s, "step_time")], default=0)
        if len(p1) < 2:
            lines.append(f"| {s} | {trained} | {_pct(p1[0][1])} → - (stopped) | - |")
            continue
        best = max(y for _, y in p1)
        lines.append(
            f"| {s} | {trained} | {_pct(p1[0][1])} → {_pct(p1[-1][1])} ({_pct(best)}) | "
            f"{_pct(p4[0][1]) if p4 else '-'} → {_pct(p4[-1][1]) if p4 else '-'} |"
        )
        changes.append(f"{100 * (p1[-1][1] - p1[0][1]):+.1f}")
        for c in CLASSES:
            got = dict(series(rows, s, f"answers/{c}"))
            first[c] += got.get(p1[0][0], 0)
            last[c] += got.get(p1[-1][0], 0)
    table = "\n".join(lines) + "\n"
    table += f"\nHeld-out pass@1 change per seed (points): {', '.join(changes) or '-'}.\n"
    if sum(first.values()):
        table += "\nHeld-out answers (those seeds' samples) before → after RL:\n\n"
        table += "| answer | before RL | after RL |\n|---|---|---|\n"
        table += "".join(f"| {c} | {first[c]:.0f} | {last[c]:.0f} |\n" for c in CLASSES)
    return table


def figure(rows: list[dict], seeds: list[int], png: Path) -> Path:
    """Held-out pass@1 (solid) and pass@4 (dashed) per seed against the step, and the fraction of
    each step's sampled answers that were right."""
    plt = pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, s in enumerate(seeds):
        colour = f"C{i}"
        for metric, style in (("val_pass@1", "-o"), ("val_pass@4", "--s")):
            pts = series(rows, s, metric)
            if pts:
                ax0.plot(*zip(*pts), style, color=colour, label=f"seed {s} {metric[4:]}")
        pts = series(rows, s, "train_pass_rate")
        if pts:
            ax1.plot(*zip(*pts), color=colour, label=f"seed {s}")
    ax0.set(xlabel="RL step", ylabel="held-out pass@k (4 samples, T 0.6)", ylim=(0, 1))
    ax1.set(xlabel="RL step", ylabel="training samples right (pass rate, T 1.0)")
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, oneshot/digit_sums, --config smollm2_digit_sums")
    return save(fig, png, 110)


def splice_doc(doc: Path, text: str) -> None:
    """Replace the part of `doc` between BEGIN and END with `text` (ValueError without them)."""
    body = doc.read_text()
    start, end = body.find(BEGIN), body.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{doc}: no {BEGIN} ... {END} block")
    doc.write_text(body[: start + len(BEGIN)] + "\n" + text.strip("\n") + "\n" + body[end:])


def _args(argv) -> argparse.Namespace:
    ap = harness.argparser(NAME, __doc__)
    add = ap.add_argument
    add("--seeds", type=harness.ints, default=[1, 2], help="comma-separated")
    add("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    add("--set", action="append", default=[], help="a dotted override for every run (repeatable)")
    add("--work", type=Path, default=harness.REPO_ROOT / "runs" / NAME, help="run directories")
    add("--results", type=Path, default=harness.RESULTS_DIR, help="where rows and figures go")
    add("--doc", type=Path, default=DOC, help="the markdown file whose section is written")
    add("--report-only", action="store_true", help="no training: report the runs in --work")
    add("--quick", action="store_true", help="1 seed x 2 tiny steps: a smoke test")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    seeds, extra = args.seeds, list(args.set)
    if args.quick:
        seeds, extra = seeds[:1], QUICK + extra
    load_config(PRESET, extra)  # a bad --set is named before anything runs
    t0 = time.time()
    if not args.report_only:
        run_seeds(seeds, args.work, extra, args.jobs)
    rows = [r for s in seeds for r in rows_of(s, args.work / f"s{s}")]
    args.results.mkdir(parents=True, exist_ok=True)
    with open(args.results / f"{NAME}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["seed", "step", "metric", "value"])
        w.writeheader()
        w.writerows(dict(r, value=f"{r['value']:.6g}") for r in rows)
    argv_text = sys.argv[2:] if argv is None else argv
    cmd = shlex.join(["python", "-m", "benchmarks", NAME, *argv_text])
    text = markdown(rows, seeds) + f"\nCommand: `{cmd}`"
    if not args.report_only:
        cpu = harness.device_name("cpu")
        text += f"; wall time {time.time() - t0:.0f} s ({args.jobs} at a time) on {cpu}"
    text += ".\n"
    (args.results / f"{NAME}.md").write_text(text)
    png = figure(rows, seeds, args.results / f"{NAME}.png")
    splice_doc(
        args.doc, text + f"\n![held-out pass@k per seed]({os.path.relpath(png, args.doc.parent)})\n"
    )
    print(text)
    written = [args.results / f"{NAME}.csv", args.results / f"{NAME}.md", png, args.doc]
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
