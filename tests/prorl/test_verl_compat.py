"""A verl user's config on prorl (prorl/verl_compat): `--verl-config FILE` and verl-style dotted
overrides mapped onto prorl's keys, the printed table, and a refusal naming each key prorl cannot
honour.

The expected prorl values follow from verl 0.9.1's documented meanings of the keys in the test data
(written for these tests, tests/prorl/data): e.g. verl's `ppo_mini_batch_size` counts prompts, so 32
prompts per step in mini-batches of 8 prompts are 4 optimizer updates; verl steps its LR scheduler
once per RL step, so 5 warmup steps of 4 updates each are 20 optimizer steps.
tests/peers/test_verl_config.py does the same with verl's own ppo_trainer.yaml.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from train_helpers import ENV, ROOT

from prorl import verl_compat
from prorl.config import ConfigError, load_config
from prorl.train import main, parse_config

DATA = Path(__file__).resolve().parent / "data"
SMALL = str(DATA / "verl_grpo_small.yaml")
LAYOUT = str(DATA / "verl_layout" / "trainer.yaml")
A = "actor_rollout_ref.actor."


def quiet_parse(argv, capsys):
    cfg, preset, _ = parse_config(argv)
    return cfg, preset, capsys.readouterr().out


def test_a_verl_config_maps_onto_prorl_with_verls_meanings(capsys):
    cfg, preset, out = quiet_parse(["--verl-config", SMALL], capsys)
    assert preset is None  # the recipe's defaults under the verl values, not the embedded default
    assert cfg.data.train_files == ["/d/gsm8k/train.parquet"] and cfg.data.val_files == [
        "/d/gsm8k/test.parquet"
    ]
    assert (cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens) == (256, 1024)
    assert (
        cfg.model.path == "/models/qwen" and cfg.model.fsdp and cfg.model.activation_checkpointing
    )
    t, a, o = cfg.trainer, cfg.algorithm, cfg.optim
    assert (t.prompts_per_step, t.mini_batches, t.micro_batch_tokens) == (32, 32 // 8, 12000)
    assert (a.eps_low, a.eps_high, a.dual_clip) == (0.2, 0.28, 10.0)
    assert a.agg == "constant"  # verl's seq-mean-token-sum-norm: Dr.GRPO's constant normaliser
    assert (a.entropy_coef, a.kl_coef, a.kl_estimator, a.kl_clamp) == (0.001, 0.002, "k3", "output")
    assert a.advantage == "dr-grpo"  # grpo without norm_adv_by_std_in_grpo
    assert a.dynamic_sampling and a.max_rounds == 6
    assert (o.lr, o.schedule, o.min_lr_ratio, o.weight_decay) == (3e-6, "cosine", 0.1, 0.0)
    assert o.warmup_steps == 5 * (32 // 8)
    r = cfg.rollout
    assert (r.backend, r.n, r.temperature, r.top_p, r.gpu_memory_utilization) == (
        "vllm",
        8,
        0.9,
        0.95,
        0.6,
    )
    assert (t.val_temperature, t.val_top_p, t.val_samples) == (0.6, 0.95, 4)
    assert (t.total_steps, t.save_every, t.val_every) == (200, 20, 10)
    assert cfg.reward.function == "/r/my_reward.py:my_score" and cfg.output_dir == "/runs/grpo"
    assert cfg.logging.tensorboard and cfg.logging.wandb_project is None
    # prorl's own additions are off: the translated run is the verl run
    assert (
        not cfg.reward.length_penalty
        and cfg.reward.c_stop == 1.0
        and cfg.algorithm.reset.interval == 0
    )
    # the printed table says what mapped to what
    assert "data.train_batch_size=32" in out and "trainer.prompts_per_step=32" in out
    assert "trainer.mini_batches=4" in out and "verl keys ignored" in out


def test_verl_overrides_and_prorl_keys_on_the_same_command_line(capsys):
    """verl keys override the file (and its interpolations follow); prorl keys apply last (ProRL on
    top)."""
    argv = ["--verl-config", SMALL, "data.max_response_length=2048", f"{A}clip_ratio_high=0.3"]
    argv += ["reward.length_penalty=true", "algorithm.reset.interval=300", "trainer.total_steps=7"]
    cfg, _, _ = quiet_parse(argv, capsys)
    assert cfg.rollout.max_response_tokens == 2048  # rollout.response_length followed: no conflict
    assert cfg.algorithm.eps_high == 0.3
    assert (
        cfg.reward.length_penalty
        and cfg.algorithm.reset.interval == 300
        and cfg.trainer.total_steps == 7
    )


def test_a_hydra_defaults_list_is_composed(capsys):
    cfg, _, _ = quiet_parse(["--verl-config", LAYOUT], capsys)
    # actor/dp_actor -> optim/adamw
    assert cfg.optim.lr == 5e-7 and list(cfg.optim.betas) == [0.9, 0.99]
    # clip_ratio for both sides
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (0.25, 0.25)
    assert (cfg.trainer.prompts_per_step, cfg.trainer.mini_batches) == (16, 16 // 4)
    assert cfg.rollout.backend == "native" and cfg.algorithm.advantage == "reinforce++-baseline"


def test_keys_without_a_counterpart_are_refused_by_name():
    bad = [
        "algorithm.adv_estimator=gae",
        f"{A}ppo_epochs=2",
        f"{A}made_up_key=3",
        "critic.ppo_epochs=5",
    ]
    with pytest.raises(ConfigError) as info:
        parse_config(["--verl-config", SMALL, *bad])
    msg = str(info.value)
    assert "algorithm.adv_estimator='gae'" in msg and "no critic" in msg
    assert f"{A}ppo_epochs=2" in msg and f"{A}made_up_key=3: not a verl 0.9.1 key" in msg
    assert "critic.ppo_epochs" not in msg  # the critic is ignored: no estimator here uses one
    assert main(["--verl-config", SMALL, *bad]) == 2


def test_verl_keys_on_a_plain_prorl_command_line(capsys):
    """No --verl-config: verl's keys among the overrides are translated; data.train_batch_size is no
    longer taken for a misspelt data.train_size."""
    argv = [
        "model.path=/m",
        "data.train_batch_size=8",
        f"{A}ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
    ]
    cfg, _, out = quiet_parse(
        [*argv, "trainer.total_training_steps=5", f"{A}optim.lr=1e-5"], capsys
    )
    assert (cfg.trainer.prompts_per_step, cfg.trainer.mini_batches, cfg.rollout.n) == (8, 2, 4)
    assert cfg.trainer.total_steps == 5 and cfg.optim.lr == 1e-5
    assert "data.train_batch_size=8" in out and "trainer.prompts_per_step=8" in out
    with pytest.raises(ConfigError) as info:
        parse_config(["model.path=/m", f"{A}policy_loss.loss_mode=gspo"])
    assert "loss_mode='gspo'" in str(info.value) and "did you mean" not in str(info.value)
    # verl's launch keys are verl's, not misspelt prorl keys ("trainer.n_gpus_per_node -> did you
    # mean trainer.prompts_per_step?"): ignored and counted
    cfg, _, out = quiet_parse(
        ["model.path=/m", "trainer.n_gpus_per_node=8", "algorithm.gamma=1.0"], capsys
    )
    assert "2 verl keys ignored" in out
    # prorl's own typos still
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_steps'"):
        load_config("default", ["trainer.total_step=3"])


def test_a_yaml_string_for_a_list_key_is_a_one_element_list(tmp_path):
    """`data.train_files: /d/x.parquet` in a --config file, as verl configs write it (was: exit 2,
    "AnyNode is not a ListConfig")."""
    path = tmp_path / "mine.yaml"
    path.write_text("model:\n  path: /m\ndata:\n  train_files: /d/x.parquet\n  val_files: ''\n")
    cfg = load_config(str(path))
    assert cfg.data.train_files == ["/d/x.parquet"] and cfg.data.val_files == []


def test_the_command_line_prints_the_table_and_refuses_with_exit_2():
    cmd = [sys.executable, "prorl/train.py", "--verl-config", SMALL, "--print-config"]
    ok = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "trainer.prompts_per_step=32" in ok.stderr and "prompts_per_step: 32" in ok.stdout
    assert OmegaConf.create(ok.stdout).trainer.prompts_per_step == 32  # the YAML alone on stdout
    bad = subprocess.run(
        [*cmd, "trainer.total_training_steps=null"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "set trainer.total_training_steps" in bad.stderr


def test_the_key_table_is_current():
    """docs/verl.md is generated from the rules: `python -m prorl.verl_compat > docs/verl.md`."""
    path = Path(ROOT) / "docs" / "verl.md"
    assert path.read_text() == verl_compat.reference_markdown(), "regenerate docs/verl.md"


def test_do_sample_false_means_greedy_in_training_and_validation(capsys):
    """verl's do_sample=false samples greedily whatever the temperature says (its vLLM rollout sets
    temperature 0); do_sample=true keeps the temperature given."""
    R = "actor_rollout_ref.rollout."
    greedy = [f"{R}temperature=0.7", f"{R}do_sample=false", f"{R}val_kwargs.temperature=0.6"]
    cfg, _, _ = quiet_parse(["model.path=/m", *greedy, f"{R}val_kwargs.do_sample=false"], capsys)
    assert (cfg.rollout.temperature, cfg.trainer.val_temperature) == (0.0, 0.0)
    sampled = [f"{R}temperature=0.7", f"{R}do_sample=true", f"{R}val_kwargs.temperature=0.6"]
    cfg, _, _ = quiet_parse(["model.path=/m", *sampled, f"{R}val_kwargs.do_sample=true"], capsys)
    assert (cfg.rollout.temperature, cfg.trainer.val_temperature) == (0.7, 0.6)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "override,message",
    [
        ("data.train_batch_size=0", "data.train_batch_size=0 must be >= 1"),
        ("trainer.mini_batches=0", "trainer.mini_batches must be >= 1"),
    ],
)
def test_a_zero_batch_is_named_not_a_zero_division(override, message):
    """Was: ZeroDivisionError out of the config checks (exit 1, no key named)."""
    argv = ["--verl-config", SMALL] if override.startswith("data.") else ["model.path=/m"]
    with pytest.raises(ConfigError, match=message):
        parse_config([*argv, override])
