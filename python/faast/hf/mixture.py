"""The probability-space read of the residual output layer: the log of a mixture of two softmaxes, elementwise over
[n, V] logits (docs/design.md §6.3). faast/hf/output.py reads one memory with it, faast/hf/rows.py a memory per row.

The elementwise mixture is faast.ops' (python/faast/ops/mixture.py). On a CPU it runs in small blocks of rows that stay
in cache, writing into buffers allocated once per read; on a GPU each block of READ_CHUNK rows goes through
faast.ops.mix_probabilities, whose dispatch times the torch composition against faast_kernels' fused kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch

from .. import ops
from ..ops.mixture import Workspace, mixture_from_sum, mixture_logits


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
    overwrite: bool = False,
) -> torch.Tensor:
    """The probability-space read of n positions: logits [n, V] (the head's output, divided by `scale`) and the
    correction's projection projected [n, d] (key·M) -> log((1 − λ)·softmax(z) + λ·softmax(z + dz)) / scale [n, V]
    in logits' dtype, z = logits·scale, dz = projected·weightᵀ (weight [V, d], the head's, in the products' dtype).

    λ as mixture_logits takes it (numbers, or [n, 1] tensors); full: True, or [n] bool rows, where λ = 1 (the
    corrected prediction alone); keep: [n] bool rows that keep their logits exactly (they read nothing). One head GEMM
    per `chunk` positions, the elementwise mixture per `block` positions (small blocks stay in a CPU's cache).
    Differentiable when the inputs require grad; otherwise it writes into buffers allocated once. overwrite: the
    caller owns `logits` (a head's fresh output) and lets a no-grad CPU read write the mixture into it when it has
    the compute dtype and is contiguous (each block's logits are read before they are overwritten): a fresh [n, V]
    float32 result is page-faulted in on every read (0.13 s for 2,048 × 49,152 on 2 AMD EPYC cores), the head's
    output already is.
    """
    grad = torch.is_grad_enabled() and (projected.requires_grad or logits.requires_grad)
    # The keywords the three reads share (each typed by the read it goes to).
    options: dict[str, Any] = {
        "scale": scale,
        "log_odds": log_odds,
        "log_rest": log_rest,
        "full": full,
        "keep": keep,
        "chunk": chunk,
    }
    if grad:
        return _read_differentiable(projected, logits, weight, compute=compute, block=block, **options)
    if logits.device.type != "cpu":
        return _read_chunks(projected, logits, weight, **options)
    return _read_cpu(projected, logits, weight, compute=compute, block=block, overwrite=overwrite, **options)


def _blocks(
    logits: torch.Tensor,
    chunk_values: torch.Tensor,
    start: int,
    block: int,
    compute: torch.dtype,
    scale: float,
    weights: tuple[float | torch.Tensor, float | torch.Tensor],
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor, list]]:
    """The blocks of `block` rows of the chunk that starts at row `start` (chunk_values: its [m, V] dz, or z·s + dz):
    (their rows, their rows of chunk_values, their logits in the compute dtype, z = those logits·scale, (log-odds,
    log(1 − λ)) picked for their rows where they are per-row tensors)."""
    for j in range(start, start + chunk_values.shape[0], block):
        rows = slice(j, min(j + block, start + chunk_values.shape[0]))
        given = logits[rows].to(compute)
        pick = [t[rows] if isinstance(t, torch.Tensor) and t.dim() else t for t in weights]
        yield (
            rows,
            chunk_values[rows.start - start : rows.stop - start],
            given,
            given * scale if scale != 1.0 else given,
            pick,
        )


def _read_differentiable(
    projected: torch.Tensor,
    logits: torch.Tensor,
    weight: torch.Tensor,
    *,
    compute: torch.dtype,
    scale: float,
    log_odds: float | torch.Tensor,
    log_rest: float | torch.Tensor,
    full: bool | torch.Tensor,
    keep: torch.Tensor | None,
    chunk: int,
    block: int,
) -> torch.Tensor:
    """read_blocks with autograd: out-of-place blocks, concatenated."""
    parts = []
    for i in range(0, logits.shape[0], chunk):
        dz = (projected[i : i + chunk].to(weight.dtype) @ weight.T).to(compute)
        for rows, d, given, z, pick in _blocks(logits, dz, i, block, compute, scale, (log_odds, log_rest)):
            mixed = torch.log_softmax(z + d, -1) if full is True else mixture_logits(z, d, *pick)
            if isinstance(full, torch.Tensor):
                mixed = torch.where(full[rows][:, None], torch.log_softmax(z + d, -1), mixed)
            mixed = mixed / scale if scale != 1.0 else mixed
            if keep is not None:
                mixed = torch.where(keep[rows][:, None], given, mixed)
            parts.append(mixed.to(logits.dtype))
    return torch.cat(parts)


def _read_cpu(
    projected: torch.Tensor,
    logits: torch.Tensor,
    weight: torch.Tensor,
    *,
    compute: torch.dtype,
    scale: float,
    log_odds: float | torch.Tensor,
    log_rest: float | torch.Tensor,
    full: bool | torch.Tensor,
    keep: torch.Tensor | None,
    chunk: int,
    block: int,
    overwrite: bool,
) -> torch.Tensor:
    """read_blocks without a gradient on a CPU. Per `chunk` rows one GEMM adds the head's product onto the scaled
    logits (z·s + dz, no separate add pass); per `block` rows the mixture, written into the result (the logits
    themselves when `overwrite` allows: each block's logits are read before they are overwritten, and rows to keep
    are mixed into scratch first)."""
    n = logits.shape[0]
    in_place = overwrite and logits.dtype == compute and logits.is_contiguous()
    result = logits if in_place else torch.empty(logits.shape, dtype=compute, device=logits.device)
    workspace = Workspace(min(block, n), result)
    held = torch.empty_like(result[: min(block, n)]) if in_place and keep is not None else None
    fused = weight.dtype == compute
    products = torch.empty((min(chunk, n), weight.shape[0]), dtype=compute) if fused else None
    for i in range(0, n, chunk):
        rows_p = projected[i : i + chunk].to(weight.dtype)
        rows_z = logits[i : i + rows_p.shape[0]]
        if products is not None:
            summed = torch.addmm(rows_z.to(compute), rows_p, weight.T, beta=scale, out=products[: rows_p.shape[0]])
        else:  # a 16-bit head: its product upcast, then the logits added in their own dtype (no chunk-sized copy)
            summed = (rows_p @ weight.T).to(compute).add_(rows_z, alpha=scale)
        for rows, zz, given, z, pick in _blocks(logits, summed, i, block, compute, scale, (log_odds, log_rest)):
            target = held[: zz.shape[0]] if held is not None else result[rows]
            if full is True:
                mixed = torch.ops.aten._log_softmax.out(zz, -1, False, out=target)
            else:
                mixed = mixture_from_sum(z, zz, *pick, out=target, workspace=workspace)
            if isinstance(full, torch.Tensor):
                mixed = torch.where(full[rows][:, None], torch.log_softmax(zz, -1), mixed, out=target)
            if scale != 1.0:
                mixed.div_(scale)
            if keep is not None:  # else the mixture was written in its place already
                torch.where(keep[rows][:, None], given, mixed, out=result[rows])
    return result.to(logits.dtype)


def _per_row(value: float | torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    """A number, or [n] / [n, 1] values, as an [n] tensor: float64 for float64 logits `like`, else float32."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    if isinstance(value, torch.Tensor) and value.dim():
        return value.reshape(n).to(dtype)
    return torch.full((n,), float(value), dtype=dtype, device=like.device)


def _read_chunks(
    projected: torch.Tensor,
    logits: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: float,
    log_odds: float | torch.Tensor,
    log_rest: float | torch.Tensor,
    full: bool | torch.Tensor,
    keep: torch.Tensor | None,
    chunk: int,
) -> torch.Tensor:
    """read_blocks without a gradient on a GPU: per `chunk` rows one head GEMM in the products' dtype, then the
    mixture through faast.ops.mix_probabilities (its dispatch picks the torch composition or the fused kernel), written
    straight into the [n, V] result in logits' dtype; a single chunk's mixture (a generated token, a short prompt) is
    the result itself, with no [n, V] copy."""
    n = logits.shape[0]
    odds, rest = _per_row(log_odds, n, logits), _per_row(log_rest, n, logits)
    if isinstance(full, torch.Tensor):
        flags: torch.Tensor | None = full.reshape(n)
    else:
        flags = torch.ones(n, dtype=torch.bool, device=logits.device) if full else None
    out = None if 0 < n <= chunk else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    for i in range(0, n, chunk):
        rows = slice(i, min(i + chunk, n))
        dz = projected[rows].to(weight.dtype) @ weight.T
        part = flags[rows] if flags is not None else None
        mixed = ops.mix_probabilities(logits[rows], dz, odds[rows], rest[rows], part, scale)
        if keep is not None:
            mixed = torch.where(keep[rows][:, None], logits[rows], mixed)
        if out is None:
            return mixed
        out[rows] = mixed
    return cast(torch.Tensor, out)  # None only while 0 < n <= chunk, and then the first block returned
