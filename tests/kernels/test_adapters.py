"""The adapters' behaviour that needs no peer installed: version checks, lazy imports, clear errors.

Their numbers are tested against the peers themselves: TRL in test_trl_parity.py (main suite), verl
and OpenRLHF in tests/peers/ (CI runs them in a separate venv that has both, .ci/peers.sh).
"""

import importlib
import importlib.metadata
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from prorl.kernels import adapters
from prorl.kernels.adapters import (
    OpenRLHFPolicyLoss,
    PeerVersionWarning,
    check_peer_version,
    trl_grpo_loss,
    verl_policy_loss,
)


@pytest.mark.parametrize(
    "dist,version,ok",
    [
        ("verl", "0.9.1", True),
        ("verl", "0.9.1.post1", True),
        ("verl", "0.9.2", False),
        ("verl", "0.10.0", False),
        ("openrlhf", "0.11.2", True),
        ("openrlhf", "0.11.1", False),
        ("trl", "1.16.0", True),
        ("trl", "1.16.3", True),
        ("trl", "1.17.0", False),
        ("trl", "1.1", False),
    ],
)
def test_version_check(dist, version, ok):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_peer_version(dist, version) is ok
    if ok:
        assert not caught
    else:
        (w,) = caught
        assert w.category is PeerVersionWarning
        assert f"{dist} {version} is installed" in str(w.message)
        assert f"tested against {dist} {adapters.TESTED[dist]}" in str(w.message)


def test_import_warns_for_an_installed_peer_outside_the_tested_range(monkeypatch):
    def version(dist):
        if dist == "openrlhf":
            return "0.12.0"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.warns(PeerVersionWarning, match=r"openrlhf 0\.12\.0 is installed") as record:
        importlib.reload(adapters)
    assert len(record) == 1  # verl and trl "not installed": nothing to say


def test_importing_the_adapters_imports_no_peer():
    code = (
        "import sys, prorl.kernels.adapters; peers = {'verl', 'openrlhf', 'trl', 'ray', "
        "'deepspeed'}; print(sorted({m.split('.')[0] for m in sys.modules} & peers))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------------------------------
# Clear errors naming the bad setting
# --------------------------------------------------------------------------------------------------


def _tensors(b=3, t=4):
    logp = -torch.rand(b, t, dtype=torch.float64)
    return logp, logp + 0.1, torch.randn(b, t, dtype=torch.float64), torch.ones(b, t)


def _verl_config(**kw):
    cfg = dict(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=3.0,
        global_batch_info={},
    )
    cfg.update(kw)
    return SimpleNamespace(get=lambda k, d=None: cfg.get(k, d), **cfg)


@pytest.mark.parametrize(
    "mode,config,named",
    [
        ("token-mean", None, "needs `config`"),
        ("seq-mean", _verl_config(), "loss_agg_mode 'seq-mean'"),
        ("token-mean", _verl_config(clip_ratio_c=1.0), "clip_ratio_c must be > 1"),
        ("token-mean", _verl_config(global_batch_info={"dp_sise": 2}), "dp_sise"),
        ("token-mean", _verl_config(global_batch_info={"dp_size": 2}), "batch_num_tokens"),
        ("seq-mean-token-sum", _verl_config(global_batch_info={"dp_size": 2}), "global_batch_size"),
    ],
)
def test_verl_errors_name_the_setting(mode, config, named):
    logp, old, adv, mask = _tensors()
    with pytest.raises(ValueError, match=named):
        verl_policy_loss(old, logp, adv, mask, mode, config)


@pytest.mark.parametrize(
    "kw,named",
    [
        (dict(policy_loss_type="gspo"), "policy_loss_type 'gspo'"),
        (dict(is_correction_level="seq"), "is_correction_level='seq'"),
        (dict(is_correction_level="token", is_correction_gating="binary_kl"), "'binary_kl'"),
        (dict(is_correction_mode="drop"), "is_correction_mode must be one of mask, clip"),
        (
            dict(is_correction_level="token", is_correction_threshold=(2.0, 1.0)),
            "is_correction_threshold",
        ),
        (dict(dual_clip=1.0), "dual_clip must be > 1.0"),
    ],
)
def test_openrlhf_errors_name_the_setting(kw, named):
    with pytest.raises(ValueError, match=named):
        OpenRLHFPolicyLoss(**kw)


def test_openrlhf_is_correction_needs_rollout_log_probs():
    logp, old, adv, mask = _tensors()
    with pytest.raises(ValueError, match="rollout_log_probs"):
        OpenRLHFPolicyLoss(is_correction_level="token")(logp, old, adv, mask)


@pytest.mark.parametrize(
    "kw,named",
    [
        (dict(loss_type="cispo"), "loss_type 'cispo'"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
        (dict(loss_type="dapo"), "num_items_in_batch"),
    ],
)
def test_trl_errors_name_the_setting(kw, named):
    logp, old, adv, mask = _tensors()
    with pytest.raises(ValueError, match=named):
        trl_grpo_loss(logp, old, adv[:, 0], mask, **kw)
