"""Both ends of a FastWeights classifier driven by hand: class labels in as one-hot values, scores out as accuracy.

FAASTClassifier does this itself; these serve code that drives faast.FastWeights by hand (the demo, the benchmarks,
examples/distributed_learn.py).
"""

from __future__ import annotations

import torch

__all__ = ["accuracy", "one_hot"]


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Values for FastWeights from class ids: int64 labels [N] in [0, num_classes) -> float32 [N, num_classes]."""
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.dim() != 1:
        got = f"{labels.dtype} {list(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels: expected an int64 tensor of shape [N], got {got}")
    return torch.nn.functional.one_hot(labels, num_classes).to(torch.float32)


def accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy of class scores [N, C] against int64 labels [N].

    Ties (e.g. W = 0) go to the lowest class id, as argmax does.
    """
    if scores.dim() != 2 or labels.shape != scores.shape[:1]:
        raise ValueError(
            f"scores, labels: expected shapes [N, C] and [N], got {list(scores.shape)} and {list(labels.shape)}"
        )
    return float((scores.argmax(-1) == labels).to(torch.float64).mean())
