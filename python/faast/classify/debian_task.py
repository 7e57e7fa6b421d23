"""The shipped Debian-sections task embedded once with a frozen sentence encoder, for the demo and the benchmarks.

``embed_debian_sections`` encodes both splits and one label prompt per class (``ZERO_SHOT_TEMPLATE``); embeddings
are cached on disk under ``cache_dir()``, so each text is encoded once per encoder.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .data import TextClassificationData, load_debian_sections

if TYPE_CHECKING:
    from .sentence_encoder import SentenceEncoder

__all__ = ["ZERO_SHOT_TEMPLATE", "EmbeddedTask", "cache_dir", "embed_debian_sections"]

# Chosen on the train split among a handful of plain templates (train accuracy 0.558; the test split was not used).
ZERO_SHOT_TEMPLATE = "{} software"


def cache_dir() -> Path:
    """Where embeddings are cached: $FAAST_CACHE, else $XDG_CACHE_HOME/faast, else ~/.cache/faast."""
    if "FAAST_CACHE" in os.environ:
        return Path(os.environ["FAAST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "faast"


@dataclass
class EmbeddedTask:
    """Unit-norm sentence embeddings of both splits.

    Attributes:
        train, test: the two splits (texts, int64 labels [N]).
        train_keys, test_keys: float32 [N, d], row i embedding the split's texts[i].
        label_keys: float32 [C, d], the embedding of ``ZERO_SHOT_TEMPLATE`` filled with each class title.
        encode_seconds: wall time of the encoding (near 0 when every embedding came from the cache).
    """

    train: TextClassificationData
    test: TextClassificationData
    train_keys: torch.Tensor
    test_keys: torch.Tensor
    label_keys: torch.Tensor
    encode_seconds: float

    @property
    def num_classes(self) -> int:
        return self.train.num_classes


def embed_debian_sections(encoder: SentenceEncoder | None = None) -> EmbeddedTask:
    """Embed both Debian-sections splits and the label prompts with `encoder` (default: all-MiniLM-L6-v2).

    Raises ImportError naming the extra to install when the default encoder's package is missing.
    """
    from .sentence_encoder import SentenceEncoder

    encoder = encoder or SentenceEncoder.default()
    train, test = load_debian_sections("train"), load_debian_sections("test")
    start = time.perf_counter()
    cache = cache_dir() / "embeddings"
    train_keys = encoder.encode(train.texts, cache_dir=cache)
    test_keys = encoder.encode(test.texts, cache_dir=cache)
    prompts = [ZERO_SHOT_TEMPLATE.format(title.lower()) for title in train.label_titles]
    label_keys = encoder.encode(prompts, cache_dir=cache)
    return EmbeddedTask(train, test, train_keys, test_keys, label_keys, time.perf_counter() - start)
