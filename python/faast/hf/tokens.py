"""Token-id helpers shared by learning, training data, evaluation and the experiment scripts (public).

Texts become token-id lists (`token_lists`), id lists become right-padded rows with a mask (`pad_rows`) or windows
that share one token (`overlapping_windows`), and a sequence of tokenised texts is cut at token thresholds
(`split_by_tokens`; `split_continuing` also says which parts begin with the rest of a cut text).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["overlapping_windows", "pad_rows", "split_by_tokens", "split_continuing", "token_lists"]


def overlapping_windows(ids: Sequence[int], max_length: int) -> Iterator[list[int]]:
    """Windows of at most max_length tokens overlapping by one, so every adjacent pair is in exactly one window."""
    if max_length < 2:
        raise ValueError(f"max_length: expected an int >= 2 (a token and its successor), got {max_length!r}")
    step = max_length - 1
    for start in range(0, max(len(ids) - 1, 1), step):
        window = list(ids[start : start + max_length])
        if len(window) >= 2:
            yield window


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids int64, attention_mask bool) [len(rows), longest], right padded with pad_id."""
    if len(rows) == 0:
        raise ValueError("rows: expected at least one row of token ids, got none")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = True
    return ids, mask


def token_lists(texts: Iterable[str], tokenizer: Callable[..., Any], limit: int) -> list[list[int]]:
    """Token ids per text, stopping once `limit` tokens are collected (the last text is cut at the limit)."""
    out, total = [], 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: limit - total]
        if len(ids) >= 2:
            out.append(list(ids))
            total += len(ids)
        if total >= limit:
            break
    return out


def split_by_tokens(texts: Sequence[Sequence[int]], thresholds: Sequence[int]) -> list[list[list[int]]]:
    """Cut a token stream into consecutive parts ending at the given cumulative token counts (ascending).

    A text cut at a boundary continues in the next part from its last token, so every adjacent pair of every text
    lands in exactly one part: learning the parts one after another learns what the whole gives.
    """
    return [part for part, _ in split_continuing(texts, thresholds)]


def split_continuing(texts: Sequence[Sequence[int]], thresholds: Sequence[int]) -> list[tuple[list[list[int]], bool]]:
    """`split_by_tokens`'s parts, each with whether its first text is the rest of a text cut at the boundary before
    it: learn(part, continues=True) then keeps the text one document to the step's tuning, as one call would."""
    if list(thresholds) != sorted(set(thresholds)) or not thresholds or thresholds[0] < 1:
        raise ValueError(f"thresholds: expected ascending distinct positive token counts, got {list(thresholds)}")
    parts: list[list[list[int]]] = [[] for _ in thresholds]
    continues = [False] * len(thresholds)
    seen, part = 0, 0
    for ids in texts:
        start = 0
        while start < len(ids) and part < len(thresholds):
            end = min(len(ids), start + thresholds[part] - seen)
            piece = list(ids[start - 1 if start else 0 : end])
            if len(piece) >= 2:
                continues[part] = continues[part] or (not parts[part] and start > 0)
                parts[part].append(piece)
            seen += end - start
            start = end
            if seen >= thresholds[part]:
                part += 1
    return list(zip(parts, continues, strict=True))
