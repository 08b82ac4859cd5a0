"""Smoke test of benchmarks/weight_push.py: one 8 MiB push between two processes through the run's
own pusher and receiver (nothing written). Never asserts speed."""

import pytest

from benchmarks import weight_push


def test_quick_push_reports_bytes_and_times(capsys):
    assert weight_push.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    metrics = {line.split()[2]: float(line.split()[3]) for line in lines if "quick" in line}
    assert metrics["bytes"] == pytest.approx(4 * 2**20 * 2 / 1e9, abs=5e-4)  # 4 Mi bf16
    assert metrics["push_s"] > 0 and metrics["stage_s"] > 0
