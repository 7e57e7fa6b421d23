"""FAASTClassifier: closed-form fast weights over frozen embeddings, with the scikit-learn estimator API.

Keys are the (L2-normalised) embeddings. Fitting streams the statistics through a faast.FastWeights, so fit on
everything equals any sequence of partial_fit calls on the same rows.

Label embeddings (CLIP-style: the text embedding of a prompt per class) give a zero-shot classifier, q·Eᵀ, to start
from. Two ways of using it:

* prior_count=N0 (a number), the paper's formulation: values are the label embeddings of the true classes, and
  W = (N0·I + N·W*) / (N0 + N) interpolates with the identity (zero-shot) prior; a query's output q·W is compared
  by cosine with every label embedding. N0 is fixed by the user.
* prior_count='auto' (default): the prior's weight is chosen from the data. Values are one-hot, the prior is the
  zero-shot scores s·q·Eᵀ (s fitted by least squares from the statistics), and the regulariser fits the residual,
  W = s·Eᵀ + argmin_D ||Y − s·K·Eᵀ − K·D||² + reg(D), so it pulls towards zero-shot rather than towards zero, with
  its strength chosen by generalized cross-validation (ridge='auto'): near zero-shot with one example per class,
  near the data-only fit with many. Measured on the Debian-sections task (16 classes, all-MiniLM-L6-v2, 20
  episodes; lab/benchmarks/results/classify_text_cpu.md): 57.2 / 60.6 / 67.3 / 72.5% at 1 / 5 / 20 shots / full,
  against zero-shot 57.2%, a tuned logistic probe 36.0 / 56.5 / 67.0 / 72.2% and the paper's fixed N0 = 40 per
  class 57.4 / 58.9 / 52.7 / 71.4%. In a side experiment (same protocol, other seed) the data-only fit scored
  36.8 / 56.1 / 67.0 / 72.5%, and the residual fit with label-embedding values instead of one-hot 58.9 / 60.7 /
  64.3 / 72.2%: its GCV sees the 384-d residual, most of which never reaches a class score.

Without label embeddings the values are one-hot and there is no prior.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from .. import persist
from .._version import __version__
from ..memory import FastWeights
from ..ops import solve_fast_weights_ex
from ..ops._validate import check_solve_options
from ._base import EmbeddingClassifier, as_embeddings, as_labels, normalize_rows

FORMAT = "faast.FAASTClassifier"
FORMAT_VERSION = 1


class FAASTClassifier(EmbeddingClassifier):
    """Few-shot and full-data classification with closed-form fast weights over frozen embeddings.

    Args:
        alpha: spectral cut exponent (keep σ > N^-alpha·σmax) or 'auto' (GCV rank); used when ridge is None.
        ridge: 'auto' (default: the GCV-best penalty), a fixed penalty μ >= 0, or None for the truncated
            pseudo-inverse of the paper.
        label_embeddings: [n_classes, dim] embeddings of the classes (e.g. of "a photo of a {name}."), rows in the
            order of `classes`: enables the zero-shot prior. None: one-hot values, no prior.
        prior_count: with label embeddings, 'auto' (fit the zero-shot prior's residual; the regulariser chooses its
            weight from the data), or a pseudo-count N0 >= 0: label-embedding values and
            W = (N0·I + N·W*) / (N0 + N) (0 ignores the prior).
        classes: the class labels (ints or strings). Default: 0..n_classes-1 with label embeddings, else the
            labels seen by fit (partial_fit needs them on its first call).
        logit_scale: predict_proba = softmax(logit_scale · decision_function).
        normalize: L2-normalise inputs and label embeddings (cosine geometry, as CLIP and sentence encoders use).
        batch_size: rows per streaming update.

    Attributes after fitting: classes_, n_features_in_, memory_ (the faast.FastWeights), weights_ (W: [dim,
    n_classes] for one-hot values, [dim, dim] for label-embedding values).
    """

    def __init__(
        self,
        *,
        alpha: float | Literal["auto"] = 1.0,
        ridge: float | Literal["auto"] | None = "auto",
        label_embeddings: object = None,
        prior_count: float | Literal["auto"] = "auto",
        classes: Sequence | None = None,
        logit_scale: float = 10.0,
        normalize: bool = True,
        batch_size: int = 4096,
    ) -> None:
        self.alpha = alpha
        self.ridge = ridge
        self.label_embeddings = label_embeddings
        self.prior_count = prior_count
        self.classes = classes
        self.logit_scale = logit_scale
        self.normalize = normalize
        self.batch_size = batch_size

    # ------------------------------------------------------------------ configuration checks

    def _check_params(self) -> None:
        check_solve_options(self.alpha, None, self.ridge, target_sqnorm=True)
        if self.prior_count != "auto":
            if isinstance(self.prior_count, bool) or not isinstance(self.prior_count, int | float):
                raise TypeError(f"prior_count: expected 'auto' or a number >= 0, got {self.prior_count!r}")
            if not self.prior_count >= 0 or not math.isfinite(self.prior_count):
                raise ValueError(f"prior_count: expected 'auto' or a finite number >= 0, got {self.prior_count}")
        if (
            isinstance(self.logit_scale, bool)
            or not isinstance(self.logit_scale, int | float)
            or self.logit_scale <= 0
        ):
            raise ValueError(f"logit_scale: expected a positive number, got {self.logit_scale!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {self.batch_size!r}")

    def _label_matrix(self) -> torch.Tensor | None:
        if self.label_embeddings is None:
            return None
        E = as_embeddings("label_embeddings", self.label_embeddings).to(torch.float64)
        return normalize_rows(E) if self.normalize else E

    def _start(self, X: torch.Tensor, y: np.ndarray | None, classes: Sequence | None) -> None:
        """Fix classes_, n_features_in_ and an empty memory."""
        self._check_params()
        E = self._label_matrix()
        declared = self.classes if self.classes is not None else classes
        if E is not None:
            if declared is None:
                declared = np.arange(E.shape[0])
            if len(declared) != E.shape[0]:
                raise ValueError(
                    f"label_embeddings: expected one row per class ({len(declared)} classes), got {E.shape[0]} rows"
                )
            if E.shape[1] != X.shape[1]:
                raise ValueError(
                    f"label_embeddings: expected width {X.shape[1]} (the width of X), got {E.shape[1]}; keys and "
                    "label embeddings must come from the same embedding space"
                )
        elif declared is None and y is None:
            raise ValueError("classes: required on the first partial_fit call (the full list of class labels)")
        self._init_classes(declared, y)
        self.n_features_in_ = X.shape[1]
        self._labels = E
        self._embedding_values = E is not None and self.prior_count != "auto"
        dim_value = X.shape[1] if self._embedding_values else len(self.classes_)
        fixed_prior = E is not None and self.prior_count != "auto" and self.prior_count > 0
        options = {"alpha": self.alpha, "ridge": self.ridge}
        self.memory_ = FastWeights(
            X.shape[1],
            dim_value,
            **options,
            prior="identity" if fixed_prior else None,
            prior_count=float(self.prior_count) if fixed_prior else 0.0,
            dtype=torch.float64,
        )
        self._cache: tuple | None = None

    # ------------------------------------------------------------------ fitting

    def fit(self, X: object, y: object) -> FAASTClassifier:
        """Learn (X [n, dim], y [n]) from scratch. Every class must have an example unless the prior covers it."""
        X = as_embeddings("X", X)
        labels = as_labels(y, X.shape[0])
        self._start(X, labels, None)
        codes = self._encode(labels)
        if self._labels is None:
            empty = [self.classes_[c].item() for c in range(len(self.classes_)) if not bool((codes == c).any())]
            if empty:
                raise ValueError(
                    f"y: classes {empty} have no examples; without label_embeddings (no zero-shot prior) they could "
                    "never be predicted. Give examples, drop them from classes, or pass label_embeddings"
                )
        self._learn(X, codes)
        return self

    def partial_fit(self, X: object, y: object, classes: Sequence | None = None) -> FAASTClassifier:
        """Learn more rows; exactly equivalent to fit on all rows seen so far. `classes` on the first call."""
        if not hasattr(self, "memory_"):
            X = as_embeddings("X", X)
            self._start(X, None, classes)
        else:
            X = as_embeddings("X", X, width=self.n_features_in_)
        labels = as_labels(y, X.shape[0])
        self._learn(X, self._encode(labels))
        return self

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        if self._embedding_values:
            return self._labels[codes]
        return torch.nn.functional.one_hot(codes, len(self.classes_)).to(torch.float64)

    def _learn(self, X: torch.Tensor, codes: torch.Tensor) -> None:
        keys = normalize_rows(X.to(torch.float64)) if self.normalize else X.to(torch.float64)
        for start in range(0, keys.shape[0], self.batch_size):
            rows = slice(start, start + self.batch_size)
            self.memory_.update(keys[rows], self._values(codes[rows]))
        self._cache = None

    # ------------------------------------------------------------------ solving and prediction

    def _weights(self) -> torch.Tensor:
        """W float64: [dim, n_classes] (one-hot values) or [dim, dim] (label-embedding values)."""
        memory = self.memory_
        if self._labels is None or self.prior_count != "auto":
            return memory.weights
        # Prior W0 = s·Eᵀ (zero-shot scores); s = argmin ||Y - s·K·Eᵀ||² = tr(E T) / tr(E S Eᵀ), from the statistics.
        E, gram, cross = self._labels, memory.gram, memory.cross
        fit = (E @ cross).diagonal().sum()
        energy = (E @ gram @ E.T).diagonal().sum()
        scale = (fit / energy).clamp_min(0) if float(energy) > 0 else torch.ones((), dtype=torch.float64)
        prior = scale * E.T
        # Regress the residual Y - K·W0: same S, T' = T - S·W0, ||Y - K·W0||² = ||Y||² - 2<W0, T> + <W0, S·W0>.
        residual_cross = cross - gram @ prior
        sqnorm = memory.target_sqnorm - 2 * (prior * cross).sum() + (prior * (gram @ prior)).sum()
        delta, info = solve_fast_weights_ex(
            gram, residual_cross, count=memory.count, alpha=self.alpha, ridge=self.ridge,
            target_sqnorm=sqnorm.clamp_min(0), out_dtype=torch.float64,
        )  # fmt: skip
        self._solve_info = info
        self._prior_scale = float(scale)
        return prior + delta

    @property
    def weights_(self) -> torch.Tensor:
        """W float64: decision_function(X) = normalize(X) @ W, or cosine(normalize(X) @ W, E) for label values."""
        self._require_fitted()
        key = (self.memory_.version, self.alpha, self.ridge, self.prior_count)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._weights())
        return self._cache[1]

    @property
    def prior_scale_(self) -> float | None:
        """s of the zero-shot prior s·Eᵀ fitted with prior_count='auto' (None in the other modes)."""
        _ = self.weights_  # solving sets the attribute read below
        return getattr(self, "_prior_scale", None) if self._labels is not None and self.prior_count == "auto" else None

    @property
    def solve_info_(self) -> object:
        """The faast.ops.SolveInfo of the last solve: kept rank, cut, ridge μ and GCV score."""
        _ = self.weights_  # solving sets the attribute read below
        return getattr(self, "_solve_info", None) or self.memory_.solve_info

    def decision_function(self, X: object) -> torch.Tensor:
        """Class scores [n, n_classes] float32: q·W (one-hot values) or cos(q·W, E) (label-embedding values)."""
        self._require_fitted()
        X = as_embeddings("X", X, width=self.n_features_in_).to(torch.float64)
        out = (normalize_rows(X) if self.normalize else X) @ self.weights_
        if self._embedding_values:
            out = normalize_rows(out) @ self._labels.T  # the paper's read-out: cosine with every label embedding
        return out.to(torch.float32)

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | Path) -> Path:
        """Write parameters, classes and the memory's statistics to a safetensors file (atomic; no pickle; missing
        parent folders are created)."""
        self._require_fitted()
        params = {k: v for k, v in self.get_params().items() if k not in ("label_embeddings", "classes")}
        classes = self.classes_.tolist()
        tensors = {f"memory.{k}": v for k, v in self.memory_.state_dict().items()}
        if self._labels is not None:
            tensors["label_embeddings"] = torch.as_tensor(self._labels)
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "faast_version": __version__,
            "params": json.dumps(params),
            "classes": json.dumps(classes),
            "n_features_in": str(self.n_features_in_),
        }
        return persist.write_atomic(path, tensors, metadata)

    @classmethod
    def load(cls, path: str | Path) -> FAASTClassifier:
        """Rebuild a classifier saved with `save`; predictions are bit-identical."""
        tensors, metadata = persist.read_verified(path)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (format={metadata.get('format')!r})")
        try:
            params = json.loads(metadata["params"])
            classes = json.loads(metadata["classes"])
            width = int(metadata["n_features_in"])
        except (KeyError, ValueError) as err:
            raise ValueError(f"{path}: malformed {FORMAT} metadata ({err!r})") from None
        labels = tensors.get("label_embeddings")
        model = cls(**params, label_embeddings=labels, classes=classes)
        # label_embeddings were saved already normalised; normalising again is exact up to rounding, so keep them.
        model._start(torch.zeros(1, width), None, classes)
        if labels is not None:
            model._labels = labels
        memory_state = {k[len("memory.") :]: v for k, v in tensors.items() if k.startswith("memory.")}
        model.memory_.load_statistics(memory_state, source=path)
        return model
