"""Key spectra from docs/numerics.md §1, which separate a float64-faithful streaming path from the failure modes.

Keys are drawn in float64 and rounded to float32 (what a model hands us); values are V = K·A + 0.5·std·noise.
"""

from __future__ import annotations

import math

import torch

SPECTRA = ("gauss", "pow1o", "pow2o", "dup_gauss", "dup_pow1o", "ln_gauss", "lowN_pow1o")
RANK_DEFICIENT = ("dup_gauss", "dup_pow1o", "ln_gauss", "lowN_pow1o")


def _power_law_with_outliers(n: int, d: int, power: float, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    sigma = torch.arange(1, d + 1, dtype=torch.float64).pow(-power)
    bulk = torch.randn(n, d, generator=g, dtype=torch.float64) * sigma @ q.T
    rms = bulk.pow(2).mean().sqrt()
    # Three axis-aligned outlier coordinates with a mean of ±100x the bulk RMS, like GPT-2's residual stream.
    for j, sign in zip(range(3), (1, -1, 1), strict=False):
        bulk[:, j] += sign * 100 * rms * (1 + 0.25 * torch.randn(n, generator=g, dtype=torch.float64))
    return bulk


def make_keys(kind: str, n: int, d: int, seed: int = 0, n_test: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(train keys [n, d], held-out keys [n_test, d]) float32, drawn together so they share one distribution (the
    same rotation, outliers and duplicated base rows). lowN_pow1o ignores n and uses n = d // 2."""
    g = torch.Generator().manual_seed(seed)
    if kind == "lowN_pow1o":
        n = d // 2
    total = n + n_test
    if kind == "gauss":
        k = torch.randn(total, d, generator=g, dtype=torch.float64)
    elif kind in ("pow1o", "lowN_pow1o"):
        k = _power_law_with_outliers(total, d, 1.0, g)
    elif kind == "pow2o":
        k = _power_law_with_outliers(total, d, 2.0, g)
    elif kind in ("dup_gauss", "dup_pow1o"):
        unique = d // 2
        base = (
            torch.randn(unique, d, generator=g, dtype=torch.float64)
            if kind == "dup_gauss"
            else _power_law_with_outliers(unique, d, 1.0, g)
        )
        k = base[torch.randint(unique, (total,), generator=g)]
    elif kind == "ln_gauss":
        k = torch.nn.functional.layer_norm(torch.randn(total, d, generator=g, dtype=torch.float64), (d,))
    else:
        raise ValueError(kind)
    k = k.to(torch.float32)
    return k[:n], k[n:]


def make_values(keys: torch.Tensor, dv: int, seed: int = 1) -> torch.Tensor:
    """V = K·A + 0.5·std(K·A)·noise, A ~ N(0, 1/d); float32 like the keys."""
    g = torch.Generator().manual_seed(seed)
    k = keys.to(torch.float64)
    a = torch.randn(k.shape[-1], dv, generator=g, dtype=torch.float64) / math.sqrt(k.shape[-1])
    clean = k @ a
    noise = torch.randn(clean.shape, generator=g, dtype=torch.float64)
    return (clean + 0.5 * clean.std() * noise).to(torch.float32)


def truth(keys: torch.Tensor, values: torch.Tensor, eps: float) -> tuple[torch.Tensor, int]:
    """float64 SVD pseudo-inverse with the strict cut σ > eps·σmax: (W [d, dv], kept rank)."""
    k, v = keys.to(torch.float64), values.to(torch.float64)
    u, s, vh = torch.linalg.svd(k, full_matrices=False)
    keep = s > eps * s[0]
    w = vh[keep].T @ ((u[:, keep].T @ v) / s[keep].unsqueeze(-1))
    return w, int(keep.sum())
