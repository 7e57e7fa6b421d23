"""Moved to faast.classify.clip_encoder: this alias keeps old imports working and warns (DeprecationWarning)."""

import warnings

from .classify.clip_encoder import ClipEncoder

__all__ = ["ClipEncoder"]

warnings.warn("faast.clip moved to faast.classify.clip_encoder; import from there", DeprecationWarning, stacklevel=2)
