"""Inputs of the probability-space read (faast/hf/mixture.py read_blocks) shared by its tests: one mixture weight,
λ = 1 for every row, or a λ per row with some rows at λ = 1 and some kept as they are."""

from __future__ import annotations

import math

import torch


def read_case(weights: str, *, n: int, d: int, v: int, seed: int, masked_entry: bool = False) -> tuple:
    """(projected [n, d], logits [n, V], head weight [V, d], options): options hold scale (1.25), log_odds, log_rest,
    full and keep for `weights` in ("one", "full", "per-row"); masked_entry puts one -inf in the logits."""
    g = torch.Generator().manual_seed(seed)
    projected, weight = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    logits = 2 * torch.randn(n, v, generator=g)
    if masked_entry:
        logits[1, 5] = float("-inf")
    keep = None
    if weights == "one":
        odds, rest, full = math.log(0.3 / 0.7), math.log(0.7), False
    elif weights == "full":
        odds, rest, full = 0.0, 0.0, True
    else:
        lam = torch.rand(n, generator=g).clamp(0.05, 0.95)
        odds, rest = torch.log(lam / (1 - lam))[:, None], torch.log1p(-lam)[:, None]
        full, keep = torch.arange(n) % 4 == 1, torch.arange(n) % 5 == 2
    return projected, logits, weight, dict(scale=1.25, log_odds=odds, log_rest=rest, full=full, keep=keep)
