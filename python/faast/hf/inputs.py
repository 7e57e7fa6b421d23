"""Input coercion and batching for FaastModel.learn: what a user may pass (an input_ids batch, texts, token-id lists,
tokenised mappings, a datasets.Dataset), checked once and turned into right-padded (input_ids, attention_mask, labels,
documents) batches, lazily, so a corpus never has to fit in memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from .learn_datasets import LabelledIds, dataset_items, is_dataset
from .lm import input_embeddings
from .tokens import overlapping_windows, pad_rows

# (input_ids [B, T] int64, attention_mask [B, T] or None, labels [B, T] int64 or None, documents: B ints or None)
Batch = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None]


def check_batch(input_ids: object, attention_mask: object, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T] int64, mask [B, T] bool) from a checked batch for `model`: ids in its vocabulary and on its
    device; attention_mask 0/1 or bool of the same shape (None: every token real). A 1-D batch is one row."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids: expected an int64 tensor [batch, seq], got {describe(input_ids)}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids: expected a non-empty [batch, seq] tensor, got shape {list(input_ids.shape)}")
    vocab = input_embeddings(model).num_embeddings
    if bool(((input_ids < 0) | (input_ids >= vocab)).any()):  # one host sync for both bounds
        raise ValueError(
            f"input_ids: token ids must lie in [0, {vocab}), got [{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    device = input_embeddings(model).weight.device
    if input_ids.device != device:
        raise ValueError(f"input_ids: on {input_ids.device}, the model is on {device}")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask: expected a tensor [batch, seq] or None, got {describe(attention_mask)}")
        if attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask: expected shape {list(input_ids.shape)} like input_ids, got "
                f"{list(attention_mask.shape)}"
            )
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask: on {attention_mask.device}, input_ids on {input_ids.device}")
        if attention_mask.dtype != torch.bool and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask: expected 0/1 (or bool) entries")
        mask = attention_mask.bool()
    return input_ids.long(), mask


def check_labels(labels: object, input_ids: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """labels [B, T] int64, checked against input_ids [B, T]: token ids of `model`'s vocabulary or -100."""
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an int64 tensor [batch, seq] like input_ids, got {describe(labels)}")
    if labels.dim() == 1:
        labels = labels.unsqueeze(0)
    if labels.shape != input_ids.shape or labels.device != input_ids.device:
        raise ValueError(
            f"labels: expected shape {list(input_ids.shape)} on {input_ids.device} like input_ids, got "
            f"{list(labels.shape)} on {labels.device}"
        )
    vocab = input_embeddings(model).num_embeddings
    if bool((((labels < 0) & (labels != -100)) | (labels >= vocab)).any()):
        raise ValueError(f"labels: expected token ids in [0, {vocab}) or -100 (not learned)")
    return labels.long()


def describe(x: object) -> str:
    """What `x` is, for error messages: a tensor's dtype and shape, else its type's name."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


def learn_source(inputs: object, input_ids: object) -> object:
    """learn()'s inputs, given either positionally or as the input_ids keyword."""
    if input_ids is not None:
        if inputs is not None:
            raise ValueError("input_ids: give the batch either as inputs or as input_ids, not both")
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected an int64 tensor [batch, seq], got {describe(input_ids)}")
        inputs = input_ids
    if inputs is None:
        raise ValueError("inputs: nothing to learn (give input_ids, a text or an iterable of texts or batches)")
    return inputs


def learn_items(
    inputs: object,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    tokenizer: object | None,
    text_column: str | None,
) -> Iterable:
    """learn()'s inputs other than an input_ids tensor as an iterable of items for `batches`: a dataset's rows, a
    single text, token-id list or tokenised batch as a list of one, any other iterable as it is."""
    if labels is not None:
        raise ValueError("labels: only valid with an input_ids tensor; a dataset gives them as its labels column")
    if attention_mask is not None:
        raise ValueError("attention_mask: only valid with an input_ids tensor; batches carry their own masks")
    if is_dataset(inputs):
        inputs = dataset_items(inputs, tokenizer, text_column)
    elif text_column is not None:
        raise ValueError(f"text_column: only valid with a datasets.Dataset or IterableDataset, not {describe(inputs)}")
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, Mapping) or (
        isinstance(inputs, list | tuple) and inputs and all(isinstance(t, int) for t in inputs)
    ):
        inputs = [inputs]  # one tokenised batch, or one text as token ids
    return cast(Iterable, inputs)  # any other object as it is: iterating it (batches) says what is wrong


def batches(
    inputs: Iterable, tokenizer: object | None, max_length: int, batch_size: int, device: torch.device | None = None
) -> Iterator[Batch]:
    """(input_ids, attention_mask, labels or None, documents or None) batches from texts, id lists, LabelledIds, id
    tensors or tokenised mappings, lazily. documents (B ints) are the index in `inputs` of the text each window was
    cut from (None for a tensor or a mapping: their rows' documents are not known).

    Batches built here from texts or token-id lists are put on `device` (the model's); tensors the caller passes keep
    their device, so a mismatch is reported by the batch check rather than copied silently."""

    def built(x: object) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, device=device)

    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length: expected an int >= 2, got {max_length!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    pending: list[tuple[list[int], list[int] | None, int]] = []  # (window, its labels, its document)
    for n, item in enumerate(inputs):
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ValueError(f"inputs[{n}]: a tokenised batch needs 'input_ids', got keys {sorted(item)}")
            yield (
                built(item["input_ids"]),
                (None if item.get("attention_mask") is None else built(item["attention_mask"])),
                None,
                None,
            )
            continue
        if isinstance(item, torch.Tensor):
            yield item, None, None, None
            continue
        labels = None
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("tokenizer: required to learn from texts")
            tokenize = cast("Callable[..., Any]", tokenizer)  # a transformers tokenizer, or any callable like one
            ids = tokenize(item, add_special_tokens=False)["input_ids"]
        elif isinstance(item, LabelledIds):
            ids, labels = item.input_ids, item.labels
        elif isinstance(item, list | tuple) and all(isinstance(t, int) for t in item):
            ids = item
        else:
            raise TypeError(
                f"inputs[{n}]: expected a text, a list of token ids, an input_ids tensor or a mapping, got "
                f"{type(item).__name__}"
            )
        # Labels are cut into the same windows as the ids: both have the same length.
        label_windows = overlapping_windows(labels, max_length) if labels is not None else None
        for window in overlapping_windows(ids, max_length):
            pending.append((window, None if label_windows is None else next(label_windows), n))
            if len(pending) == batch_size:
                yield padded(pending, device)
                pending = []
    if pending:
        yield padded(pending, device)


def padded(
    windows: list[tuple[list[int], list[int] | None, int]], device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """(input_ids, attention_mask, labels or None) [B, T] and the rows' documents (a list of B ints) from (window,
    labels, document) triples, right padded; labels are padded with -100 and are the ids themselves for a window
    without labels (every pair learned), or None when no window has any."""
    ids, mask = pad_rows([w for w, _, _ in windows])
    labels = None
    if any(lab is not None for _, lab, _ in windows):
        labels, _ = pad_rows([w if lab is None else lab for w, lab, _ in windows], pad_id=-100)
        labels = labels.to(device)
    return ids.to(device), mask.to(device), labels, [doc for _, _, doc in windows]
