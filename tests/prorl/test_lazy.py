"""prorl/lazy.py: the command modules serve their `*_run` module's functions, import failures
surface as ImportError, unknown names as AttributeError under the command module's name."""

import sys

import pytest

from prorl.lazy import forwarder


def test_the_commands_serve_their_run_modules_functions():
    from prorl import eval_run, export_run, train_run
    from prorl.eval import evaluate
    from prorl.export import export_checkpoint
    from prorl.train import load_examples

    assert load_examples is train_run.load_examples
    assert evaluate is eval_run.evaluate
    assert export_checkpoint is export_run.export_checkpoint


def test_unknown_and_dunder_names_are_attribute_errors_named_for_the_command(monkeypatch):
    import prorl.train

    with pytest.raises(AttributeError, match="module 'prorl.train' has no attribute 'nope'"):
        prorl.train.nope  # noqa: B018
    monkeypatch.delitem(
        sys.modules, "prorl.train_run", raising=False
    )  # a dunder look-up imports nothing
    with pytest.raises(AttributeError):
        prorl.train.__wrapped__  # noqa: B018
    assert "prorl.train_run" not in sys.modules


def test_an_attribute_error_while_importing_the_target_is_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "broken_target", None)  # import raises ModuleNotFoundError
    with pytest.raises(ImportError):
        forwarder("cmd", "broken_target")("x")

    def raising(name):
        raise AttributeError("module 'torch' has no attribute 'foo'")

    monkeypatch.setattr("importlib.import_module", raising)
    with pytest.raises(ImportError, match="importing broken_target failed: .*'foo'"):
        forwarder("cmd", "broken_target")("x")
