"""Mutation check of the recipe's core: do the tests fail when one line's meaning changes?

`python -m benchmarks mutants [--only ID,...] [--list] [--out PATH] [--timeout S]`

Each curated mutant (`MUTANTS`) is a one-line semantic change to the recipe (a sign, a dropped
option, a bound off by one, an answer accepted too early) together with the tests that should kill
it. The checkout's files (tracked and untracked-not-ignored, plus the built native library) are
copied to a temporary directory; there every mutant is applied on its own, its tests run (pytest
-x, OMP_NUM_THREADS=1), and the file restored. The working tree is never written. A sitecustomize
on PYTHONPATH maps `prorl`, `prorl.kernels` and `prorl.engine` to the copy for the test processes
and everything they start (an editable install would import the checkout instead).

Verdicts: killed (a test failed), survived (every test passed: the suite misses this change),
timeout (counted as killed, reported), error (pytest could not run the selection: not a kill).
First every selection runs unmutated: a failing baseline voids the run. Results:
benchmarks/results/mutants.md (score, survivors, one row per mutant). Not part of CI: the full
list takes ~15-25 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mutants.md"

WIRING = "tests/prorl/test_recipe_wiring.py"
GRADIENT = f"{WIRING}::test_a_step_gradient_is_the_documented_loss"
SAMPLING = "tests/rollout/test_sampling_support.py"
ALGORITHM = "tests/prorl/test_algorithm.py"
SCHEDULE = ("tests/prorl/test_prompt_schedule.py", "-k", "not torchrun")
MATH = "tests/rewards/test_math.py"
KERNEL = ("tests/kernels/test_ppo_loss.py", "-k", "torch")


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments
    what: str


def m(id, path, old, new, tests, what) -> Mutant:
    return Mutant(id, path, old, new, (tests,) if isinstance(tests, str) else tuple(tests), what)


U, N, A = "prorl/update.py", "engine/rollout/native.py", "prorl/algorithm.py"
MUTANTS = [
    # the nine bugs of issue 37 that passed the whole suite
    m("eps-high-lost", U, "eps_high=algo.eps_high,", "eps_high=algo.eps_low,", GRADIENT,
      "clip-higher lost: eps_high = eps_low"),
    m("kl-sign", U, "kl_coef=algo.kl_coef,", "kl_coef=-algo.kl_coef,", WIRING,
      "the KL coefficient with the wrong sign"),
    m("kl-estimator-k3", U, "kl_estimator=algo.kl_estimator,", 'kl_estimator="k3",', GRADIENT,
      "the KL estimator forced to k3"),
    m("dual-clip-dropped", U, "dual_clip=algo.dual_clip,", "dual_clip=None,", GRADIENT,
      "algorithm.dual_clip dropped"),
    m("agg-token-mean", U, "agg=algo.agg,", 'agg="token-mean",', GRADIENT,
      "the loss op's aggregation forced to token-mean"),
    m("logp-temperature-1", U, "temperature=self.logprob_temperature,", "temperature=1.0,",
      GRADIENT, "the trainer's log-probs at temperature 1"),
    m("entropy-sign", U, "loss = loss - algo.entropy_coef", "loss = loss + algo.entropy_coef",
      GRADIENT, "the entropy bonus added to the loss"),
    m("top-p-cumsum", N, "e = e * ((p.cumsum(-1) - p) < params.top_p)",
      "e = e * (p.cumsum(-1) < params.top_p)", SAMPLING, "top-p keeps tokens with cumsum < p"),
    m("reprobe-off-by-one", "prorl/prompt_schedule.py", ">= self.cfg.reprobe_epochs",
      "> self.cfg.reprobe_epochs", SCHEDULE, "the re-probe bound off by one"),
    # killed only by accident before issue 37
    m("reset-wipes-optimizer", "prorl/trainer.py", "if self.reset_policy.reset_optimizer:",
      "if True:", (WIRING, "-k", "reset"), "the reference reset also wipes AdamW's state"),
    m("resume-data-order", "prorl/sampling.py", 'self.data_order = list(state["data_order"])',
      "self.data_order = []", (WIRING, "-k", "resumed"),
      "resume restores the data RNG, not the data order"),
    m("math-prefix", "prorl/rewards/maths.py", "ok = any(is_equivalent(answer, str(g)) for",
      "ok = any(is_equivalent(answer, str(g)) or answer.startswith(str(g)) for", MATH,
      "an answer that starts with the gold is accepted"),
    # more of the update's wiring
    m("kl-clamp-none", U, "kl_clamp=algo.kl_clamp,", 'kl_clamp="none",', GRADIENT,
      "algorithm.kl_clamp dropped (the KL unclamped)"),
    m("normaliser-local", U, "normalizer=normalizer,", "normalizer=None,", GRADIENT,
      "each micro-batch divided by its own token count instead of the mini-batch's"),
    m("plan-agg-token-mean", U, "agg=self.cfg.algorithm.agg,", 'agg="token-mean",', GRADIENT,
      "the mini-batch normaliser computed for token-mean whatever algorithm.agg says"),
    m("is-mode-tis", U, "is_mode=algo.is_mode,", 'is_mode="tis",', GRADIENT,
      "the IS mode forced to TIS"),
    m("is-bounds-swapped", U, "is_bounds=(algo.is_low, algo.is_high),",
      "is_bounds=(algo.is_high, algo.is_low),", GRADIENT, "the IS bounds swapped"),
    m("whiten-by-sequence", U, "weighting=algo.whiten_weighting,", 'weighting="sequence",',
      GRADIENT, "whitening weighted by sequence instead of token"),
    m("advantage-grpo", U, "mode=algo.advantage,", 'mode="grpo",', GRADIENT,
      "GRPO advantages instead of REINFORCE++-baseline"),
    m("entropy-unnormalised", U, "algo.entropy_coef * ent_sum / normalizer",
      "algo.entropy_coef * ent_sum", GRADIENT, "the entropy bonus not divided by the normaliser"),
    m("carried-pi-old-ignored", U, "tokens.old_logp = tokens.pi_old(logp.detach().float())",
      "tokens.old_logp = logp.detach().float()", GRADIENT,
      "carried-over groups trained against logp.detach() (ratio 1)"),
    m("reference-is-policy", U, "ref = self.response_logprobs(self.reference, batch, passes[0])",
      "ref = self.response_logprobs(self.policy, batch, passes[0])", WIRING,
      "the reference log-probs taken from the policy"),
    m("reset-copies-nothing", "prorl/policy.py", "copy_parameters_(self.reference, self.policy)",
      "pass", (WIRING, "-k", "reset"), "the reference reset copies nothing"),
    # algorithm.py
    m("is-weights-inverted", A, "torch.exp((old_logp - sampler_logp)",
      "torch.exp((sampler_logp - old_logp)", (ALGORITHM, GRADIENT),
      "the importance weights inverted"),
    m("keep-all-equal", A, "return hi > lo", "return hi >= lo",
      (ALGORITHM, "tests/prorl/test_trainer_recipe.py", "-k", "keep"),
      "dynamic sampling keeps all-equal groups"),
    m("stop-properly-cap", A, "torch.minimum(rewards * c_stop, rewards)", "rewards * c_stop",
      ALGORITHM, "a truncated negative reward raised to R x c_stop"),
    m("cosine-eta-sign", A, "(1.0 + torch.cos(math.pi", "(1.0 - torch.cos(math.pi", ALGORITHM,
      "the cosine length schedule reversed"),
    m("length-on-off-by-one", A, "return step % (k_on + k_off) < k_on",
      "return step % (k_on + k_off) <= k_on", ALGORITHM, "the length term on one step too long"),
    m("constant-normaliser", A, "float(per_seq.numel() * max_new)", "float(per_seq.numel())",
      GRADIENT, "Dr.GRPO's constant normaliser without the response budget"),
    # the native sampler
    m("sampling-temperature-ignored", N,
      "z = logits if params.temperature == 1 else logits / params.temperature", "z = logits",
      SAMPLING, "the sampler ignores the temperature"),
    m("greedy-argmin", N, "tokens = logits.argmax(-1)", "tokens = logits.argmin(-1)", SAMPLING,
      "greedy takes the least likely token"),
    m("top-k-plus-one", N, "e.topk(min(params.top_k, e.shape[1]), -1)",
      "e.topk(min(params.top_k + 1, e.shape[1]), -1)", SAMPLING, "top-k keeps k + 1 tokens"),
    # the loss op's torch backend (the native and Triton backends need a rebuild per mutant; issue
    # 37's 64 kernel mutants were run by hand)
    m("clip-low-sign", "kernels/ppo_loss.py", "lo, hi = 1.0 - opts.eps_low, 1.0 + opts.eps_high",
      "lo, hi = 1.0 + opts.eps_low, 1.0 + opts.eps_high", KERNEL, "the lower clip above 1"),
    m("pg-min-not-max", "kernels/ppo_loss.py", "pg = torch.maximum(pg_unclipped, pg_clipped)",
      "pg = torch.minimum(pg_unclipped, pg_clipped)", KERNEL, "PPO's pessimistic max lost"),
    m("tis-floor", "kernels/ppo_loss.py", "return w.clamp(max=hi)", "return w.clamp(min=hi)",
      KERNEL, "TIS raises the weights to is_high instead of truncating them"),
    # the math verifier
    m("math-unparsed-accepted", "prorl/rewards/maths.py",
      "if not gold_parsed or not answer_parsed:\n        return False",
      "if not gold_parsed or not answer_parsed:\n        return True", MATH,
      "an unparsable answer is accepted"),
]  # fmt: skip


def copy_tree(dest: Path) -> None:
    """The checkout's files (tracked, untracked-not-ignored) and the built native library."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    files = [f for f in out.split("\0") if f and (ROOT / f).is_file()]
    files += [str(p.relative_to(ROOT)) for p in (ROOT / "kernels").glob("_C*.so")]
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


SITECUSTOMIZE = '''"""prorl from the mutation copy at {root}, ahead of any installed one."""
import importlib.util
import sys

_MAP = {{
    "prorl": "{root}/prorl",
    "prorl.kernels": "{root}/kernels",
    "prorl.engine": "{root}/engine",
}}


class _CopyFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in _MAP:
            return None
        where = _MAP[name]
        return importlib.util.spec_from_file_location(
            name, where + "/__init__.py", submodule_search_locations=[where]
        )


sys.meta_path.insert(0, _CopyFinder)
'''


def run_tests(tree: Path, site: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float]:
    """pytest on `tests` in the copy: ('passed' | 'failed' | 'timeout' | 'error: rc N', seconds)."""
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("CI", None)  # the mutants' tests, not the native-library check
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0
    verdict = {0: "passed", 1: "failed"}.get(rc, f"error: pytest rc {rc}")
    return verdict, time.perf_counter() - t0


def apply(tree: Path, mutant: Mutant) -> str:
    """Write the mutant into the copy; returns the original text (to restore)."""
    path = tree / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise ValueError(
            f"mutant {mutant.id}: {mutant.old!r} occurs {text.count(mutant.old)} times in "
            f"{mutant.path} (it must occur once: update the mutant list)"
        )
    path.write_text(text.replace(mutant.old, mutant.new))
    return text


def check(mutants: list[Mutant], timeout: float, log=print) -> tuple[list[dict], str]:
    """Every mutant's verdict in a fresh copy of the checkout; and the baseline's verdict."""
    with tempfile.TemporaryDirectory(prefix="prorl-mutants.") as tmp:
        tree, site = Path(tmp) / "tree", Path(tmp) / "site"
        tree.mkdir()
        site.mkdir()
        copy_tree(tree)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=tree))
        for tests in dict.fromkeys(mutant.tests for mutant in mutants):  # each selection once
            baseline, seconds = run_tests(tree, site, tests, timeout)
            log(f"baseline {' '.join(tests)}: {baseline} in {seconds:.0f} s")
            if baseline != "passed":
                return [], baseline
        rows = []
        for mutant in mutants:
            original = apply(tree, mutant)
            try:
                verdict, seconds = run_tests(tree, site, mutant.tests, timeout)
            finally:
                (tree / mutant.path).write_text(original)
            status = {"failed": "killed", "passed": "SURVIVED"}.get(verdict, verdict)
            rows.append({"mutant": mutant, "status": status, "seconds": seconds})
            log(f"{mutant.id:<30} {status:<10} {seconds:6.1f} s")
        return rows, baseline


def write_results(rows: list[dict], out: Path, command: str) -> None:
    killed = sum(r["status"] in ("killed", "timeout") for r in rows)
    survivors = [r["mutant"].id for r in rows if r["status"] == "SURVIVED"]
    errors = [r["mutant"].id for r in rows if r["status"].startswith("error")]
    lines = [
        "# Mutation check of the recipe's core",
        "",
        f"`{command}` (benchmarks/mutants.py), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f", {os.cpu_count()} CPUs, one test selection per mutant (pytest -x).",
        "",
        f"**Score: {killed} / {len(rows)} killed.** Survivors: "
        f"{', '.join(survivors) if survivors else 'none'}."
        + (f" Not run (pytest error): {', '.join(errors)}." if errors else ""),
        "",
        "| mutant | file | change | tests | verdict | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mu = r["mutant"]
        change = f"`{mu.old.strip()}` → `{mu.new.strip()}`".replace("\n", " ").replace("|", "\\|")
        tests = " ".join(mu.tests).replace("|", "\\|")
        lines.append(
            f"| {mu.id}: {mu.what} | {mu.path} | {change} | {tests} | {r['status']} | "
            f"{r['seconds']:.0f} |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks mutants", description=__doc__.split("\n")[0]
    )
    p.add_argument("--only", default="", help="comma-separated mutant ids (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--out", default=str(RESULTS), help="the results file (markdown)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's tests")
    args = p.parse_args(argv)
    if args.list:
        for mu in MUTANTS:
            print(f"{mu.id:<30} {mu.path:<28} {mu.what}")
        return 0
    wanted = [s for s in args.only.split(",") if s]
    unknown = set(wanted) - {mu.id for mu in MUTANTS}
    if unknown:
        print(f"unknown mutant ids: {sorted(unknown)} (see --list)", file=sys.stderr)
        return 2
    mutants = [mu for mu in MUTANTS if not wanted or mu.id in wanted]
    # SIGTERM as an exception: the running pytest is killed and the copy removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, baseline = check(mutants, args.timeout)
    if baseline != "passed":
        print(f"the unmutated tests did not pass ({baseline}): no score", file=sys.stderr)
        return 1
    command = "python -m benchmarks mutants" + (f" --only {args.only}" if wanted else "")
    write_results(rows, Path(args.out), command)
    print(f"wrote {args.out}")
    return 0 if all(r["status"] != "SURVIVED" for r in rows) else 1
