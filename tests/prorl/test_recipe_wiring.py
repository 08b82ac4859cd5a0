"""The trainer's use of every recipe knob, against an independent float64 reference.

For each knob (clip-higher, dual-clip, each KL estimator, its clamp and its coefficient, each
aggregation, the sampling temperature and greedy sampling, the entropy bonus, each
importance-sampling mode, micro-batches) one RL update of a real
Trainer on tokens its own sampler drew is compared with the gradient of the loss docs/recipe.md
§2-§4 states, built here in float64 from those tokens, the rewards and the knob's value as the test
sets it: plain forwards of a float64 copy of the policy and of the reference (log-softmax of
logits / T), REINFORCE++-baseline advantages, PPO-Clip-Higher, the k1/k2/k3 estimators, the
aggregations. Nothing is read from the trainer's calls into the loss ops.

pi_old is set by hand (the carried-over groups' stored log-probs, §6) to put tokens on both sides
of both clips and beyond the dual-clip cap, and the reference is perturbed so that the KL and its
gradient are not zero. Also: one step with only the KL moves the policy toward the reference; the
reference reset keeps AdamW's moments and step unless `reset_optimizer`; a resumed trainer samples
the prompts the uninterrupted one does, with the prompt scheduler off and on.
"""

import copy
import math

import pytest
import torch
from tiny_trainer import make_trainer

from prorl.metrics import StepAccumulator
from prorl.packing import StepBatch

MAX_NEW = 16
BASE = [
    "trainer.prompts_per_step=3",
    "rollout.n=4",
    f"rollout.max_response_tokens={MAX_NEW}",
    "reward.length_penalty=false",
    "trainer.mini_batches=1",
    "trainer.micro_batch_tokens=0",
    "model.dtype=float32",
]
# pi / pi_old per token, cycled over the response tokens: both sides of 1 +- eps (0.2 / 0.28 and
# the v1 0.2 / 0.4), inside, and 4.0 beyond a dual-clip cap of 3
RATIOS = [0.5, 0.75, 0.9, 1.1, 1.24, 1.35, 1.5, 4.0]


def make(setup, overrides=()):
    return make_trainer(setup, [*BASE, *overrides])


def perturb_reference(trainer, std=0.02, seed=3, scramble=0.0):
    """Move pi_ref away from the policy, so that the KL term has a gradient; `scramble` multiplies
    each channel of the reference's final norm by N(0, scramble), which spreads |logp - ref_logp|
    over both sides of the KL clamp's 10 (at 3: about 20% under 4.5, 55% in 4.5-10, 25% over)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.reference.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
        if scramble:
            norm = trainer.reference.norm.weight
            norm.mul_(torch.randn(norm.shape, generator=g, dtype=norm.dtype) * scramble)


def forward64(model, prompt, tokens, temperature):
    """A plain float64 forward: log p(token) [L] and the entropy [L] of softmax(logits / T) at
    each response position (grad flows to `model`'s parameters)."""
    ids = torch.tensor(prompt + tokens)
    logits = model.logits(model(ids))[len(prompt) - 1 : -1].double() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def advantages64(groups):
    """docs/recipe.md §2 REINFORCE++-baseline: centre on the group mean, whiten over every
    response token (token-weighted mean and population variance, floor 1e-8)."""
    centred, lengths = [], []
    for g in groups:
        mean = sum(g.shaped) / len(g.shaped)
        centred += [r - mean for r in g.shaped]
        lengths += [len(t) for t in g.responses]
    c, w = torch.tensor(centred, dtype=torch.float64), torch.tensor(lengths, dtype=torch.float64)
    mu = (w * c).sum() / w.sum()
    var = (w * (c - mu) ** 2).sum() / w.sum()
    return ((c - mu) / var.clamp(min=1e-8).sqrt()).tolist()


def kl64(delta, estimator, clamp):
    """docs/recipe.md §4: Delta = logp - ref_logp clamped to [-10, 10] (`log-ratio`), or the
    estimate clamped to [-10, 10] (`output`, OpenRLHF's), or neither (`none`)."""
    d = delta.clamp(-10, 10) if clamp == "log-ratio" else delta
    kl = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[estimator]
    return kl.clamp(-10, 10) if clamp == "output" else kl


def token_loss64(logp, old, adv, ref, knobs, is_w):
    """docs/recipe.md §3-§4 per token: PPO-Clip-Higher (dual-clip for A < 0), times the bounded
    importance weight, plus beta x KL."""
    r = torch.exp((logp - old).clamp(-20, 20))
    clipped = r.clamp(1 - knobs["eps_low"], 1 + knobs["eps_high"])
    pg = torch.maximum(-adv * r, -adv * clipped)
    if knobs.get("dual_clip"):
        pg = torch.where(adv < 0, torch.minimum(pg, -knobs["dual_clip"] * adv), pg)
    if is_w is not None:
        lo, hi = knobs["is_low"], knobs["is_high"]
        if knobs["is_mode"] == "tis":
            is_w = is_w.clamp(max=hi)
        else:  # icepop: zero outside [lo, hi]
            is_w = torch.where((is_w >= lo) & (is_w <= hi), is_w, torch.zeros_like(is_w))
        pg = pg * is_w
    return pg + knobs["kl_coef"] * kl64(logp - ref, knobs["kl_estimator"], knobs["kl_clamp"])


def aggregate64(per_seq, agg, max_new):
    """docs/recipe.md §3: token-mean over all tokens, or over sequences of their token mean / sum,
    or Dr.GRPO's constant (sequences x the response budget)."""
    if agg == "token-mean":
        return torch.cat(per_seq).sum() / sum(len(x) for x in per_seq)
    if agg == "seq-mean-token-mean":
        return sum(x.mean() for x in per_seq) / len(per_seq)
    if agg == "seq-mean-token-sum":
        return sum(x.sum() for x in per_seq) / len(per_seq)
    assert agg == "constant"
    return sum(x.sum() for x in per_seq) / (len(per_seq) * max_new)


DOCUMENTED = dict(
    eps_low=0.2,
    eps_high=0.28,
    dual_clip=None,
    kl_coef=0.1,
    kl_estimator="k2",
    kl_clamp="log-ratio",
    agg="token-mean",
    entropy_coef=0.0,
    is_mode="none",
    is_low=0.5,
    is_high=5.0,
    temperature=1.0,
)


def reference_gradient(policy, reference, groups, knobs):
    """The float64 gradient of the documented loss of one mini-batch, per parameter name."""
    t = knobs["temperature"] or 1.0  # greedy sampling: log-probs at T = 1 (rollout/base.py)
    model = copy.deepcopy(policy).double()
    ref_model = copy.deepcopy(reference).double()
    adv = iter(advantages64(groups))
    per_seq, ent_sum, tokens = [], 0.0, 0
    for g in groups:
        for j, resp in enumerate(g.responses):
            a = next(adv)
            if not resp:
                continue
            logp, ent = forward64(model, g.prompt_ids, resp, t)
            with torch.no_grad():
                ref, _ = forward64(ref_model, g.prompt_ids, resp, t)
            old = torch.tensor(g.old_logps[j], dtype=torch.float64)
            is_w = None
            if knobs["is_mode"] != "none":
                is_w = torch.exp(old - torch.tensor(g.sampler_logps[j], dtype=torch.float64))
            per_seq.append(token_loss64(logp, old, torch.full_like(logp, a), ref, knobs, is_w))
            ent_sum, tokens = ent_sum + ent.sum(), tokens + len(resp)
    loss = aggregate64(per_seq, knobs["agg"], MAX_NEW)
    if knobs["entropy_coef"]:  # the bonus: entropy is rewarded, so it is subtracted (token-mean)
        loss = loss - knobs["entropy_coef"] * ent_sum / tokens
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def sampled(trainer, temperature=1.0, k=3, seed=7):
    """k groups drawn by the trainer's own sampler, rewards mixed within each group, pi_old stored
    as for carried-over groups at the RATIOS (pi / pi_old), and sampler log-probs spread around
    pi_old over [0.05, 20] (for the IS modes)."""
    groups = trainer.sampler.rollout(list(range(k)), seed=seed, max_new=MAX_NEW)
    t = temperature or 1.0
    model = copy.deepcopy(trainer.policy).double()
    i = 0
    for g in groups:
        # responses cut to different lengths (prefixes of what was drawn): the aggregations and the
        # token-weighted whitening then differ from their neighbours
        cut = [MAX_NEW - (5 * j + 3 * g.example_index) % 12 for j in range(len(g.responses))]
        g.responses = [resp[:c] for resp, c in zip(g.responses, cut)]
        g.raw = [float((j + g.example_index) % 2) for j in range(len(g.responses))]
        g.shaped = list(g.raw)
        g.old_logps, g.sampler_logps = [], []
        for resp in g.responses:
            with torch.no_grad():
                logp = forward64(model, g.prompt_ids, resp, t)[0] if resp else torch.zeros(0)
            old = [float(x) - math.log(RATIOS[(i + n) % len(RATIOS)]) for n, x in enumerate(logp)]
            w = [0.05 * 400 ** (((i + n) * 7 % 13) / 12) for n in range(len(resp))]
            g.old_logps.append(old)
            g.sampler_logps.append([o - math.log(x) for o, x in zip(old, w)])
            i += len(resp)
    return groups


def trainer_gradient(trainer, groups, monkeypatch):
    """The gradient the trainer's update hands its optimizer (one mini-batch), per parameter."""
    got = {}
    step = trainer.updater.optimizer_step

    def capture():
        got.update(
            {
                n: p.grad.double().clone()
                for n, p in trainer.policy.named_parameters()
                if p.grad is not None
            }
        )
        return step()

    monkeypatch.setattr(trainer.updater, "optimizer_step", capture)
    batch = StepBatch.of(groups, trainer.cfg.rollout.n, trainer.device)
    trainer.update(batch, MAX_NEW, StepAccumulator())
    return got


CASES = {
    "clip-higher": {},
    "clip-v1": {"eps_high": 0.4},
    "dual-clip": {"dual_clip": 3.0},
    "kl-k1": {"kl_estimator": "k1", "kl_coef": 0.3},
    "kl-k2": {"kl_estimator": "k2", "kl_coef": 0.3},
    "kl-k3": {"kl_estimator": "k3", "kl_coef": 0.3},
    # a scrambled reference: |logp - ref_logp| on both sides of the clamp (10; k2's output: 4.5)
    "kl-clamp-log-ratio": {"kl_clamp": "log-ratio", "_scramble": 3.0},
    "kl-clamp-output": {"kl_clamp": "output", "_scramble": 3.0},
    "kl-clamp-none": {"kl_clamp": "none", "_scramble": 3.0},
    "k3-clamp-log-ratio": {"kl_estimator": "k3", "_scramble": 3.0},
    "agg-seq-mean-token-mean": {"agg": "seq-mean-token-mean"},
    "agg-seq-mean-token-sum": {"agg": "seq-mean-token-sum"},
    "agg-constant": {"agg": "constant"},
    # token-budget micro-batches: each one's share divided by the mini-batch's global normaliser
    "micro-batches-token-mean": {"_micro_batch_tokens": 40},
    "micro-batches-seq-mean": {"agg": "seq-mean-token-mean", "_micro_batch_tokens": 40},
    "temperature": {"temperature": 0.7},
    "greedy": {"temperature": 0.0},
    "entropy": {"entropy_coef": 0.05},
    "tis": {"is_mode": "tis", "is_high": 3.0},
    "icepop": {"is_mode": "icepop", "is_low": 0.2, "is_high": 4.0},
}


def overrides(knobs):
    out = [f"rollout.temperature={knobs['temperature']}"]
    out += [f"trainer.micro_batch_tokens={knobs.get('_micro_batch_tokens', 0)}"]
    for k, v in knobs.items():
        if k != "temperature" and not k.startswith("_"):
            out.append(f"algorithm.{k}={'null' if v is None else v}")
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_gradient_is_the_documented_loss(tiny_setup, monkeypatch, case):
    knobs = {**DOCUMENTED, **CASES[case]}
    trainer = make(tiny_setup, overrides(knobs))
    perturb_reference(trainer, scramble=knobs.get("_scramble", 0.0))
    groups = sampled(trainer, knobs["temperature"])
    want = reference_gradient(trainer.policy, trainer.reference, groups, knobs)
    got = trainer_gradient(trainer, groups, monkeypatch)
    assert set(got) == set(want)
    g = torch.cat([got[n].flatten() for n in sorted(want)])
    w = torch.cat([want[n].flatten() for n in sorted(want)])
    err = (g - w).norm() / w.norm()
    assert err < 1e-4, (case, float(err))  # measured ~1e-6 (fp32 trainer vs fp64)


def mean_kl_to_reference(trainer, groups):
    """The exact KL(pi || pi_ref) over the vocabulary, averaged over the response positions
    (float64 plain forwards)."""
    with torch.no_grad():
        total, count = 0.0, 0
        for g in groups:
            for resp in g.responses:
                ids = torch.tensor(g.prompt_ids + resp)
                lo, hi = len(g.prompt_ids) - 1, len(ids) - 1
                p = torch.log_softmax(
                    trainer.policy.logits(trainer.policy(ids))[lo:hi].double(), -1
                )
                ref = trainer.reference
                q = torch.log_softmax(ref.logits(ref(ids))[lo:hi].double(), -1)
                total, count = total + float((p.exp() * (p - q)).sum()), count + len(resp)
    return total / count


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_the_kl_term_pulls_the_policy_toward_the_reference(tiny_setup, estimator):
    """docs/recipe.md §4: total loss = pg + beta x KL with beta > 0, so a step whose advantages are
    all zero (every group's rewards equal) moves the policy toward pi_ref. (k1's gradient, grad
    logp of the sampled tokens, has expectation zero under pi: as a loss term it pulls nowhere.)
    A small learning rate: AdamW moves every weight by about lr, noise included."""
    trainer = make(tiny_setup, [f"algorithm.kl_estimator={estimator}", "algorithm.kl_coef=1.0"])
    trainer.optimizer.optimizer.param_groups[0]["lr"] = 1e-4
    perturb_reference(trainer, std=0.05)
    groups = trainer.sampler.rollout(list(range(3)), seed=7, max_new=MAX_NEW)
    for g in groups:
        g.raw = g.shaped = [1.0] * len(g.responses)  # no policy-gradient signal: only the KL
    before = mean_kl_to_reference(trainer, groups)
    trainer.update(StepBatch.of(groups, 4, trainer.device), MAX_NEW, StepAccumulator())
    after = mean_kl_to_reference(trainer, groups)
    assert after < before - 1e-3, (before, after)  # measured: 1.5681 -> 1.5661; sign flipped 1.5704


@pytest.mark.parametrize("reset_optimizer", [False, True])
def test_the_reference_reset_keeps_adamws_state_unless_asked(tiny_setup, reset_optimizer):
    """docs/recipe.md §7: pi_ref <- policy, exactly; ProRL v2 keeps the optimizer state (AdamW's
    moments and step count), `reset_optimizer` (v1) forgets it; the LR schedule goes on."""
    trainer = make(tiny_setup, [f"algorithm.reset.reset_optimizer={str(reset_optimizer).lower()}"])
    groups = sampled(trainer)
    trainer.update(StepBatch.of(groups, 4, trainer.device), MAX_NEW, StepAccumulator())
    adamw = trainer.optimizer.optimizer
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in adamw.state.items()}
    assert before and all(float(s["step"]) == 1 for s in before.values())
    lr = trainer.optimizer.lr
    trainer.reset_reference()
    for p, r in zip(trainer.policy.parameters(), trainer.reference.parameters()):
        assert torch.equal(p, r)
    assert trainer.optimizer.lr == lr
    if reset_optimizer:
        assert len(adamw.state) == 0
        return
    after = {id(p): s for p, s in adamw.state.items()}
    assert after.keys() == before.keys()
    for key, state in before.items():
        for k, v in state.items():
            assert torch.equal(after[key][k], v), k


# -- resume: what the next steps sample ----------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["none", "pass-rate"])
def test_a_resumed_trainer_samples_the_prompts_the_uninterrupted_one_does(tiny_setup, scheduler):
    """Trainer.state_dict -> a fresh Trainer's load_state_dict (what a checkpoint carries): the
    prompts of the next rounds are the uninterrupted run's. Scheduler off, they come from the data
    order, saved mid-epoch after a reshuffle (16 prompts, 3 a round: round 6 is in epoch 2);
    scheduler on, from the prompt record."""
    over = [f"scheduler.mode={scheduler}", "algorithm.dynamic_sampling=false"]
    a = make(tiny_setup, over)

    def round_prompts(trainer, step):
        return trainer.sampler._round_prompts(3, 0, step, StepAccumulator())

    rng, record = torch.Generator().manual_seed(0), a.sampler.scheduler
    for step in range(6):
        if record is not None:
            record.new_step()
        for prompt in round_prompts(a, step):
            if record is not None:  # a random group for each prompt
                record.observe(prompt, torch.randint(0, 2, (4,), generator=rng).tolist())
        if record is not None:
            record.merge(step, [record.pending])
    b = make(tiny_setup, over)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for step in range(6, 12):
        for t in (a, b):
            if t.sampler.scheduler is not None:
                t.sampler.scheduler.new_step()
        assert round_prompts(b, step) == round_prompts(a, step), step
    if scheduler == "none":  # the 17th to 32nd prompts drawn are epoch 2: every prompt once
        c = make(tiny_setup, over)
        seen = [i for step in range(11) for i in round_prompts(c, step)]
        assert sorted(seen[16:32]) == list(range(16))
