"""GPU-only scripts: check.py + plan.py (benchmarks/gpu_check.sh, the prepared run on a lent GPU),
preset_check.py, profile_step.py, linear_logprob_entropy.sh."""
