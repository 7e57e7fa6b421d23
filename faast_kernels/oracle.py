"""What the Gram kernels' torch oracles share (gram.naive_gram, int8_slices.naive_gram_int8), in torch alone: the
rows in float64 with the masked-out ones zeroed, and the GCV statistic ‖Y‖² from them."""

from __future__ import annotations

import torch


def masked_rows(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(K [L, N, dk], V [L, N, dv], s [L, N] or None) in float64, zero in the rows `mask` [L, N] (bool, or None: every
    row counts) leaves out. Zeroed with `where`, not multiplied, so a NaN in a left-out row does not spread."""
    keep = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device) if mask is None else mask.bool()
    k = torch.where(keep[..., None], keys.to(torch.float64), 0.0)
    v = torch.where(keep[..., None], values.to(torch.float64), 0.0)
    s = None if scores is None else torch.where(keep, scores.to(torch.float64), 0.0)
    return k, v, s


def target_sqnorm(v: torch.Tensor, s: torch.Tensor | None, weighted_least_squares: bool) -> torch.Tensor:
    """‖Y‖² [L] float64 of masked_rows' V and s: Σ ‖v‖² unscored, Σ s‖v‖² with weighted least squares, else
    Σ ‖s·v‖²."""
    if s is None:
        return v.square().sum((-2, -1))
    if weighted_least_squares:
        return (s * v.square().sum(-1)).sum(-1)
    return (s[..., None] * v).square().sum((-2, -1))
