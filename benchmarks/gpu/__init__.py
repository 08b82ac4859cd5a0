"""GPU-only scripts: check.sh (the prepared run on a lent GPU), profile_step.py, linear_logprob_entropy.sh."""
