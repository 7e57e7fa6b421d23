"""Baselines behind the same estimator API as FAASTClassifier, on identical features.

Every memory baseline stores or sums the same (key, value) pairs FAAST learns: keys are the L2-normalised
embeddings; values are the label embeddings of the true classes when given (outputs then compared by cosine with
every label embedding) or one-hot vectors (outputs are class scores).

* ZeroShotClassifier: cosine with the label embeddings; learns nothing.
* KNNMemoryClassifier: majority vote of the labels of the k = min(n, k) nearest stored keys (cosine), ties broken
  by the voters' summed similarity. A vote over labels, not a per-coordinate mode of label vectors.
* SoftmaxAttentionClassifier: softmax(q·Kᵀ/τ)·V, τ = 0.01 as in the paper's reader.
* LinearAttentionClassifier: positive kernel weights φ(q)·φ(k_i), φ(x) = elu(x − k̄) + 1, normalised
  (centered=False); or centred weights (q − k̄)·(k_i − k̄)/n, which can be negative (centered=True). Both read out
  relative to the value mean v̄, as the paper's reader does.
* LinearProbeClassifier: a linear layer trained by backpropagation with SGD (the paper's settings: lr 1e-3,
  momentum 0.9, step decay at half the epochs, early stopping after 5 epochs without gain on a held-out eighth of
  the support set that never takes a class's last example), starting from the zero-shot classifier when label
  embeddings are given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._base import EmbeddingClassifier, as_embeddings, as_labels, normalize_rows


class _StoredMemory(EmbeddingClassifier):
    """Shared: keep the normalised keys and class codes; values from label embeddings or one-hot."""

    label_embeddings: object
    classes: Sequence | None
    normalize: bool

    def fit(self, X: object, y: object) -> _StoredMemory:
        X = as_embeddings("X", X)
        labels = as_labels(y, X.shape[0])
        self._setup(X, labels)
        codes = self._encode(labels)
        self.keys_ = self._prepare(X)
        self.codes_ = codes
        return self

    def _setup(self, X: torch.Tensor, labels: np.ndarray | None) -> None:
        E = None
        if self.label_embeddings is not None:
            E = as_embeddings("label_embeddings", self.label_embeddings).to(torch.float64)
            E = normalize_rows(E) if self.normalize else E
            if E.shape[1] != X.shape[1]:
                raise ValueError(f"label_embeddings: expected width {X.shape[1]} (the width of X), got {E.shape[1]}")
        declared = self.classes
        if declared is None and E is not None:
            declared = np.arange(E.shape[0])
        self._init_classes(declared, labels)
        if E is not None and E.shape[0] != len(self.classes_):
            raise ValueError(f"label_embeddings: expected one row per class ({len(self.classes_)}), got {E.shape[0]}")
        self._labels = E
        self.n_features_in_ = X.shape[1]

    def _prepare(self, X: torch.Tensor) -> torch.Tensor:
        X = X.to(torch.float64)
        return normalize_rows(X) if self.normalize else X

    def _values(self) -> torch.Tensor:
        if self._labels is not None:
            return self._labels[self.codes_]
        return torch.nn.functional.one_hot(self.codes_, len(self.classes_)).to(torch.float64)

    def _queries(self, X: object) -> torch.Tensor:
        self._require_fitted()
        return self._prepare(as_embeddings("X", X, width=self.n_features_in_))

    def _to_classes(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs in value space -> class scores: cosine with the label embeddings, or the one-hot scores."""
        if self._labels is None:
            return out.to(torch.float32)
        return (normalize_rows(out) @ self._labels.T).to(torch.float32)


class ZeroShotClassifier(_StoredMemory):
    """Cosine similarity with the label embeddings [n_classes, dim]. fit(X, y) only records classes and width."""

    def __init__(
        self,
        *,
        label_embeddings: object,
        classes: Sequence | None = None,
        logit_scale: float = 100.0,
        normalize: bool = True,
    ) -> None:
        self.label_embeddings = label_embeddings
        self.classes = classes
        self.logit_scale = logit_scale
        self.normalize = normalize

    def fit(self, X: object = None, y: object = None) -> ZeroShotClassifier:
        if self.label_embeddings is None:
            raise ValueError("label_embeddings: required by ZeroShotClassifier")
        E = as_embeddings("label_embeddings", self.label_embeddings)
        self._setup(E[:1] if X is None else as_embeddings("X", X), None)
        return self

    def decision_function(self, X: object) -> torch.Tensor:
        return (self._queries(X) @ self._labels.T).to(torch.float32)


class KNNMemoryClassifier(_StoredMemory):
    """Majority vote of the k = min(n_stored, k) nearest stored examples (cosine similarity)."""

    def __init__(
        self,
        *,
        k: int = 10,
        label_embeddings: object = None,
        classes: Sequence | None = None,
        logit_scale: float = 1.0,
        normalize: bool = True,
    ) -> None:
        self.k = k
        self.label_embeddings = label_embeddings
        self.classes = classes
        self.logit_scale = logit_scale
        self.normalize = normalize

    def decision_function(self, X: object) -> torch.Tensor:
        """Votes per class [n, n_classes], plus the voters' summed similarity / (2k + 1) to break ties only."""
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k: expected a positive int, got {self.k!r}")
        q = self._queries(X)
        k = min(self.k, self.keys_.shape[0])
        sims, idx = (q @ self.keys_.T).topk(k, dim=-1)
        votes = torch.zeros(q.shape[0], len(self.classes_), dtype=torch.float64)
        votes.scatter_add_(1, self.codes_[idx], torch.ones_like(sims))
        # |summed cosine| <= votes <= k, so this term lies in (-1/2, 1/2): it orders tied vote counts only.
        tiebreak = torch.zeros_like(votes).scatter_add_(1, self.codes_[idx], sims) / (2 * k + 1)
        return (votes + tiebreak).to(torch.float32)


class SoftmaxAttentionClassifier(_StoredMemory):
    """softmax(q·Kᵀ / temperature) · V over the stored examples."""

    def __init__(
        self,
        *,
        temperature: float = 0.01,
        label_embeddings: object = None,
        classes: Sequence | None = None,
        logit_scale: float = 10.0,
        normalize: bool = True,
    ) -> None:
        self.temperature = temperature
        self.label_embeddings = label_embeddings
        self.classes = classes
        self.logit_scale = logit_scale
        self.normalize = normalize

    def decision_function(self, X: object) -> torch.Tensor:
        if not isinstance(self.temperature, int | float) or not self.temperature > 0:
            raise ValueError(f"temperature: expected a positive number, got {self.temperature!r}")
        attention = torch.softmax(self._queries(X) @ self.keys_.T / self.temperature, dim=-1)
        return self._to_classes(attention @ self._values())


class LinearAttentionClassifier(_StoredMemory):
    """Linear-attention memory: positive kernel weights (centered=False) or centred, signed weights (True)."""

    def __init__(
        self,
        *,
        centered: bool = False,
        label_embeddings: object = None,
        classes: Sequence | None = None,
        logit_scale: float = 10.0,
        normalize: bool = True,
    ) -> None:
        self.centered = centered
        self.label_embeddings = label_embeddings
        self.classes = classes
        self.logit_scale = logit_scale
        self.normalize = normalize

    def decision_function(self, X: object) -> torch.Tensor:
        q, K, V = self._queries(X), self.keys_, self._values()
        k_mean, v_mean = K.mean(0), V.mean(0)
        if self.centered:
            weights = (q - k_mean) @ (K - k_mean).T / K.shape[0]
            return self._to_classes(weights @ (V - v_mean))
        phi_q = torch.nn.functional.elu(q - k_mean) + 1
        phi_k = torch.nn.functional.elu(K - k_mean) + 1
        weights = phi_q @ phi_k.T
        # Minus the value mean: otherwise the shared component of the outputs decides every class score alike.
        return self._to_classes(weights @ V / weights.sum(-1, keepdim=True) - v_mean)


def validation_split(codes: torch.Tensor, fraction: float, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(train, validation) indices: about `fraction` of each class held out, never a class's last example.

    Classes with a single example keep it for training; with no class able to spare one, or fraction 0, validation
    is empty (the probe then trains for all its epochs).
    """
    train, held = [], []
    for c in codes.unique():
        members = (codes == c).nonzero().flatten()
        members = members[torch.randperm(members.numel(), generator=generator)]
        n_val = 0
        if fraction > 0 and members.numel() > 1:
            n_val = min(members.numel() - 1, max(1, round(fraction * members.numel())))
        held.append(members[:n_val])
        train.append(members[n_val:])
    return torch.cat(train).sort().values, torch.cat(held).sort().values


class LinearProbeClassifier(_StoredMemory):
    """A linear layer trained by SGD with early stopping on a held-out part of the support set."""

    def __init__(
        self,
        *,
        epochs: int = 50,
        lr: float = 1e-3,
        momentum: float = 0.9,
        batch_size: int = 32,
        patience: int = 5,
        validation_fraction: float = 0.125,
        label_embeddings: object = None,
        classes: Sequence | None = None,
        logit_scale: float = 100.0,
        normalize: bool = True,
        seed: int = 0,
    ) -> None:
        self.epochs = epochs
        self.lr = lr
        self.momentum = momentum
        self.batch_size = batch_size
        self.patience = patience
        self.validation_fraction = validation_fraction
        self.label_embeddings = label_embeddings
        self.classes = classes
        self.logit_scale = logit_scale
        self.normalize = normalize
        self.seed = seed

    def _logits(self, q: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self._labels is None:
            return self.logit_scale * (q @ weight + bias)
        # Residual around the zero-shot classifier: weight starts at 0, i.e. at zero-shot.
        out = q + q @ weight
        return self.logit_scale * normalize_rows(out) @ self._labels.T.to(out.dtype) + bias

    def fit(self, X: object, y: object) -> LinearProbeClassifier:
        super().fit(X, y)
        g = torch.Generator().manual_seed(self.seed)
        train, val = validation_split(self.codes_, self.validation_fraction, g)
        q = self.keys_.to(torch.float32)
        width = q.shape[1] if self._labels is not None else len(self.classes_)
        weight = torch.zeros(q.shape[1], width, requires_grad=True)
        bias = torch.zeros(len(self.classes_), requires_grad=True)
        opt = torch.optim.SGD([weight, bias], lr=self.lr, momentum=self.momentum)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, self.epochs // 2), gamma=0.1)
        best, best_state, stale = -1.0, (weight.detach().clone(), bias.detach().clone()), 0
        for _ in range(self.epochs):
            order = train[torch.randperm(train.numel(), generator=g)]
            for start in range(0, order.numel(), self.batch_size):
                rows = order[start : start + self.batch_size]
                loss = torch.nn.functional.cross_entropy(self._logits(q[rows], weight, bias), self.codes_[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
            if val.numel() == 0:
                best_state = (weight.detach().clone(), bias.detach().clone())
                continue
            with torch.no_grad():
                acc = float((self._logits(q[val], weight, bias).argmax(-1) == self.codes_[val]).float().mean())
            if acc > best:
                best, best_state, stale = acc, (weight.detach().clone(), bias.detach().clone()), 0
            else:
                stale += 1
                if stale >= self.patience:
                    break
        self.weight_, self.bias_ = best_state
        return self

    def decision_function(self, X: object) -> torch.Tensor:
        q = self._queries(X).to(torch.float32)
        with torch.no_grad():
            return self._logits(q, self.weight_, self.bias_) / self.logit_scale
