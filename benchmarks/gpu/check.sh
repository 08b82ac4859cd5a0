#!/usr/bin/env bash
# One prepared run on a lent GPU machine (an H200 here): checks the CUDA paths and records GPU benchmark rows.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      # from the repository root; OUT_DIR default $OUT or /tmp/prorl-gpu
#   bash benchmarks/gpu/check.sh [OUT_DIR]      # the same: benchmarks/gpu_check.sh runs this file
#
# Steps, most important first, each under its own `timeout` (one that fails or runs out does not stop the
# rest; the log says which):
#   1. install: wheels carried in .whl/ (pure-Python packages missing from the machine's image: omegaconf,
#      math-verify, liger-kernel, trl, datasets, ...) into /tmp/site. Made on the CPU machine, in the repo root
#      (.whl/ ignored through .git/info/exclude), for the image's Python 3.12:
#        pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl omegaconf==2.4.0 \
#          math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 liger-kernel \
#          trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#      and carried with the device tool's `carry: [".whl"]`; prorl editable without the native CPU
#      build (PRORL_TARGET_DEVICE=none; the Triton backend needs no build) and without fetching anything.
#   2. the prorl_v2_1.5b preset in miniature on cuda:0 (NCCL, one rank): the preset file with the size-only
#      overrides of tests/helpers/preset_helpers.py, a bf16 checkpoint with an untied head, FSDP2 bf16 mixed
#      precision + activation checkpointing, micro-batches, dynamic sampling, resets, a checkpoint; then
#      tests (tests/gpu: compiled Triton kernels vs float64 references, no host sync, determinism, native
#      sampler vs transformers, the trainer step on CUDA) and attention (tests/engine/test_attention.py:
#      SDPA and FlexAttention forward and backward on CUDA).
#   3. the embedded default end to end on cuda:0, 60 of its 150 steps: `torchrun --nproc_per_node=1 prorl/train.py`.
#   3b. FP8 (engine/fp8.py) for real: tests/gpu/test_fp8_cuda.py (torchao's real FP8 GEMMs and Transformer
#      Engine's Linear under its autocast, against float64; activation checkpointing with TE's checkpoint),
#      then the embedded default with model.fp8=torchao and model.fp8=te (bf16, FSDP2, 30 steps each: compare
#      their val/accuracy and rollout/logprob_mismatch with main_job's), then the train_step rows of
#      prorl vs prorl-fp8 vs prorl-fp8-te at the 1.5B shape and one Qwen2-7B layer. torchao and
#      transformer-engine must be in the image or carried in .whl/ (torchao's CUDA wheel for the image's
#      torch); missing ones make their tests skip (pytest -rs says why) and their runs fail fast naming the
#      extra to install.
#   4. benchmarks on cuda: ppo_loss, advantages, linear_logprob_entropy (bf16, vs Liger), rollout (native
#      sampler vs transformers.generate), train_step, rl_step (prorl vs TRL, native / transformers
#      generation: vLLM is not in the image), then profile (benchmarks/gpu/profile_step.py: where a step's
#      time goes, SDPA kernel families toggled, ppo_loss device time under CUDA graphs). Rows go to
#      benchmarks/results/gpu/*.csv.
# GPU_CHECK_ONLY=a,b runs only those steps; GPU_CHECK_SKIP=a,b leaves those out.
# Everything it writes comes back as OUT_DIR/gpu.log and OUT_DIR/results.tgz (the CSVs, plots, run logs).
# Budget: GPU_CHECK_DEADLINE seconds (default 555; the device tool allows 600 per command): each step gets
# min(its limit, what is left); steps that would get under 30 s are skipped and the results packed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-/tmp/prorl-gpu}}"
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
T0=$(date +%s)
SKIP="${GPU_CHECK_SKIP:-}"  # comma-separated step names to leave out
ONLY="${GPU_CHECK_ONLY:-}"  # comma-separated step names to run (default: all)
SKIP="${SKIP// /}" ONLY="${ONLY// /}"  # spaces ignored
DEADLINE="${GPU_CHECK_DEADLINE:-555}"  # seconds from the start: later steps get what is left, then packing

step() {  # step NAME TIMEOUT_S CMD...: run one step, log its exit code and duration
    local name=$1 limit=$2
    shift 2
    if [[ ",$SKIP," == *",$name,"* ]] || [[ -n "$ONLY" && ",$ONLY," != *",$name,"* ]]; then
        echo "=== [$name] skipped (GPU_CHECK_SKIP / GPU_CHECK_ONLY)"
        return 0
    fi
    local left=$((DEADLINE - ($(date +%s) - T0)))
    if ((left < 30)); then
        echo "=== [$name] skipped: ${left} s left before the ${DEADLINE} s deadline"
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "=== [$name] start at +$(($(date +%s) - T0)) s, limit ${limit} s: $*"
    local s=$(date +%s)
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== [$name] rc=$rc in $(($(date +%s) - s)) s$([[ $rc == 124 || $rc == 137 ]] && echo ' (TIMED OUT)')"
}

echo "=== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
"$PY" -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

echo "=== install"
if compgen -G ".whl/*.whl" >/dev/null; then
    pipt() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
    pipt .whl/*.whl || for w in .whl/*.whl; do pipt "$w" || echo "install of $w failed"; done
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PRORL_TARGET_DEVICE=none "$PY" -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>&1 | grep -v "^WARNING: Running pip as" || true
"$PY" -c "import prorl, prorl.engine, prorl.kernels, prorl.trainer; print('prorl imports ok')" || exit 1
"$PY" -m pip list 2>/dev/null | grep -iE "^(liger-kernel|trl|datasets|accelerate|pyarrow|omegaconf|math-verify) " || true

preset_args() {  # writes the miniature's checkpoint and data, prints its overrides
    PYTHONPATH="tests/helpers${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import sys, preset_helpers as h
d = sys.argv[1]
ckpt = h.write_bf16_untied_checkpoint(d + "/ckpt")
print(" ".join(h.preset_overrides(ckpt, *h.write_data(d))))' "$1"
}
rm -rf runs/gpu-preset && mkdir -p runs/gpu-preset
step preset 120 env PYTHONPATH="tests/helpers${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node=1 prorl/train.py --config prorl_v2_1.5b $(preset_args runs/gpu-preset) \
    trainer.total_steps=6 trainer.save_every=3 output_dir=runs/gpu-preset/run
step tests 150 "$PY" -m pytest -q -rs -s -p no:cacheprovider --junitxml="$OUT_DIR/junit.xml" tests/gpu
step attention 60 "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_attention.py

rm -rf runs/gpu-default  # a warm machine keeps it from an earlier call: the job would resume, not train
step main_job 150 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 prorl/train.py output_dir=runs/gpu-default \
    trainer.total_steps=60 trainer.val_every=30

step fp8_tests 90 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_fp8_cuda.py
for backend in torchao te; do
    rm -rf "runs/gpu-fp8-$backend"
    step "fp8_$backend" 100 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 prorl/train.py \
        output_dir="runs/gpu-fp8-$backend" model.fp8="$backend" model.dtype=bfloat16 model.fsdp=true \
        trainer.total_steps=30 trainer.val_every=15
done

R=benchmarks/results/gpu  # GPU rows in their own CSVs (and plots): the CPU tables and plots stay CPU-only
mkdir -p "$R"
step ppo_loss 45 "$PY" -m benchmarks ppo_loss --device cuda --reps 50 --warmup 5 --out "$R/ppo_loss.csv"
step llpe 100 "$PY" -m benchmarks linear_logprob_entropy --gpu --warmup 2 --reps 5 --timeout 30 \
    --shape 16384,1536,151936 --providers prorl,naive,liger-flce,gemm-floor --out "$R/linear_logprob_entropy.csv"
step rollout 110 "$PY" -m benchmarks rollout --device cuda --ckpts small,medium --batches 64 --new 128,512 \
    --providers prorl,transformers-eager --reps 2 --warmup 1 --timeout 52 --out "$R/rollout.csv"
step rl_step 110 "$PY" -m benchmarks rl_step --gpu --gpu-gen native --models tiny,random --providers prorl,trl \
    --prompts 16 --n 8 --max-new 128 --warmup 1 --reps 3 --timeout 52 --out "$R/rl_step.csv"
step profile 120 "$PY" -m benchmarks.gpu.profile_step --model random --steps 5
step advantages 40 "$PY" -m benchmarks advantages --device cuda --timeout 15 --out "$R/advantages.csv"
step train_step 100 "$PY" -m benchmarks train_step --gpu --timeout 30 --out "$R/train_step.csv"
for model in qwen2-1.5b qwen2-7b-layer; do
    step "train_step_fp8_$model" 90 "$PY" -m benchmarks train_step --gpu --model "$model" --seqs 8 --timeout 40 \
        --providers prorl,prorl-fp8,prorl-fp8-te --out "$R/train_step.csv"
done

echo "=== pack results at +$(($(date +%s) - T0)) s"
tar czf "$OUT_DIR/results.tgz" benchmarks/results/gpu $(ls -d runs/gpu-{default,preset/run,fp8-torchao,fp8-te}/{config.yaml,metrics.jsonl,summary.txt,training_curves.png} 2>/dev/null)
echo "=== done in $(($(date +%s) - T0)) s"
exec 1>&- 2>&-
wait "$TEE_PID"  # the log is complete before the command returns
