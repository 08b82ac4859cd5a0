import pytest
from reward_helpers import constant_half, echo_extra, out_of_range

import prorl.rewards as rewards


@pytest.fixture
def clean_registry():
    saved = dict(rewards._REGISTRY)
    yield
    rewards._REGISTRY.clear()
    rewards._REGISTRY.update(saved)


def test_builtin_keys_present():
    assert {"math", "code", "stem", "ifeval", "reasoning_gym"} <= set(rewards.registered_keys())


@pytest.mark.parametrize(
    "data_source, key",
    [
        ("math", "math"),
        ("openai/gsm8k", "math"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("aime24", "math"),
        ("numina_olympiads", "math"),
        ("codeforces", "code"),
        ("likaixin/TACO-verified", "code"),
        ("Idavidrein/gpqa", "stem"),
        ("google/IFEval", "ifeval"),
        ("reasoning_gym/leg_counting", "reasoning_gym"),
        ("code/my_subset", "code"),
    ],
)
def test_lookup(data_source, key):
    assert rewards.lookup(data_source)[0] == key


def test_lookup_does_not_import_builtins():
    # entries are "module:function" strings until used: importing prorl.rewards stays cheap
    assert isinstance(rewards.lookup("reasoning_gym/leg_counting")[1], str)


def test_unknown_data_source_lists_keys():
    with pytest.raises(rewards.UnknownDataSourceError, match=r"'nope'.*'math'.*'reasoning_gym'"):
        rewards.score("nope", "x", "y")
    with pytest.raises(LookupError):
        rewards.lookup("mathematics")  # not a '/'-prefix of 'math'


def test_register_and_dispatch(clean_registry):
    rewards.register("my_task", constant_half)
    assert rewards.score("my_task", "anything", None) == 0.5
    assert rewards.score("my_task/sub", "anything", None) == 0.5  # prefix match
    rewards.register("my_echo", echo_extra)
    assert rewards.score_with_info("my_echo", "a", "a") == (1.0, {"data_source": "my_echo"})
    rewards.register("by_name", "reward_helpers:constant_half")
    assert rewards.score("by_name", "", None) == 0.5
    # the user may override a built-in key
    rewards.register("math", constant_half)
    assert rewards.score("openai/gsm8k", "", None) == 0.5


def test_register_rejects_bad_input(clean_registry):
    with pytest.raises(TypeError):
        rewards.register("x", 3)
    with pytest.raises(ValueError):
        rewards.register("", constant_half)


def test_bad_return_values_raise(clean_registry):
    rewards.register("bad", out_of_range)
    with pytest.raises(ValueError, match="outside"):
        rewards.score("bad", "", None)
    rewards.register("nodict", lambda r, g, e: {"value": 1})
    with pytest.raises(ValueError, match="without 'score'"):
        rewards.score("nodict", "", None)
    rewards.register("str", lambda r, g, e: "1")
    with pytest.raises(TypeError):
        rewards.score("str", "", None)
    rewards.register("bool", lambda r, g, e: True)
    assert rewards.score("bool", "", None) == 1.0
