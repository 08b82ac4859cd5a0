"""The values each string option of the fused ops accepts: torch-free, so a trainer's config can
check a command line (and answer `--help`) before torch is loaded. An option's position in its
tuple is the integer code that the native and triton kernels take."""

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CLAMPS = ("log-ratio", "output", "none")
IS_MODES = ("none", "tis", "icepop")
ADVANTAGE_MODES = ("reinforce++-baseline", "grpo", "dr-grpo")  # group_advantages(mode=)
WHITEN_WEIGHTINGS = ("token", "sequence")  # group_advantages(weighting=), batch_whiten(weighting=)
