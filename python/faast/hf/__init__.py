"""faast.hf: test-time learning for Hugging Face causal LMs (GPT-2, Llama, Qwen2).

`apply_faast(model, config)` attaches memory layers to a frozen model by hooking its own modules (no copied modeling
code); the returned model learns from text in forward passes (`learn`), and `generate` reads the fast weights.
transformers is imported only by the functions that load models (faast.hf.default), not by importing this package.
"""

from .config import FaastConfig
from .layers import MemoryLayer, OutputMemoryLayer
from .model import FaastModel, LearnStats, apply_faast, from_pretrained
from .targets import TARGETS


def __getattr__(name: str):  # noqa: ANN202 - lazy: `python -m faast.hf.train` must not find it imported already
    if name in ("TrainConfig", "train_readout"):
        from . import train

        return getattr(train, name)
    raise AttributeError(f"module 'faast.hf' has no attribute {name!r}")


__all__ = [
    "TARGETS",
    "FaastConfig",
    "FaastModel",
    "LearnStats",
    "MemoryLayer",
    "OutputMemoryLayer",
    "TrainConfig",
    "apply_faast",
    "from_pretrained",
    "train_readout",
]
