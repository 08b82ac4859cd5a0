"""prorl.engine: the RL-agnostic training engine (model, attention, parallelism, optimizer,
checkpoint, rollout, metrics). Imports `prorl.kernels` only; never the trainer in `prorl`."""

if (
    __name__ == "engine"
):  # found by its folder name from the repository root: not this package's name
    from prorl.kernels._toplevel import hand_over

    hand_over(__name__, __file__)
