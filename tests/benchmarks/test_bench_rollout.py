"""benchmarks/rollout.py: the CPU defaults as before --device/--dtype, the dtype in the shapes and
notes, one tiny generate step on CPU, and --device cuda refused without a GPU. Never asserts speed.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import rollout


def test_defaults_and_notes():
    assert rollout.DEFAULT_CKPTS == ("tiny", "small") and "medium" in rollout.CHECKPOINTS
    shapes = rollout.make_shapes(["tiny"], [16], [128, 512])
    assert [s["label"] for s in shapes] == ["tiny B=16 new=128", "tiny B=16 new=512"]
    assert all(s["dtype"] == "float32" for s in shapes) and [s["sync"] for s in shapes] == [
        True,
        False,
    ]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert rollout._note("prorl", shapes[0], cpu) == ""  # CPU fp32 rows read as before
    assert rollout._note("transformers", shapes[0], cpu).endswith("static_cache no_logprobs")
    bf16 = rollout.make_shapes(["medium"], [64], [128], "bfloat16")[0]
    assert rollout._note("prorl", bf16, cuda) == "dtype=bfloat16"
    assert "auto_compile=on" in rollout._note("transformers", bf16, cuda)
    assert "auto_compile=off dtype=bfloat16" in rollout._note("transformers-eager", bf16, cuda)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prorl_generate_step_on_cpu(dtype):
    shape = rollout.make_shapes(["tiny"], [2], [4], dtype)[0]
    step = rollout.build("prorl", "generate", shape, torch.device("cpu"))
    out = step.run()
    assert len(out.samples) == 2 and all(len(s.token_ids) == 4 for s in out.samples)
    assert step.note == ("" if dtype == "float32" else "dtype=bfloat16")
    assert rollout.build("prorl", "weight_sync_checked", shape, torch.device("cpu")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_device_cuda_refused_without_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        rollout.main(["--device", "cuda", "--out", "/nonexistent/never-written.csv"])
    assert exc.value.code == 2
    assert "--device cuda needs a visible CUDA device" in capsys.readouterr().err
