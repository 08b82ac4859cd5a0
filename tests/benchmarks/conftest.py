"""What the benchmark smoke tests share: running a benchmark's `main`, reading the CSV it wrote."""

import csv

import pytest

from benchmarks import harness


@pytest.fixture
def run_main(capsys):
    """run(main, args, out, printed) -> the rows `main(args)` appended to the CSV `out`, after
    checking that it exited 0, printed `printed` (the summary) and wrote the CSV columns
    (harness.COLUMNS)."""

    def run(main, args, out, printed=""):
        assert main(args) == 0
        assert printed in capsys.readouterr().out
        with open(out, newline="") as f:
            reader = csv.DictReader(f)
            assert tuple(reader.fieldnames) == harness.COLUMNS
            return list(reader)

    return run
