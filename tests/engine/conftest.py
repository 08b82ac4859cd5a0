"""Shared set-up for engine tests: offline Hugging Face; tiny checkpoint fixtures (tiny_hf.py)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_hf import LENGTHS, TINY, VARIANTS, randomize_  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """variant name -> directory of a random fp32 checkpoint saved by transformers (cached per
    session)."""
    import transformers

    made = {}

    def make(variant: str) -> str:
        if variant not in made:
            cls_name, overrides = VARIANTS[variant]
            config = getattr(transformers, cls_name)(**{**TINY, **overrides})
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
            randomize_(model)
            path = str(tmp_path_factory.mktemp(variant))
            model.save_pretrained(path)
            made[variant] = path
        return made[variant]

    return make


@pytest.fixture
def packed_batch():
    """(input_ids [N] int64, cu_seqlens [B+1] int32) for LENGTHS, fixed seed."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (sum(LENGTHS),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu
