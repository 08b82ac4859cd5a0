"""CI's newest-versions check, run in a venv that installed prorl without constraints.txt.

A user adds prorl to an environment with newer releases than CI pins (it is a drop-in library for
TRL / verl / OpenRLHF users); this catches a release that breaks us at our next submission:

- every module of prorl, prorl.engine and prorl.kernels imports (optional GPU packages aside);
- the drop-in adapters' imports, TRL's trainer included;
- a transformers model and `prorl.kernels` import together from the repository root, with Hugging
  Face's `kernels` installed (tests/test_import_names.py);
- a short run of the embedded default on 2 ranks, shortened by the dotted overrides given (.ci/run
  passes the main job's).

    python .ci/newest.py OVERRIDE...  # from the repository root, in the newest-versions venv
"""

import importlib
import importlib.metadata as md
import os
import pkgutil
import subprocess
import sys

# verl plugins import verl at the top on purpose (only verl imports them); tests/peers covers them
NEEDS_VERL = {"prorl.kernels.adapters.verl_plugin", "prorl.kernels.adapters.verl_fused_plugin"}
PINNED = (
    "torch",
    "transformers",
    "kernels",
    "trl",
    "tokenizers",
    "torchao",
    "triton",
    "liger-kernel",
)


def all_modules() -> list[str]:
    names = []
    for top in ("prorl", "prorl.engine", "prorl.kernels"):
        package = importlib.import_module(top)
        names.append(top)
        for info in pkgutil.walk_packages(package.__path__, prefix=top + "."):
            if info.name.startswith(("prorl.engine", "prorl.kernels")) and top == "prorl":
                continue
            names.append(info.name)
    return sorted(set(names))


def main(overrides: list[str]) -> int:
    print("newest: " + ", ".join(f"{p} {md.version(p)}" for p in PINNED))
    failed = []
    for name in all_modules():
        if name in NEEDS_VERL or name.endswith("._C"):  # _C: a torch op library, loaded by torch
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the check fails
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    print(f"newest: imported the modules, {len(failed)} failed")
    from prorl.kernels.adapters import _trl_trainer  # noqa: F401 - TRL's GRPOTrainer underneath

    env = dict(os.environ, OMP_NUM_THREADS="1")
    steps = [
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_import_names.py",
        ],
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "prorl/train.py",
            *overrides,
        ],
    ]
    for command in steps:
        if subprocess.call(command, env=env) != 0:
            failed.append(" ".join(command))
    for line in failed:
        print(f"newest: FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
