"""The pieces of rl_step.py that are not prorl's own code path: TRL's GRPOTrainer instrumented per
phase (`TRLPhases`, `run_trl`), and the ablations `naive_lle` (nofused), `padded_logprobs`
(nopack) and `HFGenerator` (hfgen) that `rl_step.prorl_trainer` applies. Details:
docs/benchmarks.md.
"""

from __future__ import annotations

import math
import os
import time

import torch

from benchmarks.harness import dist_version
from benchmarks.linear_logprob_entropy import naive_logprob_entropy

# --- Ablations of prorl's Trainer -----------------------------------------------------------------


def naive_lle(hidden, weight, labels, temperature=1.0, ignore_index=-100, return_entropy=True):
    """`linear_logprob_entropy`'s signature on the unfused path (entropy either way: V is tiny)."""
    logp, ent = naive_logprob_entropy(hidden, weight, labels, temperature, ignore_index)
    return logp, (ent if return_entropy else None)


def _padded_attention_backend(length: int):
    from prorl.engine.attention import AttentionBackend

    class PaddedSDPA(AttentionBackend):
        """One causal SDPA over [S, H, Lmax, d]: right padding never reaches a real token."""

        name = "padded-sdpa"

        def __call__(self, q, k, v, ctx, scale):
            n, hq, d = q.shape
            s = n // length
            q4, k4, v4 = (t.view(s, length, t.shape[1], d).transpose(1, 2) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(
                q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(n, hq, d)

    return PaddedSDPA()


def padded_logprobs(model, batch, temperature, grad: bool, entropy: bool = False, lle=None):
    """Updater.logprobs as a padded trainer computes it: every sequence right-padded to the longest
    one of the batch and run as one [S, Lmax] batch (one batched SDPA call, pad tokens through every
    layer and the LM head); the real tokens' values, from `lle` (default the fused op), in packed
    order. Needs plain packing (share_prompts off: a shared-prompt layout has no padded
    equivalent)."""
    from prorl.kernels import linear_logprob_entropy

    if batch.kv_index is not None:
        raise ValueError("padded_logprobs needs trainer.updater.share = False (plain packing)")
    lengths = batch.cu_seqlens.diff().long()
    s, lmax, dev = lengths.numel(), int(lengths.max()), lengths.device
    valid = torch.arange(lmax, device=dev)[None, :] < lengths[:, None]  # [S, Lmax], row-major
    pid = torch.zeros(s, lmax, dtype=batch.ids.dtype, device=dev)
    pid[valid] = batch.ids
    pcu = (torch.arange(s + 1, device=dev) * lmax).to(torch.int32)
    # packed token -> its row in [S * Lmax]
    padded_row = torch.arange(s * lmax, device=dev).view(s, lmax)[valid]
    saved = model.attention
    model.attention = _padded_attention_backend(lmax)
    try:
        with torch.set_grad_enabled(grad):
            hidden = model(pid.view(-1), cu_seqlens=pcu)
            hidden = hidden.index_select(0, padded_row[batch.hidden_rows])
            kw = dict(temperature=temperature, return_entropy=entropy)
            return (lle or linear_logprob_entropy)(hidden, model.lm_head_weight, batch.labels, **kw)
    finally:
        model.attention = saved


class HFGenerator:
    """`Generator` interface over `transformers.generate` on a Qwen2ForCausalLM holding the policy's
    weights (copied in before every call: ~2 ms at these sizes); sampled-token log-probs from
    `output_scores`; the generation settings TRL uses (dynamic cache, top_k=0, top_p=1)."""

    def __init__(self, policy, model_path: str, pad_token_id: int):
        import transformers
        from prorl.engine.model.hf_io import hf_name

        self.policy, self.pad = policy, pad_token_id
        weight = next(policy.parameters())  # the policy's dtype and device
        self.device = weight.device
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=weight.dtype)
        self.hf = self.hf.to(self.device).eval()
        hf_state = self.hf.state_dict()  # detached tensors sharing the model's storage
        ours = policy.state_dict(keep_vars=True)  # the live parameters
        missing = [k for k in ours if hf_name(k) not in hf_state]
        if missing:
            raise RuntimeError(f"HFGenerator: no transformers parameter for {missing[:3]}")
        self._pairs = [(hf_state[hf_name(k)], v) for k, v in ours.items()]

    @torch.no_grad()
    def _sync(self) -> None:
        for theirs, ours in self._pairs:
            theirs.copy_(ours)

    @torch.no_grad()
    def generate(self, prompt_token_ids, params, on_finished=None):
        from prorl.engine.rollout import Rollouts, Sample

        self._sync()
        rows = [(p, j) for p in range(len(prompt_token_ids)) for j in range(params.n)]
        width = max(len(x) for x in prompt_token_ids)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(rows):  # left padding, as TRL does
            x = prompt_token_ids[p]
            ids[r, width - len(x) :] = torch.tensor(x)
            mask[r, width - len(x) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        torch.manual_seed(params.seed)
        sampling = dict(do_sample=params.temperature > 0, temperature=params.temperature or None)
        sampling.update(top_p=params.top_p, top_k=0 if params.top_k < 0 else params.top_k)
        sampling.update(max_new_tokens=params.max_new_tokens)
        stop = dict(eos_token_id=list(params.stop_token_ids) or None, pad_token_id=self.pad)
        scores = dict(output_scores=True, return_dict_in_generate=True)
        out = self.hf.generate(ids, attention_mask=mask, **sampling, **stop, **scores)
        new = out.sequences[:, width:]  # [B, T]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V] temperature-scaled logits
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        new, logp = new.cpu(), logp.cpu()  # no-ops on CPU
        stops = torch.tensor(list(params.stop_token_ids) or [-1])
        samples = []
        for r, (p, j) in enumerate(rows):
            hit = torch.isin(new[r], stops).nonzero()
            end = int(hit[0]) + 1 if len(hit) else new.shape[1]
            reason = "stop" if len(hit) else "length"
            samples.append(Sample(p, j, new[r, :end].tolist(), logp[r, :end].tolist(), reason))
        if on_finished is not None:
            on_finished(len(samples))
        return Rollouts(samples)

    def update_weights(self, named_tensors) -> None:
        pass  # weights are copied from the policy at every generate()


# --- TRL ------------------------------------------------------------------------------------------


def math_reward(completions, ground_truth, data_source=None, **kwargs) -> list[float]:
    """TRL reward function: prorl's verifier of each row's data source (default `math`; the same
    function prorl's RewardPool runs)."""
    from prorl.rewards import score

    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    sources = data_source or ["math"] * len(texts)
    return [float(score(s, t, g)) for s, t, g in zip(sources, texts, ground_truth)]


_PHASES = ("gen", "reward", "old_logp", "update")
_TOKENS = ("tokens", "prompt_tokens")  # summed over the step's samples


class TRLPhases:
    """Per-optimizer-step phase times of a GRPOTrainer, from wrappers on its instance methods (TRL's
    own `profiling_context` reports only to W&B / MLflow).

    gen = `_generate` (prompt tokenisation, `generate`, decoding); reward = `_calculate_rewards`;
    old_logp = `_get_per_token_logps_and_entropies` under no_grad (the reference model's pass, and
    the old-policy pass when TRL makes one); update = `training_step` minus `_prepare_inputs` (loss
    forward and backward) + from its return to `on_step_end` (grad clipping, optimizer and scheduler
    step); step = from one `on_step_end` to the next (the whole loop, data loading and logging
    included).
    """

    def __init__(self, memory, on_step=None):
        self.memory, self.records, self._cur, self._t_end = memory, [], self._fresh(), None
        self.on_step = on_step  # on_step(model, record) after each step, outside its interval

    @staticmethod
    def _fresh() -> dict:
        return dict.fromkeys((*_PHASES, *_TOKENS, "_prepare", "_ts_end", "_gs"), 0.0)

    def _timed(self, fn, key, when=None):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if when is None or when():
                self._cur[key] += time.perf_counter() - t0
            if key == "_gs":
                self._cur["tokens"] += float(out["completion_mask"].sum())
                self._cur["prompt_tokens"] += float(out["prompt_mask"].sum())
            return out

        return wrapper

    def instrument(self, trainer) -> None:
        from transformers import TrainerCallback

        trainer._generate = self._timed(trainer._generate, "gen")
        trainer._calculate_rewards = self._timed(trainer._calculate_rewards, "reward")
        no_grad = lambda: not torch.is_grad_enabled()
        logps = trainer._get_per_token_logps_and_entropies
        trainer._get_per_token_logps_and_entropies = self._timed(logps, "old_logp", when=no_grad)
        scored = trainer._generate_and_score_completions
        trainer._generate_and_score_completions = self._timed(scored, "_gs")
        trainer._prepare_inputs = self._timed(trainer._prepare_inputs, "_prepare")
        inner = trainer.training_step

        def training_step(*args, **kwargs):
            t0 = time.perf_counter()
            before = self._cur["_prepare"]
            out = inner(*args, **kwargs)
            t1 = time.perf_counter()
            self._cur["update"] += (t1 - t0) - (self._cur["_prepare"] - before)
            self._cur["_ts_end"] = t1
            return out

        trainer.training_step = training_step
        phases = self

        class _Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if phases._t_end is None:
                    phases.memory.start()
                    phases._t_end = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                t = time.perf_counter()
                cur = phases._cur
                cur["update"] += t - cur["_ts_end"]
                rss, extra = phases.memory.stop() or (math.nan, math.nan)
                rec = {k: cur[k] for k in (*_PHASES, *_TOKENS)}
                rec.update(step=t - phases._t_end, peak_rss=rss, peak_extra_memory=extra)
                phases.records.append(rec)
                if phases.on_step is not None:
                    phases.on_step(kwargs["model"], rec)
                phases._cur = phases._fresh()
                phases.memory.start()  # untimed: the next step's interval starts after it
                phases._t_end = time.perf_counter()

        trainer.add_callback(_Clock())


def run_trl(work: dict, model_path: str, steps: int, memory, gpu: bool, gen="vllm", on_step=None):
    """TRL's GRPOTrainer on the same model, prompts and settings; returns (per-step records, note).
    On `gpu`, `gen` = "vllm" (colocated vLLM) or "native" (transformers.generate on CUDA,
    use_vllm=False). `on_step(model, record)`: called after each step, outside its timing."""
    import shutil
    import tempfile

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from prorl.data import builtin

    tok = PreTrainedTokenizerFast.from_pretrained(model_path)
    examples = builtin(work.get("task", "digit_sums"), seed=0, split="train")
    row = lambda e: dict(prompt=e.prompt, ground_truth=e.ground_truth, data_source=e.data_source)
    ds = Dataset.from_list([row(e) for e in examples])
    p, n = work["prompts"], work["n"]
    dtype = torch.bfloat16 if gpu else torch.float32
    out_dir = tempfile.mkdtemp(prefix="rl_step_trl_")
    # one optimizer step per generation of P prompts x n completions, one update each, in
    # micro-batches of `trl_micro` completions (default all: one)
    micro = work.get("trl_micro") or p * n
    if (p * n) % micro:
        raise ValueError(f"trl_micro={micro} does not divide the {p * n} completions of a step")
    kwargs = dict(per_device_train_batch_size=micro, gradient_accumulation_steps=p * n // micro)
    kwargs.update(steps_per_generation=p * n // micro, num_iterations=1, num_generations=n)
    kwargs.update(seed=work.get("seed", 0))  # data order and sampling
    kwargs.update(max_steps=steps)
    kwargs.update(max_completion_length=work["max_new"], temperature=1.0, top_p=1.0, top_k=0)
    beta = work.get("kl", 1e-4)  # rl_step.KL unless the work says
    kwargs.update(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=beta)  # token-level loss
    kwargs.update(learning_rate=work["lr"], lr_scheduler_type="constant")
    # TRL defaults to activation checkpointing (an extra forward in backward); prorl does not
    # checkpoint here, so TRL must not either: equal work
    kwargs.update(weight_decay=0.0, max_grad_norm=1.0, gradient_checkpointing=False)
    kwargs.update(bf16=gpu, use_cpu=not gpu, model_init_kwargs={"dtype": dtype})
    kwargs.update(output_dir=out_dir, logging_steps=10**6, save_strategy="no", report_to="none")
    kwargs.update(disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    use_vllm = gpu and gen == "vllm"
    if use_vllm:  # colocated vLLM (TRL's recipe for one GPU)
        single = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        for k, v in dict(single, MASTER_PORT="29517").items():
            os.environ.setdefault(k, v)
        kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    threads = torch.get_num_threads()
    setup = dict(args=GRPOConfig(**kwargs), train_dataset=ds, processing_class=tok)
    trainer = GRPOTrainer(model=model_path, reward_funcs=math_reward, **setup)
    torch.set_num_threads(threads)  # whatever the trainer's set-up did, the same threads as prorl
    phases = TRLPhases(memory, on_step)
    phases.instrument(trainer)
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    note = f"trl={dist_version('trl')} transformers={dist_version('transformers')} loss=dapo kl=k3"
    note += f" micro_batch={micro}"
    note += f" old_logp={'recomputed' if use_vllm else 'skipped (on-policy)'}"
    note += f" gen={'vllm-colocate' if use_vllm else 'transformers.generate'} reward=in-process"
    return phases.records, note + (" dtype=bfloat16" if gpu else "")
