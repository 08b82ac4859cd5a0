"""Make the embedded default's starting point: a tiny reasoner, supervised to its plateau.

Supervised on imperfect demonstrations, saved in Hugging Face format (config.json,
model.safetensors, tokenizer, chat template).

    python -m prorl.warmstart --out prorl/assets/tiny-reasoner  # ~10 min on one CPU core
    python -m prorl.warmstart --task chain_sums --out prorl/assets/chain-reasoner ...  # chain_sums
    python -m prorl.warmstart --task long_sums --out prorl/assets/long-reasoner ...  # long_sums

Why imperfect demonstrations. ProRL starts from a distilled model that imitation has taken as far as
it goes; RL must then add what imitation cannot. A tiny model trained on *perfect* worked sums would
keep improving with more supervised steps, and RL would only race imitation. So the demonstrations
here have a systematic slip: whenever an addition crosses a multiple of ten, the worked solution
forgets the carry with probability `--slip` (default 0.6) - "7+5=2" - and carries the mistake to a
wrong boxed answer. Imitation learns the majority habit at each carry, so its greedy accuracy
plateaus near the share of problems without a carry (about 30%), however long it trains
(docs/results.md shows that control). The verifier rewards only correct answers, so RL can find and
reinforce the minority, correct, behaviour.

The model: Qwen2 architecture (hidden 128, 2 layers, 4 heads / 2 KV heads, tied embeddings, ~0.5M
parameters) over a character vocabulary built with the `tokenizers` library, ChatML-style template.
Loadable by `transformers` like any checkpoint. Trained with prorl's own decoder and fused op.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from prorl import chain_sums
from prorl.data import digit_sums, stop_token_ids
from prorl.engine.model import Decoder, ModelConfig, load_hf, save_hf
from prorl.engine.optim import Optimizer, OptimizerConfig
from prorl.engine.rollout import NativeGenerator, SamplingParams
from prorl.kernels import linear_logprob_entropy

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A character-level tokenizer (printable ASCII + newline) with ChatML special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # one token per character
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def demonstration(prompt: str, slip: float, verbose: float, rng: random.Random) -> str:
    """A worked solution of the sum `prompt` ("a+b+c=") in which each decade-crossing addition
    forgets its carry with probability `slip`; with probability `verbose` it first restates the
    terms (chain_sums' length-penalty bait; 0 for digit_sums, whose demonstrations are the embedded
    default's)."""
    terms = chain_sums.parse_terms(prompt)
    opening = chain_sums.restatement(terms) if verbose > 0 and rng.random() < verbose else ""
    return opening + chain_sums.solution(terms, slip, rng)


TASKS = {  # task -> (split loader, greedy evaluation budget in tokens)
    "digit_sums": (lambda split: digit_sums(split=split), 40),
    "chain_sums": (lambda split: chain_sums.chain_sums(split=split), 96),
    "long_sums": (lambda split: chain_sums.chain_sums(split=split, family="long_sums"), 128),
}


def tiny_config(vocab_size: int, num_layers: int = 2) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        qkv_bias=True,
        initializer_range=0.05,
    )


def encode_chat(tokenizer, user: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, examples, max_new_tokens: int = 40) -> float:
    """Greedy accuracy on `examples`, scored by exact match of the last \\boxed{} (the math
    verifier's job in training; exact match suffices for integer sums and keeps this script free of
    worker processes)."""
    prompts = [encode_chat(tokenizer, ex.prompt[-1]["content"]) for ex in examples]
    stops = stop_token_ids(tokenizer)
    out = NativeGenerator(model).generate(
        prompts,
        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stops),
    )
    correct = 0
    for s in out.samples:
        text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
        answer = text.rsplit("\\boxed{", 1)[-1].split("}", 1)[0] if "\\boxed{" in text else None
        correct += answer == examples[s.prompt_index].ground_truth
    return correct / len(examples)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "assets", "tiny-reasoner")
    )
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--slip", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=sorted(TASKS), default="digit_sums")
    ap.add_argument(
        "--verbose", type=float, default=0.0, help="share of demonstrations restating the terms"
    )
    ap.add_argument("--layers", type=int, default=2, help="decoder blocks of a new model")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--init", default=None, help="continue from this checkpoint (SFT control)")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this much wall time")
    ap.add_argument(
        "--log",
        default=None,
        help="JSONL of (step, loss, val accuracy); default <out>/warmstart.jsonl",
    )
    return ap


def _model_and_tokenizer(args):
    """The checkpoint `--init` names, or a new tiny decoder over the built tokenizer."""
    if args.init:
        from transformers import PreTrainedTokenizerFast

        return load_hf(args.init), PreTrainedTokenizerFast.from_pretrained(args.init)
    tokenizer = build_tokenizer()
    model = Decoder(tiny_config(len(tokenizer), args.layers))
    model.init_weights(torch.Generator().manual_seed(args.seed))
    return model, tokenizer


def _sft_batch(train, tokenizer, args, rng: random.Random):
    """`args.batch` demonstrations, packed: token ids [N], cu_seqlens [B + 1] int32, next-token
    labels [N] (-100 outside the answers)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, labels, lengths = [], [], []
    for ex in rng.sample(train, args.batch):
        text = ex.prompt[-1]["content"]
        prompt = encode_chat(tokenizer, text)
        answer = demonstration(text, args.slip, args.verbose, rng)
        answer = tokenizer.encode(answer, add_special_tokens=False) + [end]
        seq = prompt + answer
        ids += seq
        # next-token targets of the answer only
        labels += [-100] * (len(prompt) - 1) + answer + [-100]
        lengths.append(len(seq))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return torch.tensor(ids), cu, torch.tensor(labels)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tokenizer = _model_and_tokenizer(args)
    schedule = dict(schedule="cosine", warmup_steps=100, total_steps=args.steps, min_lr_ratio=0.05)
    opt = Optimizer(
        model, OptimizerConfig(lr=args.lr, weight_decay=0.0, max_grad_norm=1.0, **schedule)
    )
    load_split, max_new_tokens = TASKS[args.task]
    train, val = load_split("train"), load_split("val")
    os.makedirs(args.out, exist_ok=True)
    log = open(args.log or os.path.join(args.out, "warmstart.jsonl"), "w")
    start = time.time()
    for step in range(1, args.steps + 1):
        ids, cu, labels = _sft_batch(train, tokenizer, args, rng)
        hidden = model(ids, cu_seqlens=cu)
        logp, _ = linear_logprob_entropy(hidden, model.lm_head_weight, labels, return_entropy=False)
        loss = -logp.sum() / (labels != -100).sum()
        loss.backward()
        opt.step()
        out_of_time = args.minutes is not None and time.time() - start > 60 * args.minutes
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            model.eval()
            acc = greedy_accuracy(model, tokenizer, val, max_new_tokens)
            model.train()
            rec = {"step": step, "loss": round(loss.item(), 4), "val_greedy_accuracy": acc}
            rec["elapsed_s"] = round(time.time() - start, 1)
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if out_of_time:
            break
    save_hf(model, args.out)
    tokenizer.save_pretrained(args.out)
    with open(os.path.join(args.out, "warmstart_args.json"), "w") as f:
        json.dump(vars(args), f, indent=1)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
