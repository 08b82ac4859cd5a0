#!/usr/bin/env bash
# CI: the drop-in adapters against the real verl 0.9.1 and OpenRLHF 0.11.2 (tests/peers), in a venv of their own.
#
#   .ci/peers.sh [VENV]      VENV default: $PRORL_PEERS_VENV, else /tmp/prorl-peers-venv
#
# Run it with the CI's main python on PATH (torch, transformers and prorl installed, the `test` extra). Both
# peers install with --no-deps: their full dependency sets (Ray, DeepSpeed, flash-attn, vLLM, pinned
# transformers) do not install beside the CPU torch, and the tests stand in for the modules the loss code
# imports but never calls (tests/peers/peer_stubs.py). The venv sees the main environment's packages
# through a .pth file (`--system-site-packages` alone would show the base interpreter's, not a venv's), and
# an existing venv that already has both peers is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE PIP_PROGRESS_BAR=off
venv=${1:-${PRORL_PEERS_VENV:-/tmp/prorl-peers-venv}}
main_python=$(command -v python)
start=$(date +%s)

if [ ! -x "$venv/bin/python" ]; then
  "$main_python" -m venv --system-site-packages "$venv"
fi
# the main environment's site-packages, after the venv's own (rewritten each run: the main venv may move)
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$main_python" - "$site/_prorl_main_env.pth" <<'EOF'
import sys, sysconfig
paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in paths) + "\n")
EOF

have_peers='import importlib.metadata as m, tensordict; assert (m.version("verl"), m.version("openrlhf")) == ("0.9.1", "0.11.2")'
if "$venv/bin/python" -c "$have_peers" 2>/dev/null; then
  echo "peers: reusing $venv"
else
  echo "peers: installing verl 0.9.1 and openrlhf 0.11.2 (--no-deps) into $venv"
  "$venv/bin/python" -m pip install -q --no-deps "verl==0.9.1" "openrlhf==0.11.2"
  # what verl's loss modules import that the main environment lacks (tensordict's own deps, torch aside)
  "$venv/bin/python" -m pip install -q --no-deps "tensordict==0.10.0" \
    pyvers==0.2.3 orjson==3.13.0 cloudpickle==3.1.3 importlib_metadata==10.2.0 zipp==4.1.2
  "$venv/bin/python" -c "$have_peers"
fi
"$venv/bin/python" -c "import torch, transformers, prorl.kernels.adapters"  # the main environment shows through
echo "peers: environment ready in $(( $(date +%s) - start )) s"
"$venv/bin/python" -m pytest -q tests/peers
echo "peers: done in $(( $(date +%s) - start )) s"
