"""The probability-space mixture of a residual output memory, elementwise over [n, V] logits: the log of a mixture of
two softmaxes (docs/design.md §6.3), in torch. faast/hf/mixture.py reads a memory with it block by block; the op
`faast.ops.mix_probabilities` runs one block of rows through the dispatch (this torch composition, or faast_kernels'
fused kernel where it measures faster).

On a CPU these [n, V] passes, not the head's GEMM, were most of a read's cost, and most of that was allocating:
every fresh [32, V] temporary (6 MB at V = 49K) is a new mapping the kernel faults in page by page. So the no-grad
path writes into buffers the caller allocates once per read (`Workspace`) and reuses block after block.
"""

from __future__ import annotations

import torch


class Workspace:
    """Scratch buffers for mixture_logits: one [rows, V] block reused by every block of a read (a shorter last block
    uses a slice)."""

    def __init__(self, rows: int, like: torch.Tensor) -> None:
        self.scratch = torch.empty((rows, like.shape[-1]), dtype=like.dtype, device=like.device)

    def take(self, rows: int) -> torch.Tensor:
        return self.scratch[:rows]


def _logsumexp_into(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim [n, 1] of x [n, V], using scratch [n, V] (overwritten) instead of temporaries."""
    top = x.amax(-1, keepdim=True)
    top.masked_fill_(~torch.isfinite(top), 0.0)  # a row of -inf (or inf) keeps torch.logsumexp's answer
    return torch.sub(x, top, out=scratch).exp_().sum(-1, keepdim=True).log_().add_(top)


def mixture_logits(
    z: torch.Tensor,
    dz: torch.Tensor,
    log_odds: float | torch.Tensor,
    log_rest: float | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """log((1 − λ)·softmax(z) + λ·softmax(z + dz)) [n, V] for logits z and their change dz [n, V] (left unchanged),
    with λ in (0, 1) given as log(λ / (1 − λ)) and log(1 − λ): numbers, or [n, 1] tensors (a λ per row).

    Computed as log p0 + log(1 − λ) + softplus(dz − c + log(λ / (1 − λ))), c = lse(z + dz) − lse(z): stable
    (softplus is linear above 20) and one transcendental pass instead of two log-softmaxes and a logaddexp.
    out: where to write the result ([n, V], z's dtype); workspace: reused scratch (both: no-grad reads only).
    """
    if torch.is_grad_enabled() and (z.requires_grad or dz.requires_grad):  # autograd needs every temporary intact
        lse0 = torch.logsumexp(z, -1, keepdim=True)
        shift = torch.logsumexp(z + dz, -1, keepdim=True) - lse0 - log_odds
        return torch.nn.functional.softplus(dz - shift) + (z - lse0) + log_rest
    scratch = (workspace or Workspace(z.shape[0], z)).take(z.shape[0])
    out = torch.empty_like(z) if out is None else out
    lse0 = _logsumexp_into(z, scratch)
    shift = _logsumexp_into(torch.add(z, dz, out=out), scratch).sub_(lse0).sub_(log_odds)
    torch.ops.aten.softplus.out(torch.sub(dz, shift, out=scratch), 1, 20, out=out)
    return out.add_(z).sub_(lse0.sub_(log_rest))


def mix_probabilities_torch(
    z: torch.Tensor,
    dz: torch.Tensor,
    log_odds: torch.Tensor,
    log_rest: torch.Tensor,
    full: torch.Tensor | None,
    scale: float = 1.0,
) -> torch.Tensor:
    """The torch backend of faast.ops.mix_probabilities: log((1 − λ)·softmax(z·s) + λ·softmax(z·s + dz)) / s [n, V]
    in z's dtype, computed in float32 (float64 for float64 z), for z, dz [n, V], log_odds = log(λ / (1 − λ)) and
    log_rest = log(1 − λ) [n], and full [n] bool rows (None: none) read as log_softmax(z·s + dz) / s (λ = 1). No
    gradient."""
    compute = torch.float64 if z.dtype == torch.float64 else torch.float32
    a = z.to(compute)
    a = a * scale if scale != 1.0 else a
    d = dz.to(compute)
    out = torch.empty_like(a)
    mixed = mixture_logits(a, d, log_odds.to(compute)[:, None], log_rest.to(compute)[:, None], out=out)
    if full is not None:
        mixed = torch.where(full[:, None], torch.log_softmax(a + d, -1), mixed)
    mixed = mixed / scale if scale != 1.0 else mixed
    return mixed.to(z.dtype)
