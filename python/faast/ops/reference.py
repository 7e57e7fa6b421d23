"""Pure-torch backend of faast.ops.

It runs on any device, is the CPU path, and is the oracle the Triton and CUDA backends are tested against. Inputs
arrive validated and flattened to one leading batch dim by faast.ops; nothing here checks arguments.

Accumulation streams the rows through one reusable buffer X = [K | s*V] (upcast to float64), adds K^T (sV) into T
and K[:, block]^T K[:, block:] into S for column blocks of K: the blocks on and above S's diagonal, mirrored at the
end, with ~13/16 of the flops of two full GEMMs, at close to the float64 GEMM peak. lab/benchmarks/results/
learn_cpu.md has the measured cost against the authors' float32 pinv of K; docs/numerics.md §3 has the cost model.
"""

from __future__ import annotations

import torch

# Column blocks of about this width: narrower blocks skip more of the lower triangle, but below ~128 columns the
# GEMMs lose efficiency. 192 measured best at d = 768 on CPU.
_TRIANGLE_BLOCK = 192
# Rows per chunk are chosen so the float64 buffer stays near this size. Below glibc's 32 MB mmap ceiling the buffer
# freed by one update is reused by the next from the heap; a 48 MB buffer was mmap'ed and page-faulted afresh on
# every update (~15% of a 64k x 768 learn). 16 MB chunks still keep the GEMMs at full speed (>= 1300 rows at d=768).
_CHUNK_BYTES = 16 << 20
# On a GPU there is no heap to fragment and GEMMs need long inner dimensions to reach the float64 peak: 16 MB chunks
# gave ~64-row GEMMs for 48 layers at d = 1600 (11 TFLOP/s on an H100, lab/benchmarks/results/gpu_h100_run1.md).
_CHUNK_BYTES_CUDA = 1 << 30
# docs/numerics.md §1: float32 GEMMs over more than ~4096 rows lose the directions the spectral filter must keep.
FLOAT32_MAX_CHUNK_ROWS = 4096


def triangle_blocks(dim: int) -> list[tuple[int, int]]:
    """Column ranges [a0, a1) that tile 0..dim, about _TRIANGLE_BLOCK wide."""
    count = max(1, round(dim / _TRIANGLE_BLOCK))
    edges = [round(i * dim / count) for i in range(count + 1)]
    return [(edges[i], edges[i + 1]) for i in range(count) if edges[i + 1] > edges[i]]


def chunk_rows(batch: int, width: int, dtype: torch.dtype, rows: int, device: torch.device | None = None) -> int:
    itemsize = torch.finfo(dtype).bits // 8
    budget = _CHUNK_BYTES_CUDA if device is not None and device.type == "cuda" else _CHUNK_BYTES
    target = max(64, budget // max(1, batch * width * itemsize))
    if dtype == torch.float32:
        target = min(target, FLOAT32_MAX_CHUNK_ROWS)
    target = max(1, min(rows, target))
    # Equal chunks within the budget: 4,096 rows in 1,365-row chunks left a 1-row chunk of small, slow GEMMs.
    return -(-rows // -(-rows // target)) if rows else target


def _masked_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # masked_fill, not multiplication: a NaN in a masked-out row must not survive (NaN * 0 = NaN).
    return x if mask is None else x.masked_fill(~mask.unsqueeze(-1), 0)


def accumulate_gram_differentiable(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    weighted_least_squares: bool,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Out-of-place version of accumulate_gram_streaming, used when a gradient must flow to keys, values or scores.

    Shapes: keys [B, N, dk], values [B, N, dv], scores/mask [B, N]. Returns (dS [B, dk, dk], dT [B, dk, dv],
    dyy [B]) in compute_dtype, where dyy = sum of squared targets (see accumulate_gram_streaming).
    """
    k = _masked_rows(keys.to(compute_dtype), mask)
    v = _masked_rows(values.to(compute_dtype), mask)
    if scores is None:
        return k.mT @ k, k.mT @ v, v.square().sum((-2, -1))
    w = scores.to(compute_dtype)
    if mask is not None:
        w = w.masked_fill(~mask, 0)
    if weighted_least_squares:
        # S = K^T diag(w) K without sqrt(w): d sqrt(w)/dw is infinite at w = 0.
        wk = k * w.unsqueeze(-1)
        return k.mT @ wk, wk.mT @ v, (w * v.square().sum(-1)).sum(-1)
    wv = v * w.unsqueeze(-1)
    return k.mT @ k, k.mT @ wv, wv.square().sum((-2, -1))


def accumulate_gram_streaming(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    weighted_least_squares: bool,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of one batch of rows, without autograd.

    Shapes: keys [B, N, dk], values [B, N, dv] (any float dtype, any strides), scores [B, N] or None, mask [B, N]
    bool or None (False rows contribute nothing). Returns float64 (dS [B, dk, dk] symmetric, dT [B, dk, dv], dyy [B]):

    * scores weight values only (the authors' semantics): dS = K^T K, dT = K^T diag(s) V, dyy = sum ||s_n v_n||^2;
    * weighted_least_squares: dS = K^T diag(s) K, dT = K^T diag(s) V, dyy = sum s_n ||v_n||^2.

    dyy is the squared norm of the regression targets, which generalized cross-validation needs.
    compute_dtype float64 gives exact products and a float64 sum (the default); float32 computes each chunk of at most
    4096 rows in float32 and sums the chunks in float64 (faster, but see docs/numerics.md before trusting it).
    """
    batch, rows, dk = keys.shape
    dv = values.shape[-1]
    width = dk + dv
    device = keys.device
    f64 = torch.float64
    # S and T are written in place by column block, so nothing is copied or symmetrised through temporaries at the
    # end (those copies were ~4% of a 64k x 768 learn on 2 cores).
    gram = torch.zeros((batch, dk, dk), dtype=f64, device=device)
    cross = torch.zeros((batch, dk, dv), dtype=f64, device=device)
    dyy = torch.zeros((batch,), dtype=f64, device=device)
    step = chunk_rows(batch, width, compute_dtype, rows, device)
    buf = torch.empty((batch, step, width), dtype=compute_dtype, device=device)
    blocks = triangle_blocks(dk)
    exact = compute_dtype == f64
    for start in range(0, rows, step):
        n = min(step, rows - start)
        x = buf[:, :n]
        x[..., :dk].copy_(keys[:, start : start + n])
        x[..., dk:].copy_(values[:, start : start + n])
        if scores is not None:
            w = scores[:, start : start + n].to(compute_dtype).unsqueeze(-1)
            if weighted_least_squares:
                x.mul_(w.sqrt())
            else:
                x[..., dk:].mul_(w)
        if mask is not None:
            x.masked_fill_(~mask[:, start : start + n].unsqueeze(-1), 0)
        k, v = x[..., :dk], x[..., dk:]
        dyy += _float64_sqsum(v, rowwise=device.type != "cpu") if exact else _float64_sqnorm(v)
        _add_product(cross, k.mT, v, exact)
        for a0, a1 in blocks:
            _add_product(gram[:, a0:a1, a0:], k[..., a0:a1].mT, k[..., a0:], exact)
    _mirror_upper(gram, blocks)
    return gram, cross, dyy


def _float64_sqsum(v: torch.Tensor, *, rowwise: bool) -> torch.Tensor:
    """Σ v² per leading index [B] of a float64 [B, n, d] tensor: exact squares and a float64 sum (a norm's square root
    and re-squaring would round twice). A CPU chunk is small and squaring it whole is fastest; a GPU chunk can be a GB,
    so there (rowwise) the squares are reduced row by row instead of materialised."""
    return torch.linalg.vecdot(v, v).sum(-1) if rowwise else v.square().sum((-2, -1))


def _float64_sqnorm(v: torch.Tensor) -> torch.Tensor:
    """Σ v² per leading index [B] of a [B, n, d] tensor, accumulated in float64."""
    return torch.linalg.vector_norm(v, dim=(-2, -1), dtype=torch.float64).square()


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    """out += a @ b for [B, m, k] @ [B, k, n]: in place when exact (float64 throughout), else a float32 product
    added into the float64 out."""
    if exact:
        out.baddbmm_(a, b)
    else:
        out += torch.bmm(a, b)


def _mirror_upper(gram: torch.Tensor, blocks: list[tuple[int, int]]) -> None:
    """Make [B, d, d] symmetric in place from the blocks at and above the diagonal: each diagonal block takes its
    upper triangle's transpose, each block below the diagonal its mirror's (disjoint memory: no temporaries)."""
    for i, (a0, a1) in enumerate(blocks):
        diag = gram[:, a0:a1, a0:a1]
        diag.copy_(diag.triu() + diag.triu(1).mT)
        for b0, b1 in blocks[i + 1 :]:
            gram[:, b0:b1, a0:a1].copy_(gram[:, a0:a1, b0:b1].mT)


def eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of symmetric [B, d, d] matrices in float64 (lower triangle read): (λ ascending, E)."""
    return torch.linalg.eigh(gram.to(torch.float64))


def residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x + x @ m with float32 accumulation (float64 when either input is float64); result in x.dtype.

    x and m in the same 16-bit dtype take one 16-bit addmm (float32 accumulation, one rounding: tensor cores on a
    GPU); otherwise both are upcast."""
    if x.dtype == m.dtype and x.dtype in (torch.float16, torch.bfloat16):
        flat = x.reshape(-1, x.shape[-1])
        return torch.addmm(flat, flat, m).reshape(x.shape)
    compute = torch.float64 if torch.float64 in (x.dtype, m.dtype) else torch.float32
    flat = x.reshape(-1, x.shape[-1]).to(compute)
    return torch.addmm(flat, flat, m.to(compute)).to(x.dtype).reshape(x.shape)
