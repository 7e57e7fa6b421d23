"""Fused, layer-batched Gram accumulation: S += Kᵀ K, T += Kᵀ diag(s) V and ‖Y‖² in one pass over the rows.

Layout: keys K [L, N, dk], values V [L, N, dv], scores s [L, N] (optional), mask [L, N] bool (optional), any strides;
S [L, dk, dk], T [L, dk, dv] and the GCV statistic ‖Y‖² [L] float64, updated in place.

Grid: (output tiles, L, splits). A program owns one BM x BM tile of S (upper triangle only: an off-diagonal tile is
also stored transposed into the lower one) or of T, for one layer, over one fixed range of rows. With one split the
program walks all N rows and adds straight into S and T. When tiles x L would leave most multiprocessors idle, the
rows are cut into `splits` fixed ranges; each writes its own float64 partial and the partials are summed afterwards
in split order. No atomics anywhere, so the result is bitwise reproducible for a given launch configuration.

Inside a program the rows go by in chunks of FLUSH_ROWS: the products of a chunk are summed in the mode's accumulator
and the chunk's sum is then added into the float64 tile in global memory (the program's own tile, read-modify-write),
which keeps only a float32 accumulator in registers.

Precision modes (docs/numerics.md §4):
  "fp64"    tiles are upcast to float64 and multiplied in float64: exact products and float64 sums. Passes the float64
            fidelity suite. Its float64 dot does not compile for sm_90 with Triton 3.6 when a mask or 16-bit inputs
            are involved (measured on an H100 before and after this kernel's rewrite, lab/benchmarks/results/
            gpu_h100_run1.md and gpu_h100_run2.md). faast's triton backend keeps auto away from those calls and
            raises such a failure naming the fix (FAAST_BACKEND=torch: cuBLAS DGEMM; or a float32 compute_dtype).
  "exact16" for bf16 / fp16 inputs: native 16-bit tensor-core dots, whose products are exact in float32, summed in
            float32 over FLUSH_ROWS rows and then in float64. Score-weighted factors s·v are not 16-bit numbers: they
            are split into a 16-bit head and a 16-bit tail and take two dots (~16 significant bits of s·v).
  "tf32x3"  tensor-core products at float32 accuracy: each float32 factor is split into a TF32 head and a tail and
            three TF32 dots (hi·hi + hi·lo + lo·hi) are summed in float32; 16-bit inputs without scores take one dot.
  "fp32"    plain float32 products and sums (IEEE, no TF32). Opt-in.
The float32-accumulating modes lose directions below ~1e-7·λmax like any float32 sum; the fidelity suite
(lab/benchmarks/fidelity_triton_modes.py) decides which of them a caller may use where.

Masked-out rows and the padding of the last row block are excluded with `where`, never by multiplication, so a NaN in
an ignored row cannot leak. The kernel does not import faast.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import autotuning, interpreting
from .oracle import masked_rows, target_sqnorm
from .tiles import finish_tile, program_rows, tile_operands

PRECISIONS = ("fp64", "exact16", "tf32x3", "fp32")
# Rows summed in the float32 accumulator before each float64 add, per mode (the 16-bit mode's value comes from the
# fidelity suite's sweep over R; see lab/benchmarks/results/).
FLUSH_ROWS = {"fp64": 1 << 30, "exact16": 64, "tf32x3": 256, "fp32": 256}
# A split covers at least this many rows: below it the partial tiles cost more traffic than the split saves.
MIN_SPLIT_ROWS = 2048
MAX_SPLITS = 16
_REFERENCE_TILE = 128  # tile edge the split count is planned with (the largest tuned tile)


def _configs(precision: str) -> list[triton.Config]:
    if interpreting():
        # One small tile: odd test shapes then span several tiles, row blocks and flushes.
        return [triton.Config({"BM": 32, "BK": 16}, num_warps=4, num_stages=1)]
    if precision == "fp64":
        return [triton.Config({"BM": 32, "BK": 16}, num_warps=4, num_stages=2)]
    configs = [
        triton.Config({"BM": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BK": 32}, num_warps=4, num_stages=4),
        triton.Config({"BM": 64, "BK": 64}, num_warps=4, num_stages=3),
    ]
    return configs if autotuning() else configs[:1]


@triton.jit
def _load_rows(ptr, stride_n, stride_d, rows, cols, n_cols, keep):
    # int64 offsets: L·N·d can exceed 2^31 elements.
    offs = rows.to(tl.int64)[:, None] * stride_n + cols.to(tl.int64)[None, :] * stride_d
    inside = (cols[None, :] < n_cols) & keep[:, None]
    x = tl.load(ptr + offs, mask=inside, other=0.0)
    return tl.where(inside, x, 0.0)


@triton.jit
def _keep_rows(MASK, layer, stride_ml, stride_mn, rows, end_row, HAS_MASK: tl.constexpr):
    """Which of `rows` count: those before end_row and, with a mask, not masked out."""
    keep = rows < end_row
    if HAS_MASK:
        flag = tl.load(MASK + layer * stride_ml + rows.to(tl.int64) * stride_mn, mask=keep, other=0)
        keep = keep & (flag != 0)
    return keep


@triton.jit
def _load_scores(SCORES, layer, stride_sl, stride_sn, rows, keep):
    """The scores of `rows`, 0 where a row does not count."""
    s = tl.load(SCORES + layer * stride_sl + rows.to(tl.int64) * stride_sn, mask=keep, other=0.0)
    return tl.where(keep, s, 0.0)


@triton.jit
def _chunk_product(
    a_base, b_base, SCORES, MASK, layer, start_row, end_row,
    stride_an, stride_ad, stride_bn, stride_bd, stride_sl, stride_sn, stride_ml, stride_mn,
    cols_i, cols_j, DA, DB,
    SCORED: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
    NATIVE16: tl.constexpr, TF32_SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Σ over rows [start_row, end_row) of a[:, cols_i]ᵀ · s·b[:, cols_j], [BM, BM] in the mode's accumulator."""
    if PRECISION == "fp64":
        acc = tl.zeros((BM, BM), dtype=tl.float64)
    else:
        acc = tl.zeros((BM, BM), dtype=tl.float32)
    for start in range(start_row, end_row, BK):
        rows = start + tl.arange(0, BK)
        keep = _keep_rows(MASK, layer, stride_ml, stride_mn, rows, end_row, HAS_MASK)
        a_t = tl.trans(_load_rows(a_base, stride_an, stride_ad, rows, cols_i, DA, keep))
        b = _load_rows(b_base, stride_bn, stride_bd, rows, cols_j, DB, keep)
        if SCORED:
            s = _load_scores(SCORES, layer, stride_sl, stride_sn, rows, keep)
        if PRECISION == "fp64":
            b64 = b.to(tl.float64)
            if SCORED:
                b64 = b64 * s.to(tl.float64)[:, None]
            acc += tl.dot(a_t.to(tl.float64), b64)
        elif PRECISION == "exact16":
            if SCORED:
                # s·v is not a 16-bit number: a 16-bit head and the 16-bit rounding of the float32 remainder.
                b32 = b.to(tl.float32) * s.to(tl.float32)[:, None]
                b_hi = b32.to(b.dtype)
                b_lo = (b32 - b_hi.to(tl.float32)).to(b.dtype)
                if NATIVE16:
                    acc += tl.dot(a_t, b_hi)
                    acc += tl.dot(a_t, b_lo)
                else:  # the interpreter evaluates 16-bit dots wrongly: the same exact products from float32 copies
                    a32 = a_t.to(tl.float32)
                    acc += tl.dot(a32, b_hi.to(tl.float32), input_precision="ieee")
                    acc += tl.dot(a32, b_lo.to(tl.float32), input_precision="ieee")
            elif NATIVE16:
                acc += tl.dot(a_t, b)
            else:
                acc += tl.dot(a_t.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            a32 = a_t.to(tl.float32)
            b32 = b.to(tl.float32)
            if SCORED:
                b32 = b32 * s.to(tl.float32)[:, None]
            if PRECISION == "tf32x3":
                if TF32_SPLIT or SCORED:
                    # x = hi + lo with hi = x's top 11 significand bits (exactly a TF32 number): hi·hi is exact in
                    # float32, and the two cross terms restore the bits TF32 drops (3xTF32).
                    a_hi = (a32.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                    b_hi = (b32.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                    acc += tl.dot(a_hi, b32 - b_hi, input_precision="tf32")
                    acc += tl.dot(a32 - a_hi, b_hi, input_precision="tf32")
                    acc += tl.dot(a_hi, b_hi, input_precision="tf32")
                else:  # 16-bit inputs are TF32 numbers already: one exact-product dot
                    acc += tl.dot(a32, b32, input_precision="tf32")
            else:
                acc += tl.dot(a32, b32, input_precision="ieee")
    return acc


@triton.jit
def _tile_chunk_product(
    k_base, b_base, SCORES, MASK, layer, start_row, end_row, is_t,
    stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn, stride_ml, stride_mn,
    cols_i, cols_j, DK, b_cols,
    HAS_SCORES: tl.constexpr, HAS_MASK: tl.constexpr, WLS: tl.constexpr, PRECISION: tl.constexpr,
    NATIVE16: tl.constexpr, TF32_SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """_chunk_product for a tile of S (is_t false) or of T, scored where the options say so."""
    # Scores weight the values (tiles of T) only; with weighted least squares, the rows of S too. SCORED is a
    # constexpr and is_t is not: one call for each value SCORED takes.
    if HAS_SCORES:
        if WLS:
            acc = _chunk_product(k_base, b_base, SCORES, MASK, layer, start_row, end_row,
                                 stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn,
                                 stride_ml, stride_mn, cols_i, cols_j, DK, b_cols, True, HAS_MASK,
                                 PRECISION, NATIVE16, TF32_SPLIT, BM, BK)  # fmt: skip
        elif is_t:
            acc = _chunk_product(k_base, b_base, SCORES, MASK, layer, start_row, end_row,
                                 stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn,
                                 stride_ml, stride_mn, cols_i, cols_j, DK, b_cols, True, HAS_MASK,
                                 PRECISION, NATIVE16, TF32_SPLIT, BM, BK)  # fmt: skip
        else:
            acc = _chunk_product(k_base, b_base, SCORES, MASK, layer, start_row, end_row,
                                 stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn,
                                 stride_ml, stride_mn, cols_i, cols_j, DK, b_cols, False, HAS_MASK,
                                 PRECISION, NATIVE16, TF32_SPLIT, BM, BK)  # fmt: skip
    else:
        acc = _chunk_product(k_base, b_base, SCORES, MASK, layer, start_row, end_row,
                             stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn,
                             stride_ml, stride_mn, cols_i, cols_j, DK, b_cols, False, HAS_MASK,
                             PRECISION, NATIVE16, TF32_SPLIT, BM, BK)  # fmt: skip
    return acc


@triton.jit
def _flush(out, offs, inside, acc):
    """Add a chunk's sum into the program's own float64 tile in global memory (read-modify-write)."""
    tl.debug_barrier()  # the previous flush's stores (by any thread of the program) before this load
    prev = tl.load(out + offs, mask=inside, other=0.0)
    tl.store(out + offs, prev + acc.to(tl.float64), mask=inside)


@triton.jit
def _sqnorm_block(
    v_base, SCORES, MASK, OUT_SQ, layer, split, tj, row_start, row_end,
    stride_vn, stride_vd, stride_sl, stride_sn, stride_ml, stride_mn, DV, NV_MAX,
    HAS_SCORES: tl.constexpr, HAS_MASK: tl.constexpr, WLS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """The GCV statistic ‖Y‖² over value-column block tj: Σ s²‖v‖² (Σ s‖v‖² with weighted least squares)."""
    cols = tj * BM + tl.arange(0, BM)
    sq = tl.zeros((BM,), dtype=tl.float64)
    for start in range(row_start, row_end, BK):
        rows = start + tl.arange(0, BK)
        keep = _keep_rows(MASK, layer, stride_ml, stride_mn, rows, row_end, HAS_MASK)
        v = _load_rows(v_base, stride_vn, stride_vd, rows, cols, DV, keep).to(tl.float64)
        if HAS_SCORES:
            s = _load_scores(SCORES, layer, stride_sl, stride_sn, rows, keep).to(tl.float64)
            w = s if WLS else s * s
            sq += tl.sum(v * v * w[:, None], axis=0)
        else:
            sq += tl.sum(v * v, axis=0)
    tl.store(OUT_SQ + (split * tl.num_programs(1) + layer) * NV_MAX + tj, tl.sum(sq, axis=0))


@triton.jit(do_not_specialize=["N", "ROWS_PER_SPLIT"])
def _gram_kernel(
    K, V, SCORES, MASK, OUT_S, OUT_T, OUT_SQ,
    N, DK, DV, ROWS_PER_SPLIT,
    stride_kl, stride_kn, stride_kd,
    stride_vl, stride_vn, stride_vd,
    stride_sl, stride_sn,
    stride_ml, stride_mn,
    split_stride_s, split_stride_t, NV_MAX,
    HAS_SCORES: tl.constexpr, HAS_MASK: tl.constexpr, WLS: tl.constexpr, ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr, NATIVE16: tl.constexpr, TF32_SPLIT: tl.constexpr, FLUSH_ROWS: tl.constexpr,
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
        # Each chunk's sum goes straight into the program's own float64 tile in global memory (read-modify-write):
        # only the float32 accumulator lives in registers.
        for chunk in range(row_start, row_end, FLUSH_ROWS):
            chunk_end = tl.minimum(chunk + FLUSH_ROWS, row_end)
            acc = _tile_chunk_product(k_base, b_base, SCORES, MASK, layer, chunk, chunk_end, is_t,
                                      stride_kn, stride_kd, b_stride_n, b_stride_d, stride_sl, stride_sn,
                                      stride_ml, stride_mn, cols_i, cols_j, DK, b_cols, HAS_SCORES, HAS_MASK,
                                      WLS, PRECISION, NATIVE16, TF32_SPLIT, BM, BK)  # fmt: skip
            _flush(out, offs, inside, acc)
        finish_tile(out, offs, inside, cols_i, cols_j, is_t, ti, tj, DK)
    else:
        _sqnorm_block(v_base, SCORES, MASK, OUT_SQ, layer, split, tile - n_s - n_t, row_start, row_end,
                      stride_vn, stride_vd, stride_sl, stride_sn, stride_ml, stride_mn, DV, NV_MAX,
                      HAS_SCORES, HAS_MASK, WLS, BM, BK)  # fmt: skip


@functools.cache
def _tuned(precision: str):  # noqa: ANN202 - a triton Autotuner
    # Tiles, row steps, warps and stages do not change which rows a program sums or when it flushes into float64, so
    # every configuration computes the same partial sums; autotuning picks the fastest per (dk, dv, mode, options).
    return triton.autotune(
        configs=_configs(precision),
        key=["DK", "DV", "HAS_SCORES", "HAS_MASK", "WLS", "ACCUMULATE", "NATIVE16", "TF32_SPLIT"],
        restore_value=["OUT_S", "OUT_T", "OUT_SQ"],
    )(_gram_kernel)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_splits(n: int, dk: int, dv: int, layers: int, device: torch.device) -> int:
    """How many row ranges to cut N into: enough programs for two waves of the GPU's multiprocessors, each range at
    least MIN_SPLIT_ROWS rows (1 on a CPU and whenever the tiles alone fill the GPU)."""
    if device.type != "cuda":
        return 1
    tiles = triton.cdiv(dk, _REFERENCE_TILE)
    tiles = tiles * (tiles + 1) // 2 + tiles * triton.cdiv(dv, _REFERENCE_TILE)
    want = triton.cdiv(2 * _sm_count(device.index or 0), tiles * layers)
    return max(1, min(want, MAX_SPLITS, n // MIN_SPLIT_ROWS))


def _check(name: str, t: torch.Tensor | None, shape: tuple, device: torch.device) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _checked_inputs(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    precision: str,
    flush_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """gram_accumulate's inputs checked: (keys, values) in one common dtype, and the rows per flush."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor [L, N, d], got {getattr(t, 'shape', type(t))}")
    L, N, dk = keys.shape
    dv = values.shape[-1]
    device = keys.device
    if values.shape[:2] != (L, N):
        raise ValueError(f"values: expected shape [{L}, {N}, dv] (the L, N of keys), got {list(values.shape)}")
    _check("values", values, (L, N, dv), device)
    _check("scores", scores, (L, N), device)
    _check("mask", mask, (L, N), device)
    if keys.dtype != values.dtype:  # one dtype for both dot operands; the promotion is exact
        common = torch.promote_types(keys.dtype, values.dtype)
        keys, values = keys.to(common), values.to(common)
    if precision == "exact16" and keys.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"keys: precision='exact16' needs bfloat16 or float16 keys and values, got {keys.dtype}")
    flush = FLUSH_ROWS[precision] if flush_rows is None else int(flush_rows)
    if flush < 1:
        raise ValueError(f"flush_rows: expected an int >= 1, got {flush_rows!r}")
    return keys, values, flush


def _accumulators(
    gram: torch.Tensor | None,
    cross: torch.Tensor | None,
    sqnorm: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(gram, cross, sqnorm, accumulate) for keys [L, N, dk] and values [L, N, dv]: the caller's accumulators checked
    (accumulate: True), or new empty ones."""
    L, _, dk = keys.shape
    dv = values.shape[-1]
    device = keys.device
    accumulators = {"gram": gram, "cross": cross, "sqnorm": sqnorm}
    given = [k for k, v in accumulators.items() if v is not None]
    if given and len(given) != 3:
        raise ValueError("gram, cross, sqnorm: pass all three accumulators or none")
    accumulate = bool(given)
    if gram is not None and cross is not None and sqnorm is not None:  # accumulate (all three or none, as checked)
        for name, t, shape in (("gram", gram, (L, dk, dk)), ("cross", cross, (L, dk, dv)), ("sqnorm", sqnorm, (L,))):
            if t.dtype != torch.float64 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
                raise ValueError(f"{name}: expected a contiguous float64 tensor {list(shape)} on {device}")
    else:
        gram = torch.empty((L, dk, dk), dtype=torch.float64, device=device)
        cross = torch.empty((L, dk, dv), dtype=torch.float64, device=device)
        sqnorm = torch.empty((L,), dtype=torch.float64, device=device)
    return gram, cross, sqnorm, accumulate


def _nothing_to_launch(
    keys: torch.Tensor,
    values: torch.Tensor,
    gram: torch.Tensor,
    cross: torch.Tensor,
    sqnorm: torch.Tensor,
    accumulate: bool,
) -> bool:
    """Whether an empty dimension of keys [L, N, dk] or values [L, N, dv] leaves the kernel nothing to do; new
    accumulators are zeroed where it has nothing to add to them."""
    L, N, dk = keys.shape
    dv = values.shape[-1]
    if L == 0 or dk == 0:
        if not accumulate:
            cross.zero_()
            sqnorm.zero_()
        return True
    if N == 0 or dv == 0:
        if not accumulate:
            gram.zero_()
            cross.zero_()
            sqnorm.zero_()
        # dv == 0 still has a Gram to compute: only an empty stream has nothing to add.
        if N == 0:
            return True
    return False


def _split_outputs(
    gram: torch.Tensor, cross: torch.Tensor, in_place: bool, nsplit: int, nv_max: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(out_s, out_t, out_sq, in_place) the kernel writes: the accumulators themselves with one split (added into
    when in_place), else float64 partials [splits, L, ...]; out_sq: a partial ‖Y‖² per split, layer, column block."""
    L, dk, dv = cross.shape  # gram [L, dk, dk], cross [L, dk, dv]
    device = gram.device
    if nsplit == 1:
        out_s, out_t = gram, cross
    else:
        out_s = torch.empty((nsplit, L, dk, dk), dtype=torch.float64, device=device)
        out_t = torch.empty((nsplit, L, dk, dv), dtype=torch.float64, device=device)
        in_place = False
    out_sq = torch.zeros((nsplit, L, nv_max), dtype=torch.float64, device=device)
    return out_s, out_t, out_sq, in_place


def _split_rows(splits: int | None, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
    """(splits, rows per split) for keys [L, N, dk] and values [L, N, dv]: `splits` checked, or plan_splits'."""
    L, N, dk = keys.shape
    nsplit = plan_splits(N, dk, values.shape[-1], L, keys.device) if splits is None else int(splits)
    if nsplit < 1:
        raise ValueError(f"splits: expected an int >= 1, got {splits!r}")
    return nsplit, triton.cdiv(N, nsplit)


def _launch_args(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None,
    rows_per_split: int, nv_max: int,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:  # fmt: skip
    """The arguments both Gram kernels take: (pointers, layout). pointers: K, V, scores and mask (as int8), keys
    standing in for an absent one; layout, after the output pointers: N, dk, dv, the rows per split, the strides of
    keys, values, scores and mask (0 for an absent one), the split strides of S and T, and nv_max."""
    L, N, dk = keys.shape
    dv = values.shape[-1]
    mask_arg = mask.to(torch.int8) if mask is not None else keys  # dummy pointer when absent
    scores_arg = scores if scores is not None else keys
    layout = (
        N, dk, dv, rows_per_split,
        *keys.stride(), *values.stride(),
        *(scores.stride() if scores is not None else (0, 0)),
        *(mask_arg.stride() if mask is not None else (0, 0)),
        L * dk * dk, L * dk * dv, nv_max,
    )  # fmt: skip
    return (keys, values, scores_arg, mask_arg), layout


def _grid(keys: torch.Tensor, values: torch.Tensor, nsplit: int):  # noqa: ANN202 - a launch grid function
    L, _, dk = keys.shape
    dv = values.shape[-1]

    def grid(meta: dict) -> tuple[int, int, int]:
        # Tiles of S's upper triangle, tiles of T, and one program per value-column block for ‖Y‖².
        nk, nv = triton.cdiv(dk, meta["BM"]), triton.cdiv(dv, meta["BM"])
        return (nk * (nk + 1) // 2 + nk * nv + nv, L, nsplit)

    return grid


def _sum_splits(
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    gram: torch.Tensor,
    cross: torch.Tensor,
    sqnorm: torch.Tensor,
    accumulate: bool,
) -> None:
    """Sum the kernel's outputs (out_s, out_t, out_sq) over splits into gram, cross (unless the kernel wrote them
    itself, with one split) and sqnorm: added when accumulating, copied otherwise."""
    out_s, out_t, out_sq = out
    nsplit = out_sq.shape[0]
    if nsplit > 1:
        # Partials summed in split order (a fixed order: bitwise reproducible), then into the accumulators.
        total_s, total_t = out_s[0], out_t[0]
        for k in range(1, nsplit):
            total_s = total_s + out_s[k]
            total_t = total_t + out_t[k]
        if accumulate:
            gram.add_(total_s)
            cross.add_(total_t)
        else:
            gram.copy_(total_s)
            cross.copy_(total_t)
    # Entries past the chosen tile's column-block count stay zero in out_sq.
    batch_sq = out_sq[0].sum(-1)
    for k in range(1, nsplit):
        batch_sq = batch_sq + out_sq[k].sum(-1)
    if accumulate:
        sqnorm.add_(batch_sq)
    else:
        sqnorm.copy_(batch_sq)


def gram_accumulate(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    gram: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
    sqnorm: torch.Tensor | None = None,
    weighted_least_squares: bool = False,
    precision: str = "fp64",
    flush_rows: int | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused Gram kernel for all layers at once.

    Args:
        keys: [L, N, dk] float16 / bfloat16 / float32 / float64, any strides.
        values: [L, N, dv], same L and N. keys and values of different dtypes are promoted to a common one.
        scores: [L, N] or None. mask: [L, N] bool or None (False rows are skipped).
        gram, cross, sqnorm: float64 accumulators [L, dk, dk], [L, dk, dv], [L], contiguous, updated in place; None:
            new ones holding just this batch's statistics. sqnorm collects ‖Y‖² (Σ s²‖v‖², or Σ s‖v‖² with weighted
            least squares), the statistic generalized cross-validation needs.
        precision: one of PRECISIONS (see the module docstring). "exact16" needs bf16 or fp16 keys and values.
        flush_rows: rows summed in the float32 accumulator before each float64 add (default FLUSH_ROWS[precision]).
        splits: row ranges (default: plan_splits). Results are bitwise reproducible for a given value.

    Returns (gram, cross, sqnorm), float64.
    """
    keys, values, flush = _checked_inputs(keys, values, scores, mask, precision, flush_rows)
    gram, cross, sqnorm, accumulate = _accumulators(gram, cross, sqnorm, keys, values)
    if _nothing_to_launch(keys, values, gram, cross, sqnorm, accumulate):
        return gram, cross, sqnorm
    nsplit, rows_per_split = _split_rows(splits, keys, values)
    block = _configs(precision)[-1].kwargs["BM"]  # the smallest tile: the most column tiles of any configuration
    nv_max = triton.cdiv(values.shape[-1], block)
    out_s, out_t, out_sq, in_place = _split_outputs(gram, cross, accumulate, nsplit, nv_max)
    pointers, layout = _launch_args(keys, values, scores, mask, rows_per_split, nv_max)
    native16 = keys.dtype in (torch.float16, torch.bfloat16) and not interpreting() and keys.device.type == "cuda"
    tf32_split = keys.dtype in (torch.float32, torch.float64)
    _tuned(precision)[_grid(keys, values, nsplit)](
        *pointers, out_s, out_t, out_sq, *layout,
        HAS_SCORES=scores is not None, HAS_MASK=mask is not None, WLS=bool(weighted_least_squares),
        ACCUMULATE=in_place, PRECISION=precision, NATIVE16=native16, TF32_SPLIT=tf32_split, FLUSH_ROWS=flush,
    )  # fmt: skip
    _sum_splits((out_s, out_t, out_sq), gram, cross, sqnorm, accumulate)
    return gram, cross, sqnorm


def naive_gram(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    weighted_least_squares: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 oracle of gram_accumulate: (Kᵀ K, Kᵀ diag(s) V, ‖Y‖²) over unmasked rows, [L, dk, dk], [L, dk, dv],
    [L]."""
    k, v, s = masked_rows(keys, values, scores, mask)
    sqnorm = target_sqnorm(v, s, weighted_least_squares)
    if s is None:
        return k.mT @ k, k.mT @ v, sqnorm
    if weighted_least_squares:
        return k.mT @ (s[..., None] * k), k.mT @ (s[..., None] * v), sqnorm
    return k.mT @ k, k.mT @ (s[..., None] * v), sqnorm
