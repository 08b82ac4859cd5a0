"""Evaluate a checkpoint on benchmark files: pass@1, unbiased pass@k and mean score per data source.

k samples per prompt, pass@1 as the mean over k, unbiased pass@k, mean continuous score; a
per-data-source table printed and written as JSON and CSV.

    python -m prorl.eval --model DIR --data aime24.parquet math500.jsonl [--k 16] [--out DIR]
    python -m prorl.eval --model prorl/assets/tiny-reasoner --builtin digit_sums --k 4

What is computed (docs/recipe.md §8), per data source and over all prompts:
- `pass@1` (also reported as `avg@k`, the mean accuracy of k samples): mean over prompts of c / k,
  where c of the k samples are correct; a data source read from several files gets a row per file
  too (`by_file`); `maj@k` (math-verified sources): the most frequent final answer is right;
- `pass@j` for j = 2, 4, ... (powers of two) and k: mean over prompts of the unbiased estimator
  1 - C(k - c, j) / C(k, j) (Chen et al. 2021), the chance that j samples drawn without replacement
  from the k contain a correct one; with j = k it is the plain "any of the k correct";
- `mean_score`: mean of the verifier's continuous score over every sample: the headline number for
  logic puzzles (Reasoning Gym) and instruction following (IFEval), whose scores are fractions. A
  sample is "correct" when its score reaches `correct_threshold` (1.0: all tests passed, all
  instructions met);
- `mean_response_tokens`, `truncated_frac` (hit max tokens), `timeout_frac` / `error_frac`
  (verifier).
The `primary` column names the headline metric of each source (`mean_score` for the `reasoning_gym`
and `ifeval` verifiers, `pass@1` otherwise).

Defaults follow the papers: temperature 0.6, top-p 0.95, k = 16, up to 32K response tokens (capped
by the model's context, the cap printed). Prompts are the chat-templated messages
(`data.encode_prompts`); one over `--max-prompt-tokens` is filtered and counted, never truncated.
Generation uses prorl's `NativeGenerator` (CPU or one GPU) in chunks of prompts sized to a KV-cache
budget; chunk i's responses are scored in the `RewardPool` while chunk i+1 generates. Draws are
fixed by (seed + chunk start, prompt index in chunk, sample index, position): reproducible for the
same seed and chunk size. `--backend vllm` is reserved for the vLLM generator and not implemented
yet.

Written to --out (default runs/eval-<UTC time>): `results.json` (settings and every metric),
`results.csv` (one row per data source plus `all`), `samples.jsonl` (one row per sample: example
index, data source, sample index, score, correct, flags, response text), from which every number can
be recomputed (prorl/eval_results.py writes them). `evaluate(examples, EvalInputs(...),
EvalSettings(...))` is the same thing as a function; `validate` is the trainer's use of it. The
metrics themselves are prorl/eval_metrics.py's (`summarize` turns per-sample records, e.g. gathered
from several ranks, into them).
"""

from __future__ import annotations

import argparse
import sys

from prorl.engine.choices import ROLLOUT as BACKENDS
from prorl.lazy import forwarder

# The command line is parsed, and --help answered, before torch is loaded: the evaluation itself is
# prorl/eval_run.py.


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m prorl.eval",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows every default
    )
    ap.add_argument(
        "--model",
        required=True,
        help="Hugging Face-format model directory, or a training checkpoint step",
    )
    ap.add_argument(
        "--plugins",
        nargs="*",
        default=[],
        help="modules that register verifiers (as reward.plugins)",
    )
    ap.add_argument(
        "--reward-function",
        default="",
        help="verl's compute_score for every row: FILE.py[:NAME] (reward.function)",
    )
    ap.add_argument(
        "--data", nargs="+", default=[], help="benchmark files (verl parquet / JSONL / JSON)"
    )
    ap.add_argument(
        "--builtin", default=None, help="a built-in task's validation split (digit_sums, ...)"
    )
    ap.add_argument(
        "--limit", type=int, default=None, help="at most this many examples per file / task"
    )
    ap.add_argument("--k", type=int, default=16, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling (0: greedy)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling")
    ap.add_argument(
        "--max-tokens", type=int, default=32768, help="max response tokens (capped by context)"
    )
    ap.add_argument(
        "--max-prompt-tokens", type=int, default=1024, help="longer prompts are filtered"
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--backend", choices=BACKENDS, default="native", help="sampler")
    ap.add_argument("--device", default=None, help="cpu | cuda (None: cuda when available)")
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="None: the model's"
    )
    ap.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="KV-cache budget per generate call"
    )
    ap.add_argument(
        "--prompts-per-generate", type=int, default=64, help="most prompts per generate call"
    )
    ap.add_argument("--num-workers", type=int, default=2, help="reward worker processes")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per verification")
    ap.add_argument("--out", default=None, help="output directory (None: runs/eval-<UTC time>)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.backend != "native":
        msg = (
            f"--backend {args.backend} is not implemented yet (the vLLM generator); use --backend "
            "native"
        )
        print(f"prorl.eval: {msg}", file=sys.stderr)
        return 2
    if not args.data and not args.builtin:
        ap.error("give --data FILE [FILE ...] and/or --builtin TASK")
    from prorl import eval_run

    return eval_run.run(args, ap)


__getattr__ = forwarder(__name__, "prorl.eval_run")  # `from prorl.eval import ...`


if __name__ == "__main__":
    raise SystemExit(main())
