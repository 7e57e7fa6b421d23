"""Moved to faast.classify.data: this alias keeps old imports working and warns (DeprecationWarning)."""

import warnings

from .classify.data import DEBIAN_SECTIONS, TextClassificationData, load_debian_sections

__all__ = ["DEBIAN_SECTIONS", "TextClassificationData", "load_debian_sections"]

warnings.warn("faast.datasets moved to faast.classify.data; import from there", DeprecationWarning, stacklevel=2)
