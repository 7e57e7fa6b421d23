"""float64 statistics from their definitions: the oracle every accumulation test compares against."""

from __future__ import annotations

import torch

F64 = torch.float64


def statistics64(keys, values, scores=None, mask=None, *, wls=False):
    """(S, T, count, sum of squared targets) in float64 over the rows where mask is True (all rows if None).

    Scores weight the values (S = K^T K, T = K^T diag(s) V, targets s v), or whole rows with wls
    (S = K^T diag(s) K, T = K^T diag(s) V, squared targets s ||v||^2). Differentiable in every input.
    """
    k, v = keys.to(F64), values.to(F64)
    w = torch.ones(k.shape[:-1], dtype=F64) if scores is None else scores.to(F64)
    if mask is None:
        mask = torch.ones(k.shape[:-1], dtype=torch.bool)
    # where, not multiplication: a NaN in an excluded row must not leak (NaN * 0 = NaN).
    k = torch.where(mask.unsqueeze(-1), k, 0.0)
    v = torch.where(mask.unsqueeze(-1), v, 0.0)
    w = torch.where(mask, w, 0.0)
    count = mask.sum(-1).to(F64)
    if wls:
        wk = w.unsqueeze(-1) * k
        return k.mT @ wk, wk.mT @ v, count, (w * v.square().sum(-1)).sum(-1)
    wv = w.unsqueeze(-1) * v
    return k.mT @ k, k.mT @ wv, count, wv.square().sum((-2, -1))
