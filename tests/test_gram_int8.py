"""faast_kernels.gram_int8: the Gram statistics from int8 slices against float64, its stated bound, and the gate that
lets compute_dtype=float64 choose it (docs/numerics.md §4, "int8 slices").

The kernel runs in Triton's CPU interpreter here (conftest sets TRITON_INTERPRET=1), which is slow: shapes are small
but odd (N, d, dv not multiples of the 32-wide interpreter tile), and the exponent ranges decide the slice counts.
Outputs allocated inside faast_kernels start as NaN under test (conftest), so an unwritten tile fails.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from faast_kernels import gram as gram_kernels  # noqa: E402
from faast_kernels import gram_int8 as g8  # noqa: E402
from faast_kernels import int8_slices, interpreting  # noqa: E402

import faast.ops  # noqa: E402
from faast.ops import _dispatch, _triton_backend, backends  # noqa: E402
from tolerances import INT8_SLICE_ROUNDING, REORDER_REL, rel  # noqa: E402

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
# The interpreter runs CPU tensors; compiled kernels need CUDA ones (conftest interprets only without a GPU).
DEVICE = torch.device("cpu" if interpreting() else "cuda")


def _kernel(*args, **kwargs):
    """g8.gram_accumulate_int8 on DEVICE: tensor arguments moved there, the results (and any accumulators passed,
    updated in place) brought back to the CPU."""
    move = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    moved = {k: move(v) for k, v in kwargs.items()}
    out = g8.gram_accumulate_int8(*map(move, args), **moved)
    for name in ("gram", "cross", "sqnorm"):
        if isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name].copy_(moved[name])
    return tuple(t.cpu() for t in out)


def _few_bit(shape, dtype, *, span=10, gen):
    """Values of 7 significant bits over `span` binades: every product and every float64 sum of a few hundred of
    them is exact, so the float64 reference is the exact truth."""
    q = torch.randint(-127, 128, shape, generator=gen).double()
    return (q * torch.exp2(-torch.randint(0, span, shape, generator=gen).double())).to(dtype)


def _wide(shape, dtype, *, gen):
    """Columns 2^±40 (bf16, float32) or 2^±10 (fp16) apart with values spread over 2^-30 of each column's scale, and
    (16-bit) some subnormals: more bits than eight slices hold."""
    reach = 10 if dtype == torch.float16 else 40
    col = torch.exp2(torch.linspace(-reach, reach, shape[-1]))
    x = torch.randn(shape, generator=gen) * col * torch.exp2(-30 * torch.rand(shape, generator=gen))
    if dtype != torch.float32:
        tiny = torch.finfo(dtype).smallest_normal
        x[..., 0, :] = tiny * torch.tensor([0.25, -0.5, 0.75])[torch.arange(shape[-1]) % 3]
    return x.to(dtype)


def _within_bound(got, ref, scale_a, scale_b, rows, bound):
    """|got - ref| <= rows · (bound + INT8_SLICE_ROUNDING) · 2^(E_i+E_j) entrywise (scale: 2^-E per column)."""
    unit = (1.0 / scale_a)[..., :, None] * (1.0 / scale_b)[..., None, :]
    err = (got - ref).abs() / unit
    return float(err.max()) if err.numel() else 0.0, max(rows, 1) * (bound + INT8_SLICE_ROUNDING)


# ---------------------------------------------------------------------------------------------------- the bound


def test_chunk_bound_keeps_int32_sums_exact():
    for k in range(1, g8.MAX_SLICES + 1):
        rows = g8.max_chunk_rows(k)
        assert rows * k * 127**2 <= 2**31 - 1 < (rows + 1) * k * 127**2
    assert g8.FLUSH_ROWS <= g8.max_chunk_rows(g8.MAX_SLICES)


def test_every_plan_is_within_one_float64_rounding_and_seven_slices_would_not_be():
    for ka in range(1, g8.MAX_SLICES + 1):
        for kb in range(1, g8.MAX_SLICES + 1):
            assert g8.error_bound(ka, kb, ka < g8.MAX_SLICES, kb < g8.MAX_SLICES) <= g8.BOUND
    assert g8.error_bound(7, 7, False, False) > g8.BOUND  # out-of-range elements need the eighth slice
    assert g8.dropped_weight(5, 5) == 0.0 and g8.dropped_weight(3, 7) == 0.0 and g8.dropped_weight(6, 6) > 0


@pytest.mark.parametrize(
    ("dtype", "span", "slices"),
    [
        (torch.bfloat16, 13, 3),
        (torch.bfloat16, 14, 4),
        (torch.float16, 3, 2),
        (torch.float32, 4, 4),
        (torch.float32, 5, 5),
        (torch.bfloat16, 120, 8),
    ],  # fmt: skip
)
def test_slice_count_is_ceil_of_bits_plus_span_over_seven(dtype, span, slices):
    # Column max 1.5 (E = 1) and smallest element 2^(1 - span) · 1.5 (g = 1 - span + 1): exponent span e = span.
    keys = torch.full((1, 4, 2), 1.5, dtype=torch.float64)
    keys[0, 1] = 1.5 * 2.0 ** (-span)
    keys = keys.to(dtype)
    assert keys[0, 1, 0] != 0
    got = g8.plan(keys, keys)
    assert got.slices == (slices,) * 3
    assert got.in_range == ((math.ceil((g8.SIGNIFICANT_BITS[dtype] + span) / 7) <= g8.MAX_SLICES),) * 3


def test_scores_add_their_bits_to_the_scored_factors_only():
    keys = torch.ones(1, 3, 2, dtype=torch.bfloat16)
    scores = torch.ones(1, 3)
    got = g8.plan(keys, keys, scores)
    assert got.slices == (2, 2, 5)  # keys 8 bits (+1 span); s·v: 8 + 24 bits
    assert g8.plan(keys, keys, scores, weighted_least_squares=True).slices == (2, 5, 5)


def test_oracle_slices_reconstruct_in_range_elements_exactly():
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _few_bit((2, 50, 7), dtype, gen=gen)
        cut = g8.plan(x, x)
        y = x.double() * cut.scale_k[:, None, :]
        q = int8_slices._slices_torch(y, cut.slices[0])
        assert all(int(t.abs().max()) <= 127 for t in q)
        back = sum(t.double() * 2.0 ** (-7 * (a + 1)) for a, t in enumerate(q))
        assert torch.equal(back, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_oracle_is_within_the_bound_on_wide_range_columns(dtype):
    gen = torch.Generator().manual_seed(2)
    keys, values = _wide((2, 60, 9), dtype, gen=gen), _wide((2, 60, 5), dtype, gen=gen)
    cut = g8.plan(keys, values)
    if dtype == torch.float16:  # 11 bits over fp16's 40 binades fit in 8 slices: every fp16 element is in range
        assert cut.in_range == (True,) * 3
    else:
        assert cut.slices[0] == g8.MAX_SLICES and not cut.in_range[0]
    got, ref = g8.naive_gram_int8(keys, values), gram_kernels.naive_gram(keys, values)
    err, tol = _within_bound(got[0], ref[0], cut.scale_k, cut.scale_k, 60, cut.bound())
    assert err <= tol, (err, tol)
    err, tol = _within_bound(got[1], ref[1], cut.scale_k, cut.scale_v, 60, cut.bound())
    assert err <= tol, (err, tol)
    # One slice fewer than the plan breaks it: the bound is what the slices buy.
    q = int8_slices._slices_torch(keys.double() * cut.scale_k[:, None, :], cut.slices[0] // 2)
    four = sum(t.double() * 2.0 ** (-7 * (a + 1)) for a, t in enumerate(q)) / cut.scale_k[:, None, :]
    lost = (four.mT @ four - ref[0]).abs() / ((1.0 / cut.scale_k)[..., :, None] / cut.scale_k[..., None, :])
    assert float(lost.max()) > tol


# ---------------------------------------------------------------------------------------------------- the kernel


SHAPES = [(1, 37, 35, 6), (1, 1, 5, 3), (1, 0, 7, 4), (2, 9, 6, 0)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-N{}-dk{}-dv{}".format(*s))
@pytest.mark.parametrize(
    ("dtype", "options"),
    [(torch.bfloat16, "plain"), (torch.float16, "scores+mask"), (torch.float32, "mask"), (torch.bfloat16, "wls")],
)
def test_in_range_rows_give_the_exact_statistics(shape, dtype, options):
    L, N, dk, dv = shape
    gen = torch.Generator().manual_seed(3)
    keys, values = _few_bit((L, N, dk), dtype, gen=gen), _few_bit((L, N, dv), dtype, gen=gen)
    # Scores of 3 bits in bf16: s·v keeps few bits, so every product stays exact.
    scores = (torch.randint(1, 8, (L, N), generator=gen) / 4.0).to(torch.bfloat16)
    mask = torch.rand(L, N, generator=gen) > 0.3
    s = scores if "scores" in options or options == "wls" else None
    m = mask if "mask" in options else None
    wls = options == "wls"
    got = _kernel(keys, values, s, m, weighted_least_squares=wls, flush_rows=None if N > 20 else 4)
    ref = gram_kernels.naive_gram(keys, values, s, m, weighted_least_squares=wls)
    for name, a, b in zip(("gram", "cross", "sqnorm"), got, ref, strict=True):
        assert a.dtype == torch.float64 and torch.equal(a, b), (name, rel(a, b))
    if N:
        oracle = g8.naive_gram_int8(keys, values, s, m, weighted_least_squares=wls)
        assert all(torch.equal(a, b) for a, b in zip(got, oracle, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wide_range_and_subnormal_columns_are_within_the_bound(dtype):
    gen = torch.Generator().manual_seed(4)
    keys, values = _wide((1, 21, 6), dtype, gen=gen), _wide((1, 21, 3), dtype, gen=gen)
    cut = g8.plan(keys, values)
    assert cut.slices == (8, 8, 8)
    got = _kernel(keys, values)
    ref = gram_kernels.naive_gram(keys, values)
    oracle = g8.naive_gram_int8(keys, values)
    for a, b in zip(got, oracle, strict=True):
        assert rel(a, b) <= REORDER_REL
    err, tol = _within_bound(got[0], ref[0], cut.scale_k, cut.scale_k, 21, cut.bound())
    assert err <= tol
    err, tol = _within_bound(got[1], ref[1], cut.scale_k, cut.scale_v, 21, cut.bound())
    assert err <= tol
    assert torch.equal(got[0], got[0].mT)


def test_scored_float32_rows_match_the_oracle_and_float64():
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(1, 33, 7, generator=gen), torch.randn(1, 33, 4, generator=gen)
    scores = torch.rand(1, 33, generator=gen)
    got = _kernel(keys, values, scores)
    cut = g8.plan(keys, values, scores)
    ref = gram_kernels.naive_gram(keys, values, scores)
    assert all(rel(a, b) <= REORDER_REL for a, b in zip(got, g8.naive_gram_int8(keys, values, scores), strict=True))
    err, tol = _within_bound(got[1], ref[1], cut.scale_k, cut.scale_v, 33, cut.bound())
    assert err <= tol


def test_nan_in_masked_rows_does_not_leak_and_in_kept_rows_poisons_its_columns():
    gen = torch.Generator().manual_seed(6)
    keys, values = _few_bit((1, 12, 5), torch.bfloat16, gen=gen), _few_bit((1, 12, 3), torch.bfloat16, gen=gen)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 4] = False
    keys[0, 4, 1] = float("nan")
    values[0, 4, 2] = float("inf")
    got = _kernel(keys, values, None, mask)
    ref = gram_kernels.naive_gram(keys, values, None, mask)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    mask[0, 4] = True
    gram, cross, _ = _kernel(keys, values, None, mask)
    bad = torch.zeros(5, dtype=torch.bool)
    bad[1] = True
    assert gram[0][bad].isnan().all() and gram[0][:, bad].isnan().all() and gram[0][~bad][:, ~bad].isfinite().all()
    assert cross[0, 1].isnan().all() and cross[0, :, 2].isnan().all()


def test_adds_into_given_statistics_across_splits_and_chunks():
    gen = torch.Generator().manual_seed(7)
    keys, values = _few_bit((2, 20, 5), torch.float16, gen=gen), _few_bit((2, 20, 4), torch.float16, gen=gen)
    start = [torch.randn(2, 5, 5, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)]
    start[0] = start[0] + start[0].mT
    acc = (start[0].clone(), start[1].clone(), torch.ones(2, dtype=torch.float64))
    _kernel(keys, values, gram=acc[0], cross=acc[1], sqnorm=acc[2], splits=2, flush_rows=8)
    ref = gram_kernels.naive_gram(keys, values)
    assert rel(acc[0], start[0] + ref[0]) <= REORDER_REL and rel(acc[1], start[1] + ref[1]) <= REORDER_REL
    assert torch.equal(acc[2], 1 + ref[2])


def test_bad_arguments_raise_naming_them():
    keys = torch.ones(1, 4, 3, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="flush_rows: slice counts"):
        _kernel(keys, keys, flush_rows=g8.max_chunk_rows(2) + 1)
    with pytest.raises(ValueError, match="keys: expected a bfloat16, float16 or float32"):
        _kernel(keys.double(), keys)
    with pytest.raises(ValueError, match="flush_rows: expected a positive int"):
        _kernel(keys, keys, flush_rows=0)
    with pytest.raises(ValueError, match="scores: expected shape"):
        _kernel(keys, keys, torch.ones(1, 5, device=DEVICE))


# ---------------------------------------------------------------------------------------------------- the gate


def _call(device, keys=torch.bfloat16, values=torch.bfloat16, **options):
    options.setdefault("compute_dtype", torch.float64)
    return _dispatch.Call("accumulate_gram", device, (keys, values), ((1, 8, 4), (1, 8, 4)), options, "test")


def test_int8_is_a_triton_variant_with_its_own_gate():
    variant = _dispatch._REGISTRY["triton"].variants["accumulate_gram"]["int8"]
    assert variant.own_gate and variant.fn is _triton_backend.accumulate_gram_int8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float64_compute_may_choose_it_on_cuda_for_every_sliced_dtype(dtype):
    assert _triton_backend.int8_gate(_call(CUDA, dtype, dtype)) is None
    assert _triton_backend.int8_gate(_call(CUDA, dtype, dtype, scored=True, scores_dtype=torch.float32)) is None


def test_float64_scores_break_the_bound_and_float64_compute_is_refused():
    call = _call(CUDA, scored=True, scores_dtype=torch.float64)
    assert "not float64-grade" in _triton_backend.int8_gate(call)
    assert _triton_backend.int8_worst_bound(torch.bfloat16, torch.float64) > g8.BOUND
    assert _triton_backend.int8_gate(_call(CUDA, scored=True, scores_dtype=torch.float64,
                                           compute_dtype=torch.float32)) is None  # fmt: skip
    # Scores whose dtype the call does not carry are taken to be float64.
    assert _triton_backend.int8_gate(_call(CUDA, scored=True)) is not None


def test_gate_refuses_the_cpu_old_gpus_and_float64_rows(monkeypatch):
    assert "interpreter" in _triton_backend.int8_gate(_call(CPU))
    monkeypatch.setattr(_dispatch.Call, "capability", property(lambda self: (7, 0)))
    assert "sm_80" in _triton_backend.int8_gate(_call(CUDA))
    monkeypatch.setattr(_dispatch.Call, "capability", property(lambda self: (9, 0)))
    assert _triton_backend.int8_gate(_call(CUDA)) is None
    assert "bfloat16, float16 or float32" in _triton_backend.int8_cannot_run(_call(CUDA, torch.float64, torch.float64))


def test_its_gate_replaces_the_backends_which_still_gates_the_main_kernel(monkeypatch):
    backend = _dispatch._REGISTRY["triton"]
    monkeypatch.setattr(backend, "gate", lambda op, call: "the fp64 mode does not compile here")
    found = {name: why for name, _, why in _dispatch._candidates("triton", "accumulate_gram", _call(CUDA))}
    assert found["triton"] == "the fp64 mode does not compile here" and found["triton.int8"] is None
    monkeypatch.setattr(backend.variants["accumulate_gram"]["int8"], "own_gate", False)
    found = {name: why for name, _, why in _dispatch._candidates("triton", "accumulate_gram", _call(CUDA))}
    assert found["triton.int8"] == "the fp64 mode does not compile here"


def test_auto_on_the_cpu_never_picks_it():
    keys = torch.ones(1, 8, 4, dtype=torch.bfloat16)
    reasons = dict(backends.explain("accumulate_gram", CPU, faast.ops.gram_call(keys, keys)))
    assert reasons.get("triton.int8", "absent") is not None
    name, _ = _dispatch.resolve("accumulate_gram", CPU, faast.ops.gram_call(keys, keys))
    assert name != "triton.int8"


def test_a_request_for_it_runs_the_kernel_through_accumulate_gram(monkeypatch):
    monkeypatch.setenv("FAAST_BACKEND", "accumulate_gram=triton.int8")
    gen = torch.Generator().manual_seed(8)
    keys, values = _few_bit((3, 10, 4), torch.bfloat16, gen=gen), _few_bit((3, 10, 2), torch.bfloat16, gen=gen)
    gram, cross = faast.ops.accumulate_gram(keys.to(DEVICE), values.to(DEVICE))
    ref = gram_kernels.naive_gram(keys, values)
    assert torch.equal(gram.cpu(), ref[0]) and torch.equal(cross.cpu(), ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("scored", [False, True])
def test_compiled_kernel_matches_the_oracle_on_cuda(scored):
    """The kernel compiled for the GPU (int8 tensor-core dots): 16-bit rows over several tiles, row blocks and chunks,
    against the torch oracle's arithmetic and within the bound of float64."""
    gen = torch.Generator().manual_seed(9)
    keys, values = torch.randn(2, 700, 150, generator=gen), torch.randn(2, 700, 70, generator=gen)
    keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    scores = torch.rand(2, 700, generator=gen) if scored else None
    got = _kernel(keys, values, scores, flush_rows=256)
    oracle = g8.naive_gram_int8(keys, values, scores)
    assert all(rel(a, b) <= REORDER_REL for a, b in zip(got, oracle, strict=True))
    cut = g8.plan(keys, values, scores)
    ref = gram_kernels.naive_gram(keys, values, scores)
    err, tol = _within_bound(got[1], ref[1], cut.scale_k, cut.scale_v, 700, cut.bound())
    assert err <= tol
