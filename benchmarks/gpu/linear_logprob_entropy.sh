#!/usr/bin/env bash
# GPU comparison of linear_logprob_entropy on one H200 (or any single CUDA GPU), bf16:
#   prorl (backend="triton"), prorl-torch, naive (eager [N, V] logits), Liger-Kernel's Triton fused linear
#   cross entropy (liger_fused_linear_cross_entropy, reduction="none": per-token -logp, no entropy; with
#   its default bf16 dW accumulation and with accum_dtype=float32), and gemm-floor (the op's bf16 GEMMs).
# Shapes: T=16384 tokens with D=1536/V=151936 and D=4096/V=128256. Modes forward, backward, full.
# Reports time (ms), effective TFLOPS (2TDV forward, 6TDV backward, 8TDV full) and peak_fraction (% of
# 989 TFLOPS, H200 bf16 dense), and peak extra CUDA memory; rows appended to
# benchmarks/results/linear_logprob_entropy.csv, then the plots are redrawn.
#
# Usage, from the repository root on the GPU machine:
#   bash benchmarks/gpu/linear_logprob_entropy.sh [extra args for `python -m benchmarks
#   linear_logprob_entropy`, e.g. --providers prorl,naive --reps 5]
# Needs: a CUDA torch with triton. prorl is installed here if it is not importable (editable, no native
# build, no dependencies fetched). liger-kernel is not in the lent H200 image and nothing can be
# downloaded there: carry it (it is pure Python), e.g. a copy of site-packages/liger_kernel in an
# ignored folder named by LIGER_PATH=<folder holding liger_kernel/>; without it the liger providers
# report an ImportError and the others still run.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"

if [[ -n "${LIGER_PATH:-}" ]]; then
    export PYTHONPATH="${LIGER_PATH}${PYTHONPATH:+:${PYTHONPATH}}"
fi

"$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
EOF

if ! "$PY" -c "import prorl.kernels" 2>/dev/null; then
    echo "installing prorl (editable, PRORL_TARGET_DEVICE=none: the Triton backend needs no build)"
    PRORL_TARGET_DEVICE=none "$PY" -m pip install --no-build-isolation --no-deps -e . -q
fi

"$PY" -m benchmarks linear_logprob_entropy --gpu --warmup 3 --reps 10 --timeout 300 "$@"
"$PY" -m benchmarks plot linear_logprob_entropy || echo "plotting failed (is matplotlib installed?)"
