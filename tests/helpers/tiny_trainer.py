"""An in-process Trainer on the shipped tiny reasoner (prorl/assets/tiny-reasoner) for tests: its
tokenizer, digit-sum data, a one-worker reward pool, and Trainers built from dotted overrides.

`tiny_setup` is a module-scoped fixture (registered for the whole suite by tests/conftest.py): the
tokenizer, data and reward pool are made once per test module; each test builds its own Trainer
with `make_trainer`, so no model state passes between tests.
"""

import contextlib
import os
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_REASONER = os.path.join(ROOT, "prorl", "assets", "tiny-reasoner")


class TinySetup(NamedTuple):
    tok: object
    train: list
    val: list
    pool: object


@contextlib.contextmanager
def tiny_parts(n_train: int = 16, n_val: int = 4):
    """The tokenizer, `n_train` / `n_val` digit-sum examples (seed 0) and a one-worker math reward
    pool, closed on exit."""
    from transformers import PreTrainedTokenizerFast

    from prorl.data import builtin
    from prorl.rewards.pool import RewardPool

    tok = PreTrainedTokenizerFast.from_pretrained(TINY_REASONER)
    train = builtin("digit_sums", n=n_train, seed=0, split="train")
    val = builtin("digit_sums", n=n_val, seed=0, split="val") if n_val else []
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        yield TinySetup(tok, train, val, pool)


@pytest.fixture(scope="module")
def tiny_setup():
    with tiny_parts() as parts:
        yield parts


def make_trainer(setup, overrides=()):
    """A Trainer on the tiny reasoner: the embedded default config with `overrides` (dotted)."""
    from prorl.config import load_config
    from prorl.trainer import Trainer

    tok, train, val, pool = setup
    cfg = load_config("default", [f"model.path={TINY_REASONER}", *overrides])
    return Trainer(cfg, TINY_REASONER, tok, train, val, pool)
