"""The curated mutants of `python -m benchmarks mutants` still name code that exists: each one's
original text occurs exactly once in its file (a refactor that moves or rewords a line leaves the
benchmark unable to plant that mutant)."""

from pathlib import Path

import pytest

from benchmarks.mutants import MUTANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_each_mutant_s_original_text_occurs_once(mutant):
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, (mutant.id, mutant.path)
    assert mutant.new != mutant.old
