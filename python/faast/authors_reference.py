"""The authors' stored-key estimator, as a baseline and test oracle (not for production use).

`pinv_fast_weights` is their solve on keys held in one tensor; `StoredKeyMemory` is their memory around it.

StoredKeyMemory follows their algorithm (docs/authors.md §2.3–2.5): every key and value is kept; each learn call
concatenates the new rows onto a copy of the buffer; a solve runs torch.linalg.pinv on all stored keys (an SVD of the
N x dk matrix) and multiplies by the stored values. With `max_rows` it also reproduces their cap: at the start of a
learn call, while the buffer holds at least max_rows rows, the oldest `fold_rows` are solved alone and blended into a
running W0. Memory grows as N·(dk + dv); faast.FastWeights replaces all of this with O(d²) statistics.
"""

from __future__ import annotations

import torch

from .ops import _validate


def pinv_fast_weights(
    keys: torch.Tensor,
    values: torch.Tensor,
    rtol: float | torch.Tensor,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stored-key reference: W = torch.linalg.pinv(K, atol=0, rtol=rtol) @ diag(scores) V.

    This is the authors' estimator (an SVD of the N x dk key matrix). It is the oracle of the streaming path and the
    baseline of the benchmarks; it needs all keys in memory. Computed in float64 for float64 keys (the truth the
    tests use) and in float32 otherwise, like the authors' keys.float().

    Args:
        keys: [*, N, dk]; values: [*, N, dv]; scores: [*, N] or None.
        rtol: relative cut on singular values (σ > rtol·σmax kept), a number or a tensor of the batch shape.

    Returns:
        W [*, dk, dv] in the compute dtype. N = 0 gives zeros.
    """
    _validate.check_rows(keys, values, scores, None)
    _validate.check_scores(scores, None)
    for name, t in (("keys", keys), ("values", values), ("scores", scores)):
        if t is not None:
            _validate.require_finite(name, t)
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    batch = tuple(keys.shape[:-2])
    # A tensor rtol stays [*batch]: torch.linalg.pinv adds the singular-value dim itself.
    rtol = (
        _validate.per_batch("rtol", rtol, batch, device=keys.device, dtype=compute)
        if isinstance(rtol, torch.Tensor)
        else (_validate.require_nonnegative_number("rtol", rtol))
    )
    k = keys.to(compute)
    v = values.to(compute)
    if scores is not None:
        v = v * scores.to(compute).unsqueeze(-1)
    if keys.shape[-2] == 0:
        return torch.zeros((*batch, keys.shape[-1], values.shape[-1]), dtype=compute, device=keys.device)
    # atol left unset (= 0 once rtol is given): torch rejects a float atol next to a tensor rtol.
    return torch.linalg.pinv(k, rtol=rtol) @ v


class StoredKeyMemory:
    """Keys [N, dk] and values [N, dv] kept in `dtype`; solved like the authors' InverseReader.

    Args:
        alpha: eps = N^-alpha with N the rows currently stored (their N1, not the total seen).
        max_rows / fold_rows: their max_memory_size / reader_update_size (None: no cap, one joint solve).
        discount: their reader_update_discount γ (applied to N0 at folds and queries; 1.0 at inference).
        prior / prior_count: initial (W0, N0), as the vision classifier's zero-shot prior.
        dtype: storage and compute dtype; float32 is the authors' (pinv runs on keys.float()), float64 is the truth.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        *,
        max_rows: int | None = None,
        fold_rows: int = 8192,
        discount: float = 1.0,
        prior: torch.Tensor | None = None,
        prior_count: float = 0.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.alpha, self.max_rows, self.fold_rows, self.discount, self.dtype = (
            alpha,
            max_rows,
            fold_rows,
            discount,
            dtype,
        )
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.folded_weights = None if prior is None else prior.to(dtype)
        self.folded_count = float(prior_count)

    @property
    def size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def nbytes(self) -> int:
        """Bytes held by the stored rows."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def update(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Learn rows keys [n, dk], values [n, dv]; scores [n] scale the values (their vals * score)."""
        if self.max_rows is not None:
            while self.size >= self.max_rows:
                self._fold()
        values = values if scores is None else values * scores.unsqueeze(-1)
        keys, values = keys.to(self.dtype), values.to(self.dtype)
        if self.keys is None:
            self.keys, self.values = keys.clone(), values.clone()
        else:
            # Their MemoryBank.update_memory: cat([old.clone(), new]) on every call.
            assert self.values is not None  # for the type checker: set together with self.keys
            self.keys = torch.cat([self.keys.clone(), keys])
            self.values = torch.cat([self.values.clone(), values])

    def _solve(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return pinv_fast_weights(keys, values, rtol=keys.shape[0] ** -float(self.alpha))

    def _blend(self, weights: torch.Tensor, rows: int) -> torch.Tensor:
        previous = self.discount * self.folded_count
        share = rows / (previous + rows)
        if self.folded_weights is None:
            return share * weights
        return (1 - share) * self.folded_weights + share * weights

    def _fold(self) -> None:
        u = self.fold_rows
        assert self.keys is not None and self.values is not None  # for the type checker: folded only when full
        chunk = self._solve(self.keys[:u], self.values[:u])
        self.folded_weights = self._blend(chunk, u)
        self.folded_count = self.discount * self.folded_count + u
        self.keys, self.values = self.keys[u:], self.values[u:]

    @property
    def weights(self) -> torch.Tensor | None:
        """W [dk, dv], or the folded W0 (None if nothing was ever learned) when the buffer is empty."""
        if self.keys is None or self.values is None or self.size == 0:
            return self.folded_weights
        return self._blend(self._solve(self.keys, self.values), self.size)
