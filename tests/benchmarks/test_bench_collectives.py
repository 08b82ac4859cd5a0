"""Smoke test of benchmarks/collectives.py: 2 gloo ranks under torchrun, one small size, a temp CSV;
and the nccl-tests conventions (bus-bandwidth factors, their table format). Never asserts speed."""

from __future__ import annotations

import pytest

from benchmarks import collectives

# nccl-tests' table (all_reduce_perf -b 1K -e 4K -f 4 -g 2; spacing narrowed), out-of-place then
# in-place
NCCL_TESTS_TABLE = """\
#                                                          out-of-place                   in-place
#   size     count  type  redop  root  time  algbw  busbw #wrong  time  algbw  busbw #wrong
#    (B)  (elements)                           (us)  (GB/s)  (GB/s)        (us)  (GB/s)  (GB/s)
  1024       256  float  sum  -1  18.54  0.06  0.06  0  18.37  0.06  0.06  0
  4096      1024  float  sum  -1  19.10  0.21  0.21  0  18.90  0.22  0.22  0
# Out of bounds values : 0 OK
# Avg bus bandwidth  : 0.1375
"""


def test_bus_factors_follow_nccl_tests():
    assert collectives.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert collectives.bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert collectives.bus_factor("reduce_scatter", 2) == pytest.approx(1 / 2)


def test_parse_nccl_tests_reads_out_of_place_columns():
    rows = collectives.parse_nccl_tests(NCCL_TESTS_TABLE, "all_reduce", 2)
    by = {(r["shape"], r["metric"]): r["p50"] for r in rows}
    assert by == {
        ("1024 B world=2", "time"): 18.54,
        ("1024 B world=2", "algbw"): 0.06,
        ("1024 B world=2", "busbw"): 0.06,
        ("4096 B world=2", "time"): 19.10,
        ("4096 B world=2", "algbw"): 0.21,
        ("4096 B world=2", "busbw"): 0.21,
    }


def test_collectives_two_gloo_ranks(tmp_path, run_main):
    out = tmp_path / "collectives.csv"
    args = [*"--sizes 4096 --reps 2 --iters 3 --warmup 1 --cpu --out".split(), str(out)]
    rows = run_main(collectives.main, args + ["--no-plot"], out, "busbw")
    by = {(r["mode"], r["metric"]): r for r in rows}
    for op in collectives.OPS:
        t, alg, bus = by[(op, "time")], by[(op, "algbw")], by[(op, "busbw")]
        assert t["provider"] == "torch-gloo" and t["shape"] == "4096 B world=2"
        assert float(t["p50"]) > 0
        # algbw = size / time; busbw = algbw x the op's factor (2 ranks)
        assert float(alg["p50"]) == pytest.approx(4096 / (float(t["p50"]) * 1e-6) / 1e9, rel=1e-4)
        assert float(bus["p50"]) == pytest.approx(
            float(alg["p50"]) * collectives.bus_factor(op, 2), rel=1e-4
        )
