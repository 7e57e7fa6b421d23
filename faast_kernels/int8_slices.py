"""The int8 slices of the Gram statistics (the Ozaki scheme): how many, their column scales, their error bound, and
the torch oracle of faast_kernels.gram_int8's kernel (docs/numerics.md §4.4). Pure torch: no Triton here.

The arithmetic. Every column j of a factor (K; V, or the scored s·V; with weighted least squares s·K, formed in
float64, exactly for 16-bit or float32 x and float32 scores) gets a power-of-two scale 2^E_j > max_n |x_nj| over the
call's unmasked rows. Each element is cut, toward zero, into k int8 slices of 7 bits (k per factor):

    x = 2^E_j · Σ_{a=1..k} q_a · 2^(-7a) + r,      |q_a| <= 127,   |r| < 2^(E_j - 7k),

so a product of two elements is 2^(E_i+E_j) Σ_{a,b} q_a q'_b 2^(-7(a+b)) plus the remainders' terms. The pairs of one
weight m = a + b share one int32 accumulator: their int8 x int8 products are exact and so is their int32 sum while a
chunk has at most max_chunk_rows(k) = floor((2^31 - 1) / (k · 127²)) rows (k: the smaller factor's count; at most k
pairs share a weight); the chunk's sum is then scaled by 2^(-7m) · 2^(E_i+E_j), exactly, and added into the float64
output. Pairs of weight m > 10 (each below 2^-56 of 2^(E_i+E_j) per row) are dropped.

The bound (per row and entry, relative to 2^(E_i+E_j) < 4·max|x_i|·max|x_j|): the dropped pairs add at most
Σ_{a+b>10} 127² 2^(-7(a+b)) < 2^-60, each factor's remainder at most 2^-7k of it, and none when all its elements
are in range: an element with p significant bits and |x| >= 2^(E_j - 1 - e) is represented exactly by k slices when
7k >= p + e. So `plan` chooses each factor's slices from the inputs: k = ceil((p + e) / 7) for the largest exponent
span e of its columns (p: bf16 8, fp16 11, float32 24; a scored factor s·x adds the scores' bits, at most 53), at
most MAX_SLICES = 8, where a remainder is below 2^-56. In every case each row's product is off by less than
BOUND = 2^-53 · 2^(E_i+E_j), one float64 rounding of the column maxima's product (`Plan.bound`). With every element in
range and no pair dropped (`Plan.exact`, k <= 5) the products are exact and only the float64 additions of the chunk
sums round: fewer roundings than a float64 GEMM makes. ‖Y‖² is summed in float64 from float64 products, as in the fp64
mode of gram.py.

`naive_gram_int8` is the kernel's arithmetic in torch (the same plan and slices, int64 products over all rows at
once): the tests' oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .oracle import masked_rows, target_sqnorm

SLICE_BITS = 7
MAX_SLICES = 8
PAIR_WEIGHT_MAX = 10  # pairs (a, b) with a + b above this are dropped
FLUSH_ROWS = 8192
BOUND = 2.0**-53  # per row, relative to 2^(E_i + E_j)
# Significant bits of an input dtype (a scored operand s·x has the sum, at most float64's 53).
SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def max_chunk_rows(slices: int) -> int:
    """Rows whose int32 sums stay exact: at most `slices` pairs (the fewer slices of the two factors) of
    |q| <= 127 share an accumulator per row."""
    return (2**31 - 1) // (slices * 127 * 127)


def dropped_weight(slices_a: int, slices_b: int) -> float:
    """Σ over the dropped pairs (a + b > PAIR_WEIGHT_MAX, a <= slices_a, b <= slices_b) of 127² 2^(-7(a+b)): their
    largest share of a row's product, relative to 2^(E_i+E_j)."""
    return sum(
        127.0**2 * 2.0 ** (-SLICE_BITS * (a + b))
        for a in range(1, slices_a + 1)
        for b in range(1, slices_b + 1)
        if a + b > PAIR_WEIGHT_MAX
    )


def error_bound(slices_a: int, slices_b: int, in_range_a: bool = True, in_range_b: bool = True) -> float:
    """The error of one row's product relative to 2^(E_i+E_j) (module docstring): the dropped pairs, plus each
    factor's remainder (below 2^-7k of its column's 2^E) unless all its elements are in range."""
    rest_a = 0.0 if in_range_a else 2.0 ** (-SLICE_BITS * slices_a)
    rest_b = 0.0 if in_range_b else 2.0 ** (-SLICE_BITS * slices_b)
    return dropped_weight(slices_a, slices_b) + rest_a + rest_b + rest_a * rest_b


@dataclass(frozen=True)
class Plan:
    """What one call is cut into, for its three factors: keys (k), the Gram's right factor (sk: s·K with weighted
    least squares, else keys) and the values' factor (v: s·V with scores, else V). slices: (k, sk, v) slice counts;
    in_range: whether every element of each is represented exactly; column scales 2^-E [L, d] float64 and `finite`
    [L, d] bool of each; `exact`: every element in range and no pair dropped, so every product is exact."""

    slices: tuple[int, int, int]
    in_range: tuple[bool, bool, bool]
    scale_k: torch.Tensor
    scale_sk: torch.Tensor
    scale_v: torch.Tensor
    finite: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    exact: bool

    def bound(self) -> float:
        """The largest error of one row's product in S and T, relative to 2^(E_i+E_j)."""
        (k, sk, v), (rk, rsk, rv) = self.slices, self.in_range
        return max(error_bound(k, sk, rk, rsk), error_bound(k, v, rk, rv))

    def chunk_rows(self) -> int:
        """The most rows one exact int32 chunk may hold for these slice counts."""
        k, sk, v = self.slices
        return max_chunk_rows(max(min(k, sk), min(k, v)))


_PLAN_ROWS = 8192  # rows per float64 pass of the plan (bounds its temporary: 8192 x d x 8 bytes a layer)


def _column_extremes(
    x: torch.Tensor, keep: torch.Tensor | None, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min over nonzero) of |x| (times |weights| per row: the float64 product the kernel forms) per column
    [L, d] float64, masked rows left out; the min is inf for a column without a nonzero element."""
    L, N, d = x.shape
    top = torch.zeros((L, d), dtype=torch.float64, device=x.device)
    low = torch.full((L, d), torch.inf, dtype=torch.float64, device=x.device)
    for start in range(0, N, _PLAN_ROWS):
        a = x[:, start : start + _PLAN_ROWS].double().abs()
        if weights is not None:
            a = a * weights[:, start : start + _PLAN_ROWS].double().abs()[..., None]
        if keep is not None:
            a = torch.where(keep[:, start : start + _PLAN_ROWS, None], a, 0.0)
        top = torch.maximum(top, a.amax(dim=1))  # NaN propagates: the column is marked non-finite
        low = torch.minimum(low, torch.where(a > 0, a, torch.inf).amin(dim=1))
    return top, low


def _column_plan(
    x: torch.Tensor, keep: torch.Tensor | None, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale 2^-E [L, d] float64 with max |x| < 2^E per column, span [] int64: the largest E_j - g over the nonzero
    elements, |x| in [2^(g-1), 2^g), finite [L, d] bool) of the rows x [L, N, d] (scored by weights when given)."""
    top, low = _column_extremes(x, keep, weights)
    finite = torch.isfinite(top)
    top = torch.where(finite, top, 0.0)
    _, e_top = torch.frexp(top)  # a rounded product rounds to 2^E at most from below: still max < 2^E
    _, e_low = torch.frexp(torch.where(torch.isfinite(low), low, 1.0))
    if weights is not None:  # the rounded product's exponent may sit one below the exact one's
        e_low = e_low - 1
    spans = torch.where(top > 0, e_top - e_low, 0)
    span = spans.amax() if spans.numel() else torch.zeros((), dtype=spans.dtype, device=spans.device)
    scale = torch.exp2(-e_top.to(torch.float64))
    return scale, span.to(torch.int64), finite


def plan(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    weighted_least_squares: bool = False,
) -> Plan:
    """The slice count and column scales for these rows (module docstring). Reads one number back to the host."""
    keep = None if mask is None else mask.bool()
    p_in = SIGNIFICANT_BITS[keys.dtype]
    p_scored = min(53, p_in + SIGNIFICANT_BITS.get(scores.dtype, 53)) if scores is not None else p_in
    scale_k, span_k, fin_k = _column_plan(keys, keep, None)
    if scores is not None and weighted_least_squares:
        scale_sk, span_sk, fin_sk = _column_plan(keys, keep, scores)
    else:
        scale_sk, span_sk, fin_sk = scale_k, span_k, fin_k
    scale_v, span_v, fin_v = _column_plan(values, keep, scores)
    p_sk = p_scored if weighted_least_squares and scores is not None else p_in
    p_v = p_scored if scores is not None else p_in
    need = torch.stack([span_k + p_in, span_sk + p_sk, span_v + p_v])
    # The one host synchronisation: slice counts are constants of the compiled kernel.
    wanted = [max(1, math.ceil(int(bits) / SLICE_BITS)) for bits in need.tolist()]
    k, sk, v = (min(w, MAX_SLICES) for w in wanted)
    in_range = (wanted[0] <= MAX_SLICES, wanted[1] <= MAX_SLICES, wanted[2] <= MAX_SLICES)
    exact = all(in_range) and dropped_weight(k, sk) == 0.0 and dropped_weight(k, v) == 0.0
    return Plan((k, sk, v), in_range, scale_k, scale_sk, scale_v, (fin_k, fin_sk, fin_v), exact)


def _poison_non_finite(plan_: Plan, gram: torch.Tensor, cross: torch.Tensor) -> None:
    """NaN into the rows and columns of S and T whose input column had a NaN or Inf (the slices cannot carry it)."""
    fin_k, fin_sk, fin_v = plan_.finite
    rows = fin_k & fin_sk  # S is mirrored from its upper triangle: a bad column spoils its row and column
    gram.add_(torch.where(rows[..., :, None] & rows[..., None, :], 0.0, torch.nan))
    cross.add_(torch.where(fin_k[..., :, None] & fin_v[..., None, :], 0.0, torch.nan))


def _slices_torch(y: torch.Tensor, slices: int) -> list[torch.Tensor]:
    """The int8 slices of y (|y| < 1, float64) as int64 tensors, cut toward zero as the kernel cuts them."""
    out, r = [], y * 128.0
    for _ in range(slices):
        q = torch.trunc(r)
        out.append(q.to(torch.int64))
        r = (r - q) * 128.0
    return out


def naive_gram_int8(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    weighted_least_squares: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in torch (the oracle): the same plan and slices, int64 products over all rows at once,
    pairs summed into float64 in the kernel's order. Returns (S [L, dk, dk], T [L, dk, dv], ‖Y‖² [L]) float64."""
    if keys.dtype != values.dtype:  # as the launcher: one slicing precision for both
        common = torch.promote_types(keys.dtype, values.dtype)
        keys, values = keys.to(common), values.to(common)
    cut = plan(keys, values, scores, mask, weighted_least_squares=weighted_least_squares)
    k, v, s = masked_rows(keys, values, scores, mask)
    sk = k if s is None or not weighted_least_squares else k * s[..., None]
    sv = v if s is None else v * s[..., None]
    qk = _slices_torch(k * cut.scale_k[:, None, :], cut.slices[0])
    qsk = _slices_torch(sk * cut.scale_sk[:, None, :], cut.slices[1])
    qv = _slices_torch(sv * cut.scale_v[:, None, :], cut.slices[2])

    def product(qa: list[torch.Tensor], qb: list[torch.Tensor], ua: torch.Tensor, ub: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(ua.shape[0], ua.shape[1], ub.shape[1], dtype=torch.float64, device=ua.device)
        unscale = (1.0 / ua)[:, :, None] * (1.0 / ub)[:, None, :]
        na, nb = len(qa), len(qb)
        for m in range(2, min(na + nb, PAIR_WEIGHT_MAX) + 1):
            ints = torch.zeros(total.shape, dtype=torch.int64, device=total.device)
            for a in range(max(1, m - nb), min(na, m - 1) + 1):
                ints += qa[a - 1].mT @ qb[m - a - 1]
            total += ints.double() * 2.0 ** (-SLICE_BITS * m) * unscale
        return total

    gram = product(qk, qsk, cut.scale_k, cut.scale_sk)
    gram = torch.where(torch.ones_like(gram, dtype=torch.bool).triu(), gram, gram.mT)  # the upper triangle, mirrored
    cross = product(qk, qv, cut.scale_k, cut.scale_v)
    sqnorm = target_sqnorm(v, s, weighted_least_squares)
    _poison_non_finite(cut, gram, cross)
    return gram, cross, sqnorm
