#!/usr/bin/env bash
# `bash benchmarks/gpu_check.sh [RESULTS_DIR]`: the one prepared run for a lent GPU machine, in at most 6
# minutes: the CUDA-only and crash-prone paths first, each step under its own time limit, one summary table,
# exit status 1 when a step failed or timed out, 2 at once on a machine without CUDA. What it runs, and the
# wheels to carry: benchmarks/gpu/check.py and benchmarks/gpu/plan.py. RESULTS_DIR: default $OUT, else
# benchmarks/results/gpu.
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" -m benchmarks.gpu.check "$@"
