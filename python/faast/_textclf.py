"""Plumbing shared by the demo and the text-classification benchmark (not public API).

Embeds the shipped Debian-sections data with the embedded encoder (cached on disk, so each text is encoded once),
and provides the few-shot sampling and scoring both use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .datasets import TextClassificationData, load_debian_sections

# Chosen on the train split among a handful of plain templates (train accuracy 0.558; the test split was not used).
ZERO_SHOT_TEMPLATE = "{} software"


def cache_dir() -> Path:
    """Where embeddings are cached: $FAAST_CACHE, else $XDG_CACHE_HOME/faast, else ~/.cache/faast."""
    if "FAAST_CACHE" in os.environ:
        return Path(os.environ["FAAST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "faast"


@dataclass
class EmbeddedTask:
    """Unit-norm sentence embeddings of both splits: keys [N, d] float32, labels [N] int64, label_keys [C, d]."""

    train: TextClassificationData
    test: TextClassificationData
    train_keys: torch.Tensor
    test_keys: torch.Tensor
    label_keys: torch.Tensor
    encode_seconds: float

    @property
    def num_classes(self) -> int:
        return self.train.num_classes


def embed_debian_sections(encoder=None) -> EmbeddedTask:  # noqa: ANN001 - a faast.encoders.SentenceEncoder
    import time

    from .encoders import SentenceEncoder

    encoder = encoder or SentenceEncoder.default()
    train, test = load_debian_sections("train"), load_debian_sections("test")
    start = time.perf_counter()
    cache = cache_dir() / "embeddings"
    train_keys = encoder.encode(train.texts, cache_dir=cache)
    test_keys = encoder.encode(test.texts, cache_dir=cache)
    prompts = [ZERO_SHOT_TEMPLATE.format(title.lower()) for title in train.label_titles]
    label_keys = encoder.encode(prompts, cache_dir=cache)
    return EmbeddedTask(train, test, train_keys, test_keys, label_keys, time.perf_counter() - start)


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(labels, num_classes).to(torch.float32)


def sample_shots(labels: torch.Tensor, shots: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of `shots` distinct examples of every class (all of a class if it has fewer), class-balanced."""
    picks = []
    for c in range(int(labels.max()) + 1):
        members = (labels == c).nonzero().flatten()
        picks.append(members[torch.randperm(members.numel(), generator=generator)[:shots]])
    return torch.cat(picks)


def accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy of class scores [N, C]. Ties (e.g. W = 0) go to the lowest class id, as argmax does."""
    return float((scores.argmax(-1) == labels).to(torch.float64).mean())
