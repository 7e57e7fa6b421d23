"""solve_fast_weights and the streaming memory against a float64 SVD truth (docs/numerics.md §1, §6)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import spectra
from faast import FastWeights, ops
from faast.authors_reference import pinv_fast_weights
from tolerances import TRUTH_REL_P, TRUTH_REL_W, assert_close, rel

D, DV, N_TEST = 256, 64, 2048
CASES = [(kind, n) for kind in spectra.SPECTRA for n in (1000, 16384) if not (kind == "lowN_pow1o" and n > 1000)]


@functools.cache
def problem(kind: str, n: int):
    keys, held_out = spectra.make_keys(kind, n, D, n_test=N_TEST)
    values = spectra.make_values(keys, DV)
    u, s, vh = torch.linalg.svd(keys.double(), full_matrices=False)
    return keys, values, held_out, (u, s, vh)


def svd_truth(svd, values, eps):
    u, s, vh = svd
    keep = s > eps * s[0]
    return vh[keep].T @ ((u[:, keep].T @ values.double()) / s[keep].unsqueeze(-1)), int(keep.sum())


def streamed(keys, values, batch=4096, **kwargs):
    memory = FastWeights(keys.shape[-1], values.shape[-1], dtype=torch.float64, **kwargs)
    for start in range(0, keys.shape[0], batch):
        memory.update(keys[start : start + batch], values[start : start + batch])
    return memory


@pytest.mark.parametrize("alpha", [0.8, 1.0])
@pytest.mark.parametrize("kind,n", CASES, ids=[f"{k}-N{n}" for k, n in CASES])
def test_fidelity_against_svd_truth(kind, n, alpha):
    keys, values, held_out, svd = problem(kind, n)
    rows = keys.shape[0]
    truth, rank = svd_truth(svd, values, rows**-alpha)
    memory = streamed(keys, values, alpha=alpha)
    weights = memory.weights
    assert int(memory.solve_info.rank) == rank
    assert rel(weights, truth) <= TRUTH_REL_W
    q = held_out.double()
    assert rel(q @ weights, q @ truth) <= TRUTH_REL_P


def test_float32_compute_fails_where_numerics_says():
    # The rank-deficient case the float64 default exists for: float32 GEMMs cannot resolve eps² = 16384^-2, keep
    # dozens of spurious directions, and must warn about it.
    keys, values, _, svd = problem("dup_gauss", 16384)
    truth, rank = svd_truth(svd, values, 16384**-1.0)
    memory = streamed(keys, values, alpha=1.0, compute_dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="float32"):
        weights = memory.weights
    assert int(memory.solve_info.rank) > rank
    assert rel(weights, truth) > 1e-2
    with pytest.warns(UserWarning, match="one-off solve") as caught:
        memory.solve(alpha=0.5)
    # The float32 warning: once per memory, not per solve.
    assert not [w for w in caught if w.category is RuntimeWarning]


def test_matches_torch_pinv_with_rtol():
    keys, values = torch.randn(500, 40, dtype=torch.float64), torch.randn(500, 6, dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, values)
    for rtol in (0.0, 1e-3, 0.3):
        expected = torch.linalg.pinv(keys, atol=0.0, rtol=rtol) @ values
        assert rel(ops.solve_fast_weights(gram, cross, count=500, rtol=rtol), expected) < TRUTH_REL_W
        assert rel(pinv_fast_weights(keys, values, rtol), expected) < 1e-14


def test_cut_is_strict():
    # count 10, alpha 1: eps² = 10.0 ** -2 = 0.01 exactly, so λ = 0.01·λmax sits on the cut and must be dropped.
    lam = torch.tensor([1.0, 0.25, 0.01, 0.01 * (1 + 2**-50)], dtype=torch.float64)
    gram, cross = torch.diag(lam), torch.eye(4, dtype=torch.float64)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=10, alpha=1.0)
    assert int(info.rank) == 3
    assert_close(
        weights, torch.diag(torch.tensor([1.0, 4.0, 0.0, 1 / lam[3].item()], dtype=torch.float64)), torch.float64
    )


@pytest.mark.parametrize(
    "case",
    ["empty", "alpha0", "zero_keys", "nothing"],
)
def test_degenerate_memories_give_zeros(case):
    keys, values = torch.randn(30, 8, dtype=torch.float64), torch.randn(30, 3, dtype=torch.float64)
    if case == "zero_keys":
        keys = torch.zeros_like(keys)
    gram, cross = ops.accumulate_gram(keys, values)
    count = 0 if case in ("empty", "nothing") else 30
    if case == "nothing":
        gram, cross = torch.zeros_like(gram), torch.zeros_like(cross)
    weights = ops.solve_fast_weights(gram, cross, count=count, alpha=0.0 if case == "alpha0" else 1.0)
    assert torch.equal(weights, torch.zeros(8, 3, dtype=torch.float64))


def test_single_row():
    key, value = torch.randn(1, 7, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64)
    memory = FastWeights(7, 2, dtype=torch.float64).update(key, value)
    # N = 1 gives eps = 1: nothing passes σ > σmax, as with the authors' pinv(rtol=1).
    assert torch.equal(memory.weights, torch.zeros(7, 2, dtype=torch.float64))
    assert torch.equal(memory.weights, pinv_fast_weights(key, value, rtol=1.0))
    with pytest.warns(UserWarning, match="one-off solve"):
        one_off = memory.solve(rtol=0.5)
    assert_close(one_off, torch.linalg.pinv(key) @ value, torch.float64)


def test_batched_solve_equals_per_memory_solves():
    keys, values = torch.randn(4, 200, 30, dtype=torch.float64), torch.randn(4, 200, 5, dtype=torch.float64)
    keys[2, :, 10:] = 0  # a rank-deficient member
    counts = torch.tensor([200.0, 150.0, 100.0, 50.0], dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, values)
    batched, info = ops.solve_fast_weights_ex(gram, cross, count=counts, alpha=0.9)
    for i in range(4):
        single, single_info = ops.solve_fast_weights_ex(gram[i], cross[i], count=float(counts[i]), alpha=0.9)
        assert_close(batched[i], single, torch.float64)
        assert int(info.rank[i]) == int(single_info.rank)
    assert int(info.rank[2]) <= 10


def test_fixed_ridge_is_regularised_normal_equations():
    keys, values = torch.randn(300, 20, dtype=torch.float64), torch.randn(300, 4, dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, values)
    for mu in (0.0, 1.0, 1e3):
        expected = torch.linalg.solve(gram + mu * torch.eye(20, dtype=torch.float64), cross)
        got, info = ops.solve_fast_weights_ex(gram, cross, count=300, ridge=mu)
        assert_close(got, expected, torch.float64)
        assert float(info.ridge) == mu


def test_gradient_flows_through_cross_only():
    keys = torch.randn(100, 12, dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, torch.randn(100, 3, dtype=torch.float64))
    cross.requires_grad_(True)
    probe = torch.randn(12, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((ops.solve_fast_weights(gram, cross, count=100) * probe).sum(), cross)
    # W = S_eps^+ T, S^+ treated as a constant (as in the authors' detached pinv): dL/dT = S^+ probe.
    assert_close(grad, torch.linalg.pinv(gram, atol=0.0, rtol=100.0**-2, hermitian=True) @ probe, torch.float64)


def test_out_dtype_and_float32_statistics():
    keys, values = torch.randn(100, 12), torch.randn(100, 3)
    gram = torch.zeros(12, 12)
    cross = torch.zeros(12, 3)
    ops.accumulate_gram(keys, values, gram=gram, cross=cross)
    weights = ops.solve_fast_weights(gram, cross, count=100)
    assert weights.dtype == torch.float32
    assert ops.solve_fast_weights(gram, cross, count=100, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    truth = torch.linalg.pinv(keys.double(), atol=0.0, rtol=0.01) @ values.double()
    assert rel(weights, truth) < 1e-5


def test_eigh_gram_reads_lower_triangle_and_batches():
    a = torch.randn(3, 9, 9, dtype=torch.float64)
    sym = a @ a.mT
    garbage_upper = sym.tril() + torch.randn(3, 9, 9, dtype=torch.float64).triu(1)
    lam, vecs = ops.eigh_gram(garbage_upper)
    assert lam.shape == (3, 9) and vecs.shape == (3, 9, 9)
    assert_close(vecs @ torch.diag_embed(lam) @ vecs.mT, sym, torch.float64)


def test_a_solve_with_explicit_options_is_one_off_and_weights_and_solve_info_agree_with_the_configuration():
    g = torch.Generator().manual_seed(11)
    mix = torch.randn(12, 12, generator=g, dtype=torch.float64)
    keys = torch.randn(300, 12, generator=g, dtype=torch.float64) @ mix
    values = torch.randn(300, 3, generator=g, dtype=torch.float64)
    memory = FastWeights(12, 3, dtype=torch.float64)
    memory.update(keys, values)
    configured = memory.weights.clone()
    assert memory.solve_info.ridge is None
    with pytest.warns(UserWarning, match=r"one-off solve: memory.weights and memory.solve_info keep"):
        ridged, info = memory.solve(ridge="auto", return_info=True)
    assert info.ridge is not None and not torch.equal(ridged, configured)
    assert torch.equal(memory.weights, configured) and memory.solve_info.ridge is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per memory
        memory.solve(ridge="auto")
    memory.ridge = "auto"  # kept: now the configuration
    assert torch.equal(memory.weights, ridged)
    assert memory.solve_info.ridge is not None and float(memory.solve_info.ridge) == float(info.ridge)
