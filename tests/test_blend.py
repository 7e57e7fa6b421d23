"""FastWeights(mode='blend') against the authors' stored-key algorithm (faast.authors_reference.StoredKeyMemory)."""

from __future__ import annotations

import pytest
import torch

from faast import FastWeights
from faast.authors_reference import StoredKeyMemory
from tolerances import TRUTH_REL_W, rel

DK, DV = 20, 4


def stream(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, DK, generator=g, dtype=torch.float64),
        torch.randn(n, DV, generator=g, dtype=torch.float64),
        torch.rand(n, generator=g, dtype=torch.float64),
    )


CASES = [
    pytest.param(64, 16, 10, 1.0, id="w64-u16-b10"),
    pytest.param(64, 16, 16, 1.0, id="w64-u16-b16-aligned"),
    pytest.param(48, 16, 5, 1.0, id="w48-u16-b5"),
    pytest.param(16, 16, 7, 1.0, id="w16-u16-b7-fold-every-chunk"),
    pytest.param(60, 16, 11, 0.9, id="w60-u16-b11-discount0.9"),
]


@pytest.mark.parametrize("window,chunk,batch,gamma", CASES)
def test_matches_the_authors_algorithm(window, chunk, batch, gamma):
    keys, values, scores = stream(330)
    prior = torch.randn(DK, DV, dtype=torch.float64)
    ours = FastWeights(
        DK, DV, alpha=0.8, mode="blend", blend_window=window, blend_chunk=chunk, blend_discount=gamma,
        prior=prior, prior_count=25.0, dtype=torch.float64,
    )  # fmt: skip
    theirs = StoredKeyMemory(
        0.8, max_rows=window, fold_rows=chunk, discount=gamma, prior=prior, prior_count=25.0, dtype=torch.float64
    )
    folds_seen = 0
    for start in range(0, 330, batch):
        rows = slice(start, start + batch)
        ours.update(keys[rows], values[rows], scores[rows])
        theirs.update(keys[rows], values[rows], scores[rows])
        assert float(ours.count) == theirs.size
        assert rel(ours.weights, theirs.weights) < TRUTH_REL_W
        folds_seen = max(folds_seen, int(float(ours.blend.folded_count) > 25.0))
    assert folds_seen  # the comparison covered folded history, not only the joint window


def test_window_stays_bounded_for_large_calls():
    keys, values, _ = stream(1000)
    m = FastWeights(DK, DV, mode="blend", blend_window=64, blend_chunk=16, dtype=torch.float64)
    m.update(keys, values)  # one call far larger than the window
    assert float(m.count) < 64 + 16
    assert float(m.count) + float(m.blend.folded_count) == 1000


def test_blend_differs_from_exact_least_squares():
    # docs/numerics.md §4: the blend is a different estimator, which is why it is opt-in.
    keys, values, _ = stream(400)
    blended = FastWeights(DK, DV, mode="blend", blend_window=64, blend_chunk=16, dtype=torch.float64)
    exact = FastWeights(DK, DV, dtype=torch.float64)
    for start in range(0, 400, 16):
        blended.update(keys[start : start + 16], values[start : start + 16])
        exact.update(keys[start : start + 16], values[start : start + 16])
    assert rel(blended.weights, exact.weights) > 1e-3


def test_mask_must_agree_across_the_batch():
    m = FastWeights(DK, DV, mode="blend", batch_shape=(2,), blend_window=32, blend_chunk=8, dtype=torch.float64)
    keys, values = torch.randn(2, 10, DK, dtype=torch.float64), torch.randn(2, 10, DV, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.bool)
    m.update(keys, values, mask=mask)
    mask[1, 0] = False
    with pytest.raises(ValueError, match="mask"):
        m.update(keys, values, mask=mask)


@pytest.mark.parametrize("method", ["merge", "forget", "apply_discount", "scale_values"])
def test_exact_only_operations_are_refused(method):
    m = FastWeights(DK, DV, mode="blend", blend_window=32, blend_chunk=8)
    args = {"merge": (FastWeights(DK, DV, mode="blend", blend_window=32, blend_chunk=8),),
            "forget": stream(4)[:2], "apply_discount": (0.5,), "scale_values": (2.0,)}[method]  # fmt: skip
    with pytest.raises(ValueError, match="mode='exact'"):
        getattr(m, method)(*args)


def test_reset_restores_the_prior():
    prior = torch.randn(DK, DV, dtype=torch.float64)
    m = FastWeights(DK, DV, mode="blend", blend_window=32, blend_chunk=8, prior=prior, prior_count=5.0,
                    dtype=torch.float64)  # fmt: skip
    keys, values, _ = stream(100)
    m.update(keys, values)
    assert not torch.equal(m.weights, prior)
    m.reset()
    assert torch.equal(m.weights, prior) and float(m.blend.folded_count) == 5.0
