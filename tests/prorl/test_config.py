"""prorl.config: presets, overrides, and clear errors for bad keys and values."""

import pytest

from prorl.config import ConfigError, load_config, to_yaml


def test_preset_and_overrides():
    cfg = load_config(
        "prorl_v2_1.5b", ["model.path=/models/x", "trainer.total_steps=10", "rollout.n=8"]
    )
    assert cfg.trainer.total_steps == 10 and cfg.rollout.n == 8
    # the published recipe's numbers (docs/recipe.md)
    a = cfg.algorithm
    assert (a.eps_low, a.eps_high, a.kl_coef, a.kl_estimator, a.reset.interval) == (
        0.2,
        0.28,
        1e-4,
        "k2",
        300,
    )
    assert (cfg.reward.length_k_on, cfg.reward.length_k_off, cfg.rollout.max_response_tokens) == (
        100,
        500,
        8192,
    )
    assert (cfg.optim.lr, cfg.trainer.mini_batches) == (2e-6, 4)
    assert "kl_coef: 0.0001" in to_yaml(cfg)


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.bogus=1", "unknown config key 'trainer.bogus'"),
        ("bogus.key=1", "unknown config key"),
        ("rollout.n=abc", "bad config value for 'rollout.n'"),
        ("algorithm.kl_estimator=k9", "is not one of k1, k2, k3"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("no-equals-sign", "key=value"),
    ],
)
def test_bad_overrides_fail_with_their_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", [override])


@pytest.mark.tally("bad_inputs")
def test_missing_preset_and_required_key():
    with pytest.raises(ConfigError, match="presets: default"):
        load_config("nope")
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config("prorl_v2_1.5b")


def test_the_configuration_reference_is_current():
    """docs/config.md is generated from the dataclasses: `python -m prorl.config >
    docs/config.md`."""
    from pathlib import Path

    from prorl.config import reference_markdown

    path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert path.read_text() == reference_markdown(), (
        "regenerate: python -m prorl.config > docs/config.md"
    )


def test_fp8_keys_are_validated():
    cfg = load_config(
        "default", ["model.fp8=torchao", "model.fsdp=true", "model.fp8_recipe=rowwise"]
    )
    assert (cfg.model.fp8, cfg.model.fp8_recipe) == ("torchao", "rowwise")
    assert load_config("default", []).model.fp8 == "none"
    for overrides, message in (
        (["model.fp8=fp4", "model.fsdp=true"], "model.fp8='fp4' is not one of none, torchao, te"),
        (
            ["model.fp8=torchao", "model.fsdp=true", "model.fp8_recipe=delayed"],
            "not a recipe of model.fp8",
        ),
        (
            ["model.fp8=te", "model.fsdp=true", "model.fp8_recipe=rowwise"],
            "not a recipe of model.fp8='te'",
        ),
        (["model.fp8=torchao"], "needs model.fsdp=true"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("default", overrides)


def test_dp_replicate_is_validated_naming_the_key(capsys):
    from prorl import train
    from prorl.config_runtime import check_world

    cfg = load_config(
        "default", ["model.fsdp=true", "model.dp_replicate=2", "trainer.prompts_per_step=12"]
    )
    check_world(cfg, 2)
    check_world(cfg, 4)
    with pytest.raises(
        ConfigError, match=r"model.dp_replicate=2 does not divide the 3 ranks.*divisors of 3: 1, 3"
    ):
        check_world(cfg, 3)
    for overrides, message in (
        (["model.fsdp=true", "model.dp_replicate=0"], "model.dp_replicate=0: must be >= 1"),
        (["model.fsdp=true", "model.dp_replicate=-2"], "model.dp_replicate=-2: must be >= 1"),
        (["model.dp_replicate=2"], "model.dp_replicate=2: .*needs model.fsdp=true"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("default", overrides)
    # the command line: one process is a world of 1, which 2 replicas cannot split
    assert train.main(["model.fsdp=true", "model.dp_replicate=2"]) == train.lifecycle.EXIT_CONFIG
    assert (
        "config error: model.dp_replicate=2 does not divide the 1 ranks" in capsys.readouterr().err
    )


# (override, the key the message must name) - issue 41: each once trained on silently to exit 0
# with NaN weights or rewards, exited with advice that did not fit, or failed later with a
# traceback that named no key
NUMERIC_CASES = [
    ("optim.weight_decay=nan", "optim.weight_decay"),
    ("optim.min_lr_ratio=nan", "optim.min_lr_ratio"),
    ("reward.length_lam=nan", "reward.length_lam"),
    ("algorithm.entropy_coef=nan", "algorithm.entropy_coef"),
    ("trainer.val_temperature=nan", "trainer.val_temperature"),
    ("reward.timeout_s=inf", "reward.timeout_s"),
    ("reward.timeout_s=1e300", "reward.timeout_s"),
    ("optim.betas=[nan,0.999]", "optim.betas[0]"),
    ("optim.betas=[0.9,1.5]", "optim.betas"),
    ("optim.eps=nan", "optim.eps"),
    ("optim.eps=-1", "optim.eps"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("trainer.val_temperature=-1", "trainer.val_temperature"),
    ("rollout.max_response_schedule={1: -3}", "rollout.max_response_schedule"),
    ("rollout.max_response_schedule={1: 0}", "rollout.max_response_schedule"),
    ("reward.length_lam=-1", "reward.length_lam"),
]


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("override,key", NUMERIC_CASES, ids=[c[0] for c in NUMERIC_CASES])
def test_a_non_finite_or_out_of_range_number_is_named(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("default", [override])
    message = str(err.value)
    assert message.startswith(key + "="), message
    value = override.split("=", 1)[1]
    if value in ("nan", "inf"):
        assert "finite" in message, message


def test_every_preset_passes_the_numeric_checks():
    presets = [("default", []), ("prolonged", []), ("prorl_v2_1.5b", ["model.path=x"])]
    for preset, extra in [*presets, ("smollm2_digit_sums", [])]:
        load_config(preset, extra)
