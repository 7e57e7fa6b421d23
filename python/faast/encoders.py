"""Moved to faast.classify.sentence_encoder: this alias keeps old imports working and warns (DeprecationWarning)."""

import warnings

from .classify.sentence_encoder import SentenceEncoder

__all__ = ["SentenceEncoder"]

warnings.warn(
    "faast.encoders moved to faast.classify.sentence_encoder; import from there", DeprecationWarning, stacklevel=2
)
