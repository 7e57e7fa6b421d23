"""What a learning forward pass captures: the next-token pairs of hidden states, and every middle layer's pairs
gathered for one update of the shared MemoryBank.

A pair (t, t+1) is learned only where both tokens are real (`pair_mask = mask[:, :-1] & mask[:, 1:]`, which works for
left and right padding). Its key is the state at t; its value is the state at t+1 (middle layers) or another tensor
aligned with t+1 (the paper's output layer: the next token's input embedding). Non-pairs are zeroed, never left as
they are: padding positions may hold anything, even NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .bank import MemoryBank

# A middle layer's token scorer: (keys [..., d], values [..., d]) -> scores [...] float32 (docs/design.md §6.5).
Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def next_token_pairs(
    hidden: torch.Tensor,
    pair_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [B, T-1, ·]: keys hidden[:, :-1] and values hidden[:, 1:] (or `values` [B, T-1, d_v] when given)
    of hidden [B, T, d], zero where pair_mask [B, T-1] (bool) is False.

    out: buffers (keys [B, T-1, d], values [B, T-1, d_v]) to write into instead of allocating; they keep their dtype.
    """
    keep = pair_mask.unsqueeze(-1)
    following = hidden[:, 1:] if values is None else values
    if out is None:
        return (torch.where(keep, hidden[:, :-1], hidden.new_zeros(())),
                torch.where(keep, following, following.new_zeros(())))  # fmt: skip
    for buffer, source in zip(out, (hidden[:, :-1], following), strict=True):
        if source.dtype == buffer.dtype:
            torch.where(keep, source, source.new_zeros(()), out=buffer)
        else:  # a model whose blocks change dtype: the buffers keep the first layer's
            buffer.copy_(torch.where(keep, source, source.new_zeros(())))
    return out


def scored_cross(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, *, batch_dims: int = 0
) -> torch.Tensor:
    """T = Kᵀ diag(s) V float64, differentiable in the scores (readout training), over every row of keys [*B, ..., dk],
    values [*B, ..., dv] and scores [*B, ...], where *B are the first `batch_dims` dims (e.g. 1: one T per memory
    layer). Returns [*B, dk, dv].

    Non-pairs must be zero rows (as `next_token_pairs` makes them): they add nothing, so no boolean indexing and no
    host synchronisation are needed.
    """
    lead = keys.shape[:batch_dims]
    k = keys.reshape(*lead, -1, keys.shape[-1]).to(torch.float64)
    v = values.reshape(*lead, -1, values.shape[-1]).to(torch.float64)
    s = scores.reshape(*lead, -1, 1).to(torch.float64)
    return k.mT @ (s * v)


class BankCapture:
    """The rows of every middle layer in one learning forward pass, gathered for one bank update.

    The block hooks call `add` with each layer's block input; keys and values are written into buffers [L, B, T-1, d]
    (the hidden states' dtype) with non-pairs zeroed, and the scores [B, T-1] float32 are kept per slot. `update` then
    adds all layers with one `bank.update` (one Gram accumulation). A slot whose hook did not run learns nothing.

    Args:
        scorers: per slot of the bank, the layer's token scorer or None (no scores).
        pair_mask: [B, T-1] bool, True where tokens t and t+1 are both real.
        differentiable: keep the scores' graph to the scorers (readout training).
        workspace: buffers of a previous capture to reuse when their shape, dtype and device fit (a learning run
            allocates them once instead of once per batch); never reused when differentiable.
    """

    def __init__(
        self,
        scorers: Sequence[Scorer | None],
        pair_mask: torch.Tensor,
        differentiable: bool,
        workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.scorers = list(scorers)
        self.pair_mask = pair_mask
        self.differentiable = differentiable
        self.workspace = None if differentiable else workspace
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.scores: list[torch.Tensor | None] = [None] * len(self.scorers)
        self.seen = [False] * len(self.scorers)

    def _buffers(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:  # set together
            shape = (len(self.scorers), hidden.shape[0], hidden.shape[1] - 1, hidden.shape[2])
            reuse = self.workspace
            if (
                reuse is not None
                and reuse[0].shape == shape
                and reuse[0].dtype == hidden.dtype
                and (reuse[0].device == hidden.device)
            ):
                self.keys, self.values = reuse
            else:
                self.keys = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
                self.values = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
        return self.keys, self.values

    def add(self, slot: int, hidden: torch.Tensor) -> None:
        """Capture layer `slot`'s pairs from its block input hidden [B, T, d]."""
        keys, values = self._buffers(hidden)
        # The scorer and the readout-training T see finite rows; the bank update still masks non-pairs out of S, T, N.
        next_token_pairs(hidden, self.pair_mask, out=(keys[slot], values[slot]))
        scorer = self.scorers[slot]
        if scorer is not None:
            with torch.set_grad_enabled(self.differentiable):
                self.scores[slot] = scorer(keys[slot], values[slot])
        self.seen[slot] = True

    def update(self, bank: MemoryBank) -> torch.Tensor | None:
        """Add every captured layer to `bank` in one update. Returns the step's T [L, dk, dv] float64 with the graph
        to the scorers when differentiable (else None)."""
        if self.keys is None or self.values is None:  # no block hook ran (e.g. FAAST disabled mid-pass): no rows
            return None
        keys, values = self.keys, self.values
        slots = len(self.scorers)
        mask = self.pair_mask.unsqueeze(0).expand(slots, *self.pair_mask.shape)
        if not all(self.seen):
            missing = torch.tensor([not s for s in self.seen], device=mask.device)
            mask = mask & ~missing.view(-1, 1, 1)
            for slot, seen in enumerate(self.seen):
                if not seen:
                    keys[slot].zero_()
                    values[slot].zero_()
        scores = None
        if any(s is not None for s in self.scores):
            scores = torch.stack(
                [s if s is not None else keys.new_zeros(keys.shape[1:3], dtype=torch.float32) for s in self.scores]
            )
        bank.update(keys, values, None if scores is None else scores.detach(), mask=mask)
        if not (self.differentiable and scores is not None and scores.requires_grad):
            return None
        return scored_cross(keys, values, scores, batch_dims=1)

    def release(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers, for the next capture to reuse (None when they must not be reused)."""
        if self.differentiable or self.keys is None or self.values is None:
            return None
        return self.keys, self.values
