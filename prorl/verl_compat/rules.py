"""The verl 0.9.1 key table: one `Rule` per verl setting (what it reads, what prorl makes of it);
prorl/verl_compat/keys.py has the patterns of the keys that do not change what prorl trains.
prorl/verl_compat/__init__.py explains the kinds; docs/verl.md lists them all."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prorl.config import fields
from prorl.verl_compat.keys import shared_section_keys

ABSENT = object()  # a verl key the file or the command line did not give

# verl sections that prorl does not have: a dotted key under one of them is verl's (`reward` is
# prorl's too: a verl key there is one a rule reads, so that a misspelt prorl reward key still gets
# a suggestion)
VERL_SECTIONS = (
    "actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "ray_kwargs",
    "global_profiler", "transfer_queue", "distillation", "sandbox_fusion", "model_engine", "skip",
)  # fmt: skip


@dataclass
class Rule:
    """One verl setting: the keys it reads, and what it makes of their values (`apply(get)`,
    returning prorl assignments, raising Refused). `kind`: mapped | matched | ignored (docs)."""

    keys: tuple[str, ...]
    apply: Callable[[Callable[[str], Any]], dict[str, Any]]
    doc: str
    kind: str = "mapped"


class Refused(Exception):
    """A verl value prorl cannot honour; the message says why."""


@dataclass
class Derived:
    """A prorl value computed from the rest of the run's config (`compute(cfg)`), for a verl key
    given without the one it is relative to (`ppo_mini_batch_size` alone: the mini-batch count is
    prorl's trainer.prompts_per_step / it). `text` is shown in the table."""

    compute: Callable[[Any], Any]
    text: str

    def __str__(self) -> str:
        return self.text


A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
M = "actor_rollout_ref.model."
RULES: list[Rule] = []


def rule(*keys: str, doc: str = "", kind: str = "mapped"):
    def register(fn):
        RULES.append(Rule(keys, fn, doc or (fn.__doc__ or "").strip(), kind))
        return fn

    return register


def simple(verl_key: str, prorl_key: str, convert=lambda v: v, doc: str = "") -> None:
    """A 1:1 key."""
    RULES.append(
        Rule((verl_key,), lambda get: {prorl_key: convert(get(verl_key))}, doc or prorl_key)
    )


def only(verl_key: str, *allowed, why: str) -> None:
    """A key prorl has no setting for but honours at these values (`why`: what prorl does)."""

    def apply(get):
        value = get(verl_key)
        if value not in allowed:
            raise Refused(why)
        return {}

    RULES.append(
        Rule((verl_key,), apply, f"{' or '.join(map(repr, allowed))} only: {why}", "matched")
    )


def _given(get, key):
    value = get(key)
    return None if value is ABSENT else value


# -- data ------------------------------------------------------------------------------------------
def _files(v):
    files = [] if v is None else [v] if isinstance(v, str) else list(v)
    return [os.path.expanduser(str(f)) for f in files]


simple("data.train_files", "data.train_files", _files)
simple("data.val_files", "data.val_files", _files)
simple("data.prompt_key", "data.prompt_key")
simple("data.max_prompt_length", "data.max_prompt_tokens", int)
simple("data.max_response_length", "rollout.max_response_tokens", int)
simple("data.train_batch_size", "trainer.prompts_per_step", int)
simple("data.shuffle", "data.shuffle", bool)
only("data.reward_fn_key", "data_source", why="prorl picks the verifier by the row's data_source")
only(
    "data.truncation",
    "error",
    why="prorl never truncates a prompt: longer ones are dropped and counted",
)
only("data.train_max_samples", -1, None, why="prorl trains on every row of data.train_files")
only("data.val_max_samples", -1, None, why="prorl validates on every row of data.val_files")
only("data.custom_cls.path", None, why="prorl reads verl-schema parquet / JSONL rows itself")


@rule("data.gen_batch_size", kind="matched")
def _gen_batch(get):
    """None or data.train_batch_size only: DAPO samples gen_batch_size prompts a round; prorl
    samples data.train_batch_size, then refills algorithm.oversample x the groups still missing"""
    gen, prompts = _given(get, "data.gen_batch_size"), _given(get, "data.train_batch_size")
    if gen is not None and gen != prompts:
        raise Refused(
            "prorl's counterpart is algorithm.oversample: its first round samples "
            "data.train_batch_size prompts and each refill oversample x the groups still missing "
            "(drop data.gen_batch_size; algorithm.oversample=1.5 is the recipe's)"
        )
    return {}


only(
    "data.apply_chat_template_kwargs",
    {},
    None,
    why="prorl applies the model's chat template as it is",
)


@rule("data.seed")
def _data_seed(get):
    """seed (when set)"""
    seed = _given(get, "data.seed")
    return {} if seed is None else {"seed": int(seed)}


# -- model -----------------------------------------------------------------------------------------
simple(M + "path", "model.path", lambda v: os.path.expanduser(str(v)))
simple(M + "enable_gradient_checkpointing", "model.activation_checkpointing", bool)
only(M + "lora_rank", 0, why="prorl trains every weight (no LoRA)")
only(M + "lora.rank", 0, why="prorl trains every weight (no LoRA)")
only(M + "custom_chat_template", None, why="prorl uses the model directory's chat template")
only(
    M + "external_lib",
    None,
    why="prorl's decoder covers Llama / Qwen2 / Qwen3 (no external model code)",
)
only(M + "override_config", {}, None, why="prorl loads config.json as it is")
only(M + "tokenizer_path", None, why="prorl loads the tokenizer from model.path")
only(M + "hf_config_path", None, why="prorl loads config.json from model.path")


# -- actor: optimizer ------------------------------------------------------------------------------
simple(A + "optim.lr", "optim.lr", float)


@rule(A + "optim.weight_decay")
def _weight_decay(get):
    """optim.weight_decay, optim.decay_1d=true (verl's AdamW decays every parameter, biases and
    norm weights too)"""
    return {"optim.weight_decay": float(get(A + "optim.weight_decay")), "optim.decay_1d": True}


simple(A + "optim.betas", "optim.betas", lambda v: [float(x) for x in v])
simple(A + "optim.min_lr_ratio", "optim.min_lr_ratio", float)
only(A + "optim.optimizer", "AdamW", why="prorl's optimizer is AdamW")
only(A + "optim.num_cycles", 0.5, why="prorl's cosine schedule is a half cycle")
only(A + "optim.override_optimizer_config", None, {}, why="prorl's AdamW takes optim.* only")
only(
    A + "ppo_epochs",
    1,
    why="prorl makes one pass over each step's batch (trainer.mini_batches updates)",
)
only(
    A + "policy_loss.loss_mode", "vanilla", why="prorl's loss is PPO-Clip (clip-higher, dual clip)"
)
only(A + "loss_scale_factor", None, why="prorl's loss normaliser follows algorithm.agg")
only(A + "ulysses_sequence_parallel_size", 1, why="prorl has no sequence parallelism")


@rule(A + "strategy")
def _strategy(get):
    """model.fsdp (fsdp or fsdp2: prorl's FSDP2)"""
    if get(A + "strategy") not in ("fsdp", "fsdp2"):
        raise Refused("prorl shards with FSDP2 (fsdp | fsdp2), not Megatron")
    return {"model.fsdp": True}


@rule(A + "optim.clip_grad", A + "grad_clip")
def _clip_grad(get):
    """optim.max_grad_norm"""
    clip, legacy = _given(get, A + "optim.clip_grad"), _given(get, A + "grad_clip")
    if clip is not None and legacy is not None and float(clip) != float(legacy):
        raise Refused(f"differs from {A}grad_clip={legacy}: give one gradient clip")
    value = clip if clip is not None else legacy
    return {} if value is None else {"optim.max_grad_norm": float(value)}


@rule(A + "optim.lr_scheduler_type", A + "optim.warmup_style")
def _schedule(get):
    """optim.schedule (constant or cosine)"""
    style = _given(get, A + "optim.warmup_style") or _given(get, A + "optim.lr_scheduler_type")
    if style is None:
        return {}
    if style not in ("constant", "cosine"):
        raise Refused(f"prorl's schedules are constant and cosine, not {style!r}")
    return {"optim.schedule": style}


@rule(A + "optim.lr_warmup_steps", A + "optim.lr_warmup_steps_ratio", A + "ppo_mini_batch_size",
      "data.train_batch_size", "trainer.total_training_steps")  # fmt: skip
def _warmup(get):
    """optim.warmup_steps: verl counts RL steps (its scheduler steps once per update_actor), prorl
    optimizer steps: x trainer.mini_batches. The ramp's length is verl's, not each step's value:
    verl holds one lr for all of an RL step's updates and starts from 0, prorl's lr rises per
    optimizer step from lr / warmup_steps"""
    steps, ratio = (
        _given(get, A + "optim.lr_warmup_steps"),
        _given(get, A + "optim.lr_warmup_steps_ratio"),
    )
    if steps is None or steps < 0:
        total = _given(get, "trainer.total_training_steps")
        if not ratio:
            return {} if steps is None and ratio is None else {"optim.warmup_steps": 0}
        if total is None:
            raise Refused("a warmup ratio needs trainer.total_training_steps")
        steps = int(ratio * total)
    minis = _mini_batches(get)
    if minis is None:  # the RL steps times the run's own mini-batch count
        steps = int(steps)
        text = f"{steps} x trainer.mini_batches"
        return {"optim.warmup_steps": Derived(lambda cfg: steps * cfg.trainer.mini_batches, text)}
    return {"optim.warmup_steps": int(steps) * minis}


# -- actor: batch, loss ----------------------------------------------------------------------------
def _mini_batches(get) -> int | None:
    prompts, mini = _given(get, "data.train_batch_size"), _given(get, A + "ppo_mini_batch_size")
    if prompts is None or mini is None:
        return None
    if prompts < 1:
        raise Refused(f"data.train_batch_size={prompts} must be >= 1")
    if mini <= 0 or prompts % mini:
        raise Refused(
            f"data.train_batch_size={prompts} is not a multiple of ppo_mini_batch_size={mini}"
        )
    return prompts // mini


@rule(A + "ppo_mini_batch_size", "data.train_batch_size")
def _minis(get):
    """trainer.mini_batches = data.train_batch_size / ppo_mini_batch_size (both count prompts;
    without data.train_batch_size: trainer.prompts_per_step / ppo_mini_batch_size)"""
    mini = _given(get, A + "ppo_mini_batch_size")
    if mini is not None and _given(get, "data.train_batch_size") is None:
        if mini <= 0:
            raise Refused("must be > 0 (prompts per mini-batch)")
        return {"trainer.mini_batches": Derived(
            lambda cfg: _divide(cfg.trainer.prompts_per_step, mini, "trainer.prompts_per_step"),
            f"trainer.prompts_per_step / {mini}")}  # fmt: skip
    minis = _mini_batches(get)
    return {} if minis is None else {"trainer.mini_batches": minis}


def _divide(prompts: int, mini: int, name: str) -> int:
    if prompts % mini:
        raise Refused(f"{name}={prompts} is not a multiple of {A}ppo_mini_batch_size={mini}")
    return prompts // mini


@rule(A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu", A + "ppo_micro_batch_size_per_gpu",
      A + "ppo_micro_batch_size")  # fmt: skip
def _micro(get):
    """trainer.micro_batch_tokens = ppo_max_token_len_per_gpu with use_dynamic_bsz; sequence counts
    are ignored (prorl sizes micro-batches in tokens; the result is the same)"""
    if _given(get, A + "use_dynamic_bsz") and _given(get, A + "ppo_max_token_len_per_gpu"):
        return {"trainer.micro_batch_tokens": int(get(A + "ppo_max_token_len_per_gpu"))}
    return {}


@rule(A + "clip_ratio", A + "clip_ratio_low", A + "clip_ratio_high")
def _clip(get):
    """algorithm.eps_low / eps_high (clip_ratio_low / high, else clip_ratio)"""
    base = _given(get, A + "clip_ratio")
    low, high = _given(get, A + "clip_ratio_low"), _given(get, A + "clip_ratio_high")
    out = {}
    if (low if low is not None else base) is not None:
        out["algorithm.eps_low"] = float(low if low is not None else base)
    if (high if high is not None else base) is not None:
        out["algorithm.eps_high"] = float(high if high is not None else base)
    return out


simple(A + "clip_ratio_c", "algorithm.dual_clip", lambda v: None if v is None else float(v),
       "algorithm.dual_clip (verl's vanilla loss always dual-clips)")  # fmt: skip
simple(A + "entropy_coeff", "algorithm.entropy_coef", float)

AGG = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
       "seq-mean-token-sum": "seq-mean-token-sum",
       "seq-mean-token-sum-norm": "constant"}  # fmt: skip


@rule(A + "loss_agg_mode")
def _agg(get):
    """algorithm.agg (seq-mean-token-sum-norm: constant, Dr.GRPO's)"""
    mode = get(A + "loss_agg_mode")
    if mode not in AGG:
        raise Refused(f"prorl aggregates as {', '.join(AGG)}")
    return {"algorithm.agg": AGG[mode]}


# verl kl_loss_type -> (kl_estimator, kl_clamp): verl clamps low_var_kl's output to [-10, 10],
# nothing else
KL_TYPES = {"kl": ("k1", "none"), "k1": ("k1", "none"), "mse": ("k2", "none"), "k2": ("k2", "none"),
            "low_var_kl": ("k3", "output"), "k3": ("k3", "output")}  # fmt: skip


@rule(A + "use_kl_loss", A + "kl_loss_coef", A + "kl_loss_type")
def _kl(get):
    """algorithm.kl_coef (0 without use_kl_loss), kl_estimator, kl_clamp"""
    use, coef, kind = (_given(get, A + k) for k in ("use_kl_loss", "kl_loss_coef", "kl_loss_type"))
    out = {}
    if kind is not None:
        if kind not in KL_TYPES:
            raise Refused(f"prorl's KL estimators are {', '.join(KL_TYPES)}")
        out["algorithm.kl_estimator"], out["algorithm.kl_clamp"] = KL_TYPES[kind]
    if use is False:
        out["algorithm.kl_coef"] = 0.0
    elif coef is not None:
        out["algorithm.kl_coef"] = float(coef)
    return out


# -- rollout ---------------------------------------------------------------------------------------
@rule(R + "name")
def _backend(get):
    """rollout.backend (vllm; hf: prorl's native sampler)"""
    name = get(R + "name")
    backends = {"vllm": "vllm", "hf": "native", "native": "native", "???": "auto", None: "auto"}
    if name not in backends:
        raise Refused("prorl samples with vLLM or its native sampler (vllm | hf)")
    return {"rollout.backend": backends[name]}


def _sampling_temperature(get, prefix: str, target: str) -> dict:
    """`target` from verl's `<prefix>temperature`, or 0 (greedy) when `<prefix>do_sample` is
    false."""
    if _given(get, prefix + "do_sample") is False:
        return {target: 0.0}
    t = _given(get, prefix + "temperature")
    return {} if t is None else {target: float(t)}


@rule(R + "temperature", R + "do_sample")
def _temperature(get):
    """rollout.temperature (do_sample false: 0, greedy)"""
    return _sampling_temperature(get, R, "rollout.temperature")


simple(R + "top_p", "rollout.top_p", float)
simple(R + "top_k", "rollout.top_k", lambda v: -1 if v in (None, 0) else int(v))
simple(R + "n", "rollout.n", int)
simple(R + "gpu_memory_utilization", "rollout.gpu_memory_utilization", float)


@rule(
    R + "response_length", "data.max_response_length", R + "prompt_length", "data.max_prompt_length"
)
def _lengths(get):
    """(checked) rollout.response_length / prompt_length equal data.max_response_length /
    prompt_length"""
    for rollout_key, data_key in (
        ("response_length", "max_response_length"),
        ("prompt_length", "max_prompt_length"),
    ):
        a, b = _given(get, R + rollout_key), _given(get, "data." + data_key)
        if a is not None and b is not None and a != b:
            raise Refused(f"{R}{rollout_key}={a} differs from data.{data_key}={b}: make them equal")
    return {}


@rule(R + "val_kwargs.temperature", R + "val_kwargs.do_sample")
def _val_temperature(get):
    """trainer.val_temperature (do_sample false: 0, greedy)"""
    return _sampling_temperature(get, R + "val_kwargs.", "trainer.val_temperature")


simple(R + "val_kwargs.top_p", "trainer.val_top_p", float)
simple(R + "val_kwargs.n", "trainer.val_samples", int)
only(R + "val_kwargs.top_k", -1, 0, None, why="prorl validates without top-k")
only(R + "ignore_eos", False, why="prorl stops at the model's end-of-sequence tokens")
only(R + "multi_turn.enable", False, None, why="prorl samples single-turn responses")
only(R + "over_sample_rate", 0, 0.0, None, why="prorl finishes every request")
only("actor_rollout_ref.hybrid_engine", True, why="prorl colocates the sampler with the trainer")


# -- algorithm -------------------------------------------------------------------------------------
@rule("algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo", R + "n")
def _advantage(get):
    """algorithm.advantage: grpo with the unbiased group std (verl divides by torch.std; dr-grpo
    without norm_adv_by_std_in_grpo), reinforce_plus_plus_baseline (token-weighted whitening, as
    verl's masked_whiten; verl's variance carries Bessel's T / (T - 1) over the batch's T response
    tokens, prorl's not: a relative difference of 1 / 2T). rollout.n=1 is refused: verl takes a
    lone response's raw score as its advantage, prorl centres it to 0"""
    est, norm = get("algorithm.adv_estimator"), _given(get, "algorithm.norm_adv_by_std_in_grpo")
    if est is ABSENT:
        return {}
    if est in ("grpo", "reinforce_plus_plus_baseline") and _given(get, R + "n") == 1:
        raise Refused(
            f"{est} with {R}n=1: verl's advantage is then the raw score, prorl centres a group of "
            f"one to 0 (nothing is learnt); set {R}n to the group size (ProRL: 16)"
        )
    if est == "grpo":
        mode = "dr-grpo" if norm is False else "grpo"
        return {"algorithm.advantage": mode, "algorithm.grpo_std_unbiased": True}
    if est == "reinforce_plus_plus_baseline":
        return {
            "algorithm.advantage": "reinforce++-baseline",
            "algorithm.whiten_weighting": "token",
        }
    why = "prorl has no critic (value model)" if est == "gae" else "not one of prorl's estimators"
    raise Refused(f"{why}: use grpo or reinforce_plus_plus_baseline (ProRL's)")


only(
    "algorithm.use_kl_in_reward",
    False,
    why="prorl's KL is a loss term (actor.use_kl_loss), not a reward",
)
only("algorithm.use_pf_ppo", False, why="prorl has no preference-feedback reweighting")
only(
    "algorithm.rollout_correction.rollout_is",
    None,
    why="set algorithm.is_mode (tis | icepop) instead",
)
only("algorithm.rollout_correction.rollout_rs", None, why="set algorithm.is_mode=icepop instead")
only("algorithm.rollout_correction.bypass_mode", False, why="prorl recomputes pi_old")


@rule("algorithm.filter_groups.enable", "algorithm.filter_groups.metric")
def _filter(get):
    """algorithm.dynamic_sampling (DAPO's dynamic sampling on the raw score)"""
    on, metric = (
        _given(get, "algorithm.filter_groups.enable"),
        _given(get, "algorithm.filter_groups.metric"),
    )
    if on and metric not in (None, "acc", "score", "reward"):
        raise Refused("prorl filters groups on the verifier's raw score (metric acc | score)")
    return {} if on is None else {"algorithm.dynamic_sampling": bool(on)}


@rule("algorithm.filter_groups.max_num_gen_batches")
def _rounds(get):
    """algorithm.max_rounds (0, unlimited in verl: prorl's default)"""
    n = get("algorithm.filter_groups.max_num_gen_batches")
    return {"algorithm.max_rounds": int(n)} if n and n > 0 else {}


# -- trainer ---------------------------------------------------------------------------------------
@rule("trainer.total_training_steps", "trainer.total_epochs")
def _steps(get):
    """trainer.total_steps; without total_training_steps, trainer.total_epochs (total_epochs x
    training prompts // data.train_batch_size, counted when the data is read, as verl counts)"""
    steps, epochs = _given(get, "trainer.total_training_steps"), _given(get, "trainer.total_epochs")
    if steps is not None:  # verl: total_training_steps, when set, wins over total_epochs
        return {"trainer.total_steps": int(steps), "trainer.total_epochs": 0}
    if epochs is None:
        if get("trainer.total_training_steps") is ABSENT:
            return {}
        raise Refused("set trainer.total_training_steps or trainer.total_epochs")
    return {"trainer.total_epochs": int(epochs)}


simple("trainer.save_freq", "trainer.save_every", lambda v: max(int(v), 0))
simple("trainer.test_freq", "trainer.val_every", lambda v: max(int(v), 0))
simple("trainer.val_before_train", "trainer.val_before_train", bool)
RUNS = "runs"  # prorl's run folder (prorl/config.py: output_dir's default runs/<timestamp>)


@rule("trainer.default_local_dir")
def _run_dir(get):
    """output_dir. A relative path (verl's default `checkpoints/<project>/<experiment>`) is resolved
    against prorl's `output_dir` when one is given (verl resolves it against the current directory),
    else against runs/: a run started in a checkout writes nothing else into it, and re-running the
    same command resumes"""
    path = _given(get, "trainer.default_local_dir")
    if path is None:
        return {}
    path = os.path.expanduser(str(path))
    if os.path.isabs(path):
        return {"output_dir": path}
    text = f"{{output_dir or {RUNS}}}/{path}"
    return {"output_dir": Derived(lambda cfg: os.path.join(cfg.output_dir or RUNS, path), text)}


only("trainer.val_only", False, why="validate a model with python -m prorl.eval")
only("trainer.resume_mode", "auto", why="prorl resumes from output_dir's latest checkpoint (a new "
     "trainer.default_local_dir starts afresh)")  # fmt: skip
only("trainer.resume_from_path", None, why="prorl resumes from output_dir")
only("trainer.critic_warmup", 0, why="prorl has no critic")


@rule("trainer.max_actor_ckpt_to_keep")
def _keep(get):
    """trainer.keep_last (when set)"""
    n = _given(get, "trainer.max_actor_ckpt_to_keep")
    return {} if n is None else {"trainer.keep_last": int(n)}


@rule("trainer.logger", "trainer.project_name")
def _logger(get):
    """logging.tensorboard; logging.wandb_project = project_name with wandb"""
    loggers = _given(get, "trainer.logger")
    if loggers is None:
        return {}
    loggers = [loggers] if isinstance(loggers, str) else list(loggers)
    out: dict[str, Any] = {"logging.tensorboard": "tensorboard" in loggers}
    if "wandb" in loggers:
        out["logging.wandb_project"] = _given(get, "trainer.project_name") or "prorl"
    return out


# -- reward ----------------------------------------------------------------------------------------
@rule("reward.custom_reward_function.path", "reward.custom_reward_function.name",
      "custom_reward_function.path", "custom_reward_function.name")  # fmt: skip
def _reward_function(get):
    """reward.function = path:name (prorl/rewards/function.py)"""
    specs = set()
    for prefix in ("reward.", ""):
        path = _given(get, prefix + "custom_reward_function.path")
        if path:
            name = _given(get, prefix + "custom_reward_function.name") or "compute_score"
            specs.add(f"{os.path.expanduser(str(path))}:{name}")
    if len(specs) > 1:
        raise Refused(f"two different reward functions: {', '.join(sorted(specs))}")
    return {"reward.function": specs.pop()} if specs else {}


only(
    "custom_reward_function.reward_kwargs",
    {},
    None,
    why="reward.function takes verl's four arguments",
)
only(
    "reward.reward_manager.name",
    "naive",
    why="prorl scores each response once (verl's naive manager)",
)
only("reward.reward_manager.source", "register", why="prorl scores each response once")
only("reward.reward_model.enable", None, False, why="prorl has no reward model: verifiers score")
only("reward_model.enable", None, False, why="prorl has no reward model: verifiers score")
only("distillation.enabled", None, False, why="prorl has no distillation")
only("distillation.enable", None, False, why="prorl has no distillation")
simple("reward.num_workers", "reward.num_workers", int)


# verl 0.9.1's keys in the sections prorl shares (data, trainer, algorithm) that prorl does not
# have: on a prorl command line they are verl's (translated, ignored or refused), never a misspelt
# prorl key
VERL_KEYS_IN_SHARED_SECTIONS = shared_section_keys({k for k, _ in fields()})
