"""prorl/report.py: the run summary and curves regenerated from a run directory (`python -m
prorl.report`), on a metrics.jsonl written by hand, so every number in the summary is known by
construction."""

import json
import subprocess
import sys

import pytest

from prorl.report import read_metrics, summarize


def write_run(run_dir, torn_tail: bool = False, names: dict | None = None):
    """A 10-step run; `names` renames metrics (a run written under older names)."""
    names = names or {}
    rows = [{"step": 0, "val/accuracy": 0.25, "timing_s/testing": 6.0}]
    for step in range(1, 11):
        rows.append(
            {
                "step": step,
                "critic/score/mean": 0.1 * step,  # first 5 steps: mean 0.3, last 5: mean 0.8
                "actor/pg_clipfrac": 0.012,
                "actor/pg_clipfrac_high": 0.01,
                "actor/pg_clipfrac_low": 0.002,
                "actor/entropy": 0.5,
                "actor/kl_mean": 1e-3,
                "response_length/mean": 20.0,
                "reward/length_penalty/mean": -0.1 if step <= 2 else 0.0,
                "ref/reset_reason": "interval" if step in (4, 8) else "",
                "timing_s/gen": 6.0,
                "timing_s/reward": 1.0,
                "timing_s/old_log_prob": 1.0,
                "timing_s/update_actor": 2.0,
                "timing_s/step": 10.0,
            }
        )
        if step in (5, 10):
            rows[-1].update({"val/accuracy": 0.5 if step == 5 else 0.75, "timing_s/testing": 6.0})
    text = "".join(json.dumps({names.get(k, k): v for k, v in r.items()}) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + ('{"step": 11, "critic/sc' if torn_tail else ""))
    (run_dir / "config.yaml").write_text("trainer:\n  total_steps: 20\n")


def test_summary_numbers(tmp_path):
    write_run(tmp_path, torn_tail=True)  # a crash mid-write leaves a torn last line: ignored
    assert len(read_metrics(str(tmp_path / "metrics.jsonl"))) == 11
    lines = summarize(str(tmp_path)).splitlines()
    assert lines[0] == f"run {tmp_path}: 10 steps of 20"
    # before: step 0; after: mean of the evaluations after it (at most 3): (0.5 + 0.75) / 2
    assert (
        lines[1]
        == "held-out accuracy 25.0% (step 0) -> 62.5% (mean of the last 2 evaluations, step 10)"
    )
    assert lines[2] == "train reward 0.300 -> 0.800 (mean of the first / last 5 steps)"
    assert lines[3] == "reference resets: 2 (step 4 interval, step 8 interval)"
    # 10 steps of 10 s + 3 validations of 6 s
    assert lines[4] == (
        "wall time 1m58s (steps 1m40s, validation 18.0s); of the steps: gen 60%, reward 10%, "
        "old_log_prob 10%, update_actor 20%"
    )


def test_a_run_written_under_the_old_timing_names_reads_under_verls(tmp_path):
    """Runs from before the metrics took verl 0.9.1's names (old_logp, update, sync, val) read the
    same."""
    old = {"timing_s/old_log_prob": "timing_s/old_logp", "timing_s/update_actor": "timing_s/update",
           "timing_s/testing": "timing_s/val"}  # fmt: skip
    write_run(tmp_path, names=old)
    assert "timing_s/old_logp" in (tmp_path / "metrics.jsonl").read_text()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert rows[1]["timing_s/old_log_prob"] == 1.0 and "timing_s/old_logp" not in rows[1]
    assert rows[0]["timing_s/testing"] == 6.0
    assert "gen 60%, reward 10%, old_log_prob 10%, update_actor 20%" in summarize(str(tmp_path))


def test_summary_counts_generation_over_the_run_and_the_scheduler_states(tmp_path):
    write_run(tmp_path)
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    # steps 1..10: 8 groups sampled, step s keeps s // 2 + 1, 100 tokens per group
    for r in rows[1:]:
        kept = r["step"] // 2 + 1
        r.update(
            {
                "dynamic_sampling/sampled_groups": 8,
                "dynamic_sampling/passed_groups": kept,
                "dynamic_sampling/generated_tokens": 800,
                "dynamic_sampling/kept_group_fraction": kept / 8,
            }
        )
        r.update(
            {
                f"scheduler/{k}": v
                for k, v in zip(("unseen", "mixed", "solved", "unsolved"), (4, 3, 2, 1))
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = summarize(str(tmp_path)).splitlines()
    # kept: 1+2+2+3+3+4+4+5+5+6 = 35 of 80; 8000 tokens / 35 = 228.6 (a mean of the per-step ratios:
    # 283)
    assert lines[5] == (
        "generation: 43.8% of 80 sampled groups kept; 229 generated response tokens per kept group"
    )
    assert lines[6] == "prompts at step 10: unseen 4, mixed 3, solved 2, unsolved 1"


def test_command_line_regenerates_png_and_summary(tmp_path):
    write_run(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "prorl.report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "training_curves.png").stat().st_size > 10_000
    assert (tmp_path / "summary.txt").read_text() == summarize(str(tmp_path)) + "\n"
    assert "reference resets: 2" in proc.stdout

    missing = subprocess.run(
        [sys.executable, "-m", "prorl.report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr


def test_wandb_without_the_package_fails_with_the_install_hint(tmp_path, monkeypatch):
    import builtins

    from prorl.config import load_config
    from prorl.report import Reporter

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg = load_config("default", [f"output_dir={tmp_path}", "logging.wandb_project=demo"])
    with pytest.raises(ImportError, match="pip install wandb"):
        Reporter(cfg, rank=0)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "function, scores, shown",
    [(True, (0.25, 0.5), ("0.25", "0.5")), (False, (-0.5, 0.25), ("-0.5", "0.25"))],
)
def test_summary_prints_a_reward_function_s_mean_score_not_an_accuracy(
    tmp_path, function, scores, shown
):
    """A verl reward function's scores need not lie in {0, 1} (issue 41, item 8): summary.txt
    printed a -1 / +1 function's mean score as "held-out accuracy -50.0%". With a reward function,
    or any mean outside [0, 1], the line says "mean score"."""
    rows = [{"step": 0, "val/accuracy": scores[0]}, {"step": 5, "val/accuracy": scores[1]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = "reward:\n  function: /data/score.py\n" if function else ""
    (tmp_path / "config.yaml").write_text("trainer:\n  total_steps: 5\n" + reward)
    line = summarize(str(tmp_path)).splitlines()[1]
    assert line == (
        f"held-out mean score {shown[0]} (step 0) -> {shown[1]} "
        "(mean of the last 1 evaluations, step 5)"
    )


def test_resume_drops_the_saved_validation_samples_of_steps_it_redoes(tmp_path):
    """val_samples.jsonl follows metrics.jsonl on a resume: rows of steps after the checkpoint
    (about to be validated again) are dropped, so no step's answers are counted twice; a fresh
    start drops them all."""
    from prorl.config import load_config
    from prorl.report import Reporter

    samples = tmp_path / "val_samples.jsonl"
    rows = [{"step": s, "index": i} for s in (0, 4, 8) for i in range(2)]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reporter = Reporter(load_config("default", [f"output_dir={tmp_path}"]), rank=0)
    reporter.resume(4)
    assert [r["step"] for r in read_metrics(str(samples))] == [0, 0, 4, 4]
    reporter.start()
    assert read_metrics(str(samples)) == []
