"""prorl on a real pretrained model (SmolLM2-135M-Instruct: Llama, 30 layers, GQA 9/3 heads, tied
embeddings, V = 49,152, ChatML), against `transformers` on the same weights and tokenizer.

The references are transformers' own: the model and tokenizer it reads from the GGUF file itself,
its forward, `generate` and chat template; and float64 torch for the fused ops. fp32 logits here
reach |40| through 30 layers; the criterion is a max abs error of 1e-3 (2.5e-5 relative), which a
wrong RoPE base, norm epsilon, mask or head tying exceeds by orders of magnitude.
"""

import pytest
import torch
from conftest import MESSAGES

pytestmark = pytest.mark.slow  # a 135M model: seconds to a minute each

LOGIT_ATOL = 1e-3


def _packed(ids_lists):
    ids = torch.tensor([t for ids in ids_lists for t in ids])
    lengths = torch.tensor([len(ids) for ids in ids_lists])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    return ids, cu


@torch.no_grad()
def _hf_per_sequence(hf, ids_lists):
    return torch.cat([hf(torch.tensor([ids])).logits[0] for ids in ids_lists])


def test_converted_directory_is_the_gguf_model(smollm2_gguf, smollm2_dir, hf_model, chat_ids):
    """transformers reading the GGUF file directly and transformers reading our converted
    directory give the same logits and the same chat-template token ids; a second conversion to the
    same place is a cache hit."""
    import os
    import time

    import transformers

    from prorl.gguf_model import from_gguf

    folder, name = os.path.split(smollm2_gguf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with torch.no_grad():
        x = torch.tensor([chat_ids[0]])
        assert torch.equal(ref(x).logits, hf_model(x).logits)
    assert hf_model.config.tie_word_embeddings and hf_model.config.vocab_size == 49152
    for messages, ids in zip(MESSAGES, chat_ids):
        want = ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert list(want) == ids
    start = time.perf_counter()
    assert from_gguf(smollm2_gguf, smollm2_dir) == smollm2_dir
    assert time.perf_counter() - start < 10  # hashed, not converted again


def test_packed_logits_match_transformers(our_model, hf_model, chat_ids):
    """Three chat prompts packed into one row (cu_seqlens), through prorl's decoder and its tied
    head, against transformers run on each prompt alone."""
    assert our_model.lm_head_weight is our_model.embed_tokens.weight  # the tied head
    ids, cu = _packed(chat_ids)
    with torch.no_grad():
        ours = our_model.logits(our_model(ids, cu_seqlens=cu))
    ref = _hf_per_sequence(hf_model, chat_ids)
    err = (ours - ref).abs().max().item()
    print(f"packed fp32 max abs logit error {err:.2e} (max |logit| {ref.abs().max():.1f})")
    assert ours.shape == (len(ids), 49152)
    assert err <= LOGIT_ATOL


def test_chat_template_and_special_tokens(smollm2_dir, tokenizer, hf_model, chat_ids):
    """The ids prorl prompts with are ChatML as transformers renders it, with no BOS added twice;
    the tokens prorl stops at are the model's end of turn, which is also its pad."""
    from prorl.data import stop_token_ids

    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for messages, ids in zip(MESSAGES, chat_ids):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")
        assert ids == tokenizer(text, add_special_tokens=True)["input_ids"]  # no extra BOS
        default_system = messages[0]["role"] != "system"  # the template adds SmolLM's own
        assert ids[0] == im_start and ids.count(im_end) == len(messages) + default_system
        assert tokenizer.decode(ids) == text
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(chat_ids[0])
    assert stop_token_ids(tokenizer, smollm2_dir) == [im_end]
    gen = hf_model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, tokenizer.pad_token_id) == (im_end,) * 3


def test_greedy_equals_transformers_generate(our_model, hf_model, tokenizer, chat_ids):
    """NativeGenerator greedy (stopping at prorl's stop tokens) equals transformers.generate greedy
    (stopping at its generation config's eos): the same tokens, the same stop."""
    from prorl.engine.rollout import NativeGenerator, SamplingParams

    from prorl.data import stop_token_ids

    prompts = chat_ids[:2]
    stops = stop_token_ids(tokenizer)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24, stop_token_ids=stops)
    out = NativeGenerator(our_model).generate(prompts, params)
    finished = 0
    for sample in out.samples:
        prompt = torch.tensor([prompts[sample.prompt_index]])
        ref = hf_model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1] :]
        assert sample.token_ids == ref.tolist(), tokenizer.decode(sample.token_ids)
        finished += sample.finish_reason == "stop"
        assert (sample.finish_reason == "stop") == (ref[-1].item() in stops)
    print([tokenizer.decode(s.token_ids) for s in out.samples])
    assert finished >= 1  # the end-of-turn stop is exercised, not only the length limit
