"""prorl/verl_compat against verl 0.9.1's trainer config; prorl's metric names against verl's code.

- verl's `ppo_trainer.yaml` (a hydra defaults list over config groups) composed by prorl equals
  verl's own composed `_generated_ppo_trainer.yaml`, leaf for leaf;
- left at verl's defaults it is refused, naming what prorl cannot honour (`adv_estimator: gae` needs
  a critic); its `total_epochs` counts the run's steps, as in verl;
- with a ProRL-style override set (verl keys, then prorl keys) every key is mapped, matched or
  ignored, and the prorl values follow verl's meanings;
- every name in prorl.metrics.VERL_METRICS is one verl 0.9.1 emits (found in its source).

Needs verl installed (.ci/peers.sh puts verl 0.9.1 in the peers venv); the package is only read,
never imported.
"""

import importlib.util
import os
import re

import pytest

from prorl.config import ConfigError
from prorl.metrics import VERL_METRICS
from prorl.train import parse_config
from prorl.verl_compat import translate
from prorl.verl_compat.files import load_file, resolve

SPEC = importlib.util.find_spec("verl")
pytestmark = pytest.mark.skipif(
    SPEC is None, reason="verl is not installed here (.ci/peers.sh installs 0.9.1)"
)
VERL = os.path.dirname(SPEC.origin) if SPEC else ""
CONFIG = os.path.join(VERL, "trainer", "config")
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."

PRORL_STYLE = [  # ProRL v2 as a verl user writes it (the verl keys), then prorl's own additions
    "algorithm.adv_estimator=reinforce_plus_plus_baseline",
    "data.train_files=/data/train.parquet",
    "data.val_files=[/data/aime.parquet,/data/math500.parquet]",
    "data.train_batch_size=256",
    "data.max_prompt_length=1024",
    "data.max_response_length=8192",
    "actor_rollout_ref.model.path=/models/Nemotron-1.5B",
    f"{A}ppo_mini_batch_size=64",
    f"{A}optim.lr=2e-6",
    f"{A}clip_ratio_low=0.2",
    f"{A}clip_ratio_high=0.28",
    f"{A}use_kl_loss=true",
    f"{A}kl_loss_coef=0.0001",
    f"{A}kl_loss_type=mse",
    f"{A}use_dynamic_bsz=true",
    f"{A}ppo_max_token_len_per_gpu=24000",
    f"{R}name=vllm",
    f"{R}n=16",
    f"{R}temperature=1.0",
    f"{R}gpu_memory_utilization=0.6",
    f"{R}val_kwargs.do_sample=true",
    f"{R}val_kwargs.temperature=0.6",
    f"{R}val_kwargs.top_p=0.95",
    f"{R}val_kwargs.n=16",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    "+custom_reward_function.path=/recipes/prorl_reward.py",
    "custom_reward_function.name=compute_score",
    "trainer.total_training_steps=3000",
    "trainer.save_freq=50",
    "trainer.test_freq=25",
    "trainer.logger=[console,tensorboard]",
    "trainer.default_local_dir=/runs/prorl",
    # prorl's own: the cosine length penalty, reference resets, ICE-POP
    "reward.length_penalty=true",
    "algorithm.reset.interval=300",
    "algorithm.reset.kl_spike_factor=5.0",
    "algorithm.is_mode=icepop",
]


def test_ppo_trainer_yaml_composes_as_verl_composes_it():
    mine = resolve(load_file(os.path.join(CONFIG, "ppo_trainer.yaml")), [])
    verls = resolve(load_file(os.path.join(CONFIG, "_generated_ppo_trainer.yaml")), [])
    mine.pop("model_engine")  # the hydra choice itself, which verl's generated file leaves out
    assert mine == verls
    assert len(mine) > 800


def test_verls_keys_in_the_sections_prorl_shares_are_known():
    """The list prorl keeps of verl's data.* / trainer.* / algorithm.* keys it lacks is verl
    0.9.1's."""
    from prorl.config import fields
    from prorl.verl_compat.rules import VERL_KEYS_IN_SHARED_SECTIONS

    flat = resolve(load_file(os.path.join(CONFIG, "_generated_ppo_trainer.yaml")), [])
    prorl = {k for k, _ in fields()}
    shared = {
        k
        for k in flat
        if k.split(".")[0] in ("data", "trainer", "algorithm") and "_target_" not in k
    }
    assert VERL_KEYS_IN_SHARED_SECTIONS == shared - prorl


def test_verls_defaults_that_prorl_cannot_honour_are_refused_by_name():
    flat = resolve(load_file(os.path.join(CONFIG, "ppo_trainer.yaml")), [])
    t = translate(flat, from_file=True)
    assert [r.split("=")[0] for r in t.refused] == ["algorithm.adv_estimator"]
    assert "no critic" in t.refused[0]
    # total_training_steps null: verl counts its 30 default epochs, and so does prorl
    assert t.values["trainer.total_epochs"] == 30 == flat["trainer.total_epochs"]
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='gae'"):
        parse_config(["--verl-config", os.path.join(CONFIG, "ppo_trainer.yaml")])


def test_a_prorl_style_override_set_maps_every_key(capsys):
    cfg, preset, _ = parse_config(
        ["--verl-config", os.path.join(CONFIG, "ppo_trainer.yaml"), *PRORL_STYLE]
    )
    table = capsys.readouterr().out
    assert preset is None
    # verl's default strategy: fsdp
    assert cfg.model.path == "/models/Nemotron-1.5B" and cfg.model.fsdp
    assert cfg.data.train_files == ["/data/train.parquet"]
    assert cfg.data.val_files == ["/data/aime.parquet", "/data/math500.parquet"]
    assert (cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens) == (1024, 8192)
    t, a = cfg.trainer, cfg.algorithm
    assert (t.prompts_per_step, t.mini_batches, t.micro_batch_tokens) == (256, 256 // 64, 24000)
    assert (t.total_steps, t.save_every, t.val_every) == (3000, 50, 25)
    assert (t.val_temperature, t.val_top_p, t.val_samples) == (0.6, 0.95, 16)
    assert a.advantage == "reinforce++-baseline" and a.dynamic_sampling
    # verl's clip_ratio_c default: 3
    assert (a.eps_low, a.eps_high, a.dual_clip) == (0.2, 0.28, 3.0)
    # verl's mse: (d^2)/2, unclamped
    assert (a.kl_coef, a.kl_estimator, a.kl_clamp) == (1e-4, "k2", "none")
    assert a.agg == "token-mean" and a.entropy_coef == 0.0
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.max_grad_norm) == (2e-6, 0.01, 1.0)
    r = cfg.rollout
    assert (r.backend, r.n, r.temperature, r.top_p, r.gpu_memory_utilization) == (
        "vllm",
        16,
        1.0,
        1.0,
        0.6,
    )
    assert cfg.reward.function == "/recipes/prorl_reward.py:compute_score"
    assert (
        cfg.output_dir == "/runs/prorl"
        and cfg.logging.tensorboard
        and cfg.logging.wandb_project is None
    )
    # the prorl keys given after the translation turned ProRL's additions back on
    assert cfg.reward.length_penalty and a.reset.interval == 300 and a.is_mode == "icepop"
    assert cfg.reward.c_stop == 1.0  # verl keeps a truncated response's reward; not overridden here
    for shown in (
        "data.train_batch_size=256",
        "trainer.prompts_per_step=256",
        "trainer.mini_batches=4",
    ):
        assert shown in table
    assert re.search(r"\((\d+) verl keys ignored", table)


def _source(*parts) -> str:
    return open(os.path.join(VERL, *parts)).read()


def test_prorls_verl_metric_names_are_verls():
    timers = set(re.findall(r'marked_timer\("(\w+)"', _source("trainer", "ppo", "ray_trainer.py")))
    timers.add("ref")  # marked_timer(str(Role.RefPolicy)): Role.RefPolicy's string is "ref"
    assert '"ref"' in _source("trainer", "ppo", "utils.py")
    data_metrics = _source("trainer", "ppo", "metric_utils.py")
    actor = _source("trainer", "ppo", "core_algos.py") + _source("workers", "utils", "losses.py")
    actor += _source("workers", "engine_workers.py") + _source("trainer", "ppo", "ray_trainer.py")
    assert 'rename_dict(actor_output, "actor/")' in _source("trainer", "ppo", "ray_trainer.py")
    missing = []
    for name in VERL_METRICS:
        section, key = name.split("/", 1)
        if section == "timing_s":
            found = key in timers
        elif section == "actor":  # set as "actor/x", or as "x" and renamed with the "actor/" prefix
            found = f'"{name}"' in actor or f'"{key}"' in actor
        else:
            found = f'"{name}"' in data_metrics
        if not found:
            missing.append(name)
    assert not missing, missing
