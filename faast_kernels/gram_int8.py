"""The Gram statistics from int8 slices (the Ozaki scheme): S += Kᵀ K, T += Kᵀ diag(s) V on int8 tensor cores, with
float64-grade results for 16-bit and float32 rows (docs/numerics.md §4.4).

Layout as faast_kernels.gram: keys K [L, N, dk], values V [L, N, dv] (bf16, fp16 or float32), scores s [L, N] and
mask [L, N] bool optional, any strides; S [L, dk, dk], T [L, dk, dv] and ‖Y‖² [L] float64, updated in place.

The arithmetic and its bound, the slice counts (`plan`) and the torch oracle `naive_gram_int8` are in int8_slices.py
(this module re-exports them). Here: one program per output tile of S (upper triangle) or T, or per value-column block
for ‖Y‖², as in gram.py; for each chunk of rows and each pair weight m = a + b it loads the rows, scales them by their
columns' 2^-E in float64, cuts the slices a and b = m - a, sums their int8 dots in one int32 accumulator, and adds the
chunk's sum times 2^(-7m)·2^(E_i+E_j) into the float64 tile in global memory.

Rows per chunk: FLUSH_ROWS by default (below max_chunk_rows(8) = 16,643), enforced for any flush_rows given.
Masked-out rows and padding are excluded with `where` (a NaN there cannot leak). A column whose maximum is NaN or
Inf makes its rows and columns of S and T NaN (added after the launch, no host synchronisation); `plan` itself reads
one number back to the host (the slice count, a compile-time constant of the kernel).

On a CPU this runs in Triton's interpreter (TRITON_INTERPRET=1: the tests). The kernel does not import faast.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import autotuning, interpreting
from .gram import (
    _accumulators,
    _check,
    _grid,
    _keep_rows,
    _launch_args,
    _load_rows,
    _load_scores,
    _nothing_to_launch,
    _split_outputs,
    _split_rows,
    _sqnorm_block,
    _sum_splits,
)
from .int8_slices import (
    BOUND,
    FLUSH_ROWS,
    INPUT_DTYPES,
    MAX_SLICES,
    PAIR_WEIGHT_MAX,
    SIGNIFICANT_BITS,
    SLICE_BITS,
    Plan,
    _poison_non_finite,
    dropped_weight,
    error_bound,
    max_chunk_rows,
    naive_gram_int8,
    plan,
)
from .tiles import finish_tile, program_rows, tile_operands

__all__ = [
    "BOUND",
    "FLUSH_ROWS",
    "INPUT_DTYPES",
    "MAX_SLICES",
    "PAIR_WEIGHT_MAX",
    "SIGNIFICANT_BITS",
    "SLICE_BITS",
    "Plan",
    "dropped_weight",
    "error_bound",
    "gram_accumulate_int8",
    "max_chunk_rows",
    "naive_gram_int8",
    "plan",
]


def _configs() -> list[triton.Config]:
    if interpreting():
        # One small tile: odd test shapes then span several tiles, row blocks and chunks.
        return [triton.Config({"BM": 32, "BK": 32}, num_warps=4, num_stages=1)]
    # Two configurations: every slice count compiles its own kernel, and a fresh GPU machine pays each compile.
    configs = [
        triton.Config({"BM": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BM": 64, "BK": 64}, num_warps=4, num_stages=3),
    ]
    return configs if autotuning() else configs[:1]


@triton.jit
def _slice(y, A: tl.constexpr):
    """Slice A (1-based) of y [BK, BM] float64, |y| < 1: the int8 q_A with y = Σ_a q_a 2^(-7a) + r, cut toward zero.
    Every step is exact in float64: y·2^7 and the fraction r - trunc(r) of a number of at most 53 bits."""
    r = y * 128.0
    q = r.to(tl.int32)  # toward zero
    for _ in tl.static_range(A - 1):
        r = (r - q.to(tl.float64)) * 128.0
        q = r.to(tl.int32)
    return q.to(tl.int8)


@triton.jit
def _scaled_rows(base, stride_n, stride_d, rows, cols, n_cols, keep, scale_row, s, SCORED: tl.constexpr):
    """y = x [BK, BM] (times the rows' scores s [BK] when SCORED) times its columns' scales 2^-E, in float64."""
    x = _load_rows(base, stride_n, stride_d, rows, cols, n_cols, keep).to(tl.float64)
    if SCORED:
        x = x * s[:, None]
    scale = tl.load(scale_row + cols, mask=cols < n_cols, other=1.0)
    y = x * scale[None, :]
    # NaN and Inf (their columns' results are made NaN after the launch) are not cast to integers.
    return tl.where(tl.abs(y) < 1.0, y, 0.0)


@triton.jit
def _weight_sum(
    a_base, b_base, SCORES, MASK, layer, start_row, end_row, a_scale, b_scale,
    stride_an, stride_ad, stride_bn, stride_bd, stride_sl, stride_sn, stride_ml, stride_mn,
    cols_i, cols_j, DA, DB,
    M: tl.constexpr, SCORED: tl.constexpr, HAS_MASK: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Σ over rows [start_row, end_row) and slice pairs a + b = M (a <= KA, b <= KB) of q_a(K[:, cols_i])ᵀ
    q_b(B[:, cols_j]): [BM, BM] int32, exact (the launcher keeps the chunk within max_chunk_rows)."""
    acc = tl.zeros((BM, BM), dtype=tl.int32)
    for start in range(start_row, end_row, BK):
        rows = start + tl.arange(0, BK)
        keep = _keep_rows(MASK, layer, stride_ml, stride_mn, rows, end_row, HAS_MASK)
        if SCORED:
            s = _load_scores(SCORES, layer, stride_sl, stride_sn, rows, keep).to(tl.float64)
        else:
            s = 0.0
        ya = _scaled_rows(a_base, stride_an, stride_ad, rows, cols_i, DA, keep, a_scale, s, False)
        yb = _scaled_rows(b_base, stride_bn, stride_bd, rows, cols_j, DB, keep, b_scale, s, SCORED)
        for a in tl.static_range(1, KA + 1):
            if M - a >= 1 and M - a <= KB:
                acc += tl.dot(tl.trans(_slice(ya, a)), _slice(yb, M - a))
    return acc


@triton.jit
def _add_weight(out, offs, inside, acc, unscale, M: tl.constexpr):
    """out += acc · 2^(-7M) · 2^(E_i+E_j) (all powers of two: exact until the float64 addition)."""
    tl.debug_barrier()  # the previous addition's stores (by any thread of the program) before this load
    weight = 1.0
    for _ in tl.static_range(M):
        weight = weight * 0.0078125  # 2^-7, M times: exact
    prev = tl.load(out + offs, mask=inside, other=0.0)
    tl.store(out + offs, prev + acc.to(tl.float64) * weight * unscale, mask=inside)


@triton.jit
def _tile_chunk(
    k_base, b_base, SCORES, MASK, layer, chunk, chunk_end, a_scale, b_scale, out, offs, inside, unscale,
    stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn, stride_ml, stride_mn,
    cols_i, cols_j, DK, b_cols,
    SCORED: tl.constexpr, HAS_MASK: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Add one chunk of rows into the tile, one pair weight at a time (one int32 accumulator live)."""
    for m in tl.static_range(2, KA + KB + 1):
        if m <= 10:  # PAIR_WEIGHT_MAX
            acc = _weight_sum(k_base, b_base, SCORES, MASK, layer, chunk, chunk_end, a_scale, b_scale,
                              stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn, stride_ml,
                              stride_mn, cols_i, cols_j, DK, b_cols, m, SCORED, HAS_MASK, KA, KB, BM, BK)  # fmt: skip
            _add_weight(out, offs, inside, acc, unscale, m)


@triton.jit
def _scored_tile_chunk(
    k_base, b_base, SCORES, MASK, layer, chunk, chunk_end, a_scale, b_scale, out, offs, inside, unscale, is_t,
    stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn, stride_ml, stride_mn,
    cols_i, cols_j, DK, b_cols,
    HAS_SCORES: tl.constexpr, HAS_MASK: tl.constexpr, WLS: tl.constexpr, K_K: tl.constexpr, K_SK: tl.constexpr,
    K_V: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """_tile_chunk for a tile of S (is_t false: right factor s·K with weighted least squares, else K, K_SK slices) or
    of T (right factor s·V with scores, else V, K_V slices). SCORED and the slice counts are constexprs and is_t is
    not: one call for each value they take."""
    if is_t:
        _tile_chunk(k_base, b_base, SCORES, MASK, layer, chunk, chunk_end, a_scale, b_scale, out, offs, inside,
                    unscale, stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn, stride_ml,
                    stride_mn, cols_i, cols_j, DK, b_cols, HAS_SCORES, HAS_MASK, K_K, K_V, BM, BK)  # fmt: skip
    else:
        _tile_chunk(k_base, b_base, SCORES, MASK, layer, chunk, chunk_end, a_scale, b_scale, out, offs, inside,
                    unscale, stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn, stride_ml,
                    stride_mn, cols_i, cols_j, DK, b_cols, HAS_SCORES and WLS, HAS_MASK, K_K, K_SK, BM,
                    BK)  # fmt: skip


@triton.jit(do_not_specialize=["N", "ROWS_PER_SPLIT"])
def _gram_int8_kernel(
    K, V, SCORES, MASK, SC_K, SC_SK, SC_V, OUT_S, OUT_T, OUT_SQ,
    N, DK, DV, ROWS_PER_SPLIT,
    stride_kl, stride_kn, stride_kd,
    stride_vl, stride_vn, stride_vd,
    stride_sl, stride_sn,
    stride_ml, stride_mn,
    split_stride_s, split_stride_t, NV_MAX,
    HAS_SCORES: tl.constexpr, HAS_MASK: tl.constexpr, WLS: tl.constexpr, ACCUMULATE: tl.constexpr,
    K_K: tl.constexpr, K_SK: tl.constexpr, K_V: tl.constexpr, FLUSH_ROWS: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    tile, layer, split, row_start, row_end, k_base, v_base, nk, nv, n_s, n_t = program_rows(
        K, V, N, DK, DV, ROWS_PER_SPLIT, stride_kl, stride_vl, BM
    )
    if tile < n_s + n_t:
        is_t, ti, tj, cols_i, cols_j, b_base, b_stride_n, b_stride_d, b_cols, out, offs, inside = tile_operands(
            tile, layer, split, k_base, v_base, nk, nv, n_s, OUT_S, OUT_T, DK, DV,
            stride_kn, stride_kd, stride_vn, stride_vd, split_stride_s, split_stride_t, ACCUMULATE, BM,
        )  # fmt: skip
        # The column scales of the left factor (K) and of the right one (V for T; s·K or K for S).
        a_scale = SC_K + layer * DK
        if is_t:
            b_scale = SC_V + layer * DV
        else:
            b_scale = SC_SK + layer * DK
        # 2^(E_i + E_j) of the tile: the reciprocals of the scales (powers of two, exact).
        u_i = 1.0 / tl.load(a_scale + cols_i, mask=cols_i < DK, other=1.0)
        u_j = 1.0 / tl.load(b_scale + cols_j, mask=cols_j < b_cols, other=1.0)
        unscale = u_i[:, None] * u_j[None, :]
        for chunk in range(row_start, row_end, FLUSH_ROWS):
            chunk_end = tl.minimum(chunk + FLUSH_ROWS, row_end)
            _scored_tile_chunk(k_base, b_base, SCORES, MASK, layer, chunk, chunk_end, a_scale, b_scale, out, offs,
                               inside, unscale, is_t, stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl,
                               stride_sn, stride_ml, stride_mn, cols_i, cols_j, DK, b_cols, HAS_SCORES, HAS_MASK, WLS,
                               K_K, K_SK, K_V, BM, BK)  # fmt: skip
        finish_tile(out, offs, inside, cols_i, cols_j, is_t, ti, tj, DK)
    else:
        _sqnorm_block(v_base, SCORES, MASK, OUT_SQ, layer, split, tile - n_s - n_t, row_start, row_end,
                      stride_vn, stride_vd, stride_sl, stride_sn, stride_ml, stride_mn, DV, NV_MAX,
                      HAS_SCORES, HAS_MASK, WLS, BM, BK)  # fmt: skip


@functools.cache
def _tuned():  # noqa: ANN202 - a triton Autotuner
    # Tiles and row steps do not change which rows a chunk sums: every configuration gives the same sums.
    return triton.autotune(
        configs=_configs(),
        key=["DK", "DV", "HAS_SCORES", "HAS_MASK", "WLS", "ACCUMULATE", "K_K", "K_SK", "K_V"],
        restore_value=["OUT_S", "OUT_T", "OUT_SQ"],
    )(_gram_int8_kernel)


def _checked(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    flush_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(keys, values) in one input dtype, and flush_rows checked to be a positive int (or None)."""
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in INPUT_DTYPES:
            raise ValueError(
                f"{name}: expected a bfloat16, float16 or float32 tensor [L, N, d], got "
                f"{getattr(t, 'dtype', type(t))} {list(getattr(t, 'shape', []))}"
            )
    L, N, _ = keys.shape
    if values.shape[:2] != (L, N):
        raise ValueError(f"values: expected shape [{L}, {N}, dv] (the L, N of keys), got {list(values.shape)}")
    _check("values", values, tuple(values.shape), keys.device)
    _check("scores", scores, (L, N), keys.device)
    _check("mask", mask, (L, N), keys.device)
    if scores is not None and not scores.is_floating_point():
        raise ValueError(f"scores: expected a floating tensor, got {scores.dtype}")
    if keys.dtype != values.dtype:  # exact promotion: one slicing precision for both
        common = torch.promote_types(keys.dtype, values.dtype)
        keys, values = keys.to(common), values.to(common)
    if flush_rows is not None and (isinstance(flush_rows, bool) or not isinstance(flush_rows, int) or flush_rows < 1):
        raise ValueError(f"flush_rows: expected a positive int or None, got {flush_rows!r}")
    return keys, values, flush_rows


def gram_accumulate_int8(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    gram: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
    sqnorm: torch.Tensor | None = None,
    weighted_least_squares: bool = False,
    flush_rows: int | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the int8-slice Gram kernel for all layers at once (module docstring: the arithmetic and its bound).

    Args:
        keys: [L, N, dk] bfloat16 / float16 / float32, any strides. values: [L, N, dv], same L and N (promoted to
            a common dtype with keys). scores: [L, N] floating or None. mask: [L, N] bool or None.
        gram, cross, sqnorm: float64 accumulators [L, dk, dk], [L, dk, dv], [L], contiguous, added into in place;
            None: new ones holding this batch's statistics (‖Y‖²: Σ s²‖v‖², or Σ s‖v‖² with weighted least squares).
        flush_rows: rows per exact int32 chunk (default FLUSH_ROWS); at most max_chunk_rows(slices), else ValueError.
        splits: row ranges (default: gram.plan_splits); results are bitwise reproducible for a given value.

    Returns (gram, cross, sqnorm), float64.
    """
    keys, values, flush_rows = _checked(keys, values, scores, mask, flush_rows)
    gram, cross, sqnorm, accumulate = _accumulators(gram, cross, sqnorm, keys, values)
    if _nothing_to_launch(keys, values, gram, cross, sqnorm, accumulate):
        return gram, cross, sqnorm
    cut = plan(keys, values, scores, mask, weighted_least_squares=weighted_least_squares)
    limit = cut.chunk_rows()
    flush = min(FLUSH_ROWS, limit) if flush_rows is None else flush_rows
    if flush > limit:
        raise ValueError(
            f"flush_rows: slice counts {cut.slices} keep int32 sums exact for at most {limit} rows a chunk, "
            f"got {flush}"
        )
    nsplit, rows_per_split = _split_rows(splits, keys, values)
    nv_max = triton.cdiv(values.shape[-1], min(c.kwargs["BM"] for c in _configs()))  # the most column blocks of a tile
    out_s, out_t, out_sq, in_place = _split_outputs(gram, cross, accumulate, nsplit, nv_max)
    pointers, layout = _launch_args(keys, values, scores, mask, rows_per_split, nv_max)
    scales = (cut.scale_k.contiguous(), cut.scale_sk.contiguous(), cut.scale_v.contiguous())
    _tuned()[_grid(keys, values, nsplit)](
        *pointers, *scales, out_s, out_t, out_sq, *layout,
        HAS_SCORES=scores is not None, HAS_MASK=mask is not None, WLS=bool(weighted_least_squares),
        ACCUMULATE=in_place, K_K=cut.slices[0], K_SK=cut.slices[1], K_V=cut.slices[2], FLUSH_ROWS=flush,
    )  # fmt: skip
    _sum_splits((out_s, out_t, out_sq), gram, cross, sqnorm, accumulate)
    _poison_non_finite(cut, gram, cross)
    return gram, cross, sqnorm
