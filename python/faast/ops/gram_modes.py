"""Two alternative torch implementations of accumulate_gram, candidates beside reference.accumulate_gram_streaming.

Both take and return what reference.accumulate_gram_streaming does: keys [B, N, dk], values [B, N, dv], scores /
mask [B, N] or None -> float64 (dS [B, dk, dk], dT [B, dk, dv], dyy [B]), with the same semantics (scores weight
the values; weighted_least_squares weights whole rows; masked rows contribute nothing even when they hold NaN).

* accumulate_gram_exact16: 16-bit keys and values, one 16-bit GEMM with a float32 output per R-row chunk (tensor
  cores on a GPU), each float32 partial flushed into float64. Float32-grade: see its docstring.
* accumulate_gram_syrk: CPU, float64: S through BLAS dsyrk (half the flops of a GEMM), T through dgemm.

The *_unavailable_reason / *_cannot_run / *_gate helpers say why a mode cannot run, or why `auto` must not pick it,
in the form faast.ops._dispatch takes.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .reference import _masked_rows, chunk_rows

# Rows summed in float32 before each float64 flush, chosen with lab/benchmarks/fidelity_triton_modes.py
# (lab/benchmarks/results/fidelity_torch_modes_cpu.md, CPU emulation): no R passes the whole float64 suite (26 cases:
# R = 16 23, 64 18, 256 / 1024 / 4096 15 each; the float32 compute mode 13). Shorter flushes buy no grade from
# R = 256 up and cost launches and float64 traffic on a GPU, so R is the longest of the sweep, the float32 compute
# mode's chunk (reference.FLOAT32_MAX_CHUNK_ROWS).
EXACT16_FLUSH_ROWS = 4096
# Several R-row chunks go into one batched GEMM; their float32 partials ([chunks, dk, width]) stay under this size.
_PARTIAL_BYTES = 16 << 20
_PARTIAL_BYTES_CUDA = 512 << 20
# fp16 holds at most 65504: scaled rows are brought to this power of two's range before the split (an exact scaling).
_FP16_TOP = 2.0**14
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------- exact16


@functools.cache
def _native_out_dtype(device_type: str) -> bool:
    """Whether torch has a 16-bit bmm with a float32 output on this device type (aten::bmm.dtype; no CPU kernel)."""
    try:
        a = torch.ones((1, 2, 2), dtype=torch.bfloat16, device=device_type)
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except Exception:  # noqa: BLE001 - no kernel (NotImplementedError), no out_dtype (TypeError), no CUDA build
        return False


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, m, k] @ b [G, k, n], 16-bit inputs, float32 output and accumulation.

    On CUDA one cuBLAS call (tensor cores: exact 16-bit products, float32 sums). Where aten::bmm.dtype has no kernel
    (CPU) the same products on float32 copies (a 16-bit value is exact in float32, and so is the product of two), so
    only the rounding of the float32 sums differs."""
    if _native_out_dtype(a.device.type):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _split16(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, n, c] float32 as hi + lo in dtype times a power of two: (hi, lo, unscale [B, 1, 1] float64).

    hi + lo keeps 16 (bf16) or 22 (fp16) significant bits of each element; unscale * (hi + lo) ≈ x exactly up to that
    rounding. fp16 rows are scaled so the largest element is near 2^14 (no overflow, lo above the subnormals)."""
    if dtype == torch.float16:
        top = x.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        scale = torch.exp2(torch.floor(torch.log2(_FP16_TOP / top)))
        x = x * scale
        unscale = scale.double().reciprocal()
    else:
        unscale = torch.ones((x.shape[0], 1, 1), dtype=torch.float64, device=x.device)
    hi = x.to(dtype)
    lo = (x - hi.float()).to(dtype)
    return hi, lo, unscale


def accumulate_gram_exact16(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    weighted_least_squares: bool,
    compute_dtype: torch.dtype,
    flush_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of 16-bit rows from 16-bit GEMMs with float32 partial sums flushed into float64 every R rows.

    Shapes as reference.accumulate_gram_streaming: keys [B, N, dk] and values [B, N, dv], both bfloat16 or both
    float16; scores / mask [B, N] or None. Returns float64 (dS [B, dk, dk] symmetric, dT [B, dk, dv], dyy [B]).

    Per group of R-row chunks (R = flush_rows, default EXACT16_FLUSH_ROWS) one batched GEMM over the layers and the
    chunks computes Kᵀ [K | V] with 16-bit inputs and a float32 output (one cuBLAS bmm with out_dtype=torch.float32
    on CUDA: tensor-core products are exact, their float32 sums are not); the partials are summed into float64. With
    scores, s·v (and s·k with weighted_least_squares) is no longer a 16-bit number: it is computed in float32 and split
    into two 16-bit terms (hi + lo, ~16 significant bits for bf16, 22 for fp16), so the right operand widens to
    [K | (sV)hi | (sV)lo] (or [(sK)hi | (sK)lo | (sV)hi | (sV)lo]). dyy is computed in float64 from the 16-bit values.

    Grade: float32, whatever compute_dtype says. On a CPU the products run on float32 copies (torch 2.13 has no CPU
    kernel for aten::bmm.dtype) and no R passes the float64 fidelity suite (best: R = 16, 23 of 26 cases; R = 4096:
    15 of 26, the float32 compute mode 13; lab/benchmarks/results/fidelity_torch_modes_cpu.md). On an H100 the tensor
    cores truncate the float32 accumulation and no R passes either (the Triton exact16 kernel, the same arithmetic:
    20/26 at R = 64, 3/26 at R = 4096; lab/benchmarks/results/gpu_h100_run2_triton_fidelity.json). So the mode serves
    compute_dtype=float32 only (exact16_gate). On an H100 (lab/benchmarks/results/gpu_h100_run3.md) it learned a
    48 x 1600 stack's 64K bf16 tokens in 0.508 s against 0.856 s for float64 GEMMs, relative error of S 4.8e-6.

    Raises ValueError naming keys/values when they are not the same 16-bit dtype, or flush_rows when it is not a
    positive int.
    """
    reason = exact16_unavailable_reason(keys.dtype, values.dtype)
    if reason is not None:
        raise ValueError(reason)
    rows_per_flush = EXACT16_FLUSH_ROWS if flush_rows is None else flush_rows
    if isinstance(rows_per_flush, bool) or not isinstance(rows_per_flush, int) or rows_per_flush < 1:
        raise ValueError(f"flush_rows: expected a positive int or None, got {flush_rows!r}")
    batch, rows, dk = keys.shape
    dv = values.shape[-1]
    device, dtype = keys.device, keys.dtype
    w = None if scores is None else scores.to(torch.float32)
    if w is not None and mask is not None:
        w = w.masked_fill(~mask, 0)  # a NaN score in a masked row must not reach the products
    scale_keys = w is not None and weighted_least_squares
    key_cols = 2 * dk if scale_keys else dk
    width = key_cols + (dv if w is None else 2 * dv)
    acc = torch.zeros((batch, dk, width), dtype=torch.float64, device=device)
    dyy = torch.zeros((batch,), dtype=torch.float64, device=device)
    budget = _PARTIAL_BYTES_CUDA if device.type == "cuda" else _PARTIAL_BYTES
    chunks_per_group = max(1, budget // max(1, batch * dk * width * 4))
    step = min(max(rows, 1), rows_per_flush * chunks_per_group)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        m = None if mask is None else mask[:, start : start + n]
        k = _masked_rows(keys[:, start : start + n], m)
        v = _masked_rows(values[:, start : start + n], m)
        ws = None if w is None else w[:, start : start + n, None]
        unscales = []
        if ws is None:
            dyy += torch.linalg.vector_norm(v, dim=(-2, -1), dtype=torch.float64).square()
            parts = [k, v]
        else:
            norms = torch.linalg.vector_norm(v, dim=-1, dtype=torch.float64).square()
            ws64 = ws[..., 0].double()
            dyy += (norms * (ws64 if weighted_least_squares else ws64.square())).sum(-1)
            parts = [k]
            if scale_keys:
                khi, klo, kun = _split16(k.float() * ws, dtype)
                parts, unscales = [khi, klo], [(0, key_cols, kun)]
            vhi, vlo, vun = _split16(v.float() * ws, dtype)
            parts += [vhi, vlo]
            unscales.append((key_cols, width, vun))
        right = torch.cat(parts, dim=-1)
        full, tail = divmod(n, rows_per_flush)
        pieces = [(0, full, rows_per_flush)] if full else []
        if tail:
            pieces.append((full * rows_per_flush, 1, tail))
        for first, count, length in pieces:
            end = first + count * length
            left = k[:, first:end].reshape(batch * count, length, dk)
            part = _bmm_fp32(left.mT, right[:, first:end].reshape(batch * count, length, width))
            flushed = part.view(batch, count, dk, width).sum(1, dtype=torch.float64)
            for c0, c1, unscale in unscales:
                flushed[..., c0:c1] *= unscale
            acc += flushed
    if scale_keys:
        s = acc[..., :dk] + acc[..., dk:key_cols]
    else:
        s = acc[..., :dk]
    t = acc[..., key_cols:]
    if w is not None:
        t = t[..., :dv] + t[..., dv:]
    # Kᵀ(sK) and the float32 sums are not exactly symmetric: the mean of both triangles is.
    gram = (s + s.mT) * 0.5
    return gram, t.contiguous(), dyy


def exact16_unavailable_reason(
    keys_dtype: torch.dtype, values_dtype: torch.dtype, device: torch.device | None = None
) -> str | None:
    """Why accumulate_gram_exact16 cannot run on these input dtypes (and device, when given); None when it can."""
    if keys_dtype not in _SIXTEEN_BIT or values_dtype != keys_dtype:
        return (
            "keys, values: torch.exact16 needs both in the same 16-bit dtype (torch.bfloat16 or torch.float16), got "
            f"{keys_dtype} and {values_dtype}"
        )
    if device is not None and device.type == "cuda" and not _native_out_dtype("cuda"):
        return f"torch {torch.__version__} has no CUDA bmm with out_dtype=torch.float32 (aten::bmm.dtype)"
    return None


def exact16_cannot_run(call: Any) -> str | None:
    """faast.ops._dispatch cannot_run for accumulate_gram's torch.exact16 (call: a _dispatch.Call)."""
    if len(call.dtypes) < 2:
        return "torch.exact16 needs the keys' and values' dtypes"
    return exact16_unavailable_reason(call.dtypes[0], call.dtypes[1], call.device)


def exact16_gate(call: Any) -> str | None:
    """Why `auto` must not pick torch.exact16 for this call: float64 compute asks for a grade it does not have, and on
    a CPU it is an emulation on float32 copies (the float32 compute mode does the same GEMMs without them)."""
    if call.options.get("compute_dtype", torch.float64) != torch.float32:
        return (
            "torch.exact16 is float32-grade (no flush length passes the float64 fidelity suite, on an H100 or in CPU "
            "emulation): only compute_dtype=torch.float32 may use it"
        )
    if call.device.type != "cuda":
        return "torch.exact16 on a CPU is an emulation on float32 copies (no aten::bmm.dtype kernel)"
    return None


# ---------------------------------------------------------------------------------------------------- syrk


# OpenBLAS's idle workers spin for 2^OPENBLAS_THREAD_TIMEOUT cycles (default 2^28, ~0.1 s) after each call, holding
# a core that torch's OpenMP threads need between the Gram calls (validation, the accumulator adds, the eigh): a
# FastWeights learn at N = 65,536, d = 768 on 2 cores took 4.05 s through torch.syrk with the default against 2.41 s
# with 4 (the minimum), and the torch path 2.56 s. OpenBLAS reads the variable once, when it loads.
_OPENBLAS_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
_OPENBLAS_TIMEOUT = "4"
_blas_state: dict[str, object] = {}


def _scipy_openblas_loaded() -> bool:
    """Whether scipy's bundled OpenBLAS is mapped into this process already (Linux; elsewhere: scipy.linalg is
    imported)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "scipy.linalg" in sys.modules
    return any("libscipy_openblas" in line and "scipy.libs" in line for line in maps.splitlines())


@functools.cache
def _scipy_blas() -> Any:
    """scipy.linalg.blas, or the ImportError's text. Before scipy's OpenBLAS first loads, sets
    OPENBLAS_THREAD_TIMEOUT (unless the user did) so that its idle workers do not spin against torch's threads."""
    _blas_state["preloaded"] = _scipy_openblas_loaded()
    if not _blas_state["preloaded"]:
        os.environ.setdefault(_OPENBLAS_TIMEOUT_ENV, _OPENBLAS_TIMEOUT)
    _blas_state["timeout"] = os.environ.get(_OPENBLAS_TIMEOUT_ENV)
    try:
        from scipy.linalg import blas
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return blas


def syrk_gate(call: Any) -> str | None:
    """Why `auto` must not pick torch.syrk: scipy's OpenBLAS was loaded (by another import) before faast could shorten
    its workers' spin, and with the default spin the learn is slower than the torch path (see _OPENBLAS_TIMEOUT_ENV).
    A sample timing of the op alone does not see that cost, which falls on the torch ops between the calls."""
    if isinstance(_scipy_blas(), str):
        return None  # cannot_run says why
    if _blas_state.get("preloaded") and _blas_state.get("timeout") in (None, ""):
        return (
            "scipy's OpenBLAS was loaded before faast with its default thread spin (OPENBLAS_THREAD_TIMEOUT unset), "
            "which slows torch's threads between calls; set OPENBLAS_THREAD_TIMEOUT=4 before importing scipy"
        )
    return None


def syrk_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why accumulate_gram_syrk cannot run (scipy missing, or a device other than the CPU); None when it can."""
    blas = _scipy_blas()
    if isinstance(blas, str):
        return f"torch.syrk needs scipy (BLAS dsyrk), which is not importable here ({blas}); pip install scipy"
    if device is not None and device.type != "cpu":
        return f"torch.syrk runs on the CPU only (scipy's BLAS), not on {device}"
    return None


def syrk_cannot_run(call: Any) -> str | None:
    """faast.ops._dispatch cannot_run for accumulate_gram's torch.syrk (call: a _dispatch.Call)."""
    reason = syrk_unavailable_reason(call.device)
    if reason is None and call.options.get("compute_dtype", torch.float64) != torch.float64:
        reason = f"torch.syrk computes in float64 only, got compute_dtype={call.options.get('compute_dtype')}"
    return reason


def accumulate_gram_syrk(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    weighted_least_squares: bool,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.accumulate_gram_streaming on the CPU with S = KᵀK through BLAS dsyrk (one triangle: half the flops
    of a GEMM) and T = Kᵀ diag(s) V through dgemm, both scipy's BLAS, in float64 (exact products, float64 sums).

    Shapes: keys [B, N, dk], values [B, N, dv] (any float dtype, any strides, CPU), scores / mask [B, N] or None.
    Returns float64 (dS [B, dk, dk] symmetric, dT [B, dk, dv], dyy [B]), as reference.accumulate_gram_streaming.
    Rows stream per layer through two reused float64 buffers of about reference's chunk size. The per-chunk work
    (upcast, mask, scale, ||v||²) is numpy's, single-threaded: scipy's BLAS has its own thread pool, and alternating
    it with torch's OpenMP pool in every chunk left each pool spinning against the other (measured 25% slower at
    N = 65,536, d = 768 on 2 cores). Not differentiable.

    Raises ValueError naming compute_dtype unless it is torch.float64, or naming the input that requires grad while
    grad is enabled; RuntimeError when scipy is missing or the tensors are not on the CPU (syrk_unavailable_reason).
    """
    if compute_dtype != torch.float64:
        raise ValueError(
            f"compute_dtype: torch.syrk computes in float64 only; expected torch.float64, got {compute_dtype}"
        )
    reason = syrk_unavailable_reason(keys.device)
    if reason is not None:
        raise RuntimeError(reason)
    if torch.is_grad_enabled():
        for name, t in (("keys", keys), ("values", values), ("scores", scores)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name}: torch.syrk is not differentiable; got a tensor that requires grad")
    import numpy as np

    blas = _scipy_blas()
    batch, rows, dk = keys.shape
    dv = values.shape[-1]
    f64 = torch.float64
    # S is built in its lower triangle (C order), which is dsyrk's upper triangle of the Fortran-ordered view.
    lower = torch.zeros((batch, dk, dk), dtype=f64)
    cross = torch.zeros((batch, dk, dv), dtype=f64)
    dyy = torch.zeros((batch,), dtype=f64)
    step = chunk_rows(1, dk + dv, f64, rows)
    kbuf = torch.empty((step, dk), dtype=f64).numpy()
    vbuf = torch.empty((step, dv), dtype=f64).numpy()
    weights = None if scores is None else scores.detach().to(f64)
    if weights is not None and mask is not None:
        weights = weights.masked_fill(~mask, 0)  # masked rows are zeroed before scaling: no NaN * 0
    if weights is not None and weighted_least_squares:
        weights = weights.sqrt()  # applied to keys and values: S = Kᵀ diag(s) K, T = Kᵀ diag(s) V
    keep = None if mask is None else mask.numpy()
    weights_np = None if weights is None else weights.numpy()
    with np.errstate(all="ignore"):  # inf / NaN rows overflow like reference's; the caller checks finiteness
        for b in range(batch):
            # Fortran views of the C-ordered [dk, dk] / [dk, dv] results: BLAS writes through them (checked below).
            s_f, t_f = lower[b].numpy().T, cross[b].numpy().T
            total = 0.0
            for start in range(0, rows, step):
                n = min(step, rows - start)
                k, v = kbuf[:n], vbuf[:n]
                np.copyto(k, _numpy_rows(keys, b, start, n))
                np.copyto(v, _numpy_rows(values, b, start, n))
                if keep is not None:
                    drop = ~keep[b, start : start + n]
                    k[drop] = 0
                    v[drop] = 0
                if weights_np is not None:
                    w = weights_np[b, start : start + n, None]
                    if weighted_least_squares:
                        k *= w
                    v *= w
                # Not a BLAS ddot (flat @ flat): after OpenBLAS's threaded level-1 call, its next dsyrk and dgemm
                # ran 2x slower on this 2-core machine (measured); einsum's own loop does not touch the pool.
                total += float(np.einsum("ij,ij->", v, v))
                if dk == 0:
                    continue
                k_f = k.T  # [dk, n], Fortran-contiguous: no copy in the wrapper
                out = blas.dsyrk(1.0, k_f, beta=1.0, c=s_f, trans=0, lower=0, overwrite_c=1)
                if not np.shares_memory(out, s_f):
                    s_f[...] = out
                if dv:
                    # The Fortran [dv, dk] view of T is Vᵀ K = v_f k_fᵀ.
                    out = blas.dgemm(1.0, v.T, k_f, beta=1.0, c=t_f, trans_b=1, overwrite_c=1)
                    if not np.shares_memory(out, t_f):
                        t_f[...] = out
            dyy[b] = total
    # dsyrk wrote one triangle and left the other at zero: adding the transpose doubles only the diagonal (halved
    # exactly).
    gram = lower + lower.mT
    gram.diagonal(dim1=-2, dim2=-1).mul_(0.5)
    return gram, cross, dyy


def _numpy_rows(x: torch.Tensor, b: int, start: int, n: int) -> Any:
    """x[b, start:start + n] as a numpy array without a copy where numpy has the dtype (bf16 goes through float32)."""
    rows = x[b, start : start + n].detach()
    return (rows.float() if rows.dtype == torch.bfloat16 else rows).numpy()
