"""Run reporting: metrics.jsonl (one object per step), TensorBoard when installed, a summary line
per step on rank 0, the final checkpoint export, a PNG of the training curves (reference resets
marked, length-penalty phases shaded, clip fractions, time per phase) and a short text summary.

The report can be made again from a run directory at any time, also of a run in progress or one that
was stopped:

    python -m prorl.report runs/20261129-203100   # -> training_curves.png, summary.txt, printed

The console line of a step (every logging.log_every steps, and at validations), in a terminal under
a progress bar and in a log file (SLURM, nohup) alike:

    step 12/300  score 0.412  val 0.380  H 0.731  kl 1.2e-04  len 211.0  pass 0.43  s 4.10  eta 20m

step/total; score: critic/score/mean (the verifier's raw score of the trained responses); val:
val/accuracy (at validations); H: actor/entropy; kl: actor/kl_mean (to the reference); len:
response_length/mean; pass: dynamic_sampling/pass_rate (every sampled response, kept or not); s:
timing_s/step; eta: the steps left x this process's mean step time. A step that learnt nothing
prints `EMPTY` and its reason on a WARNING line instead of the scores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from prorl.config import to_dict
from prorl.generation_config import write_generation_config

SUMMARY_KEYS = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("val/accuracy", "val", "{:.3f}"),
    ("actor/entropy", "H", "{:.3f}"),
    ("actor/kl_mean", "kl", "{:.2e}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("dynamic_sampling/pass_rate", "pass", "{:.2f}"),
    ("timing_s/step", "s", "{:.2f}"),
)
# the phases of a step, stacked in the timing panel (timing_s/step is their sum plus bookkeeping)
SCHEDULER_STATES = ("unseen", "mixed", "solved", "unsolved", "excluded", "reprobes")
TIMING_KEYS = (
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/adv",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/update_actor",
    "timing_s/update_weights",
)
# names of runs written before the metrics took verl's names (docs/recipe.md §9) -> their names now
LEGACY_NAMES = {
    "timing_s/old_logp": "timing_s/old_log_prob",
    "timing_s/update": "timing_s/update_actor",
    "timing_s/sync": "timing_s/update_weights",
    "timing_s/val": "timing_s/testing",
}
LAST_EVALS = 3  # "after" accuracy: mean of the last evaluations (one greedy evaluation is noisy)


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl; a torn last line (a crash mid-write) is ignored."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append({LEGACY_NAMES.get(k, k): v for k, v in row.items()})
    return rows


def _write_rows(path: str, rows: list[dict]) -> None:
    """Replace the file atomically: a kill during the rewrite leaves the old file, never half of
    one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def start_wandb(cfg):
    """A W&B run for `logging.wandb_project` (rank 0), the same one on every resume (its id kept in
    the run directory's `wandb_run_id`). WANDB_MODE=offline keeps it on disk."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            f"logging.wandb_project={cfg.logging.wandb_project!r} needs the wandb package: pip "
            "install wandb (or unset logging.wandb_project)"
        ) from exc

    # the run id lives in the run directory: a resumed run goes on logging into the same W&B run
    id_file = os.path.join(cfg.output_dir, "wandb_run_id")
    if os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
    return wandb.init(
        project=cfg.logging.wandb_project,
        config=to_dict(cfg),
        dir=cfg.output_dir,
        name=os.path.basename(os.path.normpath(cfg.output_dir)),
        id=run_id,
        resume="allow",
    )


class Reporter:
    def __init__(self, cfg, rank: int):
        self.cfg, self.rank = cfg, rank
        self.dir = cfg.output_dir
        self.path = os.path.join(self.dir, "metrics.jsonl")
        self.tb = None
        self.wandb = None
        self.bar = None
        self.val_history: list[tuple[int, float]] = []
        self.step_times: list[float] = []  # this process's steps, for the ETA
        if rank == 0:
            os.makedirs(self.dir, exist_ok=True)
            if cfg.logging.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(os.path.join(self.dir, "tensorboard"))
                except ImportError:
                    self.tb = None
                    print(
                        "prorl: warning: logging.tensorboard=true but tensorboard is not "
                        "installed (pip install tensorboard): metrics go to metrics.jsonl only",
                        flush=True,
                    )
            if cfg.logging.wandb_project:
                self.wandb = start_wandb(cfg)
            # a live progress bar for people; plain summary lines for log files
            if sys.stdout.isatty():
                from tqdm import tqdm

                self.bar = tqdm(total=cfg.trainer.total_steps, unit="step", dynamic_ncols=True)

    def say(self, text: str) -> None:
        if self.rank == 0:
            self._print(text)

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def save_config(self, text: str) -> None:
        with open(os.path.join(self.dir, "config.yaml"), "w") as f:
            f.write(text)

    def start(self) -> int:
        """A run from step 0: rows of an earlier attempt that saved no checkpoint are dropped
        (counted)."""
        return self.resume(-1)

    def resume(self, step: int) -> int:
        """Drop metrics (and saved validation samples) of steps after the checkpoint (they are
        about to be redone) and reload history. Returns how many metric rows were dropped
        (rank 0)."""
        if self.rank != 0:  # only rank 0 writes metrics or reads the history
            return 0
        samples = os.path.join(self.dir, "val_samples.jsonl")  # trainer.val_save_samples
        if os.path.exists(samples):
            _write_rows(samples, [r for r in read_metrics(samples) if r.get("step", 0) <= step])
        rows = read_metrics(self.path)
        kept = [r for r in rows if r.get("step", 0) <= step]
        self.val_history = [(r["step"], r["val/accuracy"]) for r in kept if "val/accuracy" in r]
        if os.path.exists(self.path):
            _write_rows(self.path, kept)
        return len(rows) - len(kept)

    def validation(self, step: int, metrics: dict, seconds: float | None = None) -> None:
        """A validation row outside a training step (the one before RL)."""
        self.val_history.append((step, metrics["val/accuracy"]))
        if self.rank == 0:
            self._write(
                {
                    "step": step,
                    **metrics,
                    **({"timing_s/testing": seconds} if seconds is not None else {}),
                }
            )

    def _write(self, row: dict) -> None:
        """One row to metrics.jsonl, TensorBoard and W&B (rank 0)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def log(self, metrics: dict) -> None:
        if "val/accuracy" in metrics:
            self.val_history.append((metrics["step"], metrics["val/accuracy"]))
        if self.rank != 0:
            return
        if validation_warning(metrics):
            self._print(validation_warning(metrics))
        self._write(metrics)
        if self.bar is not None:
            self.bar.n = metrics["step"]
            self.bar.refresh()
        if metrics.get("trainer/empty_reason"):  # loud, whatever logging.log_every says
            self._print(
                f"prorl: WARNING: step {metrics['step']} learnt nothing (counted as empty): "
                f"{metrics['trainer/empty_reason']}"
            )
        if "timing_s/step" in metrics:
            self.step_times.append(metrics["timing_s/step"])
        if metrics["step"] % max(self.cfg.logging.log_every, 1) == 0 or "val/accuracy" in metrics:
            self._print(self.summary_line(metrics))

    def summary_line(self, metrics: dict) -> str:
        """The console line of a step (module docstring)."""
        total = self.cfg.trainer.total_steps
        parts = [f"step {metrics['step']:>5}/{total}"]
        empty = metrics.get("trainer/empty_step")
        for key, short, fmt in SUMMARY_KEYS:
            if key in metrics and not (empty and key not in ("timing_s/step", "val/accuracy")):
                parts.append(f"{short} {fmt.format(metrics[key])}")
        if empty:
            parts.insert(1, "EMPTY")
        if self.step_times:
            left = max(total - metrics["step"], 0) * sum(self.step_times) / len(self.step_times)
            parts.append(f"eta {_duration(left)}")
        if metrics.get("ref/reset_reason"):
            parts.append(f"[ref reset: {metrics['ref/reset_reason']}]")
        return "  ".join(parts)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, trainer) -> str | None:
        """Export the final policy (HF format), the curves and the summary; returns the closing text
        (rank 0). Every rank calls it: gathering a sharded policy for the export is a collective."""
        out = os.path.join(self.dir, "checkpoints", "final")
        trainer.models.export_hf(out)
        if self.rank != 0:
            return None
        trainer.tokenizer.save_pretrained(out)
        write_generation_config(
            out, trainer.tokenizer, trainer.model_path, to_dict(self.cfg)["trainer"]
        )
        png = plot_run(self.path, os.path.join(self.dir, "training_curves.png"))
        self.close()
        summary = write_summary(self.dir)
        return (
            f"prorl: {accuracy_line(self.val_history, not self.cfg.reward.function)}\n"
            f"prorl: metrics {self.path}\nprorl: checkpoint {out}\nprorl: curves {png}\n"
            f"prorl: summary {summary}"
        )


def _duration(seconds: float) -> str:
    """12s, 19m40s, 3h05m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def accuracy_before_after(vals: list[tuple[int, float]]) -> tuple[float, float, int]:
    """(first evaluation, mean of the last LAST_EVALS after it, how many were averaged)."""
    if not vals:
        return float("nan"), float("nan"), 0
    last = [a for _, a in vals[1:][-LAST_EVALS:]] or [vals[0][1]]
    return vals[0][1], sum(last) / len(last), len(last)


def held_out(value: float, unit: bool) -> tuple[str, str]:
    """(what, value) of a validation's mean score: ("accuracy", a percentage) when scores lie in
    [0, 1] (the built-in verifiers: for binary ones the mean is pass@1), else ("mean score", the
    mean itself): a verl reward function may score -1 / +1 or anything finite, and then its mean
    is no accuracy."""
    return ("accuracy", f"{value:.1%}") if unit else ("mean score", f"{value:.4g}")


def accuracy_line(vals: list[tuple[int, float]], unit: bool = True) -> str:
    """The closing line on held-out accuracy (`unit`: scores in [0, 1]; else the mean score), or
    that nothing was validated."""
    if not vals:
        return "held-out accuracy not measured (no validation set, or trainer.val_every=0)"
    before, after, n = accuracy_before_after(vals)
    unit = unit and all(0.0 <= v <= 1.0 for _, v in vals)  # a mean outside [0, 1] is none
    (what, first), (_, last) = held_out(before, unit), held_out(after, unit)
    return f"held-out {what} {first} -> {last} (mean of the last {n} evaluations)"


def validation_warning(metrics: dict) -> str | None:
    """A warning when most of a validation's verifier calls failed (raised, died, timed out): they
    score 0, so the accuracy would measure the harness, not the model."""
    failed = metrics.get("val/verify_failed_frac", 0.0)
    if failed < 0.5:
        return None
    return (
        f"prorl: warning: {failed:.0%} of this validation's verifier calls failed (raised, died or "
        "timed out; see reward.timeout_s and the verifier's errors): its accuracy measures the "
        "verifier, not the model"
    )


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def summarize(run_dir: str) -> str:
    """A few lines about a run directory: steps, held-out accuracy before/after, resets, wall time
    and where it went. Wall time is the sum of the recorded step and validation times (start-up and
    checkpoint writes are not in metrics.jsonl)."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in rows if "critic/score/mean" in r]
    vals = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    total, function = None, None
    config = os.path.join(run_dir, "config.yaml")
    if os.path.exists(config):
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(config)
        total = cfg.get("trainer", {}).get("total_steps")
        function = cfg.get("reward", {}).get("function")
    last = steps[-1]["step"] if steps else 0
    lines = [f"run {run_dir}: {last} steps" + (f" of {total}" if total is not None else "")]
    if vals:
        before, after, n = accuracy_before_after(vals)
        # as the run's closing line: a reward function's scores need not lie in [0, 1]
        unit = not function and all(0.0 <= v <= 1.0 for _, v in vals)
        (what, first), (_, final) = held_out(before, unit), held_out(after, unit)
        lines.append(
            f"held-out {what} {first} (step {vals[0][0]}) -> {final} "
            f"(mean of the last {n} evaluations, step {vals[-1][0]})"
        )
    if steps:
        k = min(5, len(steps))
        first = sum(r["critic/score/mean"] for r in steps[:k]) / k
        final = sum(r["critic/score/mean"] for r in steps[-k:]) / k
        lines.append(
            f"train reward {first:.3f} -> {final:.3f} (mean of the first / last {k} steps)"
        )
        resets = [(r["step"], r["ref/reset_reason"]) for r in steps if r.get("ref/reset_reason")]
        lines.append(
            f"reference resets: {len(resets)}"
            + (" (" + ", ".join(f"step {s} {why}" for s, why in resets) + ")" if resets else "")
        )
    step_s = sum(r.get("timing_s/step", 0.0) for r in steps)
    if step_s:
        val_s = sum(r.get("timing_s/testing", 0.0) for r in rows)
        timed_val = any("timing_s/testing" in r for r in rows)
        parts = [
            f"{key.split('/')[1]} {sum(r.get(key, 0.0) for r in steps) / step_s:.0%}"
            for key in TIMING_KEYS
            if any(key in r for r in steps)
        ]
        timing = (
            f"wall time {_duration(step_s + val_s)} "
            f"(steps {_duration(step_s)}, validation {_duration(val_s)})"
            if timed_val
            else f"wall time in steps {_duration(step_s)} (validation not timed)"
        )
        lines.append(timing + (f"; of the steps: {', '.join(parts)}" if parts else ""))
    lines += _generation_lines(steps)
    return "\n".join(lines)


def _generation_lines(steps: list[dict]) -> list[str]:
    """Where generation went over the whole run (totals, not a mean of per-step ratios), and the
    prompt scheduler's last counts."""
    sampled = sum(r.get("dynamic_sampling/sampled_groups", 0.0) for r in steps)
    passed = sum(r.get("dynamic_sampling/passed_groups", 0.0) for r in steps)
    tokens = sum(r.get("dynamic_sampling/generated_tokens", 0.0) for r in steps)
    lines = []
    if sampled:
        per_kept = (
            f"{tokens / passed:.0f} generated response tokens per kept group"
            if passed
            else "none kept"
        )
        lines.append(
            f"generation: {passed / sampled:.1%} of {sampled:.0f} sampled groups kept; {per_kept}"
        )
    last = next((r for r in reversed(steps) if "scheduler/unseen" in r), None)
    if last is not None:
        states = ", ".join(
            f"{k} {last[f'scheduler/{k}']:.0f}"
            for k in SCHEDULER_STATES
            if f"scheduler/{k}" in last
        )
        lines.append(f"prompts at step {last['step']}: {states}")
    return lines


def write_summary(run_dir: str) -> str:
    path = os.path.join(run_dir, "summary.txt")
    with open(path, "w") as f:
        f.write(summarize(run_dir) + "\n")
    return path


def _draw_panel(ax, key: str, steps: list[dict], vals: list, control) -> None:
    """The curves of one panel of `plot_run`: a metric against step, or a composite (`clipfrac`,
    `timing`, `scheduler`, held-out accuracy with the SFT control)."""
    x = [r["step"] for r in steps]
    if key == "val/accuracy":
        ax.plot([s for s, _ in vals], [a for _, a in vals], "o-", label="RL")
        if control:
            ax.plot([s for s, _ in control], [a for _, a in control], "s--", label="SFT control")
            ax.legend()
    # clip-higher: the upper bound (1 + eps_high) and the lower (1 - eps_low)
    elif key == "clipfrac":
        for k, label in (
            ("actor/pg_clipfrac", "either side"),
            ("actor/pg_clipfrac_high", "high (A > 0)"),
            ("actor/pg_clipfrac_low", "low (A < 0)"),
        ):
            ax.plot(x, [r.get(k, float("nan")) for r in steps], lw=1, label=label)
        ax.legend(fontsize=8)
    elif key == "timing":
        present = [k for k in TIMING_KEYS if any(k in r for r in steps)]
        if present:
            ax.stackplot(
                x,
                *[[r.get(k, 0.0) for r in steps] for k in present],
                labels=[k[9:] for k in present],
            )
        ax.plot(
            x, [r.get("timing_s/step", float("nan")) for r in steps], "k-", lw=0.8, label="step"
        )
        # legend room
        ax.set_ylim(0, 1.4 * max([r.get("timing_s/step", 0.0) for r in steps] + [1e-3]))
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    elif key == "scheduler":
        for state in SCHEDULER_STATES[:4]:
            ax.plot(
                x, [r.get(f"scheduler/{state}", float("nan")) for r in steps], lw=1, label=state
            )
        ax.legend(fontsize=8)
    else:
        ax.plot(x, [r.get(key, float("nan")) for r in steps], lw=1)


def plot_run(
    metrics_path: str, png_path: str, control: list[tuple[int, float]] | None = None
) -> str:
    """Reward, accuracy, entropy, KL, response length, truncation, pass rate, clip fractions, grad
    norm, time per phase, kept groups and (with the scheduler on) prompts by state against step;
    reference resets as dashed lines, steps with the cosine length penalty on shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r for r in rows if "critic/score/mean" in r]
    vals = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    resets = [r["step"] for r in steps if r.get("ref/reset_reason")]
    panels = [
        ("critic/score/mean", "train reward (raw)"),
        ("val/accuracy", "held-out accuracy"),
        ("actor/entropy", "entropy"),
        ("actor/kl_mean", "KL to reference"),
        ("response_length/mean", "response length"),
        ("response_length/clip_ratio", "truncated responses (fraction)"),
        ("dynamic_sampling/pass_rate", "pass rate of sampled groups"),
        ("clipfrac", "clipped token fraction"),
        ("actor/grad_norm", "grad norm (before clipping)"),
        ("timing", "seconds per step"),
        ("dynamic_sampling/kept_group_fraction", "sampled groups kept (fraction)"),
    ]
    if any("scheduler/unseen" in r for r in steps):
        panels.append(("scheduler", "prompts by state (scheduler)"))
    cols = 4
    fig, axes = plt.subplots(3, cols, figsize=(4 * cols, 9.6))
    axes = axes.ravel()
    for ax in axes[len(panels) :]:
        ax.axis("off")
    for ax, (key, title) in zip(axes, panels):
        _draw_panel(ax, key, steps, vals, control)
        for s in resets:
            ax.axvline(s, color="grey", ls="--", lw=0.8)
        if key == "response_length/mean":  # steps where the cosine length penalty was on, shaded
            for r in steps:
                if r.get("reward/length_penalty/mean", 0.0) != 0.0:
                    ax.axvspan(r["step"] - 0.5, r["step"] + 0.5, color="orange", alpha=0.15, lw=0)
        ax.set_title(title)
        ax.set_xlabel("RL step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return png_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m prorl.report",
        description="Regenerate the curves PNG and the summary of a run",
    )
    ap.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--png", default=None, help="output PNG (default RUN_DIR/training_curves.png)")
    args = ap.parse_args(argv)
    metrics = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        print(
            f"prorl.report: {args.run_dir} has no metrics.jsonl (not a run directory?)",
            file=sys.stderr,
        )
        return 2
    png = plot_run(metrics, args.png or os.path.join(args.run_dir, "training_curves.png"))
    summary = write_summary(args.run_dir)
    print(open(summary).read(), end="")
    print(f"curves {png}\nsummary {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
