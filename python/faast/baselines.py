"""Moved: the authors' stored-key algorithm is `faast.authors_reference.StoredKeyMemory`. This name keeps old imports
working with a DeprecationWarning; it will be removed."""

import warnings

from .authors_reference import StoredKeyMemory

__all__ = ["StoredKeyMemory"]

warnings.warn(
    "faast.baselines moved to faast.authors_reference (the authors' stored-key algorithm); import it from there",
    DeprecationWarning,
    stacklevel=2,
)
