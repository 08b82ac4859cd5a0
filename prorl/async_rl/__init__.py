"""Asynchronous RL: rollout ranks sample and verify while trainer ranks train (architecture.md).

    roles.py      the role split under torchrun and the process groups of each side
    transport.py  objects and weights between the two sides (gloo), weight checksums
    worker.py     the rollout ranks' loop: sample groups for step s with weights >= s - steps_ahead
    remote.py     the trainer ranks' side: receive the step's groups, push weights, metrics, state

Imports nothing heavy at package import: prorl/config.py reads `settings.AsyncConfig` from here.
"""
