"""faast.hf: test-time learning for Hugging Face models.

`apply_faast(model, config)` attaches memory layers to a frozen causal LM (the decoder types of
faast.hf.targets.TARGETS, others through discovery) by hooking its own modules (no copied modeling code); the
returned model learns from text in forward passes (`learn`, or `read_stream` while reading a long text), and
`generate` reads the fast weights.
FaastConfig groups the settings: `output` (ResidualOutput, the default; EmbeddingOutput, the paper's; or None),
`middle` (MiddleLayers, an opt-in) and `regulariser` (Regulariser); the residual output layer's tuned constants are one
OutputPolicy (ResidualOutput.policy). `FaastConfig(target_modules=...)` puts a memory on any module, PEFT-style (an
encoder's classification head, an LM head: faast.hf.modules), and `apply_faast_to_peft` does the same inside a PEFT
model (faast.hf.peft_method).
transformers is imported only by the functions that load models (faast.hf.default), not by importing this package.
"""

from .config import EmbeddingOutput, FaastConfig, MiddleLayers, OutputPolicy, Regulariser, ResidualOutput
from .layers import MemoryLayer, OutputMemoryLayer
from .model import FaastModel, LearnStats, apply_faast, from_pretrained
from .modules import FaastModuleModel
from .output import MemoryOffWarning
from .peft_method import apply_faast_to_peft
from .reading import ReadReport, chunk_windows, read_stream
from .targets import TARGETS, discover_target


def __getattr__(name: str) -> object:  # lazy: `python -m faast.hf.train` must not find it imported already
    if name in ("TrainConfig", "train_readout"):
        from . import train

        return getattr(train, name)
    raise AttributeError(f"module 'faast.hf' has no attribute {name!r}")


__all__ = [
    "TARGETS",
    "EmbeddingOutput",
    "FaastConfig",
    "FaastModel",
    "FaastModuleModel",
    "LearnStats",
    "MemoryLayer",
    "MemoryOffWarning",
    "MiddleLayers",
    "OutputMemoryLayer",
    "OutputPolicy",
    "ReadReport",
    "Regulariser",
    "ResidualOutput",
    "TrainConfig",
    "apply_faast",
    "apply_faast_to_peft",
    "chunk_windows",
    "discover_target",
    "from_pretrained",
    "read_stream",
    "train_readout",
]
