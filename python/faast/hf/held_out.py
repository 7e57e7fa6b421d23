"""The residual output layer's held-out tail (docs/design.md §6.3): which learned positions tune its step
(`tail_plan`: the end of every learned text, in proportion to its length) and the bounded buffer that keeps them
(`HeldOutTail`). The step and weight are tuned on them in faast/hf/output/tuning.py. The shares and thresholds are the
layer's OutputPolicy's (held_out_share, min_held_out, gap_multiple, tune_sample)."""

from __future__ import annotations

import itertools
import math
from typing import cast

import torch

from .document_folds import DocumentFolds
from .output.policy import DEFAULT_POLICY, OutputPolicy


def tail_plan(
    counts: list[int],
    learned: int,
    tune_tokens: int,
    min_fit: int,
    gap_allowed: list[bool] | None = None,
    policy: OutputPolicy = DEFAULT_POLICY,
) -> list[tuple[int, int]]:
    """Which positions tune the step, per document: [(held_i, gap_i)] for documents with counts[i] learned positions
    (stream order), out of `learned` positions in all (the memory's count: it may include text whose positions were
    not kept, e.g. loaded statistics).

    Every document holds out its last held_i = round(f·n_i) positions, f = H / learned with H = min(tune_tokens,
    policy.held_out_share·learned): the held-out text is drawn from every document in proportion to its length, so a
    text learned last does not decide the step alone (learning A then B tunes on what B then A tunes on). The fit also
    leaves out the gap_i = min(policy.gap_multiple·held_i, n_i − held_i) positions just before each document's
    held-out ones: text next to them shares their names and phrasing. When the gaps would leave fewer than `min_fit`
    positions to fit on, no gaps; when fewer than policy.min_held_out would be held out, or fewer than `min_fit`
    left, nothing is (the step is not tuned). gap_allowed[i] False: document i gets no gap (HeldOutTail pools the
    rows of unknown documents into one, whose end is not one text's). Pure: the baselines of lab/experiments/
    lm_domains.py hold out the same.
    """
    if learned <= 0 or not counts:
        return [(0, 0)] * len(counts)
    total = min(tune_tokens, int(learned * policy.held_out_share))
    fraction = total / learned
    held = [min(n, math.floor(fraction * n + 0.5)) for n in counts]
    if sum(held) < policy.min_held_out or learned - sum(held) < min_fit:
        return [(0, 0)] * len(counts)
    allowed = [True] * len(counts) if gap_allowed is None else gap_allowed
    multiple = policy.gap_multiple
    gaps = [min(multiple * h, n - h) if ok else 0 for h, n, ok in zip(held, counts, allowed, strict=True)]
    if learned - sum(held) - sum(gaps) < min_fit:
        gaps = [0] * len(counts)
    return list(zip(held, gaps, strict=True))


def _from_end(runs: list[int], device: torch.device) -> torch.Tensor:
    """For consecutive runs of the given lengths, each position's distance from its run's last position [Σ runs]."""
    lengths = torch.tensor(runs, dtype=torch.long, device=device)
    ends = lengths.cumsum(0)
    index = torch.arange(int(ends[-1]), device=device)
    return torch.repeat_interleave(ends, lengths) - 1 - index


def _per_position(values: list[int], runs: list[int], device: torch.device) -> torch.Tensor:
    """values[i] repeated runs[i] times [Σ runs]."""
    lengths = torch.tensor(runs, dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.long, device=device), lengths)


def _canonical_order(index: torch.Tensor, keys: torch.Tensor, ys: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The held-out rows `index` [h] (stream order, each document's rows contiguous) with the documents ordered by
    their own content (length, targets, then the sum of their keys), not by when they were learned: the step is tuned
    on a sample of these rows, and learning A then B must sample what B then A does (docs/design.md §6.3)."""
    counts = torch.unique_consecutive(docs[index], return_counts=True)[1].tolist()
    runs = list(zip(itertools.accumulate([0, *counts[:-1]]), itertools.accumulate(counts), strict=True))
    targets = ys[index].tolist()
    order = sorted(
        runs, key=lambda r: (r[1] - r[0], targets[r[0] : r[1]], float(keys[index[r[0] : r[1]]].double().sum()))
    )
    return index if order == runs else torch.cat([index[a:b] for a, b in order])


# The tail buffer keeps keys in float16 (half the bytes of float32: the buffer stays smaller than the statistics it
# tunes); a key outside float16's range switches the buffer to float32. The rounding (2⁻¹¹ relative) moves the fit's
# statistics by far less than the held-out noise the step is tuned against.
KEY_STORAGE = torch.float16
_FLOAT16_LIMIT = 6.0e4

# What HeldOutTail keeps: (keys [n, d_key], targets [n] int64, documents [n] int64, values [n, d]).
Kept = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# What HeldOutTail.snapshot gives: (the kept tensors or None, document -> learned positions, positions seen, the
# folds' snapshot).
Snapshot = tuple[Kept | None, dict[int, int], int, tuple]


class HeldOutTail:
    """The learned positions kept to tune the step: for every document, its last positions (those `tail_plan` may
    hold out or leave out of the fit), as keys [n, d_key] and values [n, d] (float16, or float32 when one exceeds
    float16's range), targets [n] int64 and documents [n] int64 in stream order, and each kept document's learned
    position count. Each row of an unknown document (negative number) is a document of its own. With
    policy.document_folds F ≥ 2 it also keeps every fold's key statistics (`folds`, document_folds.DocumentFolds).
    Learning state of this process, not saved.

    Bounded: as more text is learned the held-out fraction f = min(held_out_share, tune_tokens / learned) only
    falls, so a document never needs more than the (1 + gap_multiple)·round(f·n) last positions it keeps now. In all
    about (1 + gap_multiple)·tune_tokens positions (rounding up to half a position per document adds at most as many
    again, for text of many documents of 1/(2f) to 1/f positions). The shares are `policy`'s (the layer's
    OutputPolicy; the layer sets it when its own changes).
    """

    def __init__(
        self,
        tune_tokens: int,
        kept: Kept | None = None,
        counts: dict[int, int] | None = None,
        seen: int = 0,
        policy: OutputPolicy = DEFAULT_POLICY,
    ) -> None:
        self.tune_tokens = tune_tokens
        self.folds = DocumentFolds(policy.document_folds)
        self._policy = policy
        self._kept = kept
        self._counts = dict(counts or {})  # document -> learned positions, for the documents with kept positions
        self._seen = seen  # positions learned into this buffer in all

    @property
    def policy(self) -> OutputPolicy:
        """The OutputPolicy whose shares and fold count the buffer keeps by."""
        return self._policy

    @policy.setter
    def policy(self, policy: OutputPolicy) -> None:
        """Keep by `policy` from now on. Under another fold count the folds kept so far describe no fold of it:
        they are forgotten, and the step is tuned on the tail alone until the memory learns anew."""
        if policy.document_folds != self.folds.folds:
            self.folds = DocumentFolds(policy.document_folds)
        self._policy = policy

    def __len__(self) -> int:
        return 0 if self._kept is None else int(self._kept[0].shape[0])

    def snapshot(self) -> Snapshot:
        """What the buffer holds now, for restore (the kept tensors are replaced, never written in place)."""
        return self._kept, dict(self._counts), self._seen, self.folds.snapshot()

    def restore(self, snapshot: object) -> None:
        """Put back what snapshot() returned (a learn that failed part way leaves the buffer as it was)."""
        self._kept, counts, self._seen, folds = cast(Snapshot, snapshot)  # what snapshot() returned
        self._counts = dict(counts)
        self.folds.restore(folds)

    def clear(self) -> None:
        """Forget every kept position."""
        self._kept, self._counts, self._seen = None, {}, 0
        self.folds.clear()

    def drop_documents(self, documents: set[int], learned: HeldOutTail | None = None) -> int:
        """Forget the kept positions of `documents` (document numbers; negative: rows of unknown documents, each its
        own), e.g. of texts a memory forgot: they must not tune its step. learned: a buffer that learned just those
        texts (numbered apart): its fold statistics are taken out of this one's. Returns how many positions were
        dropped."""
        if learned is not None:
            self.folds.subtract(learned.folds, documents)
        if self._kept is None or not documents:
            return 0
        ids = torch.tensor(sorted(documents), dtype=torch.long, device=self._kept[2].device)
        keep = ~torch.isin(self._kept[2], ids)
        dropped = int((~keep).sum())
        for doc in documents:
            self._seen -= self._counts.pop(doc, 0)
        self._kept = cast(Kept, tuple(t[keep] for t in self._kept)) if bool(keep.any()) else None
        return dropped

    def extended(self, later: HeldOutTail) -> HeldOutTail:
        """A new buffer holding this one's positions followed by `later`'s: what one buffer would hold after learning
        this buffer's stream and then `later`'s (merging two memories; their documents are numbered apart)."""
        # its fields, not snapshot(): that copies the folds' sums, which folds.extended reads without a copy
        kept, counts, seen = later._kept, later._counts, later._seen
        parts = [k for k in (self._kept, kept) if k is not None]
        if not parts or not self.tune_tokens:
            return HeldOutTail(self.tune_tokens, policy=self.policy)
        folds = self.folds.extended(later.folds)
        dtype = torch.promote_types(parts[0][0].dtype, parts[-1][0].dtype)
        joined = tuple(torch.cat([p[i].to(parts[-1][i].device, dtype if i in (0, 3) else p[i].dtype) for p in parts])
                       for i in range(4))  # fmt: skip
        joined = cast(Kept, joined)  # the four kept tensors, each joined
        merged = HeldOutTail(self.tune_tokens, joined, {**self._counts, **counts}, self._seen + seen, self.policy)
        merged.folds = folds
        merged._trim()
        return merged

    def keep(
        self,
        keys: torch.Tensor,
        targets: torch.Tensor,
        pair_mask: torch.Tensor,
        documents: torch.Tensor | None,
        values: torch.Tensor,
    ) -> None:
        """Append the learned positions of keys [B, T-1, d_key], targets [B, T-1] and values [B, T-1, d] (the
        gradients the memory learned for them: the fit's statistics subtract them without recomputing the head's
        products) where pair_mask [B, T-1] (documents [B] int64, non-decreasing along the stream for texts; None:
        each row unknown, numbered -1) and trim every document to what it may still need. Only learned positions
        are kept: with right-padded batches the last positions of a batch are often padding (selecting them costs a
        host sync, as the learn step's own counts do)."""
        d = keys.shape[-1]
        docs = torch.full(keys.shape[:2], -1, dtype=torch.long, device=keys.device)
        if documents is not None:
            docs = docs.copy_(documents.to(torch.long)[:, None].expand_as(docs))
        keep = pair_mask.reshape(-1)
        new_docs = docs.reshape(-1)[keep]
        flat = keys.reshape(-1, d)[keep]
        flat_values = values.reshape(-1, values.shape[-1])[keep]
        new_targets = targets.reshape(-1)[keep]
        dtype = KEY_STORAGE
        if self._kept is not None and self._kept[0].dtype != KEY_STORAGE:
            dtype = self._kept[0].dtype
        else:
            big = max(float(flat.abs().max()), float(flat_values.abs().max())) if flat.numel() else 0.0
            if big > _FLOAT16_LIMIT:
                dtype = torch.float32
        if self.folds.folds:  # each new document's first window (a row: windows never span batches) deals its fold
            firsts: dict[int, list[int]] = {}
            for b, doc in enumerate(docs[:, 0].tolist()):
                if doc >= 0 and doc not in firsts and not self.folds.knows(doc):
                    firsts[doc] = targets[b][pair_mask[b]].tolist()
            self.folds.add(flat, flat_values, new_docs, firsts)  # before rounding: the sums are the memory's
        new = (flat.to(dtype), new_targets, new_docs, flat_values.to(dtype))
        if self._kept is not None:
            new = cast(
                Kept, tuple(torch.cat([old.to(part.dtype), part]) for old, part in zip(self._kept, new, strict=True))
            )
        self._kept = new
        ids, counts = torch.unique_consecutive(new_docs, return_counts=True)
        for doc, n in zip(ids.tolist(), counts.tolist(), strict=True):
            self._counts[doc] = self._counts.get(doc, 0) + n
            self._seen += n
        self._trim()

    def _rows(self) -> Kept:
        """The kept tensors, for the methods that run only while the buffer keeps positions."""
        return cast(Kept, self._kept)

    def _runs(self) -> tuple[list[int], list[int]]:
        """(documents, kept positions of each) in stream order: each document's kept positions are contiguous."""
        ids, counts = torch.unique_consecutive(self._rows()[2], return_counts=True)
        return ids.tolist(), counts.tolist()

    def _trim(self) -> None:
        """Keep each document's last (1 + gap_multiple)·round(f·n) positions (the last document, which may still
        grow: (1 + gap_multiple)·(round(f·n) + 1)) and forget the documents that keep none."""
        if self._kept is None:
            return
        fraction = min(self.policy.held_out_share, self.tune_tokens / max(self._seen, 1))
        docs, runs = self._runs()
        wanted = []
        for i, (doc, run) in enumerate(zip(docs, runs, strict=True)):
            n = self._counts.get(doc, run)
            # The document learned last may still grow: one position more per multiple covers what it can need
            # after any append (f only falls, and (1 + gap_multiple)·f < 1).
            extra = 1 if i == len(docs) - 1 else 0
            wanted.append(min(run, (1 + self.policy.gap_multiple) * (math.floor(fraction * n + 0.5) + extra)))
        if wanted == runs:
            return
        keep = _from_end(runs, self._kept[2].device) < _per_position(wanted, runs, self._kept[2].device)
        self._kept = cast(Kept, tuple(t[keep] for t in self._kept)) if bool(keep.any()) else None
        self._counts = {doc: self._counts[doc] for doc, want in zip(docs, wanted, strict=True)
                        if want > 0 and doc in self._counts}  # fmt: skip

    def plan(self, learned: int, min_fit: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """(documents, kept positions of each, [(held, gap)] of each by `tail_plan`) for a memory of `learned`
        positions: the positions its step is tuned on now."""
        if self._kept is None or not self.tune_tokens:
            return [], [], []
        docs, runs = self._runs()
        counts = [self._counts.get(doc, run) for doc, run in zip(docs, runs, strict=True)]
        plan = tail_plan(counts, learned, self.tune_tokens, min_fit, policy=self.policy)
        # A document never holds out more than it kept (the buffer keeps what the plan can ask for; this guards it).
        plan = [(min(h, run), min(g, run - min(h, run))) for (h, g), run in zip(plan, runs, strict=True)]
        return docs, runs, plan

    def split(
        self, learned: int, min_fit: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """The positions `plan` chooses: (keys [m, d_key] float32, targets [m] and documents [m] of at most
        policy.tune_sample held-out positions spread evenly over all of them; keys [k, d_key] and values [k, d] (as
        kept: float16 or float32) of every position the fit leaves out (held out and gaps); how many are held out; how
        many are gaps)."""
        keys, ys, docs, values = self._rows()
        held_mask, out_mask = self._masks(learned, min_fit)
        device = docs.device
        held = int(held_mask.sum())
        gap = int(out_mask.sum()) - held
        held_index = _canonical_order(held_mask.nonzero().squeeze(-1), keys, ys, docs)
        count = min(held, self.policy.tune_sample)
        sample = held_index[torch.linspace(0, held - 1, count, device=device).round().long()]
        return (keys[sample].float(), ys[sample], docs[sample], keys[out_mask], values[out_mask], held, gap)

    def left_out_documents(self, learned: int, min_fit: int) -> torch.Tensor:
        """The document [k] int64 of every position the fit leaves out under `plan`, in the order `split` returns
        their keys and values."""
        return self._rows()[2][self._masks(learned, min_fit)[1]]

    def _masks(self, learned: int, min_fit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([kept] bool: held out, [kept] bool: left out of the fit, held out or gap) under `plan`."""
        _, runs, plan = self.plan(learned, min_fit)
        device = self._rows()[2].device
        from_end = _from_end(runs, device)
        held = from_end < _per_position([h for h, _ in plan], runs, device)
        return held, from_end < _per_position([h + g for h, g in plan], runs, device)

    def held_positions(self, learned: int, min_fit: int) -> int:
        """How many positions `plan` holds out for a memory of `learned` positions (0: too few to tune)."""
        return sum(held for held, _ in self.plan(learned, min_fit)[2])

    def documents(self, learned: int, min_fit: int) -> int:
        """How many documents hold out positions under `plan`."""
        return sum(1 for held, _ in self.plan(learned, min_fit)[2] if held)

    def capacity_bytes(self, dim_key: int, dim_value: int) -> int:
        """Bytes the buffer takes at its usual fullest, (1 + gap_multiple)·tune_tokens positions: float16 keys and
        values (dim_value wide), int64 targets and documents (float32 keys, or text of many short documents, take up
        to twice or thrice that), and the folds' sums (DocumentFolds.capacity_bytes)."""
        rows = (1 + self.policy.gap_multiple) * self.tune_tokens * ((dim_key + dim_value) * 2 + 8 + 8)
        return rows + self.folds.capacity_bytes(dim_key, dim_value)
