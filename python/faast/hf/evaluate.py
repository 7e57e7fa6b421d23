"""Held-out perplexity of a causal LM (with or without its fast weights) over fixed token windows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ._tokens import pad_rows


@dataclass
class Perplexity:
    """exp(nll / tokens) over `tokens` predicted tokens (every window predicts all but its first token)."""

    nll: float
    tokens: int
    seconds: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


def token_windows(ids: Sequence[int], length: int) -> list[list[int]]:
    """Non-overlapping windows of `length` tokens (the last may be shorter; windows under 2 tokens are dropped,
    since they predict nothing)."""
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"length: expected an int >= 2, got {length!r}")
    return [list(ids[i : i + length]) for i in range(0, len(ids), length) if len(ids[i : i + length]) >= 2]


@torch.no_grad()
def perplexity(model: nn.Module, windows: Sequence[Sequence[int]], *, batch_size: int = 4) -> Perplexity:
    """Sum the next-token NLL over every window (right padded in batches; padding is never scored)."""
    import time

    if not windows:
        raise ValueError("windows: expected at least one window of >= 2 tokens, got none")
    device = model.get_input_embeddings().weight.device
    nll, tokens = 0.0, 0
    started = time.perf_counter()
    for start in range(0, len(windows), batch_size):
        rows = windows[start : start + batch_size]
        ids, mask = pad_rows(rows)
        ids, mask = ids.to(device), mask.long().to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        target = ids[:, 1:]
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        nll -= float(logp[valid].sum())
        tokens += int(valid.sum())
    return Perplexity(nll=nll, tokens=tokens, seconds=time.perf_counter() - started)
