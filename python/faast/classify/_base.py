"""What every classifier over frozen embeddings shares: the scikit-learn estimator protocol and input checks.

scikit-learn is not a dependency: get_params/set_params follow its conventions (constructor arguments stored as
attributes of the same name, fitted state in attributes ending with '_'), so sklearn.base.clone, pipelines and
grid searches work when it is installed, and nothing needs it otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import numpy as np
import torch

from ..ops import _validate


def as_embeddings(name: str, X: object, *, width: int | None = None) -> torch.Tensor:
    """X (tensor or array-like [n, d], real) as a float32 CPU-or-device tensor; errors name `name`."""
    if not isinstance(X, torch.Tensor):
        try:
            X = torch.as_tensor(np.asarray(X))
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name}: expected a tensor or array of shape [n_samples, n_features] ({err})") from None
    if not (X.is_floating_point() or X.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"{name}: expected real-valued embeddings, got dtype {X.dtype}")
    if X.dim() != 2:
        raise ValueError(f"{name}: expected shape [n_samples, n_features], got {list(X.shape)}")
    if X.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one sample, got shape {list(X.shape)}")
    if width is not None and X.shape[1] != width:
        raise ValueError(f"{name}: expected {width} features per sample (as at fit time), got {X.shape[1]}")
    X = X.to(torch.float32) if X.dtype != torch.float64 else X
    _validate.require_finite(name, X)
    return X


def normalize_rows(X: torch.Tensor) -> torch.Tensor:
    """L2-normalise rows (all-zero rows stay zero)."""
    return X / X.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(X.dtype).tiny)


def as_labels(y: object, n: int) -> np.ndarray:
    """y as a 1-D numpy array of n labels (ints or strings)."""
    if isinstance(y, torch.Tensor):
        y = y.detach().cpu().numpy()
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"y: expected a 1-D sequence of labels, got shape {list(y.shape)}")
    if y.shape[0] != n:
        raise ValueError(f"y: expected {n} labels (one per row of X), got {y.shape[0]}")
    if y.dtype.kind not in "iuUSO":
        raise TypeError(f"y: expected integer or string class labels, got dtype {y.dtype}")
    return y


class EmbeddingClassifier:
    """Base: classes_, label encoding, predict / predict_proba / score / get_params / set_params.

    Subclasses implement `_fit_encoded(X, codes)` (codes: int64 tensor of class indices, X checked) and
    `decision_function(X)` -> [n, n_classes] scores; `predict_proba` is softmax(logit_scale · scores).
    """

    logit_scale: float

    # ------------------------------------------------------------------ sklearn protocol

    @classmethod
    def _param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p.name for p in sig.parameters.values() if p.name != "self" and p.kind == p.KEYWORD_ONLY]

    def get_params(self, deep: bool = True) -> dict:
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: object) -> EmbeddingClassifier:
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(f"{name}: not a parameter of {type(self).__name__} (valid: {', '.join(valid)})")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items() if not isinstance(v, torch.Tensor))
        return f"{type(self).__name__}({args})"

    # ------------------------------------------------------------------ labels

    def _init_classes(self, classes: Sequence | None, y: np.ndarray | None) -> None:
        if classes is None:
            classes = np.unique(y)
        classes = np.asarray(classes)
        if classes.ndim != 1 or classes.shape[0] < 1:
            raise ValueError(f"classes: expected a non-empty 1-D sequence of labels, got {classes!r}")
        if np.unique(classes).shape[0] != classes.shape[0]:
            raise ValueError(f"classes: labels must be distinct, got {classes.tolist()}")
        self.classes_ = classes

    def _encode(self, y: np.ndarray) -> torch.Tensor:
        index = {label.item() if hasattr(label, "item") else label: i for i, label in enumerate(self.classes_)}
        codes = []
        for label in y:
            key = label.item() if hasattr(label, "item") else label
            if key not in index:
                raise ValueError(f"y: unknown label {key!r}; the classes are {self.classes_.tolist()}")
            codes.append(index[key])
        return torch.tensor(codes, dtype=torch.int64)

    def _require_fitted(self) -> None:
        if not hasattr(self, "classes_"):
            raise RuntimeError(f"{type(self).__name__}: not fitted; call fit (or partial_fit) first")

    # ------------------------------------------------------------------ prediction

    def decision_function(self, X: object) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def predict(self, X: object) -> np.ndarray:
        """Class labels [n] of X, from the highest decision score (ties: the first class)."""
        scores = self.decision_function(X)
        return self.classes_[scores.argmax(-1).cpu().numpy()]

    def predict_proba(self, X: object) -> torch.Tensor:
        """softmax(logit_scale · decision_function(X)) [n, n_classes], columns in the order of classes_."""
        return torch.softmax(self.logit_scale * self.decision_function(X).to(torch.float64), dim=-1).to(torch.float32)

    def score(self, X: object, y: object) -> float:
        """Mean accuracy on (X, y)."""
        labels = as_labels(y, len(X))
        predicted = self.predict(X)
        return float(np.mean(predicted == labels))
