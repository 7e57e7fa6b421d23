"""Property-based tests (hypothesis) of the streaming statistics and the solve, against float64 math written here.

Tensors are built from a drawn seed with torch.Generator, so examples shrink cheaply and CI is reproducible
(derandomize=True).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import faast
from faast import ops
from oracles import statistics64
from tolerances import REORDER_REL, TRUTH_REL_W, rel

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
_STATS = ("gram", "cross", "target_sqnorm")

PROPERTY = settings(max_examples=50, deadline=None, derandomize=True, print_blob=True)


@dataclass
class Problem:
    keys: torch.Tensor  # [*batch, n, dk] in `dtype`
    values: torch.Tensor  # [*batch, n, dv]
    scores: torch.Tensor | None  # [*batch, n] in [0, 2]
    mask: torch.Tensor | None  # [*batch, n] bool
    bounds: list[int]  # 0 = b0 <= b1 <= ... = n: consecutive update batches, some possibly empty
    batch: tuple[int, ...]

    @property
    def n(self) -> int:
        return self.keys.shape[-2]

    @property
    def dk(self) -> int:
        return self.keys.shape[-1]

    @property
    def dv(self) -> int:
        return self.values.shape[-1]

    def rows(self, a: int, b: int):
        """(keys, values, scores, mask) of rows a..b."""
        pick = lambda t, extra: None if t is None else t[(..., slice(a, b), *([slice(None)] * extra))]  # noqa: E731
        return pick(self.keys, 1), pick(self.values, 1), pick(self.scores, 0), pick(self.mask, 0)

    def parts(self):
        return [self.rows(a, b) for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True)]


@st.composite
def problems(draw, dtypes=(F32, F64, BF16), max_n: int = 40, min_n: int = 0) -> Problem:
    n = draw(st.integers(min_n, max_n), label="n")
    dk = draw(st.integers(1, 17), label="dim_key")
    dv = draw(st.integers(1, 9), label="dim_value")
    batch = draw(st.sampled_from([(), (2,), (3,)]), label="batch_shape")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    with_scores = draw(st.booleans(), label="scores")
    with_mask = draw(st.booleans(), label="mask")
    cuts = draw(st.lists(st.integers(0, n), max_size=4), label="cuts")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    # Mixed scales across columns, so that the statistics are not all of one magnitude.
    scale = torch.logspace(-1, 1, dk, dtype=F64)
    keys = (torch.randn((*batch, n, dk), generator=g, dtype=F64) * scale).to(dtype)
    values = torch.randn((*batch, n, dv), generator=g, dtype=F64).to(dtype)
    scores = None
    if with_scores:
        scores = 2 * torch.rand((*batch, n), generator=g, dtype=F64)
        scores[torch.rand((*batch, n), generator=g) < 0.1] = 0.0  # exact zeros too
        scores = scores.to(dtype)
    mask = torch.rand((*batch, n), generator=g) < 0.7 if with_mask else None
    return Problem(keys, values, scores, mask, [0, *sorted(cuts), n], batch)


def truth(keys, values, scores=None, mask=None):
    """float64 statistics keyed like FastWeights' buffers."""
    return dict(
        zip(("gram", "cross", "count", "target_sqnorm"), statistics64(keys, values, scores, mask), strict=False)
    )


def memory(p: Problem, **kwargs) -> faast.FastWeights:
    return faast.FastWeights(p.dk, p.dv, batch_shape=p.batch, **kwargs)


def learn(m: faast.FastWeights, keys, values, scores, mask) -> faast.FastWeights:
    return m.update(keys, values, scores, mask=mask)


def stats(m: faast.FastWeights) -> dict[str, torch.Tensor]:
    return {name: getattr(m, name) for name in (*_STATS, "count")}


def assert_same_statistics(actual: dict, expected: dict) -> None:
    for name in _STATS:
        assert actual[name].dtype == F64, name
        assert rel(actual[name], expected[name]) <= REORDER_REL, name
    assert torch.equal(actual["count"], expected["count"]), (actual["count"], expected["count"])


# ---------------------------------------------------------------------------------------------------- 1. streaming


@PROPERTY
@given(p=problems())
def test_streaming_equals_one_shot_and_float64_truth(p: Problem):
    streamed = memory(p)
    for part in p.parts():
        learn(streamed, *part)
    once = learn(memory(p), *p.rows(0, p.n))
    expected = truth(*p.rows(0, p.n))
    assert_same_statistics(stats(streamed), stats(once))
    assert_same_statistics(stats(streamed), expected)
    assert_same_statistics(stats(once), expected)


@PROPERTY
@given(p=problems())
def test_streaming_accumulate_gram_equals_float64_truth(p: Problem):
    gram = torch.zeros((*p.batch, p.dk, p.dk), dtype=F64)
    cross = torch.zeros((*p.batch, p.dk, p.dv), dtype=F64)
    sqnorm = torch.zeros(p.batch, dtype=F64)
    for keys, values, scores, mask in p.parts():
        out = ops.accumulate_gram(keys, values, scores, gram=gram, cross=cross, target_sqnorm=sqnorm, mask=mask)
        assert out[0] is gram and out[1] is cross  # updated in place
    expected = truth(*p.rows(0, p.n))
    assert rel(gram, expected["gram"]) <= REORDER_REL
    assert rel(cross, expected["cross"]) <= REORDER_REL
    assert rel(sqnorm, expected["target_sqnorm"]) <= REORDER_REL
    assert torch.equal(gram, gram.mT)  # S is exactly symmetric


# ---------------------------------------------------------------------------------------------------- 2. merge


@PROPERTY
@given(p=problems())
def test_merge_equals_union(p: Problem):
    pieces = [learn(memory(p), *part) for part in p.parts()]
    merged = pieces[0]
    for other in pieces[1:]:
        merged.merge(other)
    union = learn(memory(p), *p.rows(0, p.n))
    assert_same_statistics(stats(merged), stats(union))
    assert_same_statistics(stats(merged), truth(*p.rows(0, p.n)))


# ---------------------------------------------------------------------------------------------------- 3. forget


@PROPERTY
@given(p=problems(), cut=st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
def test_forget_after_update_equals_never_seen(p: Problem, cut: float):
    # All rows are learned batch by batch; rows [c, n) are then forgotten in one call, grouped differently from how
    # they were learned, so the subtraction does not cancel bit for bit by construction.
    c = round(cut * p.n)
    kept, forgotten = p.rows(0, c), p.rows(c, p.n)
    seen = memory(p)
    for part in p.parts():
        learn(seen, *part)
    version = seen.version
    keys, values, scores, mask = forgotten
    seen.forget(keys, values, scores, mask=mask)
    assert seen.version > version
    never = learn(memory(p), *kept)

    t_kept, t_forgotten = truth(*kept), truth(*forgotten)
    for name in _STATS:
        # Subtraction cancels: the error scales with the magnitude of what was summed, kept and forgotten parts.
        scale = float(t_kept[name].norm() + t_forgotten[name].norm())
        assert float((getattr(seen, name) - getattr(never, name)).norm()) <= REORDER_REL * scale, name
    assert torch.equal(seen.count, never.count)
    assert torch.equal(seen.count, t_kept["count"])

    # Where nothing is left the memory is exactly empty: no rounding residue masquerading as data.
    empty = (t_kept["count"] == 0).reshape(-1)
    weights = seen.weights.reshape(-1, p.dk, p.dv)
    for index in torch.nonzero(empty).flatten().tolist():
        for name in ("count", *_STATS):
            t = getattr(seen, name).reshape(empty.shape[0], -1)[index]
            assert torch.equal(t, torch.zeros_like(t)), name
        assert torch.equal(weights[index], torch.zeros_like(weights[index]))


# ---------------------------------------------------------------------------------------------------- 4. solve vs pinv


def _well_separated(sigma: torch.Tensor, rtol: float) -> bool:
    """No singular value within 1e-4·rtol (relative) of the cut, and the kept set not ill-conditioned."""
    if sigma.numel() == 0 or float(sigma.max()) == 0:
        return True
    ratio = sigma / sigma.max()
    if bool(((ratio - rtol).abs() < 1e-6 * rtol * 100).any()):
        return False
    kept = ratio[ratio > rtol]
    return kept.numel() == 0 or float(kept.min()) >= 1e-8


@PROPERTY
@given(p=problems(dtypes=(F64,)), alpha=st.sampled_from([1.0, 0.8, 0.5]))
def test_solve_equals_pinv_of_the_stored_keys(p: Problem, alpha: float):
    mask = p.mask if p.mask is not None else torch.ones(p.keys.shape[:-1], dtype=torch.bool)
    size = math.prod(p.batch)
    flat_k = p.keys.reshape(size, p.n, p.dk)
    flat_y = (p.values if p.scores is None else p.values * p.scores.unsqueeze(-1)).reshape(size, p.n, p.dv)
    flat_m = mask.reshape(size, p.n)
    expected = []
    for k, y, rows in zip(flat_k, flat_y, flat_m, strict=True):
        k, y = k[rows], y[rows]
        if k.shape[0] == 0:
            expected.append(torch.zeros(p.dk, p.dv, dtype=F64))
            continue
        rtol = k.shape[0] ** -alpha
        assume(_well_separated(torch.linalg.svdvals(k), rtol))
        expected.append(torch.linalg.pinv(k, atol=0.0, rtol=rtol) @ y)
    expected = torch.stack(expected).reshape(*p.batch, p.dk, p.dv)

    m = learn(memory(p, alpha=alpha, dtype=F64), *p.rows(0, p.n))
    weights = m.weights
    assert weights.dtype == F64 and weights.shape == (*p.batch, p.dk, p.dv)
    # The functional path must agree too.
    gram, cross = ops.accumulate_gram(p.keys, p.values, p.scores, mask=p.mask)
    functional = ops.solve_fast_weights(gram, cross, count=mask.sum(-1), alpha=alpha)
    for b, (w, f, e) in enumerate(
        zip(*(t.reshape(-1, p.dk, p.dv) for t in (weights, functional, expected)), strict=True)
    ):
        if int(flat_m[b].sum()) == 0:
            assert torch.equal(w, torch.zeros_like(w)), "an empty memory must give exact zeros"
            assert torch.equal(f, torch.zeros_like(f))
        else:
            assert rel(w, e) <= TRUTH_REL_W, b
            assert rel(f, e) <= TRUTH_REL_W, b


@pytest.mark.parametrize("batch", [(), (3,)], ids=["unbatched", "batch3"])
@pytest.mark.parametrize("dims", [(1, 1), (5, 3), (17, 9)], ids=lambda d: f"dk{d[0]}-dv{d[1]}")
def test_empty_memory_gives_exact_zeros(dims, batch):
    dk, dv = dims
    m = faast.FastWeights(dk, dv, batch_shape=batch, dtype=F64)
    assert torch.equal(m.weights, torch.zeros((*batch, dk, dv), dtype=F64))
    m.update(torch.randn(*batch, 0, dk), torch.randn(*batch, 0, dv))
    assert torch.equal(m.count, torch.zeros(batch, dtype=F64))
    assert torch.equal(m.weights, torch.zeros((*batch, dk, dv), dtype=F64))
    gram, cross = ops.accumulate_gram(torch.randn(*batch, 0, dk), torch.randn(*batch, 0, dv))
    w = ops.solve_fast_weights(gram, cross, count=0)
    assert torch.equal(w, torch.zeros((*batch, dk, dv), dtype=F64))


# -------------------------------------------------------------------------------------------------- 5. finite, shapes


@PROPERTY
@given(p=problems(), out_dtype=st.sampled_from([F32, F64, BF16]))
def test_weights_and_statistics_are_finite_with_the_right_shapes(p: Problem, out_dtype: torch.dtype):
    m = memory(p, dtype=out_dtype)
    for part in p.parts():
        learn(m, *part)
    assert m.gram.shape == (*p.batch, p.dk, p.dk)
    assert m.cross.shape == (*p.batch, p.dk, p.dv)
    assert m.count.shape == p.batch and m.target_sqnorm.shape == p.batch
    for name in _STATS:
        assert bool(torch.isfinite(getattr(m, name)).all()), name
    # A solve with options is one-off and says so, once per memory (pytest.warns re-emits any other warning).
    with pytest.warns(UserWarning, match="one-off solve"):
        for options in ({}, {"alpha": "auto"}, {"ridge": "auto"}, {"ridge": 0.5}, {"rtol": 0.01}):
            w = m.solve(**options)
            assert w.shape == (*p.batch, p.dk, p.dv), options
            assert w.dtype == out_dtype, options
            assert bool(torch.isfinite(w).all()), options
    query = p.keys[..., :3, :]
    out = m(query)
    assert out.shape == (*query.shape[:-1], p.dv)
    assert bool(torch.isfinite(out).all())
