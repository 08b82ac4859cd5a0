"""Run reporting: metrics.jsonl (one object per step), TensorBoard when installed, a summary line per step on
rank 0, the final checkpoint export, and a PNG of the training curves with reference resets marked."""

from __future__ import annotations

import json
import os

SUMMARY_KEYS = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("val/accuracy", "val", "{:.3f}"),
    ("actor/entropy", "H", "{:.3f}"),
    ("actor/kl_mean", "kl", "{:.2e}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("dynamic_sampling/pass_rate", "pass", "{:.2f}"),
    ("timing_s/step", "s", "{:.2f}"),
)


class Reporter:
    def __init__(self, cfg, rank: int):
        self.cfg, self.rank = cfg, rank
        self.dir = cfg.output_dir
        self.path = os.path.join(self.dir, "metrics.jsonl")
        self.tb = None
        self.val_history: list[tuple[int, float]] = []
        if rank == 0:
            os.makedirs(self.dir, exist_ok=True)
            if cfg.trainer.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(os.path.join(self.dir, "tensorboard"))
                except ImportError:
                    self.tb = None  # tensorboard not installed: JSONL only

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def save_config(self, text: str) -> None:
        with open(os.path.join(self.dir, "config.yaml"), "w") as f:
            f.write(text)

    def resume(self, step: int) -> None:
        """Drop metrics of steps after the checkpoint (they are about to be redone) and reload history."""
        rows = []
        if os.path.exists(self.path):
            rows = [json.loads(line) for line in open(self.path)]
        rows = [r for r in rows if r.get("step", 0) <= step]
        self.val_history = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
        if self.rank == 0:
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)

    def validation(self, step: int, acc: float) -> None:
        self.val_history.append((step, acc))
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "val/accuracy": acc}) + "\n")

    def log(self, metrics: dict) -> None:
        if "val/accuracy" in metrics:
            self.val_history.append((metrics["step"], metrics["val/accuracy"]))
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, metrics["step"])
        if metrics["step"] % max(self.cfg.trainer.log_every, 1) == 0 or "val/accuracy" in metrics:
            parts = [f"step {metrics['step']:>5}"]
            for key, short, fmt in SUMMARY_KEYS:
                if key in metrics:
                    parts.append(f"{short} {fmt.format(metrics[key])}")
            if metrics.get("ref/reset_reason"):
                parts.append(f"[ref reset: {metrics['ref/reset_reason']}]")
            print("  ".join(parts), flush=True)

    def finish(self, trainer) -> str | None:
        """Export the final policy (HF format) and the curves; returns the closing summary (rank 0)."""
        if self.rank != 0:
            return None
        from prorl.engine.model import save_hf

        out = os.path.join(self.dir, "checkpoints", "final")
        save_hf(trainer.policy, out)
        trainer.tokenizer.save_pretrained(out)
        png = plot_run(self.path, os.path.join(self.dir, "training_curves.png"))
        if self.tb is not None:
            self.tb.close()
        before = self.val_history[0][1] if self.val_history else float("nan")
        last = [a for _, a in self.val_history[-3:]]
        after = sum(last) / len(last) if last else float("nan")
        return (
            f"prorl: held-out accuracy {before:.1%} -> {after:.1%} "
            f"(mean of the last {len(last)} evaluations)\n"
            f"prorl: metrics {self.path}\nprorl: checkpoint {out}\nprorl: curves {png}"
        )


def plot_run(metrics_path: str, png_path: str, control: list[tuple[int, float]] | None = None) -> str:
    """Reward, accuracy, entropy, KL and response length against step, reference resets as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path)]
    steps = [r for r in rows if "critic/score/mean" in r]
    vals = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    resets = [r["step"] for r in steps if r.get("ref/reset_reason")]
    panels = [
        ("critic/score/mean", "train reward (raw)"),
        ("val/accuracy", "held-out accuracy"),
        ("actor/entropy", "entropy"),
        ("actor/kl_mean", "KL to reference"),
        ("response_length/mean", "response length"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels):
        if key == "val/accuracy":
            ax.plot([s for s, _ in vals], [a for _, a in vals], "o-", label="RL")
            if control:
                ax.plot([s for s, _ in control], [a for _, a in control], "s--", label="SFT control")
                ax.legend()
        else:
            ax.plot([r["step"] for r in steps], [r[key] for r in steps], lw=1)
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
