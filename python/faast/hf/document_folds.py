"""The learned documents' key statistics by fold (OutputPolicy.document_folds; docs/design.md §6.3).

With F ≥ 2 folds (4 by default), the learned documents are dealt into the folds in turn as they arrive, so the first F
documents each have a fold of their own (a fold that holds every document cannot be fitted without), and the held-out
tail (held_out.HeldOutTail) keeps each fold's sums S_f = Σ k kᵀ [d_key, d_key], T_f = Σ k rᵀ [d_key, d] and count,
float64. The step's tuning (faast/hf/output/step.py) can then score each held-out row by W fitted on S − S_f: without
the whole of every document of its fold, which is how the memory reads text it did not learn. The folds apply once
every fold holds a document (step.py `row_folds`); by default they only gate the memory
(OutputPolicy.document_folds_gate). Sums subtract exactly, so this costs F pairs of sums and one solve per fold, never
the keys. A document's fold is remembered by its content (`content_key`, a hash
of its first window's learned targets): the same text learned apart, to be forgotten, falls where it fell (`follow`),
and a text learned twice, as two documents, falls into one fold, so that no fold's fit sees its twin. Beyond F
documents the partition depends on the order of learning; each fold then holds several documents.
"""

from __future__ import annotations

import torch

_MODULUS = (1 << 61) - 1  # a Mersenne prime


def content_key(targets: list[int]) -> int:
    """The key of a document whose first window's learned targets are `targets` (token ids, stream order): a hash of
    them all. A window is cut the same whatever was learned before it; files of one kind often share a header longer
    than a hundred tokens, so the whole window is read."""
    h = 0
    for t in targets:
        h = (h * 1_000_003 + int(t) + 1) % _MODULUS
    return h


# (S [F, d_key, d_key], T [F, d_key, d], count [F]), all float64.
FoldSums = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DocumentFolds:
    """Each fold's key statistics and each known document's fold. `add` writes into the sums in place; `snapshot`
    copies them, so a learn that fails can put back what it took (`snapshot` / `restore`): one copy per learn() call,
    not one per batch.

    Args:
        folds: F, 0 (keep nothing) or >= 2.
    """

    def __init__(
        self,
        folds: int,
        fold_of: dict[int, int] | None = None,
        by_content: dict[int, int] | None = None,
        dealt: int = 0,
        sums: FoldSums | None = None,
    ) -> None:
        self.folds = folds
        self._fold_of: dict[int, int] = dict(fold_of or {})  # document number -> fold
        self._by_content: dict[int, int] = dict(by_content or {})  # content_key -> fold, for every document dealt
        self._dealt = dealt  # documents dealt so far: the next goes to fold _dealt mod F
        self._sums = sums

    def __bool__(self) -> bool:
        return self._sums is not None

    def snapshot(self) -> tuple:
        sums = None if self._sums is None else tuple(x.clone() for x in self._sums)
        return dict(self._fold_of), dict(self._by_content), self._dealt, sums

    def restore(self, snapshot: tuple) -> None:
        fold_of, by_content, self._dealt, sums = snapshot
        self._fold_of, self._by_content = dict(fold_of), dict(by_content)
        # copied again: later adds write in place, and the snapshot may be restored more than once
        self._sums = None if sums is None else tuple(x.clone() for x in sums)

    def clear(self) -> None:
        self._fold_of, self._by_content, self._dealt, self._sums = {}, {}, 0, None

    def follow(self, other: DocumentFolds) -> None:
        """Deal documents as `other` did: a text `other` learned falls into the fold it fell into there (what a
        forget learns apart, to subtract from `other`)."""
        self._by_content, self._dealt = dict(other._by_content), other._dealt

    def _deal(self, targets: list[int]) -> int:
        key = content_key(targets)
        if key not in self._by_content:
            self._by_content[key] = self._dealt % self.folds
            self._dealt += 1
        return self._by_content[key]

    def knows(self, document: int) -> bool:
        """Whether `document` (its number) has a fold."""
        return document in self._fold_of

    def add(
        self, keys: torch.Tensor, values: torch.Tensor, documents: torch.Tensor, first_windows: dict[int, list[int]]
    ) -> None:
        """Add learned positions: keys [n, d_key], values [n, d] (float32 or float64) and documents [n] int64 in
        stream order. first_windows: for each document not `knows` yet, its first window's learned targets (token
        ids), which deal it its fold. Rows of unknown documents (negative numbers) belong to no fold: every fold's fit
        keeps them."""
        if not self.folds or keys.shape[0] == 0:
            return
        ids, counts = torch.unique_consecutive(documents, return_counts=True)
        start, fold_rows = 0, []
        for doc, n in zip(ids.tolist(), counts.tolist(), strict=True):
            if doc >= 0:
                if doc not in self._fold_of:
                    if doc not in first_windows:
                        raise ValueError(f"first_windows: expected the first window of document {doc}, new here")
                    self._fold_of[doc] = self._deal(first_windows[doc])
                fold_rows.append(torch.full((n,), self._fold_of[doc], dtype=torch.long, device=keys.device))
            else:
                fold_rows.append(torch.full((n,), -1, dtype=torch.long, device=keys.device))
            start += n
        fold = torch.cat(fold_rows)
        d_key, d = keys.shape[-1], values.shape[-1]
        if self._sums is None:

            def zeros(*shape: int) -> torch.Tensor:
                return torch.zeros(shape, dtype=torch.float64, device=keys.device)

            self._sums = (zeros(self.folds, d_key, d_key), zeros(self.folds, d_key, d), zeros(self.folds))
        s, t, c = self._sums
        for f in torch.unique(fold[fold >= 0]).tolist():
            # float32 products of float32 keys, as the tail's own statistics (HeldOutTail.split) are formed
            k, v = keys[fold == f].float(), values[fold == f].float()
            s[f] += (k.T @ k).double()
            t[f] += (k.T @ v).double()
            c[f] += k.shape[0]

    def fold_of(self, documents: torch.Tensor) -> torch.Tensor:
        """The fold [m] int64 of each of documents [m] (-1: unknown, or learned before the folds were kept)."""
        return torch.tensor([self._fold_of.get(doc, -1) for doc in documents.tolist()], dtype=torch.long,
                            device=documents.device)  # fmt: skip

    def sums(self, fold: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(S_f [d_key, d_key], T_f [d_key, d], count_f []) float64 of fold `fold`."""
        if self._sums is None:
            raise RuntimeError("DocumentFolds: no positions were added")
        return self._sums[0][fold], self._sums[1][fold], self._sums[2][fold]

    def extended(self, later: DocumentFolds) -> DocumentFolds:
        """The folds of this stream followed by `later`'s (their documents are numbered apart): sums add."""
        if later.folds != self.folds:  # kept under other policies: neither covers the union
            return DocumentFolds(self.folds)
        parts = [p for p in (self._sums, later._sums) if p is not None]
        sums: FoldSums | None = None
        if parts:
            device = parts[-1][0].device
            s, t, c = (sum(p[i].to(device) for p in parts) for i in range(3))
            sums = (torch.as_tensor(s), torch.as_tensor(t), torch.as_tensor(c))
        fold_of, by_content = {**self._fold_of, **later._fold_of}, {**later._by_content, **self._by_content}
        return DocumentFolds(self.folds, fold_of, by_content, self._dealt + later._dealt, sums)

    def subtract(self, other: DocumentFolds, documents: set[int]) -> None:
        """Take out what `other` added (the same text learned apart: its documents fall into the same folds) and
        forget the fold of `documents` (their numbers here). Under other fold counts the sums no longer describe the
        memory: they are dropped."""
        for doc in documents:
            self._fold_of.pop(doc, None)
        if other._sums is None or self._sums is None:
            return
        if other.folds != self.folds:
            self.clear()
            return
        self._sums = tuple(a - b.to(a.device) for a, b in zip(self._sums, other._sums, strict=True))  # type: ignore[assignment]

    def capacity_bytes(self, dim_key: int, dim_value: int) -> int:
        """Bytes of the sums: F·(d_key² + d_key·d + 1) float64."""
        return self.folds * (dim_key * dim_key + dim_key * dim_value + 1) * 8
