"""A verl run translated by prorl/verl_compat trains what verl 0.9.1 trains: the numbers below come
from verl's formulas written out in float64 (its `compute_grpo_outcome_advantage` divides by
torch.std, Bessel-corrected; its AdamW decays every parameter), not from prorl's code;
tests/peers/test_verl_algorithms.py calls verl's own functions on the same inputs."""

from pathlib import Path

import pytest
import torch
from prorl.engine.optim import param_groups
from prorl.kernels import group_advantages

from prorl.config import ConfigError
from prorl.train import main, parse_config

DATA = Path(__file__).resolve().parent / "data"
SMALL = str(DATA / "verl_grpo_small.yaml")
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."


def _algo(argv, capsys):
    cfg, _, _ = parse_config(argv)
    capsys.readouterr()
    return cfg


def _advantages(cfg, rewards, n):
    a = cfg.algorithm
    r = torch.tensor(rewards, dtype=torch.float64)
    groups = torch.arange(len(rewards) // n).repeat_interleave(n)
    return group_advantages(r, groups, mode=a.advantage, std_unbiased=a.grpo_std_unbiased)


def test_verls_grpo_divides_by_the_unbiased_group_std(capsys):
    """rewards [1, 0, 0, 0] at n = 4: verl's (1 - 0.25) / (torch.std + 1e-6) = 0.75 / 0.5 = 1.5
    (a population std gives 1.732)."""
    cfg = _algo(["--verl-config", SMALL, "algorithm.norm_adv_by_std_in_grpo=true"], capsys)
    assert cfg.algorithm.advantage == "grpo"
    rewards = [1.0, 0.0, 0.0, 0.0, 0.3, 0.9, 0.9, 0.1]
    expected = []
    for g in (rewards[:4], rewards[4:]):
        t = torch.tensor(g, dtype=torch.float64)
        expected += ((t - t.mean()) / (t.std(unbiased=True) + 1e-6)).tolist()
    got = _advantages(cfg, rewards, 4)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    assert got[0].item() == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-12)
    # on a plain command line too
    cfg = _algo(["model.path=/m", "algorithm.adv_estimator=grpo"], capsys)
    assert (cfg.algorithm.advantage, cfg.algorithm.grpo_std_unbiased) == ("grpo", True)


def test_a_group_of_one_is_refused_with_a_group_estimator(capsys):
    """verl's GRPO takes a lone response's raw score as its advantage (mean 0, std 1); prorl centres
    it to 0: rollout.n=1 (verl's default) is refused, naming the key."""
    with pytest.raises(ConfigError, match=rf"{R}n=1"):
        parse_config(["--verl-config", SMALL, f"{R}n=1"])


def test_verls_weight_decay_applies_to_biases_and_norms_too(capsys):
    """verl builds AdamW over module.parameters() with one weight_decay: 1-D parameters decay."""
    cfg = _algo(["--verl-config", SMALL, f"{A}optim.weight_decay=0.1"], capsys)
    o = cfg.optim
    assert (o.weight_decay, o.decay_1d) == (0.1, True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    decayed = {id(p) for g in param_groups(model, o.weight_decay, o.decay_1d) for p in g["params"]
               if g["weight_decay"] == 0.1}  # fmt: skip
    assert decayed == {id(p) for p in model.parameters()}
    # prorl's own default keeps biases and norms undecayed
    plain = _algo(["model.path=/m"], capsys).optim
    kept = [g for g in param_groups(model, plain.weight_decay, plain.decay_1d) if g["params"]]
    assert [len(g["params"]) for g in kept] == [1, 3] and kept[1]["weight_decay"] == 0.0


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "key, near",
    [
        (f"{R}temprature=0.6", f"{R}temperature"),
        ("data.train_batch_szie=8", "data.train_batch_size"),  # not prorl's data.train_size
        ("algorithm.kl_ctrl.kl_coeff=0.1", "algorithm.kl_ctrl.kl_coef"),
        ("actor_rollout_ref.ref.log_prob_micro_batch_sizee=2", "ref.log_prob_micro_batch_size"),
        (f"{A}made_up_key=3", None),
    ],
)
def test_a_key_verl_rejects_is_an_error_with_verls_spelling(key, near, capsys):
    """verl's hydra rejects a key its config lacks (without `+`): so does prorl, exit 2, naming
    the nearest verl key."""
    assert main(["model.path=/m", key, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert f"{key.split('=')[0]}=" in err and "not a verl 0.9.1 key" in err
    if near:
        assert near in err.split("did you mean ", 1)[1]
    else:
        assert "did you mean" not in err


@pytest.mark.tally("bad_inputs")
def test_a_key_that_changes_sampling_is_honoured_or_refused(capsys):
    """rollout.repetition_penalty (verl's RolloutConfig; prorl's sampler has no penalty): refused
    away from verl's 1.0, with or without `+`; at 1.0 it changes nothing and is ignored."""
    for given in (f"{R}repetition_penalty=1.1", f"+{R}repetition_penalty=1.1"):
        assert main(["model.path=/m", given, "--print-config"]) == 2
        err = capsys.readouterr().err
        assert "repetition_penalty=1.1: changes what verl samples" in err and "1.0" in err
    assert main(["model.path=/m", f"{R}repetition_penalty=1.0", "--print-config"]) == 0
    err = capsys.readouterr().err
    assert f"ignored, at verl's default: {R}repetition_penalty" in err
    # a vLLM engine argument (a free-form dict of verl's) can change sampling too
    assert main(["model.path=/m", f"+{R}engine_kwargs.vllm.seed=3", "--print-config"]) == 2
    assert "engine_kwargs.vllm.seed=3: changes what verl samples" in capsys.readouterr().err


def test_print_config_lists_every_ignored_key_with_why(capsys):
    assert main(["--verl-config", SMALL, "--print-config"]) == 0
    err = capsys.readouterr().err
    assert "4 verl keys ignored" in err
    for key in (f"{R}tensor_model_parallel_size", "trainer.n_gpus_per_node", "trainer.nnodes",
                "ray_kwargs.ray_init.num_cpus"):  # fmt: skip
        assert key in err.split("ignored, ", 1)[1]
    parse_config(["--verl-config", SMALL])  # a run without --print-config says where the list is
    assert "--print-config lists them" in capsys.readouterr().out


@pytest.mark.parametrize(
    "given, prompts, minis, warmup",
    [
        ([f"{A}ppo_mini_batch_size=32"], 256, 8, 0),  # the recipe's 256 prompts per step
        ([f"{A}ppo_mini_batch_size=16", "trainer.prompts_per_step=128"], 128, 8, 0),
        ([f"{A}ppo_mini_batch_size=32", f"{A}optim.lr_warmup_steps=3"], 256, 8, 3 * 8),
        ([f"{A}optim.lr_warmup_steps=3", "trainer.mini_batches=2"], 256, 2, 3 * 2),
    ],
)
def test_ppo_mini_batch_size_alone_maps_against_prorls_batch(given, prompts, minis, warmup, capsys):
    """verl's mini-batch and warmup keys count prompts and RL steps: given without
    data.train_batch_size they are read against the run's own trainer.prompts_per_step."""
    cfg = _algo(["model.path=/m", *given], capsys)
    t = cfg.trainer
    assert (t.prompts_per_step, t.mini_batches, cfg.optim.warmup_steps) == (prompts, minis, warmup)


@pytest.mark.tally("bad_inputs")
def test_a_mini_batch_that_does_not_divide_the_batch_is_refused(capsys):
    assert main(["model.path=/m", f"{A}ppo_mini_batch_size=100", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "trainer.prompts_per_step=256 is not a multiple of" in err and "=100" in err


def test_total_epochs_counts_steps_as_verls_dataloader(capsys):
    """verl: total_training_steps = len(train_dataloader) x total_epochs, the dataloader dropping
    the last partial batch; a set total_training_steps wins."""
    from torch.utils.data import DataLoader

    from prorl.config_runtime import steps_from_epochs

    cfg = _algo(["--verl-config", SMALL, "trainer.total_training_steps=null",
                 "trainer.total_epochs=3"], capsys)  # fmt: skip
    assert cfg.trainer.total_epochs == 3
    steps_from_epochs(cfg, 100)
    verls = len(DataLoader(range(100), batch_size=32, drop_last=True)) * 3
    assert cfg.trainer.total_steps == verls == 9
    cfg = _algo(["--verl-config", SMALL, "trainer.total_epochs=3"], capsys)  # steps: 200
    steps_from_epochs(cfg, 100)
    assert (cfg.trainer.total_epochs, cfg.trainer.total_steps) == (0, 200)
    assert main(["--verl-config", SMALL, "+data.gen_batch_size=96", "--print-config"]) == 2
    assert "algorithm.oversample" in capsys.readouterr().err


RECIPE = """\
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
data:
  train_files: /d/train.parquet
  train_batch_size: 64
  max_response_length: 2048
algorithm:
  adv_estimator: grpo
actor_rollout_ref:
  model: {path: /m}
  rollout: {n: 8}
  actor: {ppo_mini_batch_size: 16}
trainer: {total_training_steps: 10}
"""


def test_a_recipe_style_yaml_composes_onto_verls_trainer_config(tmp_path, capsys):
    """verl's recipes: `hydra.searchpath` + `defaults: [ppo_trainer, _self_]`, run outside verl's
    config folder: composed onto verl 0.9.1's ppo_trainer (its interpolations follow the recipe's
    values: rollout.response_length = data.max_response_length), the hydra block read, not
    translated."""
    path = tmp_path / "my_recipe.yaml"
    path.write_text(RECIPE)
    cfg = _algo(["--verl-config", str(path)], capsys)
    assert cfg.rollout.max_response_tokens == 2048 and cfg.rollout.n == 8
    assert (cfg.trainer.prompts_per_step, cfg.trainer.mini_batches) == (64, 4)
    assert (cfg.algorithm.advantage, cfg.algorithm.grpo_std_unbiased) == ("grpo", True)
    assert cfg.optim.weight_decay == 0.01  # verl's default, from its ppo_trainer
    path.write_text(RECIPE.replace("  - ppo_trainer", "  - my_base"))
    with pytest.raises(ConfigError, match=r"defaults entry 'my_base': no my_base.yaml in"):
        parse_config(["--verl-config", str(path)])
