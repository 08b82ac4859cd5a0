"""One training or evaluation problem as data files hold it (verl's row schema); the split names.

A module of its own so that the task generators (prorl/chain_sums.py) and the readers
(prorl/data.py) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPLITS = ("train", "val")


@dataclass
class Example:
    prompt: list[dict]
    data_source: str
    ground_truth: Any
    extra: dict = field(default_factory=dict)
    ability: str | None = None
    # the data file it came from
    source: str | None = field(default=None, compare=False, repr=False)

    def to_row(self) -> dict:
        """The verl-schema row of this example (what `load_file` reads back)."""
        row = {
            "data_source": self.data_source,
            "prompt": self.prompt,
            "reward_model": {"ground_truth": self.ground_truth},
            "extra_info": self.extra,
        }
        if self.ability is not None:
            row["ability"] = self.ability
        return row
