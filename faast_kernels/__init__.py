"""Triton kernels for faast: fused score-weighted Gram accumulation, the folded residual projection and the
probability-space mixture read.

This package never imports faast (the dependency runs one way: faast's dispatch registers these kernels as its
``triton`` backend). Kernels live one family per file (``gram.py``, ``gram_int8.py``, ``residual.py``,
``mixture.py``), each with a private ``@triton.jit`` kernel, a launcher that checks, allocates and launches, and a
``naive_*`` oracle (``int8_slices.py`` holds the int8 Gram's plan, bound and oracle, in torch alone). The two Gram
kernels share their tile bookkeeping (``tiles.py``: which program owns which rows and tile) and their oracles' masked
rows and ‖Y‖² (``oracle.py``). ``ops.py`` registers the Gram, residual and mixture kernels as torch.library custom
ops. Everything runs on the CPU under ``TRITON_INTERPRET=1`` (how CI tests them); on a GPU they compile for the
device.
"""

import importlib.util
import os

# Triton is optional (CPU-only installs and macOS have none). Found, not imported: importing faast stays cheap, and
# the kernels import it when first used.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotuning() -> bool:
    """False when FAAST_TRITON_AUTOTUNE=0: every kernel runs its first configuration only (tests compile fewer
    variants; benchmarks time the tuned kernels)."""
    return os.environ.get("FAAST_TRITON_AUTOTUNE", "1") not in ("", "0")


__all__ = ["HAS_TRITON", "autotuning", "interpreting"]
