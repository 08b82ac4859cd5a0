"""A step that teaches the policy nothing says so (issue 40): a loud console line naming the key to
change, `trainer/empty_step` 1 and the step counted towards trainer.max_consecutive_skips; and every
step row carries the same metric keys, whether it trained or not. In-process, tiny reasoner."""

import pytest
from tiny_trainer import make_trainer

from prorl.config import load_config
from prorl.report import Reporter
from prorl.trainer import TrainingStalled

BASE = ["trainer.prompts_per_step=4", "rollout.n=4", "reward.length_penalty=false",
        "trainer.mini_batches=1", "trainer.micro_batch_tokens=0", "logging.tensorboard=false",
        "algorithm.max_rounds=1"]  # fmt: skip


def make(setup, *overrides):
    return make_trainer(setup, [*BASE, *overrides])


def test_every_response_cut_is_an_empty_step_naming_the_budget(tiny_setup, tmp_path, capsys):
    """Every response cut at a 1-token budget, dynamic sampling off: the groups are trained on but
    their rewards (c_stop 0) and advantages are all 0. The step is empty, the console says why."""
    trainer = make(tiny_setup, "rollout.max_response_tokens=1", "algorithm.dynamic_sampling=false",
                   "trainer.max_consecutive_skips=2", f"output_dir={tmp_path}")  # fmt: skip
    m = trainer.step()
    assert m["response_length/clip_ratio"] == 1.0 and m["dynamic_sampling/kept_groups"] == 4
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (0.0, 0.0)
    assert m["trainer/empty_step"] == 1.0
    assert "rollout.max_response_tokens=1" in m["trainer/empty_reason"]
    assert "reward.c_stop=0" in m["trainer/empty_reason"]
    Reporter(trainer.cfg, 0).log(m)
    out = capsys.readouterr().out
    assert "WARNING: step 1 learnt nothing" in out and "rollout.max_response_tokens=1" in out
    with pytest.raises(TrainingStalled, match="2 consecutive steps learnt nothing"):
        trainer.step()


def test_every_step_row_carries_the_same_keys(tiny_setup):
    """Step 1 keeps no group (a 1-token budget: every group all wrong, dynamic sampling drops it);
    step 2 trains (the schedule raises the budget). Both rows have the same keys, verl's way."""
    trainer = make(tiny_setup, "rollout.max_response_tokens=1",
                   "rollout.max_response_schedule={1:40}", "algorithm.is_mode=tis",
                   "algorithm.max_rounds=6")  # fmt: skip
    empty, trained = trainer.step(), trainer.step()
    assert empty["trainer/empty_step"] == 1.0 and "no group kept" in empty["trainer/empty_reason"]
    assert trained["trainer/empty_reason"] == "", trained["trainer/empty_reason"]
    assert trained["trainer/empty_step"] == 0.0
    assert sorted(empty) == sorted(trained)
    for key in ("timing_s/adv", "timing_s/ref", "timing_s/update_actor", "rollout/is_mean"):
        assert empty[key] == 0.0 and key in trained


def test_memory_metrics_as_verl_logs_them(tiny_setup):
    """perf/cpu_memory_used_gb is psutil's virtual_memory().used in GiB (verl's formula; the host's
    memory moves between the two readings, hence the tolerance); CUDA's peaks only on CUDA."""
    psutil = pytest.importorskip("psutil")
    m = make(tiny_setup, "rollout.max_response_tokens=8").step()
    assert m["perf/cpu_memory_used_gb"] == pytest.approx(
        psutil.virtual_memory().used / 1024**3, abs=0.5
    )
    assert "perf/max_memory_allocated_gb" not in m  # the CPU run has no CUDA peak


def test_the_console_line_outside_a_terminal_has_step_total_eta_and_says_empty(tmp_path, capsys):
    """A log file (SLURM, nohup: no tty) gets step/total and an ETA from the mean step time; an
    empty step says EMPTY instead of scores of nothing."""

    cfg = load_config("default", [f"output_dir={tmp_path}", "trainer.total_steps=10",
                                  "logging.tensorboard=false"])  # fmt: skip
    rep = Reporter(cfg, 0)
    row = {"critic/score/mean": 0.5, "timing_s/step": 30.0, "trainer/empty_step": 0.0}
    rep.log({"step": 1, **row})
    rep.log({"step": 2, **row, "timing_s/step": 90.0, "trainer/empty_step": 1.0,
             "trainer/empty_reason": "no group kept"})  # fmt: skip
    first, warning, second = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("step     1/10") and "score 0.500" in first
    assert first.endswith("eta 4m30s")  # 9 steps x 30 s
    assert "WARNING: step 2 learnt nothing" in warning
    assert "EMPTY" in second and "score" not in second
    assert second.endswith("eta 8m00s")  # 8 steps x (30 + 90) / 2 s


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    """The W&B run id is kept in the run directory; a second start (a resume) passes the same id
    with resume='allow' (wandb itself stands in: it is not a dependency of the tests)."""
    import sys
    import types

    from prorl.report import start_wandb

    calls, ids = [], iter(["first1", "second2"])
    util = types.SimpleNamespace(generate_id=lambda: next(ids))
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or kw, util=util)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config("default", [f"output_dir={tmp_path}", "logging.wandb_project=p"])
    start_wandb(cfg)
    start_wandb(cfg)
    assert [c["id"] for c in calls] == ["first1", "first1"]
    assert all(c["resume"] == "allow" for c in calls)
    assert (tmp_path / "wandb_run_id").read_text().strip() == "first1"
