"""The CUDA paths, on a real GPU: compiled Triton kernels, the native sampler, the trainer step.

Skipped without a CUDA device (the CPU suite covers the same code under the Triton interpreter,
which cannot show compiled-code problems: register pressure, fast-math exp/log accuracy, truly
concurrent programs racing on the ppo_loss completion counter, host syncs). Run on a GPU machine
with `python -m pytest tests/gpu` (benchmarks/gpu_check.sh does, with the GPU benchmarks).

Kernel results are held to independent references computed on the CPU in float64 (`*_reference` ops)
and greedy decoding to `transformers`' generate. Two checks compare prorl with itself by design: the
sampler's log-probs against the training model's recomputation (the sampler/trainer mismatch that
training logs), and a sampler after `update_weights` against a fresh sampler on the new weights.
"""

import contextlib
import math
import os

import pytest
import torch

# PRORL_GPU_TEST_DEVICE=cpu runs the module on CPU tensors (Triton interpreted; TRITON_INTERPRET=1
# set by tests/conftest.py): a check of the tests themselves, not of compiled GPU code
CUDA = torch.device(os.environ.get("PRORL_GPU_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SCALE = 1 if CUDA.type == "cuda" else 8  # the interpreter is slow: smaller problems on the CPU


def _n(n: int) -> int:
    return max(4, n // SCALE)


@pytest.fixture(autouse=True)
def _exact_matmuls():
    """fp32 products in full fp32 (no TF32) so that fp32 results can be held to tight tolerances."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------
# ppo_loss (Triton: one forward launch, one backward launch, no host sync)
# --------------------------------------------------------------------------------------------------


def _ppo_case(n_seqs, max_len, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n_seqs,), generator=g)
    n = int(lens.sum())
    cu = torch.zeros(n_seqs + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    old = -torch.rand(n, generator=g) * 4
    # ratios far outside the clip
    logp = (old + 0.3 * torch.randn(n, generator=g)).clamp(max=0).to(dtype)
    ref = -torch.rand(n, generator=g) * 4
    adv = torch.randn(n_seqs, generator=g).repeat_interleave(lens)
    mask = torch.rand(n, generator=g) > 0.1
    return logp, old, adv, mask, ref, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "agg,kw",
    [
        ("token-mean", dict(kl_coef=1e-3, kl_estimator="k2")),
        ("seq-mean-token-mean", dict(kl_coef=0.1, kl_estimator="k3", dual_clip=3.0)),
        ("seq-mean-token-sum", dict(kl_coef=0.0)),
        ("constant", dict(kl_coef=1e-2, kl_estimator="k1", normalizer=4096.0)),
    ],
)
def test_ppo_loss_triton_matches_float64(agg, kw, dtype):
    from prorl.kernels import ppo_loss, ppo_loss_reference

    logp, old, adv, mask, ref, cu = _ppo_case(_n(300), _n(200), seed=1, dtype=dtype)
    x = logp.to(CUDA, copy=True).requires_grad_()
    loss, metrics = ppo_loss(
        x, old.to(CUDA), adv.to(CUDA), mask.to(CUDA), ref_logp=ref.to(CUDA), cu_seqlens=cu.to(CUDA),
        agg=agg, backend="triton", **kw,
    )  # fmt: skip
    loss.backward()
    xr = logp.detach().double().requires_grad_()
    want, want_metrics = ppo_loss_reference(
        xr, old.double(), adv.double(), mask, ref_logp=ref.double(), cu_seqlens=cu, agg=agg, **kw
    )
    want.backward()
    torch.testing.assert_close(loss.double().cpu(), want.detach(), rtol=1e-5, atol=1e-7)
    # bf16 logp gets a bf16 gradient: one rounding of each element
    tol = dict(rtol=1e-5, atol=1e-9) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-8)
    torch.testing.assert_close(x.grad.double().cpu(), xr.grad, **tol)
    for k in ("clipfrac_low", "clipfrac_high", "num_tokens"):
        torch.testing.assert_close(
            metrics[k].double().cpu(), torch.as_tensor(want_metrics[k]).double()
        )


@contextlib.contextmanager
def _no_host_sync():
    """torch raises on a host sync inside (CUDA only)."""
    if CUDA.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_ppo_loss_triton_no_host_sync_and_deterministic():
    """A large call (many programs, truly concurrent on the GPU): no host sync in forward or
    backward (torch raises on one under sync debug mode "error"), and bitwise-equal results over
    repeats (the last program reduces the partials in a fixed order)."""
    from prorl.kernels import ppo_loss, ppo_loss_reference

    logp, old, adv, mask, ref, cu = _ppo_case(_n(4096), _n(512), seed=2, dtype=torch.float32)
    args = [t.to(CUDA) for t in (old, adv, mask)]
    refd, cud = ref.to(CUDA), cu.to(CUDA)
    outs = []
    for _ in range(5):
        x = logp.to(CUDA, copy=True).requires_grad_()
        with _no_host_sync():
            loss, _ = ppo_loss(
                x, *args, ref_logp=refd, kl_coef=1e-3, cu_seqlens=cud, backend="triton"
            )
            loss.backward()
        outs.append((loss.detach().clone(), x.grad.clone()))
    for loss, grad in outs[1:]:
        assert torch.equal(loss, outs[0][0]) and torch.equal(grad, outs[0][1])
    want, _ = ppo_loss_reference(
        logp.double(),
        old.double(),
        adv.double(),
        mask,
        ref_logp=ref.double(),
        kl_coef=1e-3,
        cu_seqlens=cu,
    )
    torch.testing.assert_close(outs[0][0].double().cpu(), want, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# linear_logprob_entropy and linear_ppo_loss (Triton tile kernels + cuBLAS GEMMs)
# --------------------------------------------------------------------------------------------------


def _llpe_case(n, d, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * 2).to(dtype)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d) * 4).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[0], y[-1], y[5] = 0, v - 1, -100
    return h, w, y, torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_logprob_entropy_triton_matches_float64(dtype, temperature):
    from prorl.kernels import linear_logprob_entropy, linear_logprob_entropy_reference

    # odd V: a partial last tile
    h, w, y, g_lp, g_ent = _llpe_case(_n(777), 256, _n(5003) | 1, dtype)
    hc, wc = h.to(CUDA, copy=True).requires_grad_(), w.to(CUDA, copy=True).requires_grad_()
    lp, ent = linear_logprob_entropy(hc, wc, y.to(CUDA), temperature, backend="triton")
    (lp.float() * g_lp.to(CUDA) + ent.float() * g_ent.to(CUDA)).sum().backward()
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp_r, ent_r = linear_logprob_entropy_reference(hr, wr, y, temperature)
    (lp_r * g_lp.double() + ent_r * g_ent.double()).sum().backward()
    if dtype == torch.float32:
        torch.testing.assert_close(lp.double().cpu(), lp_r.detach(), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(ent.double().cpu(), ent_r.detach(), rtol=2e-5, atol=2e-5)
        assert _rel(hc.grad, hr.grad) < 1e-5 and _rel(wc.grad, wr.grad) < 1e-5
    else:  # bf16 products accumulate in fp32; outputs and gradients are rounded to bf16 once
        torch.testing.assert_close(lp.double().cpu(), lp_r.detach(), rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(ent.double().cpu(), ent_r.detach(), rtol=1e-2, atol=2e-2)
        assert _rel(hc.grad, hr.grad) < 1e-2 and _rel(wc.grad, wr.grad) < 1e-2
    assert lp[5].item() == 0 and hc.grad[5].abs().sum().item() == 0  # ignore_index row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ppo_loss_triton_matches_float64(dtype):
    from prorl.kernels import linear_logprob_entropy_reference, linear_ppo_loss, ppo_loss_reference

    n, d, v = 900, 192, _n(3001) | 1
    h, w, y, _, _ = _llpe_case(n, d, v, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    lens = [300, 1, 250, 349]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    true_lp, _ = linear_logprob_entropy_reference(h.double(), w.double(), y, 1.0)
    old = (true_lp + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(len(lens), generator=g).repeat_interleave(torch.tensor(lens))
    mask = (torch.rand(n, generator=g) > 0.05) & (y != -100)
    ref = old - 0.1
    kw = dict(kl_coef=1e-2, agg="token-mean")
    hc, wc = h.to(CUDA, copy=True).requires_grad_(), w.to(CUDA, copy=True).requires_grad_()
    loss, _ = linear_ppo_loss(
        hc, wc, y.to(CUDA), old.to(CUDA), adv.to(CUDA), mask.to(CUDA), ref_logp=ref.to(CUDA),
        cu_seqlens=cu.to(CUDA), backend="triton", **kw,
    )  # fmt: skip
    loss.backward()
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp_r, _ = linear_logprob_entropy_reference(hr, wr, y, 1.0)
    want, _ = ppo_loss_reference(
        lp_r, old.double(), adv.double(), mask, ref_logp=ref.double(), cu_seqlens=cu, **kw
    )
    want.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() - want.item()) <= tol * max(1.0, abs(want.item()))
    assert _rel(hc.grad, hr.grad) < tol and _rel(wc.grad, wr.grad) < tol


def test_group_advantages_cuda_matches_float64():
    from prorl.kernels import group_advantages, group_advantages_reference

    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 64, (512,), generator=g)
    rewards = (torch.rand(512, generator=g) > 0.5).float()
    lengths = torch.randint(1, 1024, (512,), generator=g)
    got = group_advantages(rewards.to(CUDA), idx.to(CUDA), lengths=lengths.to(CUDA))
    want = group_advantages_reference(rewards, idx, lengths=lengths)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Native sampler and trainer on CUDA
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rollout_checkpoints import save_random_qwen2

    path = tmp_path_factory.mktemp("tiny-qwen2-cuda")
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=128)
    return str(path), save_random_qwen2(path, std=0.15, **cfg)


PROMPTS = [[5, 9, 17, 3], [200, 7], [11, 12, 13, 14, 15, 16, 17], [42]]


def test_native_sampler_cuda_greedy_matches_transformers_cpu(checkpoint):
    """Greedy decoding on CUDA (fp32, no TF32) equals transformers' greedy generate on the CPU."""
    from prorl.engine.model import load_hf
    from prorl.engine.rollout import NativeGenerator, SamplingParams

    path, hf = checkpoint
    gen = NativeGenerator(load_hf(path, device=CUDA))
    out = gen.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=16))
    for s in out.samples:
        prompt = torch.tensor([PROMPTS[s.prompt_index]])
        ref = hf.generate(
            prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert s.token_ids == ref[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sampler_cuda_logprobs_match_trainer(checkpoint, dtype):
    """Sampled tokens' log-probs equal the training model's recomputed ones (fp32: tight; bf16: the
    sampler-vs-trainer mismatch that training logs, bounded)."""
    from prorl.engine.model import load_hf
    from prorl.engine.rollout import NativeGenerator, SamplingParams
    from rollout_checkpoints import recompute_logprobs

    path, _ = checkpoint
    model = load_hf(path, dtype=dtype, device=CUDA)
    gen = NativeGenerator(model)
    params = SamplingParams(n=4, temperature=0.8, top_p=0.95, max_new_tokens=24, seed=3)
    out = gen.generate(PROMPTS, params)
    diffs = [
        torch.tensor(s.logprobs)
        - recompute_logprobs(model, PROMPTS[s.prompt_index], s.token_ids, 0.8)
        for s in out.samples
    ]
    d = torch.cat(diffs)
    print(
        f"sampler-vs-trainer logp mismatch {dtype}: max "
        f"{d.abs().max():.3g} rms {d.pow(2).mean().sqrt():.3g}"
    )
    assert d.abs().max() < (1e-3 if dtype == torch.float32 else 0.25)


def test_native_sampler_cuda_update_weights_follow(checkpoint):
    from prorl.engine.model import load_hf
    from prorl.engine.rollout import NativeGenerator, SamplingParams

    path, _ = checkpoint
    model = load_hf(path, device=CUDA)
    gen = NativeGenerator(model)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    before = [s.token_ids for s in gen.generate(PROMPTS, params).samples]
    other = load_hf(path, device=CUDA)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    gen.update_weights(other.state_dict())
    after = [s.token_ids for s in gen.generate(PROMPTS, params).samples]
    fresh = [s.token_ids for s in NativeGenerator(other).generate(PROMPTS, params).samples]
    assert after == fresh and after != before


def test_trainer_steps_on_cuda(tmp_path):
    """The embedded default's trainer, in-process on cuda:0: two RL steps, finite loss, the policy
    moves, the sampler follows it (drift metric small)."""
    from transformers import PreTrainedTokenizerFast

    from prorl.config import load_config
    from prorl.data import builtin
    from prorl.rewards.pool import RewardPool
    from prorl.trainer import Trainer

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "prorl", "assets", "tiny-reasoner")
    cfg = load_config(
        "default",
        [
            f"output_dir={tmp_path}",
            "trainer.prompts_per_step=8",
            "rollout.n=4",
            "reward.num_workers=1",
            "rollout.backend=native",
        ],
    )
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    train = builtin("digit_sums", seed=0, split="train")
    val = builtin("digit_sums", n=4, seed=0, split="val")
    with RewardPool(num_workers=1, timeout_s=30.0, preload=("math",)) as pool:
        trainer = Trainer(cfg, path, tok, train, val, pool)
        assert trainer.device.type == CUDA.type
        w0 = next(trainer.policy.parameters()).detach().clone()
        metrics = [trainer.step() for _ in range(2)]
    for m in metrics:
        print({k: round(float(v), 5) for k, v in m.items() if isinstance(v, (int, float))})
        assert all(math.isfinite(float(v)) for v in m.values() if isinstance(v, (int, float)))
        # fp32 sampler on the policy vs the update's forward
        assert m["rollout/logprob_mismatch"] < 1e-3
    assert not torch.equal(w0, next(trainer.policy.parameters()).detach())
