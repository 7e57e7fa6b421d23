"""faast: closed-form fast weights for frozen models.

Keys K and values V taken from a frozen model are compiled into W = pinv_eps(K) V by streaming the sufficient
statistics S = K^T K and T = K^T diag(s) V (never the keys) and solving once with a float64 eigendecomposition.

`import faast` loads the core only (ops, FastWeights, Accumulator, SummedStatistics); the subpackages
checkpoint, classify, distributed and hf are imported on first use (`faast.hf`, `from faast import hf`,
`import faast.hf` all work).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import ops
from ._version import __version__
from .accumulator import Accumulator
from .memory import FastWeights
from .statistics import SummedStatistics

_LAZY = ("checkpoint", "classify", "distributed", "hf")

__all__ = [
    "Accumulator",
    "FastWeights",
    "SummedStatistics",
    "__version__",
    "checkpoint",
    "classify",
    "distributed",
    "hf",
    "ops",
]


def __getattr__(name: str) -> ModuleType:  # the lazy subpackages
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'faast' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
