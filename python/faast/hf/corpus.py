"""Text corpora for readout training and the demo: local files or a datasets split, streamed through the datasets
library (`datasets.load_dataset("text" | "json", data_files=...)` for local files), cut into (learn, predict)
windows of one document.

A training step learns one window of a document into the fast weights and is scored on the *next* window of the
same document, which is not in the attention context. That is the test-time situation (learn a corpus, then
predict new text of the same domain), unlike the authors' recipe that scores the very tokens it just stored
(docs/authors.md H7).
"""

from __future__ import annotations

import glob
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .tokens import pad_rows

# Local files the trainer reads through the datasets library's packaged builders, by suffix.
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text"}


def read_text_files(
    patterns: Sequence[str], *, min_chars: int = 1, shuffle_seed: int | None = None
) -> Iterator[tuple[str, str]]:
    """(path, text) of every file matching the glob patterns (recursive '**' allowed), one document per file.

    Read lazily through `datasets.load_dataset("text", sample_by="document", streaming=True)`, in sorted order or in
    a seeded random order over all patterns (so sources mix). Files that are not UTF-8 text (their undecodable bytes
    read as U+FFFD) or shorter than min_chars are skipped; a pattern that matches no file raises, so a typo does not
    train on an empty corpus.
    """
    paths = _expand(patterns, "text_files")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(paths)
    # One row per file, in the order given: the rows are matched to the paths by position.
    rows = _load_local("text", paths, split="train", sample_by="document", encoding_errors="replace")
    for path, row in zip(paths, rows, strict=True):
        text = row["text"]
        if "\ufffd" not in text and len(text) >= min_chars:
            yield path, text


def read_dataset(
    name: str, *, config: str | None = None, split: str = "train", text_column: str = "text", streaming: bool = True
) -> Iterator[tuple[str, str]]:
    """(id, text) rows of a datasets split, streamed (needs `datasets`); empty texts are skipped.

    `name` is a hub dataset (needs access to the hub), a local folder of data files (its splits named by the file
    names), or local JSON Lines / JSON / text files: a path or a glob pattern ending in one of LOCAL_BUILDERS'
    suffixes, read as the split `split` (a text file gives one row per line).
    """
    builder = _local_builder(name)
    if builder is not None:
        rows = _load_local(builder, _expand([name], "dataset"), split=split, streaming=streaming)
    else:
        rows = _datasets().load_dataset(name, config, split=split, streaming=streaming)
    for i, row in enumerate(rows):
        if text_column not in row:
            raise ValueError(f"text_column: {text_column!r} is not a column of {name} (columns: {sorted(row)})")
        text = row[text_column]
        if text and text.strip():
            yield f"{name}:{split}:{i}", text


def _datasets():  # noqa: ANN202 - the datasets module
    try:
        import datasets
    except ImportError as err:
        raise ImportError("reading a corpus needs the datasets library: `pip install datasets`") from err
    return datasets


def _expand(patterns: Sequence[str], argument: str) -> list[str]:
    """The files matching each glob pattern, sorted per pattern, without repeats; a pattern matching none raises."""
    paths: list[str] = []
    for pattern in patterns:
        found = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"{argument}: the pattern {pattern!r} matches no file")
        paths.extend(found)
    return list(dict.fromkeys(paths))


def _local_builder(name: str) -> str | None:
    """The packaged builder for a local file or glob pattern (by its suffix), or None for a hub name or a folder."""
    if Path(name).is_dir() or not (Path(name).is_file() or glob.has_magic(name)):
        return None
    suffix = Path(name).suffix.lower()
    if suffix not in LOCAL_BUILDERS:
        raise ValueError(
            f"dataset: {name!r} is a local file of unknown type; expected one of {sorted(LOCAL_BUILDERS)}"
        )
    return LOCAL_BUILDERS[suffix]


def _load_local(builder: str, paths: list[str], *, split: str, streaming: bool = True, **options: object) -> Any:
    """The rows of local files through a packaged builder ('json' or 'text'), in the order of `paths`, streamed
    unless streaming=False (a datasets IterableDataset or Dataset: the datasets library is untyped)."""
    # datasets globs each data file again: escaped, a name with [ ] * ? stays the one file it is.
    files = [glob.escape(p) for p in paths]
    return _datasets().load_dataset(builder, data_files={split: files}, split=split, streaming=streaming, **options)


@dataclass
class WindowPair:
    """One training example: learn `learn` [T] into memory, then predict `target` [T] (its continuation)."""

    learn: list[int]
    target: list[int]


def window_pairs(
    documents: Iterable[tuple[str, str]], tokenizer: object, seq_len: int, *, max_pairs_per_document: int = 8
) -> Iterator[WindowPair]:
    """Consecutive (learn, target) windows of `seq_len` tokens from each document.

    Documents shorter than two windows are joined with the next ones of the stream (separated by a newline) so short
    files still count; a pair never spans more than one joined group. At most max_pairs_per_document pairs are taken
    from one group so long files do not dominate.
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len: expected an int >= 2, got {seq_len!r}")
    tokenize = cast("Callable[..., Any]", tokenizer)  # a transformers tokenizer, or any callable like one
    newline = tokenize("\n", add_special_tokens=False)["input_ids"]
    buffer: list[int] = []
    for _, text in documents:
        ids = tokenize(text, add_special_tokens=False)["input_ids"]
        buffer = buffer + newline + ids if buffer else list(ids)
        if len(buffer) < 2 * seq_len:
            continue
        for k in range(min(len(buffer) // (2 * seq_len), max_pairs_per_document)):
            start = 2 * k * seq_len
            yield WindowPair(buffer[start : start + seq_len], buffer[start + seq_len : start + 2 * seq_len])
        buffer = []


def shuffled(items: Iterable, buffer_size: int, seed: int) -> Iterator:
    """Shuffle a stream with a fixed-size buffer (a corpus need not fit in memory)."""
    rng = random.Random(seed)
    pool: list = []
    for item in items:
        pool.append(item)
        if len(pool) >= buffer_size:
            yield pool.pop(rng.randrange(len(pool)))
    rng.shuffle(pool)
    yield from pool


def collate(pairs: Sequence[WindowPair]) -> dict[str, torch.Tensor]:
    """A training batch: learn_ids/learn_mask and input_ids/attention_mask [B, T] (right padded with 0)."""

    learn_ids, learn_mask = pad_rows([p.learn for p in pairs])
    ids, mask = pad_rows([p.target for p in pairs])
    return {"learn_ids": learn_ids, "learn_mask": learn_mask.long(), "input_ids": ids, "attention_mask": mask.long()}


def batches(pairs: Iterable[WindowPair], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    chunk: list[WindowPair] = []
    for p in pairs:
        chunk.append(p)
        if len(chunk) == batch_size:
            yield collate(chunk)
            chunk = []
    if chunk:
        yield collate(chunk)


def domain_pairs(
    groups: Sequence[Sequence[tuple[str, str]]],
    tokenizer: object,
    seq_len: int,
    *,
    steps_per_domain: int = 8,
    batch_size: int = 4,
    max_tokens_per_document: int = 8192,
    seed: int = 0,
) -> Iterator[list[WindowPair]]:
    """Endless batches in which the learned windows and the predicted windows come from *different* documents of one
    domain (a group, e.g. one source folder): the test-time situation of the demo, where the model learns some
    files of a code base and predicts others. The domain stays the same for `steps_per_domain` consecutive batches
    so the (discounted) memory is mostly of that domain, as it is at test time. Deterministic for a seed.
    """
    groups = [list(g) for g in groups if len(g) >= 2]
    if not groups:
        raise ValueError("groups: need at least one group with two or more documents")
    rng = random.Random(seed)
    cache: dict[tuple[int, int], list[int]] = {}
    tokenize = cast("Callable[..., Any]", tokenizer)  # a transformers tokenizer, or any callable like one

    def tokens(g: int, i: int) -> list[int]:
        if (g, i) not in cache:
            ids = tokenize(groups[g][i][1], add_special_tokens=False)["input_ids"][:max_tokens_per_document]
            cache[(g, i)] = list(ids)
        return cache[(g, i)]

    def window(ids: list[int]) -> list[int]:
        start = rng.randrange(max(len(ids) - seq_len, 0) + 1)
        return ids[start : start + seq_len]

    while True:
        g = rng.randrange(len(groups))
        for _ in range(steps_per_domain):
            batch: list[WindowPair] = []
            while len(batch) < batch_size:
                target, source = rng.sample(range(len(groups[g])), 2)
                learn, predict = tokens(g, source), tokens(g, target)
                if len(learn) >= 2 and len(predict) >= 2:
                    batch.append(WindowPair(window(learn), window(predict)))
            yield batch
