"""prorl.engine: the RL-agnostic training engine (model, attention, parallelism, optimizer,
checkpoint, rollout, metrics). Imports `prorl.kernels` only; never the trainer in `prorl`."""
