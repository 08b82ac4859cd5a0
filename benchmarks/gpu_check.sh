#!/usr/bin/env bash
# `bash benchmarks/gpu_check.sh [OUT_DIR]`: the one prepared run for a lent GPU machine (benchmarks/gpu/check.sh).
exec bash "$(dirname "$0")/gpu/check.sh" "$@"
