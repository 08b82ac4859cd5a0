"""verl 0.9.1's own keys and defaults (`verl_0_9_1_ppo_trainer.json`: its composed
`_generated_ppo_trainer.yaml`, flattened, interpolations kept; tests/peers checks it), and the verl
keys without a prorl rule that change what verl samples or trains, and the patterns of those that
do not change what prorl trains (ignored at any value). The file also stands in for
verl's `ppo_trainer` config when a recipe-style YAML names it and verl is not installed
(prorl/verl_compat/files.py).

A key verl does not have is one hydra rejects on verl's command line (without `+`); a known key that
changes what is sampled or trained and that prorl has no rule for is honoured only at verl's
default. Regenerate the file with `python -m prorl.verl_compat.keys VERL/trainer/config`.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import sys

from prorl.verl_compat.files import (
    TEMPLATE_FILE,
    VERL_TEMPLATE,
    flatten,
    load_file,
    nested,
    resolve,
)


@functools.cache
def _resolved() -> dict:
    return resolve(nested(VERL_TEMPLATE), [])


# verl keys that its config dataclasses declare but its YAML does not (verl takes them with `+`)
DATACLASS_ONLY = {
    "actor_rollout_ref.rollout.repetition_penalty": 1.0,
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": None,
    "actor_rollout_ref.rollout.moe_tensor_parallel_size": 1,
    "actor_rollout_ref.rollout.custom": None,
    "actor_rollout_ref.rollout.checkpoint_manager_class": None,
}

# verl keys with no prorl rule that change what is sampled or trained: honoured at verl's default
# only (a sampling penalty, the sampler's dtype or context, another agent loop, a quantised or
# speculative sampler, a LoRA adapter loaded, a tokenizer other than the model's, tools, the actor's
# mini-batch shuffle, an asynchronous trainer mode)
CHANGES_TRAINING = {
    "actor_rollout_ref.rollout." + k
    for k in (
        "repetition_penalty dtype max_model_len logprobs_mode engine_kwargs.vllm "
        "engine_kwargs.sglang engine_kwargs.trtllm agent.default_agent_loop "
        "agent.agent_loop_config_path agent.custom_async_server.path "
        "agent.custom_async_server.name quantization quantization_config_file "
        "enable_rollout_routing_replay mtp.enable mtp.enable_train mtp.enable_rollout custom"
    ).split()
} | {
    "actor_rollout_ref.model.lora_adapter_path", "actor_rollout_ref.model.lora.adapter_path",
    "actor_rollout_ref.model.mtp.enable", "actor_rollout_ref.model.mtp.enable_train",
    "actor_rollout_ref.actor.shuffle", "data.tokenizer", "data.tool_config_path",
    "data.function_tool_path", "trainer.v1.trainer_mode",
}  # fmt: skip


# -- keys that do not change what prorl trains -----------------------------------------------------
IGNORED = [  # (pattern on the dotted key, why)
    (r"(^|\.)_target_$", "verl's dataclass targets"),
    (
        r"^(ray_kwargs|global_profiler|transfer_queue|skip|model_engine)(\.|$)",
        "verl's infrastructure",
    ),
    (r"(^|\.)(profiler|checkpoint|router_replay|qat)\.", "verl's profiling, checkpoint contents"),
    (r"^critic\.", "the critic (no prorl estimator uses one)"),
    (
        r"^(reward_model|reward\.reward_model|sandbox_fusion|reward\.sandbox_fusion)\.",
        "reward model and remote sandbox (off; prorl's code verifier has its own sandbox)",
    ),
    (r"^reward\.reward_manager\.module\.", "reward manager plug-ins (naive only)"),
    (r"^distillation\.", "distillation (off)"),
    (
        r"^actor_rollout_ref\.ref\.",
        "the reference's batch and sharding knobs (the reference is the policy's initial copy)",
    ),
    (
        r"^actor_rollout_ref\.(actor|ref)\.(fsdp_config|megatron|torchtitan|veomni)\.",
        "sharding knobs",
    ),
    (r"^actor_rollout_ref\.actor\.policy_loss\.", "parameters of other policy losses"),
    (
        r"^actor_rollout_ref\.actor\.(tau_pos|tau_neg|rollout_n|shuffle|data_loader_seed|"
        r"use_torch_compile|use_fused_kernels|use_remove_padding|use_prefix_grouper|"
        r"freeze_vision_tower|calculate_entropy|calculate_sum_pi_squared|"
        r"entropy_from_logits_with_chunking|entropy_from_logits_chunk_size|"
        r"entropy_checkpointing|pad_to_length)$",
        "speed and memory knobs",
    ),
    (
        r"^actor_rollout_ref\.actor\.optim\."
        r"(optimizer_impl|total_training_steps|zero_indexed_step)$",
        "derived by verl",
    ),
    (r"^actor_rollout_ref\.model\.", "model loading knobs (no effect on the weights trained)"),
    (r"^actor_rollout_ref\.rollout\.", "sampler engine knobs (parallelism, memory, scheduling)"),
    (r"^actor_rollout_ref\.nccl_timeout$", "prorl sizes its collective timeout from the config"),
    (r"^data\.", "data-loader knobs (workers, multimodal keys, shared memory)"),
    (r"^algorithm\.(gamma|lam)$", "GAE / REINFORCE++ discounts (unused by grpo and the baseline)"),
    (r"^algorithm\.(kl_penalty|kl_ctrl\..*)$", "the in-reward KL (off: use_kl_in_reward false)"),
    (r"^algorithm\.(pf_ppo|rollout_correction|filter_groups)\.", "parameters of features off"),
    (r"^trainer\.", "launch, logging and checkpoint-storage knobs (nodes, GPUs, paths, callbacks)"),
]
_IGNORED = [(re.compile(p), why) for p, why in IGNORED]


def default(key: str):
    """verl 0.9.1's default of `key`, interpolations resolved."""
    return DATACLASS_ONLY[key] if key in DATACLASS_ONLY else _resolved().get(key)


def known(key: str, extra=()) -> bool:
    """A key of verl 0.9.1 (its YAML, its dataclasses, `extra`: the rules' legacy spellings), or
    one under a free-form dict of it (`rollout.engine_kwargs.vllm.x`)."""
    if key in _resolved() or key in DATACLASS_ONLY or key in extra:
        return True
    parts = key.split(".")
    return any(_resolved().get(".".join(parts[:i])) == {} for i in range(1, len(parts)))


def suggest(key: str, extra=()) -> str | None:
    """The nearest verl key to a misspelt one (None when none is near)."""
    pool = [k for k in (*_resolved(), *DATACLASS_ONLY, *extra) if "_target_" not in k]
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in pool if k.rpartition(".")[0] == parent}
    near = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    if near:
        return siblings[near[0]]
    near = difflib.get_close_matches(key, pool, n=1, cutoff=0.85)
    return near[0] if near else None


def shared_section_keys(prorl_keys) -> frozenset:
    """verl's data.* / trainer.* / algorithm.* keys that prorl does not have."""
    return frozenset(
        k
        for k in VERL_TEMPLATE
        if k.split(".")[0] in ("data", "trainer", "algorithm")
        and "_target_" not in k
        and k not in prorl_keys
    )


if __name__ == "__main__":  # python -m prorl.verl_compat.keys VERL/trainer/config
    flat = flatten(load_file(os.path.join(sys.argv[1], "_generated_ppo_trainer.yaml")))
    with open(TEMPLATE_FILE, "w") as f:
        f.write(json.dumps(dict(sorted(flat.items())), indent=0) + "\n")
