"""A reward plugin for the preset-in-miniature tests (`reward.plugins=[preset_rewards]`): data
source `preset_uneven` scores like `math` on rank 0, and on every other rank gives 1 to all but ~1
in 16 responses, so most of those ranks' groups are all-equal and dropped. Dynamic sampling then
keeps different numbers of groups on different ranks, as skewed data does on a cluster.
Deterministic: a hash of the response decides."""

import hashlib
import os

import prorl.rewards as rewards


def uneven(response, ground_truth, extra):
    if os.environ.get("RANK", "0") == "0":
        return rewards.score("math", response, ground_truth, extra)
    return 0.0 if int(hashlib.sha256(response.encode()).hexdigest(), 16) % 64 == 0 else 1.0


rewards.register("preset_uneven", "preset_rewards:uneven")
