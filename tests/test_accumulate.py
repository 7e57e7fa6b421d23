"""faast.ops.accumulate_gram against float64 hand computations."""

from __future__ import annotations

import pytest
import torch

from faast import ops
from faast.ops import reference
from oracles import statistics64
from tolerances import ELEMENTWISE, FLOAT32_COMPUTE_REL, REORDER_REL, assert_close, rel


def expected(keys, values, scores=None, mask=None, wls=False):
    gram, cross, _, sqnorm = statistics64(keys, values, scores, mask, wls=wls)
    return gram, cross, sqnorm


SHAPES = [
    pytest.param((), 77, 60, 33, id="N77-d60-dv33"),
    pytest.param((3,), 77, 60, 33, id="L3-N77-d60-dv33"),
    pytest.param((2, 3), 5, 7, 1, id="B2x3-N5-d7-dv1"),
    pytest.param((), 1, 13, 5, id="N1"),
    pytest.param((), 0, 13, 5, id="N0"),
    pytest.param((), 300, 401, 9, id="N300-d401-3blocks"),
]


@pytest.mark.parametrize("batch,n,dk,dv", SHAPES)
@pytest.mark.parametrize("with_scores", [False, True], ids=["noscores", "scores"])
@pytest.mark.parametrize("wls", [False, True], ids=["values-weighted", "wls"])
def test_matches_float64_definition(batch, n, dk, dv, with_scores, wls):
    keys = torch.randn(*batch, n, dk)
    values = torch.randn(*batch, n, dv)
    scores = torch.rand(*batch, n) if with_scores else None
    sqnorm = torch.zeros(batch, dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, values, scores, target_sqnorm=sqnorm, weighted_least_squares=wls)
    s_ref, t_ref, yy_ref = expected(keys, values, scores, wls=wls)
    assert gram.dtype == cross.dtype == torch.float64
    assert_close(gram, s_ref, torch.float64)
    assert_close(cross, t_ref, torch.float64)
    assert_close(sqnorm, yy_ref, torch.float64)
    # Only the upper triangle is computed; the mirror must make S exactly symmetric.
    assert torch.equal(gram, gram.mT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_input_dtypes_are_upcast_exactly(dtype):
    # An outlier of 3000 squared overflows fp16 (max 65504): the Gram must never be formed in the input dtype.
    keys = torch.randn(50, 24).to(dtype)
    keys[3, 5] = 3000
    values = torch.randn(50, 7).to(dtype)
    gram, cross = ops.accumulate_gram(keys, values)
    s_ref, t_ref, _ = expected(keys, values)
    assert torch.isfinite(gram).all()
    assert_close(gram, s_ref, torch.float64)
    assert_close(cross, t_ref, torch.float64)


def test_non_contiguous_inputs():
    base_k = torch.randn(60, 3, 77)  # keys are the transposed view [3, 77, 60]
    base_v = torch.randn(2, 33, 77, 3)
    keys = base_k.permute(1, 2, 0)
    values = base_v[0].permute(2, 1, 0)
    scores = torch.rand(77, 3).T
    assert not keys.is_contiguous() and not values.is_contiguous() and not scores.is_contiguous()
    gram, cross = ops.accumulate_gram(keys, values, scores)
    s_ref, t_ref, _ = expected(keys, values, scores)
    assert_close(gram, s_ref, torch.float64)
    assert_close(cross, t_ref, torch.float64)


def test_mask_skips_rows_even_with_nan():
    keys, values, scores = torch.randn(2, 40, 9), torch.randn(2, 40, 4), torch.rand(2, 40)
    mask = torch.rand(2, 40) > 0.3
    keys[~mask] = float("nan")  # padding may hold anything
    scores[~mask] = -1.0
    gram, cross = ops.accumulate_gram(keys, values, scores, mask=mask)
    s_ref, t_ref, _ = expected(keys, values, scores, mask)
    assert_close(gram, s_ref, torch.float64)
    assert_close(cross, t_ref, torch.float64)


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64], ids=str)
def test_in_place_accumulation_over_batches(acc_dtype):
    keys, values, scores = torch.randn(3, 500, 21), torch.randn(3, 500, 5), torch.rand(3, 500)
    gram = torch.zeros(3, 21, 21, dtype=acc_dtype)
    cross = torch.zeros(3, 21, 5, dtype=acc_dtype)
    for start in range(0, 500, 77):
        rows = slice(start, start + 77)
        out = ops.accumulate_gram(keys[:, rows], values[:, rows], scores[:, rows], gram=gram, cross=cross)
        assert out[0] is gram and out[1] is cross
    s_ref, t_ref, _ = expected(keys, values, scores)
    assert_close(gram, s_ref, acc_dtype)
    assert_close(cross, t_ref, acc_dtype)


def test_many_chunks_and_blocks(monkeypatch):
    # A tiny chunk budget forces many chunks (with a ragged last one) through the NaN-poisoned buffer.
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 8 * (37 + 11) * 64)
    monkeypatch.setattr(reference, "_TRIANGLE_BLOCK", 8)
    keys, values, scores = torch.randn(1000, 37), torch.randn(1000, 11), torch.rand(1000)
    assert reference.chunk_rows(1, 48, torch.float64, 1000) == 63  # 16 chunks of a 64-row budget: 15 x 63 + 55
    assert len(reference.triangle_blocks(37)) == 5
    gram, cross = ops.accumulate_gram(keys, values, scores)
    s_ref, t_ref, _ = expected(keys, values, scores)
    assert_close(gram, s_ref, torch.float64)
    assert_close(cross, t_ref, torch.float64)


def test_chunk_rows_splits_rows_evenly_within_the_budget(monkeypatch):
    # The budget's row count, then as few chunks as it allows, of equal length: 4,096 rows under a 1,365-row budget
    # are 4 chunks of 1,024, not 3 of 1,365 and a 1-row chunk of slow GEMMs.
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 1365 * 1536 * 8)
    assert reference.chunk_rows(1, 1536, torch.float64, 4096) == 1024
    for budget_rows in (64, 100, 1365):
        monkeypatch.setattr(reference, "_CHUNK_BYTES", budget_rows * 48 * 8)
        for rows in (0, 1, 63, 64, 65, 99, 1000, 4096, 4097):
            step = reference.chunk_rows(1, 48, torch.float64, rows)
            assert 1 <= step <= max(1, min(rows, budget_rows))
            if rows:
                chunks = -(-rows // step)
                assert chunks == -(-rows // min(rows, budget_rows))  # no more chunks than the budget needs
                assert rows - (chunks - 1) * step > step - chunks  # the last chunk is short by less than one row each


def test_triangle_blocks_tile_the_columns():
    for dim in (1, 2, 60, 191, 192, 193, 768, 1600, 3584):
        blocks = reference.triangle_blocks(dim)
        assert blocks[0][0] == 0 and blocks[-1][1] == dim
        assert all(a1 == b0 for (_, a1), (b0, _) in zip(blocks, blocks[1:], strict=False))


def test_float32_compute_mode():
    keys, values = torch.randn(9000, 50), torch.randn(9000, 6)
    gram, cross = ops.accumulate_gram(keys, values, compute_dtype=torch.float32)
    s_ref, t_ref, _ = expected(keys, values)
    assert gram.dtype == torch.float64
    assert rel(gram, s_ref) < FLOAT32_COMPUTE_REL
    assert rel(cross, t_ref) < FLOAT32_COMPUTE_REL
    # ...and it is really computed differently from the float64 default (else this test proves nothing).
    assert rel(gram, s_ref) > ELEMENTWISE[torch.float64][1]


def test_deterministic():
    keys, values, scores = torch.randn(2, 3000, 200), torch.randn(2, 3000, 30), torch.rand(2, 3000)
    first = ops.accumulate_gram(keys, values, scores)
    second = ops.accumulate_gram(keys, values, scores)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=False))


def test_streaming_equals_one_shot():
    keys, values = torch.randn(4000, 64), torch.randn(4000, 8)
    gram, cross = ops.accumulate_gram(keys, values)
    g2 = torch.zeros_like(gram)
    c2 = torch.zeros_like(cross)
    for start in range(0, 4000, 333):
        ops.accumulate_gram(keys[start : start + 333], values[start : start + 333], gram=g2, cross=c2)
    assert rel(g2, gram) < REORDER_REL and rel(c2, cross) < REORDER_REL


@pytest.mark.parametrize("wls", [False, True], ids=["values-weighted", "wls"])
def test_gradients_flow_to_scores_and_values(wls):
    keys = torch.randn(2, 30, 6, dtype=torch.float64, requires_grad=True)
    values = torch.randn(2, 30, 4, dtype=torch.float64, requires_grad=True)
    scores = (torch.rand(2, 30, dtype=torch.float64) + 0.1).requires_grad_()
    probe_s, probe_t = torch.randn(2, 6, 6, dtype=torch.float64), torch.randn(2, 6, 4, dtype=torch.float64)

    def loss(fn, *args):
        gram, cross = fn(*args)
        return (gram * probe_s).sum() + (cross * probe_t).sum()

    ours = loss(lambda *a: ops.accumulate_gram(*a, weighted_least_squares=wls), keys, values, scores)
    got = torch.autograd.grad(ours, (keys, values, scores))
    want = torch.autograd.grad(
        loss(lambda *a: expected(*a, wls=wls)[:2], keys, values, scores), (keys, values, scores)
    )
    for g, w in zip(got, want, strict=False):
        assert_close(g, w, torch.float64)
    assert torch.autograd.gradcheck(
        lambda s, v: ops.accumulate_gram(keys.detach(), v, s, weighted_least_squares=wls), (scores, values)
    )


def test_gradient_through_given_accumulator():
    values = torch.randn(20, 3, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(20, 5, dtype=torch.float64)
    cross = torch.zeros(5, 3, dtype=torch.float64)
    _, cross = ops.accumulate_gram(keys, values, cross=cross)
    (grad,) = torch.autograd.grad(cross.sum(), values)
    assert_close(grad, keys.sum(-1, keepdim=True).expand(20, 3), torch.float64)


@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "masked"])
def test_unchecked_entry_allocates_or_adds_in_place(masked):
    keys, values, scores = torch.randn(2, 40, 9), torch.randn(2, 40, 4), torch.rand(2, 40)
    mask = torch.rand(2, 40) > 0.3 if masked else None
    if masked:
        keys[~mask] = float("nan")  # rows the mask leaves out contribute nothing, whatever they hold
    fresh = ops.accumulate_gram_unchecked(keys, values, scores, mask)
    s_ref, t_ref, yy_ref = expected(torch.nan_to_num(keys), values, scores, mask)
    for got, want in zip(fresh, (s_ref, t_ref, yy_ref), strict=True):
        assert got.dtype == torch.float64
        assert_close(got, want, torch.float64)
    start = [torch.ones_like(t) for t in fresh]
    held = [t.clone() for t in start]
    returned = ops.accumulate_gram_unchecked(keys, values, scores, mask, gram=held[0], cross=held[1],
                                             target_sqnorm=held[2])  # fmt: skip
    for out, acc, first, part in zip(returned, held, start, fresh, strict=True):
        assert out is acc
        assert rel(acc, first + part) < REORDER_REL
    with pytest.raises(ValueError, match="pass all three accumulators, or none"):
        ops.accumulate_gram_unchecked(keys, values, scores, mask, gram=held[0])


@pytest.mark.parametrize("rowwise", [False, True], ids=["whole-chunk", "row-by-row"])
def test_squared_targets_both_ways_against_float64(rowwise):
    # The CPU squares a chunk whole, a GPU reduces it row by row (no chunk-sized temporary): both are the float64 sum
    # of exact squares, on a strided view like the streaming buffer's value columns.
    x = torch.randn(3, 41, 20, dtype=torch.float64)
    v = x[..., 7:]
    got = reference._float64_sqsum(v, rowwise=rowwise)
    want = torch.tensor([sum(float(e) ** 2 for e in row.flatten()) for row in v], dtype=torch.float64)
    assert_close(got, want, torch.float64)
