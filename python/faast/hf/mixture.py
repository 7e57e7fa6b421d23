"""The probability-space read of the residual output layer: the log of a mixture of two softmaxes, elementwise over
[n, V] logits (docs/design.md §6.3). faast/hf/output.py reads one memory with it, faast/hf/rows.py a memory per row.

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


def read_blocks(
    projected: torch.Tensor,
    logits: torch.Tensor,
    weight: torch.Tensor,
    *,
    compute: torch.dtype,
    scale: float,
    log_odds: float | torch.Tensor,
    log_rest: float | torch.Tensor,
    full: bool | torch.Tensor = False,
    keep: torch.Tensor | None = None,
    chunk: int,
    block: int,
) -> torch.Tensor:
    """The probability-space read of n positions: logits [n, V] (the head's output, divided by `scale`) and the
    correction's projection projected [n, d] (key·M) -> log((1 − λ)·softmax(z) + λ·softmax(z + dz)) / scale [n, V]
    in logits' dtype, z = logits·scale, dz = projected·weightᵀ (weight [V, d], the head's, in the products' dtype).

    λ as mixture_logits takes it (numbers, or [n, 1] tensors); full: True, or [n] bool rows, where λ = 1 (the
    corrected prediction alone); keep: [n] bool rows that keep their logits exactly (they read nothing). One head GEMM
    per `chunk` positions, the elementwise mixture per `block` positions (small blocks stay in a CPU's cache).
    Differentiable when the inputs require grad; otherwise it writes into buffers allocated once.
    """
    n = logits.shape[0]
    grad = torch.is_grad_enabled() and (projected.requires_grad or logits.requires_grad)
    parts, result, workspace, products = [], None, None, None
    if not grad:
        result = torch.empty(logits.shape, dtype=compute, device=logits.device)
        workspace = Workspace(min(block, n), result)
        if weight.dtype == compute:
            products = torch.empty((min(chunk, n), weight.shape[0]), dtype=compute, device=logits.device)
    for i in range(0, n, chunk):
        rows_p = projected[i : i + chunk].to(weight.dtype)
        if products is not None:
            dz = torch.mm(rows_p, weight.T, out=products[: rows_p.shape[0]])
        else:
            dz = (rows_p @ weight.T).to(compute)
        for j in range(i, i + dz.shape[0], block):
            rows = slice(j, min(j + block, i + dz.shape[0]))
            d = dz[rows.start - i : rows.stop - i]
            z = logits[rows].to(compute)
            z = z * scale if scale != 1.0 else z
            pick = [t[rows] if isinstance(t, torch.Tensor) and t.dim() else t for t in (log_odds, log_rest)]
            out = None if grad else result[rows]
            mixed = (torch.log_softmax(z + d, -1) if full is True
                     else mixture_logits(z, d, *pick, out=out, workspace=workspace))  # fmt: skip
            if isinstance(full, torch.Tensor):
                mixed = torch.where(full[rows][:, None], torch.log_softmax(z + d, -1), mixed)
            mixed = mixed / scale if scale != 1.0 else mixed
            if keep is not None:
                mixed = torch.where(keep[rows][:, None], logits[rows].to(compute), mixed)
            if grad:
                parts.append(mixed.to(logits.dtype))
            elif mixed is not out:
                out.copy_(mixed)
    return torch.cat(parts) if grad else result.to(logits.dtype)
