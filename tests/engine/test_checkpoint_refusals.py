"""What a checkpoint save or load refuses (issue 41): weights or optimizer state holding a NaN or an
infinity are never saved (the tensor and the step named, the last good checkpoint kept)."""

import os

import pytest
import torch
from dist_helpers import random_decoder
from prorl.engine.checkpoint import Checkpointer, NonFiniteState
from prorl.engine.optim import Optimizer, OptimizerConfig


def _trained(seed=1):
    """A tiny decoder and an AdamW that has taken one step (so it has moments)."""
    model = random_decoder(seed=seed)
    opt = Optimizer(model, OptimizerConfig(lr=1e-3))
    model(torch.tensor([[1, 2, 3]])).float().pow(2).mean().backward()
    opt.step()
    return model, opt


@pytest.mark.tally("faults")
@pytest.mark.parametrize("where", ["weight", "moment", "inf weight"])
def test_a_non_finite_weight_or_moment_is_not_saved(tmp_path, where):
    model, opt = _trained()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep_last=1)
    state = {"model": model, "optimizer": opt, "data": {"position": 1}}
    ckpt.save(1, state)
    name, param = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        if where == "moment":
            opt.optimizer.state[param]["exp_avg"].view(-1)[3] = float("nan")
        else:
            param.view(-1)[3] = float("nan") if where == "weight" else float("inf")
    with pytest.raises(NonFiniteState) as err:
        ckpt.save(2, state)
    message = str(err.value)
    assert message.startswith("step 2: ") and name in message, message
    assert ("exp_avg" in message) == (where == "moment"), message
    assert (
        message.split(":")[1]
        .strip()
        .split()[0]
        .startswith("optimizer" if where == "moment" else "model")
    )
    # nothing of step 2 on disk; step 1 kept (keep_last=1 would have deleted it)
    assert ckpt.complete_steps() == [1]
    assert sorted(os.listdir(ckpt.directory)) == ["step_00000001"]
