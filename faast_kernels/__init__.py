"""Triton kernels for faast: fused score-weighted Gram accumulation and the folded residual projection.

This package never imports faast (the dependency runs one way: faast's dispatch registers these kernels). The
kernels themselves are the subject of a later change; until then faast runs its pure-torch backend everywhere,
and FAAST_BACKEND=triton raises instead of pretending.
"""

try:  # Triton is optional: CPU-only installs and macOS have none.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

__all__ = ["HAS_TRITON"]
