"""learn() from a `datasets.Dataset` or `datasets.IterableDataset`, streamed.

Rows are read ROWS_PER_READ at a time and turned into the items learn() already batches: a text column becomes one
token-id list per row (the texts of a read are tokenised in one tokenizer call), an `input_ids` column becomes its
rows, with their `labels` when the dataset has them. So learning a dataset learns exactly what learning the same texts
(or token-id lists) as a list does, and no more than one read of rows is held at a time.

`datasets` is never imported here: an object can only be a Dataset if the caller's program imported the library.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, cast

ROWS_PER_READ = 64

_STRING_DTYPES = ("string", "large_string")


@dataclass(frozen=True)
class LabelledIds:
    """One tokenised row and its labels (same length): the pair ending at position t is learned only where
    labels[t] != -100, as in a Hugging Face causal LM's labels."""

    input_ids: list[int]
    labels: list[int]


def is_dataset(x: object) -> bool:
    """True for a datasets.Dataset or IterableDataset, or a dict of their splits (False whenever `datasets` was never
    imported)."""
    module = sys.modules.get("datasets")
    if module is None:
        return False
    return isinstance(x, (module.Dataset, module.IterableDataset, module.DatasetDict, module.IterableDatasetDict))


def dataset_items(
    dataset: Any, tokenizer: object | None, text_column: str | None
) -> Iterator[list[int] | LabelledIds]:
    """The rows of `dataset` as token-id lists (a text column, tokenised) or LabelledIds (input_ids with labels).

    Column choice: `text_column` when given (a column of strings); otherwise `input_ids` when the dataset has it (with
    `labels` and `attention_mask` if present); otherwise its only string column. Anything else is refused with the
    columns named. Raises lazily, when the returned iterator is first advanced.
    """
    if isinstance(dataset, dict):  # DatasetDict / IterableDatasetDict
        raise ValueError(f"inputs: a dict of dataset splits {sorted(dataset)}; pass one split, e.g. dataset['train']")
    features = dataset.features  # None for a stream whose schema shows only in its rows
    if features is not None:
        plan = _plan(_column_kinds_from_features(features), text_column)
        # Read only the columns learned from (a dataset may also hold images, long metadata, ...).
        reads: Iterator[Mapping] = dataset.select_columns(plan.columns).iter(batch_size=ROWS_PER_READ)
    else:
        reads = dataset.iter(batch_size=ROWS_PER_READ)
        first = next(reads, None)
        if first is None:
            return
        plan = _plan(_column_kinds_from_rows(first), text_column)
        reads = chain([first], reads)
    if plan.text_column is not None:
        yield from _text_rows(reads, plan.text_column, tokenizer)
    else:
        yield from _id_rows(reads, plan.has_labels, plan.has_mask)


@dataclass(frozen=True)
class _Plan:
    text_column: str | None = None
    has_labels: bool = False
    has_mask: bool = False

    @property
    def columns(self) -> list[str]:
        if self.text_column is not None:
            return [self.text_column]
        return ["input_ids"] + ["labels"] * self.has_labels + ["attention_mask"] * self.has_mask


def _plan(kinds: dict[str, bool], text_column: str | None) -> _Plan:
    """kinds: column -> whether it holds strings."""
    names = sorted(kinds)
    if text_column is not None:
        if not isinstance(text_column, str):
            raise TypeError(f"text_column: expected a column name (str), got {type(text_column).__name__}")
        if text_column not in kinds:
            raise ValueError(f"text_column: {text_column!r} is not a column of the dataset (columns: {names})")
        if not kinds[text_column]:
            raise ValueError(f"text_column: {text_column!r} does not hold strings (columns: {names})")
        return _Plan(text_column=text_column)
    if "input_ids" in kinds:
        return _Plan(has_labels="labels" in kinds, has_mask="attention_mask" in kinds)
    strings = [name for name in names if kinds[name]]
    if len(strings) == 1:
        return _Plan(text_column=strings[0])
    if not strings:
        raise ValueError(f"inputs: the dataset has no string column and no 'input_ids' column (columns: {names})")
    raise ValueError(f"text_column: the dataset has several string columns {strings}; name the one to learn")


def _column_kinds_from_features(features: Mapping) -> dict[str, bool]:
    return {name: getattr(feature, "dtype", None) in _STRING_DTYPES for name, feature in features.items()}


def _column_kinds_from_rows(batch: Mapping[str, list]) -> dict[str, bool]:
    # A stream read without a schema: a column holds strings when its first non-null value in the read is one.
    kinds = {}
    for name, values in batch.items():
        value = next((v for v in values if v is not None), None)
        kinds[name] = isinstance(value, str)
    return kinds


def _text_rows(reads: Iterable[Mapping], column: str, tokenizer: object | None) -> Iterator[list[int]]:
    if tokenizer is None:
        raise ValueError("tokenizer: required to learn from the texts of a dataset")
    row = 0
    for read in reads:
        texts = read[column]
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"text_column: row {row + i} of {column!r} is {type(text).__name__}, expected a text")
        if texts:
            # One call per read: a fast tokenizer encodes the batch in parallel, each text as it would alone.
            tokenize = cast("Callable[..., Any]", tokenizer)  # a transformers tokenizer, or any callable like one
            ids = tokenize(list(texts), add_special_tokens=False)["input_ids"]
            if len(ids) != len(texts):
                raise ValueError(
                    f"tokenizer: returned {len(ids)} token lists for {len(texts)} texts; it must take a list of texts"
                )
            yield from (list(x) for x in ids)
        row += len(texts)


def _id_rows(reads: Iterable[Mapping], has_labels: bool, has_mask: bool) -> Iterator[list[int] | LabelledIds]:
    row = 0
    for read in reads:
        all_ids = read["input_ids"]
        for i, raw in enumerate(all_ids):
            n = row + i
            ids = _int_list(raw, "input_ids", n)
            labels = _int_list(read["labels"][i], "labels", n) if has_labels else None
            if labels is not None and len(labels) != len(ids):
                raise ValueError(f"labels: row {n} has {len(labels)} labels for {len(ids)} input_ids")
            if has_mask:
                start, end = _real_span(_int_list(read["attention_mask"][i], "attention_mask", n), len(ids), n)
                ids = ids[start:end]
                labels = None if labels is None else labels[start:end]
            yield ids if labels is None else LabelledIds(ids, labels)
        row += len(all_ids)


def _int_list(value: object, column: str, row: int) -> list[int]:
    if hasattr(value, "tolist"):  # a dataset formatted as torch / numpy tensors
        value = value.tolist()
    if not isinstance(value, list | tuple) or not all(isinstance(t, int) for t in value):
        raise ValueError(f"{column}: row {row} expected a list of ints, got {type(value).__name__}")
    return list(value)


def _real_span(mask: list[int], length: int, row: int) -> tuple[int, int]:
    """[start, end) of the real tokens of a left- or right-padded row; a mask with holes is refused, because
    dropping the hole would make pairs of tokens that were never adjacent."""
    if len(mask) != length:
        raise ValueError(f"attention_mask: row {row} has {len(mask)} entries for {length} input_ids")
    real = [t for t, m in enumerate(mask) if m]
    if not real:
        return 0, 0
    start, end = real[0], real[-1] + 1
    if len(real) != end - start or any(m not in (0, 1) for m in mask):
        raise ValueError(f"attention_mask: row {row} expected 0/1 entries with the real tokens contiguous (padding)")
    return start, end
