"""faast: closed-form fast weights for frozen models.

Keys K and values V taken from a frozen model are compiled into W = pinv_eps(K) V by streaming the sufficient
statistics S = K^T K and T = K^T diag(s) V (never the keys) and solving once with a float64 eigendecomposition.
"""

from . import ops
from ._version import __version__
from .memory import FastWeights

from . import checkpoint, classify, distributed, hf  # isort: skip  (they build on FastWeights)

__all__ = ["FastWeights", "__version__", "checkpoint", "classify", "distributed", "hf", "ops"]
