"""Helpers shared by the sampler tests (tests/rollout, tests/gpu): a tiny random Qwen2 checkpoint
written by `transformers` (the independent reference), and the training-side recomputation of
sampled log-probs."""

import torch


def save_random_qwen2(path, std: float, **config):
    """Write a Qwen2 checkpoint with N(0, std) weights (norms left at 1) to `path`; returns the
    `transformers` model (eval mode), whose `generate` is the reference."""
    import transformers

    defaults = dict(
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=True
    )
    cfg = transformers.Qwen2Config(**{**defaults, **config})
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    hf.save_pretrained(path)
    return hf.eval()


def recompute_logprobs(
    model, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """log p(token) of each sampled token under the training model (prorl Decoder + the fused op),
    at the sampling temperature: what the trainer computes for the same tokens."""
    from prorl.kernels import linear_logprob_entropy

    device = next(model.parameters()).device
    ids = torch.tensor(prompt + tokens, device=device)
    with torch.no_grad():
        hidden = model(ids)
    labels = torch.full_like(ids, -100)
    labels[len(prompt) - 1 : -1] = torch.tensor(tokens, device=device)
    logp, _ = linear_logprob_entropy(hidden, model.lm_head_weight, labels, temperature=temperature)
    return logp[len(prompt) - 1 : -1].float().cpu()
