"""Held-out perplexity of a causal LM (with or without its fast weights) over fixed token windows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..intervals import wilson_interval  # noqa: F401 - re-exported: faast.hf.evaluate.wilson_interval
from .lm import input_embeddings
from .tokens import pad_rows


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
def perplexity(
    model: nn.Module,
    windows: Sequence[Sequence[int]],
    *,
    batch_size: int = 4,
    context: Sequence[int] = (),
    progress: bool | None = None,
) -> Perplexity:
    """Sum the next-token NLL over every window (right padded in batches; padding is never scored).

    `context` (in-context learning): token ids put before every window. Only the window's own tokens after its
    first are scored, so the scored tokens are the same with and without a context. progress: a bar on stderr with
    tokens/s and the time left from the second batch (None: when stderr is a terminal; faast/hf/progress.py).
    """
    return token_log_probs(model, windows, batch_size=batch_size, context=context, progress=progress).total


@dataclass
class TokenScores:
    """Every scored token of `perplexity`, kept: log_probs [M] float32 (the model's log-probability of each target)
    and targets [M] int64, window by window in order, each window's tokens after its first; total is the
    Perplexity `perplexity` returns (its nll summed batch by batch, so it can differ from -log_probs.sum() in the
    last bits)."""

    log_probs: torch.Tensor
    targets: torch.Tensor
    total: Perplexity


@torch.no_grad()
def token_log_probs(
    model: nn.Module,
    windows: Sequence[Sequence[int]],
    *,
    batch_size: int = 4,
    context: Sequence[int] = (),
    progress: bool | None = None,
) -> TokenScores:
    """`perplexity`, keeping each scored token's log-probability (for mixing with another distribution, or per
    token analysis). Arguments as `perplexity`."""
    import time

    from .progress import Bar, enabled

    if not windows:
        raise ValueError("windows: expected at least one window of >= 2 tokens, got none")
    device = input_embeddings(model).weight.device
    prefix = list(context)
    nll, tokens, kept, targets = 0.0, 0, [], []
    started = time.perf_counter()
    bar, total, done = Bar(enabled(progress), "faast score"), max(1, sum(len(w) for w in windows)), 0
    for start in range(0, len(windows), batch_size):
        rows = [prefix + list(w) for w in windows[start : start + batch_size]]
        ids, mask = pad_rows(rows)
        ids, mask = ids.to(device), mask.long().to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        target = ids[:, 1:]
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        valid[:, : len(prefix)] = False  # the context's tokens and the window's first token are not scored
        logp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)[valid]
        nll -= float(logp.sum())
        tokens += int(valid.sum())
        kept.append(logp.cpu())
        targets.append(target[valid].cpu())
        scored = sum(len(w) for w in windows[start : start + batch_size])
        done += scored
        bar.update(scored, done / total)
    bar.close()
    result = Perplexity(nll=nll, tokens=tokens, seconds=time.perf_counter() - started)
    return TokenScores(log_probs=torch.cat(kept), targets=torch.cat(targets), total=result)


@dataclass
class Prefix:
    """Token ids shared by many prompts (in-context demonstrations) and their key/value cache, computed once."""

    ids: list[int]
    cache: object


@torch.no_grad()
def encode_prefix(model: nn.Module, ids: Sequence[int]) -> Prefix:
    """Run `ids` once and keep the key/value cache, so prompts after it cost only their own tokens."""
    if len(ids) < 1:
        raise ValueError("ids: expected at least one token, got none")
    device = input_embeddings(model).weight.device
    batch = torch.as_tensor([list(ids)], dtype=torch.long, device=device)
    out = model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=True)
    return Prefix(ids=list(ids), cache=out.past_key_values)


@torch.no_grad()
def continuation_log_probs(
    model: nn.Module, prompt: Sequence[int], continuations: Sequence[Sequence[int]], *, prefix: Prefix | None = None
) -> torch.Tensor:
    """log p(continuation | [prefix +] prompt) [len(continuations)] float64: the sum over the continuation's tokens.

    For single-token continuations (" positive" / " negative" with GPT-2 or SmolLM2) this is one forward pass and
    comparing the results is comparing the next-token logits after the prompt, the paper's rule; longer continuations
    are scored token by token. A `prefix` (from encode_prefix) is reused through a copy of its cache.
    """
    import copy

    if len(prompt) < 1:
        raise ValueError("prompt: expected at least one token, got none")
    if not continuations or any(len(c) < 1 for c in continuations):
        raise ValueError("continuations: expected one or more non-empty token lists")
    device = input_embeddings(model).weight.device
    past = len(prefix.ids) if prefix is not None else 0
    # One row per distinct input: prompt + all but the continuation's last token (single tokens share one row).
    inputs = sorted({tuple(prompt) + tuple(c[:-1]) for c in continuations}, key=len)
    logp = {}
    # A cache holds one row, so with a prefix each input runs alone; without one they share a padded batch.
    for rows in [[r] for r in inputs] if prefix is not None else [inputs]:
        ids, mask = pad_rows(rows)
        ids, mask = ids.to(device), mask.long().to(device)
        kwargs: dict[str, object] = {"use_cache": prefix is not None}
        if prefix is not None:
            mask = torch.cat([torch.ones(1, past, dtype=torch.long, device=device), mask], dim=1)
            kwargs["past_key_values"] = copy.deepcopy(prefix.cache)
        logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits.double()
        for i, r in enumerate(rows):
            logp[r] = torch.log_softmax(logits[i, : len(r)], dim=-1).cpu()
    out = torch.zeros(len(continuations), dtype=torch.float64)
    for i, c in enumerate(continuations):
        table = logp[tuple(prompt) + tuple(c[:-1])]
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(c))
        out[i] = table[positions, torch.as_tensor(list(c))].sum()
    return out
