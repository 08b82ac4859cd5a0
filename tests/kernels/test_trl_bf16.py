"""bf16 (TRL's default `bf16=True`): the fused route's gradient error is no larger than stock TRL's.

One GRPO micro-batch (benchmarks/dropin.py's tiny random Qwen2 at V = 2048, TRL's defaults,
on-policy), the parameter gradient of `compute_loss` under TRL's bf16 autocast, for: stock
GRPOTrainer, stock with `cast_lm_head_to_fp32=True` (bf16 backbone, fp32 head), GRPOTrainer with the
older `trl_compute_loss` drop-in, and FusedGRPOTrainer. The reference is stock TRL in fp32
(`bf16=False`), the same weights and batch. Error = ||g - g_ref|| / ||g_ref|| over all parameters
(flash-attention's criterion, STYLE.md: the kernel's low-precision error against the fp32 reference,
next to plain torch's own).
"""

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl); CI installs it")
pytest.importorskip("datasets", reason="TRL's trainer needs datasets (installed with trl)")

from benchmarks.dropin import grpo_micro_batch, grpo_trainer, qwen2  # noqa: E402

V = 2048


def _grad(route: str, bf16: bool) -> torch.Tensor:
    from prorl.kernels.adapters import FusedGRPOTrainer, trl_compute_loss

    class Adapter(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return trl_compute_loss(self, model, inputs)

    cls = {"adapter": Adapter, "fused": FusedGRPOTrainer}.get(route, trl.GRPOTrainer)
    extra = dict(cast_lm_head_to_fp32=True) if route == "stock-fp32-head" else {}
    model = qwen2(V)
    trainer = grpo_trainer(cls, model, bf16=bf16, **extra)
    trainer.compute_loss(trainer.model, grpo_micro_batch(V)).backward()
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


@pytest.mark.slow
def test_fused_bf16_gradient_error_is_no_larger_than_stock(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    try:
        ref = _grad("stock", bf16=False)
        err = lambda g: float((g - ref).norm() / ref.norm())
        errors = {
            r: err(_grad(r, bf16=True)) for r in ("stock", "stock-fp32-head", "adapter", "fused")
        }
        fp32 = {r: err(_grad(r, bf16=False)) for r in ("adapter", "fused")}
    finally:
        torch.set_num_threads(threads)
    print("bf16 gradient errors against fp32 stock:", errors, "fp32:", fp32)
    # in fp32 both drop-ins are stock's numbers: the ops add no error
    assert max(fp32.values()) < 1e-5
    assert errors["stock"] > 1e-4  # bf16 autocast does perturb the gradient (the test can fail)
    # its error is TRL's autocast
    assert errors["adapter"] == pytest.approx(errors["stock"], rel=0.05)
    assert errors["fused"] <= errors["stock"]
