"""Fused, layer-batched Gram accumulation: S += Kᵀ K and T += Kᵀ diag(s) V in one pass over the rows.

Layout: keys K [L, N, dk], values V [L, N, dv], scores s [L, N] (optional), mask [L, N] bool (optional), any strides;
S [L, dk, dk] and T [L, dk, dv] float64. One program owns one output tile of one layer and walks all N rows in
order, so the reduction order is fixed and the result bitwise reproducible (no atomics). Only the tiles on and
above the diagonal of S are computed; an off-diagonal tile is stored twice (transposed into the lower triangle).

Precision modes (method.md §4):
  "fp64"    tiles are upcast to float64 and multiplied in float64: exact products and float64 sums, the same
            numbers as the torch reference up to summation order. Passes the float64 fidelity suite; the default.
  "tf32x3"  tensor-core products at float32 accuracy: each float32 factor is split into a TF32 head and a tail and
            three TF32 dots (hi·hi + hi·lo + lo·hi) are summed in float32, flushed into float64 every FLUSH_ROWS
            rows; bf16/fp16 inputs are TF32 numbers already and take one exact dot. Spurious directions below
            ~1e-7·λmax, like any float32 accumulation, so it is opt-in (numerics.md §1). (bf16 hi + lo splitting
            was the other candidate: it keeps 16 significand bits, not 22.)
  "fp32"    plain float32 products and sums (IEEE, no TF32), flushed into float64 every FLUSH rows. Opt-in.

Masked-out rows and the padding of the last row block are excluded with `where`, never by multiplication, so a
NaN in an ignored row cannot leak. The kernel does not import faast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PRECISIONS = ("fp64", "tf32x3", "fp32")
FLUSH_ROWS = 256  # float32 partial sums are folded into float64 after at most this many rows


@triton.jit
def _load_rows(ptr, stride_n, stride_d, rows, cols, n_rows, n_cols, keep):
    # int64 offsets: L·N·d can exceed 2^31 elements.
    offs = rows.to(tl.int64)[:, None] * stride_n + cols.to(tl.int64)[None, :] * stride_d
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols) & keep[:, None]
    x = tl.load(ptr + offs, mask=inside, other=0.0)
    return tl.where(inside, x, 0.0)


@triton.jit
def _gram_accumulate_kernel(
    K, V, SCORES, MASK, OUT_S, OUT_T, TILES,
    N, DK, DV,
    stride_kl, stride_kn, stride_kd,
    stride_vl, stride_vn, stride_vd,
    stride_sl, stride_sn,
    stride_ml, stride_mn,
    HAS_SCORES: tl.constexpr, HAS_MASK: tl.constexpr, WLS: tl.constexpr, ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    FLUSH: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kind = tl.load(TILES + 3 * tile)  # 0: a tile of S (i <= j), 1: a tile of T
    ti = tl.load(TILES + 3 * tile + 1)
    tj = tl.load(TILES + 3 * tile + 2)
    cols_i = ti * BM + tl.arange(0, BM)
    cols_j = tj * BN + tl.arange(0, BN)
    k_base = K + layer * stride_kl
    if kind == 0:
        b_base = k_base
        b_stride_n = stride_kn
        b_stride_d = stride_kd
        b_cols = DK
    else:
        b_base = V + layer * stride_vl
        b_stride_n = stride_vn
        b_stride_d = stride_vd
        b_cols = DV

    acc64 = tl.zeros((BM, BN), dtype=tl.float64)
    acc32 = tl.zeros((BM, BN), dtype=tl.float32)
    for start in range(0, N, BK):
        rows = start + tl.arange(0, BK)
        keep = rows < N
        if HAS_MASK:
            keep = keep & (
                tl.load(MASK + layer * stride_ml + rows.to(tl.int64) * stride_mn, mask=rows < N, other=0) != 0
            )
        a = _load_rows(k_base, stride_kn, stride_kd, rows, cols_i, N, DK, keep)
        b = _load_rows(b_base, b_stride_n, b_stride_d, rows, cols_j, N, b_cols, keep)
        if PRECISION == "fp64":
            a = a.to(tl.float64)
            b = b.to(tl.float64)
        else:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if HAS_SCORES:
            # Scores weight the values (tiles of T) only; with weighted least squares, the rows of S too.
            s = tl.load(SCORES + layer * stride_sl + rows.to(tl.int64) * stride_sn, mask=keep, other=0.0)
            s = tl.where(keep, s, 0.0).to(b.dtype)
            use = (kind == 1) | WLS
            b = b * tl.where(use, s, 1.0)[:, None]
        if PRECISION == "fp64":
            acc64 += tl.dot(tl.trans(a), b)
        else:
            at = tl.trans(a)
            if PRECISION == "tf32x3":
                if SPLIT:
                    # x = hi + lo with hi = x's top 11 significand bits (exactly a TF32 number): hi·hi is exact in
                    # float32, and the two cross terms restore the bits TF32 drops (3xTF32).
                    a_hi = (at.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                    b_hi = (b.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                    acc32 += tl.dot(a_hi, b - b_hi, input_precision="tf32")
                    acc32 += tl.dot(at - a_hi, b_hi, input_precision="tf32")
                    acc32 += tl.dot(a_hi, b_hi, input_precision="tf32")
                else:  # 16-bit inputs are TF32 numbers already: one exact-product dot
                    acc32 += tl.dot(at, b, input_precision="tf32")
            else:
                acc32 += tl.dot(at, b, input_precision="ieee")
            if (start // BK + 1) % FLUSH == 0:
                acc64 += acc32.to(tl.float64)
                acc32 = tl.zeros((BM, BN), dtype=tl.float32)
    acc64 += acc32.to(tl.float64)

    layer_s = OUT_S + layer * DK * DK
    if kind == 0:
        if ti == tj:  # a diagonal tile: its two triangles hold the same sums, possibly rounded differently
            acc64 = tl.where(cols_i[:, None] <= cols_j[None, :], acc64, tl.trans(acc64))
        offs = cols_i.to(tl.int64)[:, None] * DK + cols_j[None, :]
        inside = (cols_i[:, None] < DK) & (cols_j[None, :] < DK)
        if ACCUMULATE:
            acc64 += tl.load(layer_s + offs, mask=inside, other=0.0)
        tl.store(layer_s + offs, acc64, mask=inside)
        if ti != tj:  # mirror into the lower triangle
            offs_t = cols_j.to(tl.int64)[None, :] * DK + cols_i[:, None]
            tl.store(layer_s + offs_t, acc64, mask=inside)
    else:
        layer_t = OUT_T + layer * DK * DV
        offs = cols_i.to(tl.int64)[:, None] * DV + cols_j[None, :]
        inside = (cols_i[:, None] < DK) & (cols_j[None, :] < DV)
        if ACCUMULATE:
            acc64 += tl.load(layer_t + offs, mask=inside, other=0.0)
        tl.store(layer_t + offs, acc64, mask=inside)


def _tile_table(dk: int, dv: int, block: int, device: torch.device) -> torch.Tensor:
    """(kind, i, j) per program: the upper-triangle tiles of S, then every tile of T."""
    nk, nv = triton.cdiv(dk, block), triton.cdiv(dv, block)
    tiles = [(0, i, j) for i in range(nk) for j in range(i, nk)] + [(1, i, j) for i in range(nk) for j in range(nv)]
    return torch.tensor(tiles, dtype=torch.int32, device=device).reshape(-1)


def _block(precision: str) -> tuple[int, int]:
    # (tile edge, rows per step). Small float64 tiles: float64 dots have no tensor-core path on most GPUs.
    return (32, 32) if precision == "fp64" else (64, 32)


def gram_accumulate(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    gram: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
    weighted_least_squares: bool = False,
    precision: str = "fp64",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused Gram kernel for all layers at once.

    Args:
        keys: [L, N, dk] float16 / bfloat16 / float32 / float64, any strides.
        values: [L, N, dv], same L and N.
        scores: [L, N] or None. mask: [L, N] bool or None (False rows are skipped).
        gram, cross: float64 accumulators [L, dk, dk], [L, dk, dv], contiguous, updated in place; None: new ones
            holding just this batch's statistics (every element written by the kernel).
        precision: one of PRECISIONS (see the module docstring).

    Returns (gram, cross), float64.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    for name, t, nd in (("keys", keys, 3), ("values", values, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor [L, N, d], got {getattr(t, 'shape', type(t))}")
    L, N, dk = keys.shape
    dv = values.shape[-1]
    if values.shape[:2] != (L, N):
        raise ValueError(f"values: expected shape [{L}, {N}, dv] (the L, N of keys), got {list(values.shape)}")
    for name, t in (("scores", scores), ("mask", mask)):
        if t is not None and tuple(t.shape) != (L, N):
            raise ValueError(f"{name}: expected shape [{L}, {N}], got {list(t.shape)}")
        if t is not None and t.device != keys.device:
            raise ValueError(f"{name}: expected device {keys.device}, got {t.device}")
    if values.device != keys.device:
        raise ValueError(f"values: expected device {keys.device}, got {values.device}")
    accumulate = gram is not None
    if (gram is None) != (cross is None):
        raise ValueError("gram, cross: pass both accumulators or neither")
    if accumulate:
        for name, t, shape in (("gram", gram, (L, dk, dk)), ("cross", cross, (L, dk, dv))):
            if t.dtype != torch.float64 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != keys.device:
                raise ValueError(f"{name}: expected a contiguous float64 tensor {list(shape)} on {keys.device}")
    else:
        gram = torch.empty((L, dk, dk), dtype=torch.float64, device=keys.device)
        cross = torch.empty((L, dk, dv), dtype=torch.float64, device=keys.device)
    if L == 0 or dk == 0:
        return gram, cross
    if N == 0 and not accumulate:
        gram.zero_()
        cross.zero_()
        return gram, cross
    block, rows = _block(precision)
    tiles = _tile_table(dk, dv, block, keys.device)
    mask_arg = mask.to(torch.int8) if mask is not None else keys  # dummy pointer when absent
    scores_arg = scores if scores is not None else keys
    grid = (tiles.numel() // 3, L)
    _gram_accumulate_kernel[grid](
        keys, values, scores_arg, mask_arg, gram, cross, tiles,
        N, dk, dv,
        *keys.stride(), *values.stride(),
        *(scores.stride() if scores is not None else (0, 0)),
        *(mask_arg.stride() if mask is not None else (0, 0)),
        HAS_SCORES=scores is not None, HAS_MASK=mask is not None, WLS=bool(weighted_least_squares),
        ACCUMULATE=accumulate, PRECISION=precision, BM=block, BN=block, BK=rows, FLUSH=max(1, FLUSH_ROWS // rows),
        # Split whenever a factor may not be exactly a TF32 number: float32/float64 inputs, or score-weighted values.
        SPLIT=keys.dtype in (torch.float32, torch.float64) or values.dtype in (torch.float32, torch.float64)
        or scores is not None,
    )  # fmt: skip
    return gram, cross


def naive_gram(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    weighted_least_squares: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 oracle of gram_accumulate: (Kᵀ K, Kᵀ diag(s) V) over unmasked rows, [L, dk, dk] and [L, dk, dv]."""
    k, v = keys.to(torch.float64), values.to(torch.float64)
    keep = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device) if mask is None else mask.bool()
    k = torch.where(keep[..., None], k, 0.0)
    v = torch.where(keep[..., None], v, 0.0)
    s = None if scores is None else torch.where(keep, scores.to(torch.float64), 0.0)
    if s is None:
        return k.mT @ k, k.mT @ v
    if weighted_least_squares:
        return k.mT @ (s[..., None] * k), k.mT @ (s[..., None] * v)
    return k.mT @ k, k.mT @ (s[..., None] * v)
