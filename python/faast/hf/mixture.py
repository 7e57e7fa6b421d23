"""The probability-space read of the residual output layer: the log of a mixture of two softmaxes, elementwise over
[n, V] logits (docs/design.md §6.3). faast/hf/output.py reads one memory with it, faast/hf/rows.py a memory per row."""

from __future__ import annotations

import torch


def mixture_logits(
    z: torch.Tensor, dz: torch.Tensor, log_odds: float | torch.Tensor, log_rest: float | torch.Tensor
) -> torch.Tensor:
    """log((1 − λ)·softmax(z) + λ·softmax(z + dz)) [n, V] for logits z and their change dz [n, V] (left unchanged),
    with λ in (0, 1) given as log(λ / (1 − λ)) and log(1 − λ): numbers, or [n, 1] tensors (a λ per row).

    Computed as log p0 + log(1 − λ) + softplus(dz − c + log(λ / (1 − λ))), c = lse(z + dz) − lse(z): stable
    (softplus is linear above 20) and one transcendental pass instead of two log-softmaxes and a logaddexp.
    """
    lse0 = torch.logsumexp(z, -1, keepdim=True)
    if torch.is_grad_enabled() and (z.requires_grad or dz.requires_grad):  # autograd needs every temporary intact
        shift = torch.logsumexp(z + dz, -1, keepdim=True) - lse0 - log_odds
        return torch.nn.functional.softplus(dz - shift) + (z - lse0) + log_rest
    # One temporary, reused in place: on a CPU these [n, V] passes, not the head's GEMM, are most of a read's cost,
    # and this halves them (docs/serving.md).
    t = torch.add(z, dz)
    shift = torch.logsumexp(t, -1, keepdim=True).sub_(lse0).sub_(log_odds)
    out = torch.nn.functional.softplus(torch.sub(dz, shift, out=t))
    return out.add_(z).sub_(lse0.sub_(log_rest))
