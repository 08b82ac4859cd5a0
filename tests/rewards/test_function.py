"""`reward.function=path/to/file.py:name`: verl's compute_score by path (prorl/rewards/function.py).

The files are written here as a verl user writes them (a plain .py file, not an importable module),
with verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info)`. The
expected scores are the functions' own definitions applied by hand; they run in the reward pool's
worker processes, which import the file by path. Errors name the file and the function.
"""

import math
import subprocess
import sys

import pytest
from train_helpers import ENV, ROOT

import prorl.rewards as rewards
from prorl import data
from prorl.rewards.function import RewardFunctionError, check_result
from prorl.rewards.pool import RewardPool
from prorl.train import Fatal, load_reward_code

VERL_STYLE = """
from helper_beside_it import normalise   # a sibling module, as `python my_reward.py` would find it


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = normalise(solution_str) == normalise(ground_truth)
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": solution_str[-8:],
            "bonus": float(extra_info.get("bonus", 0)), "source_len": len(data_source)}


def plain(data_source, solution_str, ground_truth, extra_info):
    return len(solution_str) / 10


def broken(data_source, solution_str, ground_truth, extra_info):
    return {"acc": 1.0}


def raises(data_source, solution_str, ground_truth, extra_info):
    raise KeyError("no_such_field")


def two_args(solution_str, ground_truth):
    return 1.0
"""


@pytest.fixture
def reward_file(tmp_path):
    (tmp_path / "helper_beside_it.py").write_text(
        "def normalise(s):\n    return str(s).strip().lower()\n"
    )
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_STYLE)
    yield str(path)
    rewards.use_function(None)


def test_verl_return_conventions_scored_in_worker_processes(reward_file):
    rewards.use_function(f"{reward_file}:compute_score")
    # every data_source, as verl's custom reward
    assert rewards.lookup("anything/at/all")[0] == "function"
    sources = ["openai/gsm8k", "my_own_source", "my_own_source"]
    responses = ["  42 ", "41", "abc"]
    truths = ["42", "42", "ABC"]
    extras = [{"bonus": 2}, {}, {"bonus": True}]
    with RewardPool(num_workers=1, timeout_s=30.0, preload=()) as pool:
        res = pool.score_batch(sources, responses, truths, extras)
    assert not any(res.errored), res.errors
    # verl's convention: outside [0, 1] is fine, finite is required
    assert res.scores == [1.0, -1.0, 1.0]
    assert [x["acc"] for x in res.extras] == [True, False, True]
    assert [x["bonus"] for x in res.extras] == [2.0, 0.0, 1.0]
    assert [x["source_len"] for x in res.extras] == [len(s) for s in sources]


def test_a_plain_float_and_the_default_name(reward_file, tmp_path):
    rewards.use_function(f"{reward_file}:plain")
    assert rewards.score("x", "abcd", "y") == pytest.approx(0.4)
    default = tmp_path / "default_name.py"
    default.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n"
    )
    rewards.use_function(str(default))  # no ':name': verl's default name compute_score
    assert rewards.score("x", "y", "z") == 1.0


@pytest.mark.parametrize(
    "spec_tail, message",
    [
        (":missing_fn", "defines no 'missing_fn' .*it has: .*compute_score"),
        (":two_args", "signature .*cannot take verl's arguments"),
    ],
)
def test_a_bad_function_is_named_at_start(reward_file, spec_tail, message):
    with pytest.raises(
        RewardFunctionError, match=f"reward function '{spec_tail[1:]}' in {reward_file}.*"
    ):
        rewards.use_function(reward_file + spec_tail)
    with pytest.raises(RewardFunctionError, match=message):
        rewards.use_function(reward_file + spec_tail)


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(RewardFunctionError, match=f"{tmp_path}/nope.py: the file does not exist"):
        rewards.use_function(f"{tmp_path}/nope.py:compute_score")
    bad = tmp_path / "syntax.py"
    bad.write_text("def compute_score(:\n")
    with pytest.raises(
        RewardFunctionError, match=f"in {bad}: importing the file failed: SyntaxError"
    ):
        rewards.use_function(f"{bad}:compute_score")
    with pytest.raises(RewardFunctionError, match="expected 'path/to/file.py:function_name'"):
        rewards.use_function("my_module:compute_score")


def test_errors_while_scoring_name_the_file_and_the_function(reward_file):
    with RewardPool(num_workers=1, timeout_s=30.0, preload=()) as pool:
        for name, why in (
            ("raises", "raised KeyError: 'no_such_field'"),
            ("broken", "without 'score'"),
        ):
            rewards.use_function(f"{reward_file}:{name}")
            res = pool.score_batch(["s"], ["r"], ["g"])
            assert res.errored == [True] and res.scores == [0.0]
            assert f"{reward_file}:{name}" in res.errors[0] and why in res.errors[0], res.errors[0]
    for value in (math.nan, math.inf, "1.0", None):
        with pytest.raises(ValueError, match="not a finite number"):
            check_result(value, "f.py:g")


def test_train_refuses_a_file_in_plugins_and_a_bad_function_with_exit_2(reward_file):
    with pytest.raises(Fatal) as info:
        load_reward_code([reward_file], "")
    assert info.value.code == 2 and "reward.function=" in str(info.value)
    with pytest.raises(Fatal) as info:
        load_reward_code([], f"{reward_file}:nope")
    assert info.value.code == 2 and f"'nope' in {reward_file}" in str(info.value)
    with pytest.raises(Fatal, match="cannot import 'no_such_module_here'"):
        load_reward_code(["no_such_module_here"], "")


def test_prorl_eval_scores_with_the_function(reward_file, tmp_path):
    """`python -m prorl.eval --reward-function FILE:NAME` on the tiny reasoner: every sample's score
    is the function of its response (recomputed here), and the extras are averaged per data
    source."""
    import json

    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        "-m",
        "prorl.eval",
        "--model",
        "prorl/assets/tiny-reasoner",
        "--builtin",
        "digit_sums",
    ]
    cmd += [
        "--limit",
        "3",
        "--k",
        "2",
        "--max-tokens",
        "24",
        "--num-workers",
        "1",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        [*cmd, "--reward-function", f"{reward_file}:compute_score"], cwd=ROOT, env=ENV,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    examples = dict(enumerate(data.builtin("digit_sums", n=3, split="val")))

    def norm(text):
        return str(text).strip().lower()

    expected = [1.0 if norm(s["response"]) == norm(examples[s["index"]].ground_truth) else -1.0
                for s in samples]  # fmt: skip
    assert [s["score"] for s in samples] == expected and len(samples) == 6
    result = json.load(open(out / "results.json"))
    acc = sum(s["extras"]["acc"] for s in samples) / 6
    assert result["all"]["extra/acc"] == pytest.approx(acc)
    bad = subprocess.run(
        [*cmd, "--reward-function", f"{reward_file}:nope"], cwd=ROOT, env=ENV, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and f"'nope' in {reward_file}" in bad.stderr


def test_the_start_up_check_runs_the_function_once_per_data_source(reward_file):
    """train.py's reward self-test with reward.function (selftest.check_function): a function that
    raises stops the run with its own message, naming the file and the function."""
    from prorl.rewards.selftest import check_function

    examples = [
        data.Example([{"role": "user", "content": "q"}], src, "7") for src in ("a", "b", "a")
    ]
    with RewardPool(num_workers=1, timeout_s=30.0, preload=()) as pool:
        rewards.use_function(f"{reward_file}:compute_score")
        assert check_function(examples, pool) == "ok"
        rewards.use_function(f"{reward_file}:raises")
        with pytest.raises(
            RuntimeError, match=f"data_source 'a'.*{reward_file}:raises raised KeyError"
        ):
            check_function(examples, pool)


@pytest.mark.tally("bad_inputs")
def test_a_bool_score_is_a_score_as_in_verl():
    """verl's compute_score may return a bool (True: 1.0); it was refused (exit 3 at start)."""
    assert check_result(True, "f")["score"] == 1.0 and check_result(False, "f")["score"] == 0.0
    assert check_result({"score": True, "acc": True}, "f") == {"score": 1.0, "acc": True}
