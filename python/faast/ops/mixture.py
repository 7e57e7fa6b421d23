"""The probability-space mixture of a residual output memory, elementwise over [n, V] logits: the log of a mixture of
two softmaxes (docs/design.md §6.3), in torch. faast/hf/mixture.py reads a memory with it block by block; the op
`faast.ops.mix_probabilities` runs one block of rows through the dispatch (this torch composition, or faast_kernels'
fused kernel where it measures faster).

On a CPU these [n, V] passes cost about half of what the head's GEMM for the change does, and a fresh [32, V]
temporary (6 MB at V = 49K) is a new mapping the kernel faults in page by page. So the no-grad path writes into
buffers the caller allocates once per read (`Workspace`) and reuses block after block, and uses torch's fused
log-softmax kernel, which reads each row while it is in cache.
"""

from __future__ import annotations

import torch


class Workspace:
    """Scratch buffers for mixture_logits: two [rows, V] blocks reused by every block of a read (a shorter last block
    uses slices)."""

    def __init__(self, rows: int, like: torch.Tensor) -> None:
        self.scratch = torch.empty((2, rows, like.shape[-1]), dtype=like.dtype, device=like.device)

    def take(self, rows: int) -> torch.Tensor:
        """The first scratch block's first `rows` rows."""
        return self.scratch[0, :rows]

    def take_pair(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both scratch blocks' first `rows` rows."""
        return self.scratch[0, :rows], self.scratch[1, :rows]


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

    Computed as log(1 − λ) + logaddexp(log p0, log p1 + log(λ / (1 − λ))) with p0 = softmax(z), p1 = softmax(z + dz):
    stable for tokens far below a row's maximum (no probability is formed), and without a gradient each log-softmax
    is one fused kernel that keeps a row in cache while it finds the maximum, sums and writes. Written as
    log p0 + log(1 − λ) + softplus(dz − lse(z + dz) + lse(z) + log(λ / (1 − λ))) from amax/sub/exp/sum passes it read
    [n, V] about twice as often: 649 against 538 ms for 2,048 × 49,152 float32 logits on 2 AMD EPYC cores.
    out: where to write the result ([n, V], z's dtype, not z or dz); workspace: reused scratch (both: no-grad reads
    only).
    """
    if torch.is_grad_enabled() and (z.requires_grad or dz.requires_grad):  # autograd needs every temporary intact
        lse0 = torch.logsumexp(z, -1, keepdim=True)
        shift = torch.logsumexp(z + dz, -1, keepdim=True) - lse0 - log_odds
        return torch.nn.functional.softplus(dz - shift) + (z - lse0) + log_rest
    out = torch.empty_like(z) if out is None else out
    return mixture_from_sum(z, torch.add(z, dz, out=out), log_odds, log_rest, out=out, workspace=workspace)


def mixture_from_sum(
    z: torch.Tensor,
    summed: torch.Tensor,
    log_odds: float | torch.Tensor,
    log_rest: float | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """mixture_logits without a gradient, given summed = z + dz [n, V] (e.g. from one GEMM that adds the head's
    product onto the logits) instead of dz: log((1 − λ)·softmax(z) + λ·softmax(summed)) [n, V].

    out may be z or summed themselves (each is read once, before anything is written); workspace: reused scratch.
    """
    first, second = (workspace or Workspace(z.shape[0], z)).take_pair(z.shape[0])
    out = torch.empty_like(z) if out is None else out
    log_softmax = torch.ops.aten._log_softmax.out
    log_softmax(z, -1, False, out=first)  # log p0
    log_softmax(summed, -1, False, out=second)  # log p1
    return torch.logaddexp(first, second.add_(log_odds), out=out).add_(log_rest)


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
