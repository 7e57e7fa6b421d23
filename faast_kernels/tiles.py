"""The tile bookkeeping the two Gram kernels share (gram.py: float modes; gram_int8.py: int8 slices).

Grid: (output tiles, L, splits). Axis 0 numbers the tiles of S's upper triangle first (n_s of them), then the tiles
of T (n_t), then one program per value-column block for ‖Y‖²; axis 1 is the layer; axis 2 the row range (split).
These @triton.jit helpers say which program owns what: its rows, its tile, the tile's right factor and where its
float64 output lives. Triton inlines them, so the kernels compile as if the code stood in each.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def upper_tile(t, nk):
    """(i, j) of the t-th tile of the upper triangle (i <= j), row-major, of an nk x nk grid of tiles."""
    total = nk * (nk + 1) // 2
    r = total - 1 - t  # counted from the last tile: row nk-1-k holds k+1 tiles
    k = ((tl.sqrt((8 * r + 1).to(tl.float32)) - 1) * 0.5).to(tl.int32)
    k = tl.where((k + 1) * (k + 2) // 2 <= r, k + 1, k)  # float rounding of the root, either way
    k = tl.where(k * (k + 1) // 2 > r, k - 1, k)
    i = nk - 1 - k
    j = nk - 1 - (r - k * (k + 1) // 2)
    return i, j


@triton.jit
def tile_of(tile, n_s, nk, nv):
    """(is_t, i, j): program `tile` owns tile (i, j) of S's upper triangle (the first n_s tiles) or of T (the rest)."""
    is_t = tile >= n_s
    ti_s, tj_s = upper_tile(tl.minimum(tile, n_s - 1), nk)
    t_idx = tl.maximum(tile - n_s, 0)
    ti = tl.where(is_t, t_idx // nv, ti_s)
    tj = tl.where(is_t, t_idx % nv, tj_s)
    return is_t, ti, tj


@triton.jit
def out_tile(OUT, split, split_stride, layer, DK, D_OUT, cols_i, cols_j):
    """(base, offsets, inside) of the [BM, BM] tile (cols_i, cols_j) of one layer's [DK, D_OUT] float64 output."""
    out = OUT + split.to(tl.int64) * split_stride + layer * DK * D_OUT
    offs = cols_i.to(tl.int64)[:, None] * D_OUT + cols_j[None, :]
    inside = (cols_i[:, None] < DK) & (cols_j[None, :] < D_OUT)
    return out, offs, inside


@triton.jit
def program_rows(K, V, N, DK, DV, ROWS_PER_SPLIT, stride_kl, stride_vl, BM: tl.constexpr):
    """What this program works on: (tile, layer, split, row_start, row_end, k_base, v_base, nk, nv, n_s, n_t), with
    rows [row_start, row_end) of its split, k_base and v_base its layer's keys and values, nk and nv the column
    blocks of K and V, n_s and n_t the tiles of S's upper triangle and of T."""
    tile = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    nk = tl.cdiv(DK, BM)
    nv = tl.cdiv(DV, BM)
    row_start = split * ROWS_PER_SPLIT
    row_end = tl.minimum(row_start + ROWS_PER_SPLIT, N)
    k_base = K + layer * stride_kl
    v_base = V + layer * stride_vl
    return tile, layer, split, row_start, row_end, k_base, v_base, nk, nv, nk * (nk + 1) // 2, nk * nv


@triton.jit
def tile_operands(
    tile, layer, split, k_base, v_base, nk, nv, n_s, OUT_S, OUT_T, DK, DV,
    stride_kn, stride_kd, stride_vn, stride_vd, split_stride_s, split_stride_t,
    ACCUMULATE: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """For a program owning a tile of S or T (tile < n_s + n_t): (is_t, ti, tj, cols_i, cols_j, b_base, b_stride_n,
    b_stride_d, b_cols, out, offs, inside). The tile's left factor is K[:, cols_i]; its right factor B[:, cols_j] is
    V (a tile of T) or K (of S), at b_base with strides (b_stride_n, b_stride_d) and b_cols columns; (out, offs,
    inside) locate the tile in OUT_T or OUT_S (out_tile), zeroed here unless ACCUMULATE (then it is added into)."""
    is_t, ti, tj = tile_of(tile, n_s, nk, nv)
    cols_i = ti * BM + tl.arange(0, BM)
    cols_j = tj * BM + tl.arange(0, BM)
    if is_t:
        b_base = v_base
        b_stride_n = stride_vn
        b_stride_d = stride_vd
        b_cols = DV
        out, offs, inside = out_tile(OUT_T, split, split_stride_t, layer, DK, DV, cols_i, cols_j)
    else:
        b_base = k_base
        b_stride_n = stride_kn
        b_stride_d = stride_kd
        b_cols = DK
        out, offs, inside = out_tile(OUT_S, split, split_stride_s, layer, DK, DK, cols_i, cols_j)
    if not ACCUMULATE:
        tl.store(out + offs, tl.zeros((BM, BM), dtype=tl.float64), mask=inside)
    return is_t, ti, tj, cols_i, cols_j, b_base, b_stride_n, b_stride_d, b_cols, out, offs, inside


@triton.jit
def mirror_s_tile(out, offs, inside, cols_i, cols_j, ti, tj, DK):
    """Make a finished tile (ti, tj) of S symmetric: a diagonal tile within itself, an off-diagonal one into the lower
    triangle."""
    tl.debug_barrier()
    total = tl.load(out + offs, mask=inside, other=0.0)
    if ti == tj:  # a diagonal tile: its two triangles hold the same sums, possibly rounded differently
        total = tl.where(cols_i[:, None] <= cols_j[None, :], total, tl.trans(total))
        tl.debug_barrier()
        tl.store(out + offs, total, mask=inside)
    else:  # mirror into the lower triangle
        offs_t = cols_j.to(tl.int64)[None, :] * DK + cols_i[:, None]
        tl.store(out + offs_t, total, mask=inside)


@triton.jit
def finish_tile(out, offs, inside, cols_i, cols_j, is_t, ti, tj, DK):
    """After a tile's last chunk: a tile of S is made symmetric (mirror_s_tile); a tile of T is complete."""
    if not is_t:
        mirror_s_tile(out, offs, inside, cols_i, cols_j, ti, tj, DK)
