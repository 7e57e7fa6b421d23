"""A fixed ridge μ > 0 solved by a batched Cholesky factorisation of S + μI (faast.ops.solve.solve_fixed_ridge), and a
truncation proven to cut nothing solved as S⁻¹T (solve_uncut), against the eigendecomposition path they replace
(solve_from_eigh on torch.linalg.eigh, float64) and the normal equations; their fallback to that path; and
SolveInfo.method."""

from __future__ import annotations

import logging

import pytest
import torch

from faast import ops
from faast.ops import SolveInfo, solve
from tolerances import CHOLESKY_NULL_DIRECTIONS, assert_close, rel


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(solve, "_logged", set())


def _statistics(batch: tuple[int, ...], n: int, dk: int, dv: int, *, rank: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(*batch, n, rank or dk, generator=g, dtype=torch.float64)
    if rank is not None:  # rank-deficient keys: S has dk - rank null directions (zero only up to rounding)
        keys = keys @ torch.randn(rank, dk, generator=g, dtype=torch.float64)
    values = torch.randn(*batch, n, dv, generator=g, dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, values)
    return gram, cross


def _eigh_path(gram: torch.Tensor, cross: torch.Tensor, count: float, mu: float) -> tuple[torch.Tensor, SolveInfo]:
    """The reference: the ridge branch of solve_from_eigh on torch.linalg.eigh, whatever backend eigh_gram picks."""
    dk, dv = gram.shape[-1], cross.shape[-1]
    lam, vecs = torch.linalg.eigh(gram.reshape(-1, dk, dk))
    counts = torch.full((lam.shape[0],), float(count), dtype=torch.float64)
    weights, info = solve.solve_from_eigh(
        lam, vecs, cross.reshape(-1, dk, dv), counts, alpha=1.0, rtol=None, ridge=mu, target_sqnorm=None
    )
    return weights.reshape(cross.shape), info


@pytest.mark.parametrize(("batch", "dk", "dv"), [((), 16, 16), ((4,), 16, 5), ((2, 3), 9, 20)])
@pytest.mark.parametrize("mu", [1e-3, 1.0, 250.0])
def test_a_fixed_ridge_is_a_cholesky_solve_equal_to_the_eigh_path(batch, dk, dv, mu):
    gram, cross = _statistics(batch, 300, dk, dv)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=300, ridge=mu)
    reference, reference_info = _eigh_path(gram, cross, 300, mu)
    assert info.method == "cholesky" and reference_info.method == "eigh"
    assert weights.shape == (*batch, dk, dv) and weights.dtype == torch.float64
    assert_close(weights, reference, torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    assert_close(weights, torch.linalg.solve(gram + mu * eye, cross), torch.float64)
    assert info.rank.shape == info.rtol.shape == info.ridge.shape == batch
    assert bool((info.rank == dk).all()) and bool((info.rtol == 0).all()) and bool((info.ridge == mu).all())
    assert info.gcv is None and reference_info.gcv is None  # a fixed ridge computes no GCV on either path


@pytest.mark.parametrize("mu", [1e-4, 1e-2, 1.0, 100.0])
def test_singular_statistics_with_a_ridge_agree_with_the_eigh_path_up_to_the_documented_noise(mu):
    # S has rank 6 of 12 (up to rounding) and T lies in its range: the eigh path drops the null directions, the
    # Cholesky path divides T's rounding-level component along them by μ (solve_fixed_ridge's docstring).
    gram, cross = _statistics((3,), 200, 12, 4, rank=6, seed=1)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=200, ridge=mu)
    reference, reference_info = _eigh_path(gram, cross, 200, mu)
    assert info.method == "cholesky" and bool((reference_info.rank < 12).all())
    noise = 2.0**-52 * float(torch.linalg.eigvalsh(gram)[..., -1].max()) / mu
    assert rel(weights, reference) <= CHOLESKY_NULL_DIRECTIONS * noise


def test_exactly_null_directions_give_exactly_zero_rows():
    gram, cross = _statistics((2,), 100, 10, 3)
    gram[:, 7:, :], gram[:, :, 7:], cross[:, 7:] = 0, 0, 0  # keys whose last 3 columns are zero
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=100, ridge=0.5)
    assert info.method == "cholesky"
    assert torch.equal(weights[:, 7:], torch.zeros_like(weights[:, 7:]))
    assert_close(weights, _eigh_path(gram, cross, 100, 0.5)[0], torch.float64)


def _indefinite(batch: int, d: int, bad: int, seed: int = 2) -> torch.Tensor:
    """PSD statistics, except element `bad` whose smallest eigenvalue is -1e-12·λmax (rounding of a float32 Gram)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(batch, d, d, generator=g, dtype=torch.float64))
    lam = torch.logspace(-3, 2, d, dtype=torch.float64).expand(batch, d).clone()
    lam[bad, 0] = -1e-12 * lam[bad, -1]
    return (q * lam.unsqueeze(-2)) @ q.mT


def test_a_failed_factorisation_falls_back_to_the_eigh_path_for_the_whole_call_and_says_so_once(caplog):
    gram = _indefinite(3, 8, bad=1)
    cross = torch.randn(3, 8, 2, dtype=torch.float64)
    mu = 1e-14  # below the negative eigenvalue: S + μI is not positive definite for element 1 only
    with caplog.at_level(logging.INFO, logger="faast"):
        for _ in range(2):
            weights, info = ops.solve_fast_weights_ex(gram, cross, count=50, ridge=mu)
            reference, reference_info = _eigh_path(gram, cross, 50, mu)
            assert info.method == "eigh"
            assert torch.equal(info.rank, reference_info.rank)  # the eigh path's noise floor dropped the direction
            assert_close(weights, reference, torch.float64)
    lines = [r.getMessage() for r in caplog.records if "not positive definite" in r.getMessage()]
    assert len(lines) == 1 and "1 of 3 memories" in lines[0]


def test_solve_fixed_ridge_reports_failure_as_none():
    gram = _indefinite(2, 6, bad=0)
    counts = torch.full((2,), 10.0, dtype=torch.float64)
    assert solve.solve_fixed_ridge(gram, torch.ones(2, 6, 1, dtype=torch.float64), counts, 1e-14) is None
    assert solve.solve_fixed_ridge(gram, torch.ones(2, 6, 1, dtype=torch.float64), counts, 1.0) is not None


@pytest.mark.parametrize(
    ("options", "method"),
    [
        ({}, "cholesky"),  # 60 random rows of 7 keys: nothing near the cut N^-2 (solve_uncut)
        ({"rtol": 1e-3}, "cholesky"),
        ({"alpha": 0.0}, "eigh"),  # eps = 1 cuts every direction
        ({"rtol": 0.9}, "eigh"),
        ({"ridge": 0.0}, "eigh"),  # μ = 0 is the pseudo-inverse: it needs the spectrum's noise floor
        ({"ridge": 0}, "eigh"),
        ({"ridge": "auto"}, "eigh"),
        ({"alpha": "auto"}, "eigh"),
        ({"ridge": 0.25}, "cholesky"),
        ({"ridge": 3}, "cholesky"),
    ],
)
def test_solve_info_says_which_method_ran(options, method):
    keys, values = torch.randn(60, 7, dtype=torch.float64), torch.randn(60, 2, dtype=torch.float64)
    sqnorm = torch.zeros((), dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, values, target_sqnorm=sqnorm)
    _, info = ops.solve_fast_weights_ex(gram, cross, count=60, target_sqnorm=sqnorm, **options)
    assert info.method == method
    assert info.rank.shape == ()


def test_empty_memories_give_zero_weights_on_the_cholesky_path():
    gram, cross = _statistics((3,), 40, 5, 2)
    gram[2], cross[2] = 0, 0  # a memory that saw only zero keys
    counts = torch.tensor([40.0, 0.0, 40.0], dtype=torch.float64)  # and one that saw nothing (stale statistics)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=counts, ridge=0.1)
    assert info.method == "cholesky" and info.rank.tolist() == [5, 0, 0]
    assert torch.equal(weights[1:], torch.zeros_like(weights[1:]))
    reference, reference_info = _eigh_path(gram[0], cross[0], 40, 0.1)
    assert_close(weights[0], reference, torch.float64)


def test_only_the_lower_triangle_is_read_and_float32_statistics_are_solved_in_float64():
    gram, cross = _statistics((2,), 80, 6, 3)
    garbage = gram + torch.randn(2, 6, 6, dtype=torch.float64).triu(1)
    weights, _ = ops.solve_fast_weights_ex(garbage, cross, count=80, ridge=0.3)
    assert_close(weights, _eigh_path(gram, cross, 80, 0.3)[0], torch.float64)
    single, info = ops.solve_fast_weights_ex(gram.float(), cross.float(), count=80, ridge=0.3)
    assert info.method == "cholesky" and single.dtype == torch.float32
    reference = _eigh_path(gram.float().double(), cross.float().double(), 80, 0.3)[0]
    assert_close(single, reference, torch.float32)


def test_the_gradient_flows_through_cross_only_as_on_the_eigh_path():
    gram, cross = _statistics((2,), 100, 8, 3)
    gram.requires_grad_(True)
    cross.requires_grad_(True)
    probe = torch.randn(2, 8, 3, dtype=torch.float64)
    grads = {}
    for name, mu in (("cholesky", 0.7), ("eigh", 0.7)):
        if name == "eigh":  # the same solve through the spectrum: W = E diag(1 / (λ + μ)) E^T T
            weights, _ = _eigh_path(gram.detach(), cross, 100, mu)
        else:
            weights, info = ops.solve_fast_weights_ex(gram, cross, count=100, ridge=mu)
            assert info.method == "cholesky"
        grads[name] = torch.autograd.grad((weights * probe).sum(), [gram, cross], allow_unused=True)
    assert grads["cholesky"][0] is None  # S is a constant (detached), as on the eigh path
    eye = torch.eye(8, dtype=torch.float64)
    assert_close(grads["cholesky"][1], torch.linalg.solve(gram.detach() + 0.7 * eye, probe), torch.float64)
    assert_close(grads["cholesky"][1], grads["eigh"][1], torch.float64)


def test_solve_info_keeps_positional_construction_and_maps_only_its_tensors():
    rank, rtol = torch.tensor([3, 4]), torch.tensor([0.1, 0.2], dtype=torch.float64)
    info = SolveInfo(rank, rtol, None, None)
    assert info.method == "eigh"
    sliced = info._replace(method="cholesky").map_tensors(lambda f: f[1])
    assert sliced.rank.item() == 4 and sliced.rtol.item() == 0.2 and sliced.ridge is None
    assert sliced.method == "cholesky"


def test_fast_weights_with_a_fixed_ridge_solve_by_cholesky_and_match_the_eigh_path():
    from faast import FastWeights

    torch.manual_seed(3)
    keys, values = torch.randn(2, 200, 12, dtype=torch.float64), torch.randn(2, 200, 5, dtype=torch.float64)
    fast = FastWeights(12, 5, batch_shape=(2,), ridge=0.5, dtype=torch.float64).update(keys, values)
    weights, info = fast.solve(return_info=True)
    assert info.method == "cholesky"
    s, t = keys.mT @ keys, keys.mT @ values
    expected = torch.linalg.solve(s + 0.5 * torch.eye(12, dtype=torch.float64), t)
    assert_close(weights, expected.to(weights.dtype), weights.dtype)  # W is stored in its own dtype
    # ridge='auto' needs the spectrum: eigh.
    fast.ridge = "auto"
    _, auto = fast.solve(return_info=True)
    assert auto.method == "eigh"


def _spectrum(batch: int, d: int, smallest: list[float], seed: int = 4) -> torch.Tensor:
    """S [batch, d, d] with eigenvalues logspace(-1, 2) except the smallest, set to smallest[i]·λmax per element."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(batch, d, d, generator=g, dtype=torch.float64))
    lam = torch.logspace(-1, 2, d, dtype=torch.float64).expand(batch, d).clone()
    lam[:, 0] = torch.tensor(smallest, dtype=torch.float64) * lam[:, -1]
    return (q * lam.unsqueeze(-2)) @ q.mT


def _eigh_truncation(gram, cross, count, alpha=1.0, rtol=None):  # noqa: ANN001, ANN202
    """The reference: the truncation branch of solve_from_eigh on torch.linalg.eigh."""
    dk, dv = gram.shape[-1], cross.shape[-1]
    lam, vecs = torch.linalg.eigh(gram.reshape(-1, dk, dk))
    counts = torch.full((lam.shape[0],), float(count), dtype=torch.float64)
    weights, info = solve.solve_from_eigh(
        lam, vecs, cross.reshape(-1, dk, dv), counts, alpha=alpha, rtol=rtol, ridge=None, target_sqnorm=None
    )
    return weights.reshape(cross.shape), info


@pytest.mark.parametrize(("batch", "dk", "dv"), [((), 16, 16), ((4,), 13, 5), ((2, 3), 9, 20)])
@pytest.mark.parametrize(("alpha", "rtol"), [(1.0, None), (0.5, None), (1.0, 1e-4)])
def test_a_truncation_that_cuts_nothing_is_a_cholesky_solve_equal_to_the_eigh_path(batch, dk, dv, alpha, rtol):
    gram, cross = _statistics(batch, 500, dk, dv)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=500, alpha=alpha, rtol=rtol)
    reference, reference_info = _eigh_truncation(gram, cross, 500, alpha, rtol)
    assert info.method == "cholesky" and reference_info.method == "eigh"
    assert bool((reference_info.rank == dk).all())  # the spectrum keeps every direction too
    assert weights.shape == (*batch, dk, dv) and weights.dtype == torch.float64
    assert_close(weights, reference, torch.float64)
    assert_close(weights, torch.linalg.solve(gram, cross), torch.float64)
    assert bool((info.rank == dk).all()) and info.rank.shape == batch and info.ridge is None and info.gcv is None
    assert_close(info.rtol, reference_info.rtol.reshape(batch), torch.float64)


@pytest.mark.parametrize(
    ("smallest", "kept"),
    [
        ([1e-2, 1e-12], [8, 7]),  # element 1 has a direction below the cut N^-2 = 1e-8: the spectrum drops it
        ([1e-2, 2e-8], [8, 8]),  # above the cut, within the margin: not proven, so the spectrum decides (keeps it)
    ],
)
def test_a_truncation_near_or_below_the_cut_is_decided_by_the_spectrum_for_the_whole_call(smallest, kept):
    gram = _spectrum(2, 8, smallest)
    cross = torch.randn(2, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=1e4, alpha=1.0)
    reference, reference_info = _eigh_truncation(gram, cross, 1e4)
    assert info.method == "eigh" and info.rank.tolist() == reference_info.rank.tolist() == kept
    assert torch.equal(weights, reference)
    counts = torch.full((2,), 1e4, dtype=torch.float64)
    assert solve.solve_uncut(gram, cross, counts, 1.0, None) is None
    assert solve.solve_uncut(gram[:1], cross[:1], counts[:1], 1.0, None) is not None  # the well-conditioned one


def test_an_empty_memory_is_never_solved_by_the_uncut_path():
    gram, cross = _statistics((3,), 40, 5, 2)
    gram[2], cross[2] = 0, 0
    counts = torch.tensor([40.0, 0.0, 40.0], dtype=torch.float64)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=counts)
    assert info.method == "eigh" and info.rank.tolist() == [5, 0, 0]
    assert torch.equal(weights[1:], torch.zeros_like(weights[1:]))


def test_the_uncut_path_reads_the_lower_triangle_and_passes_the_gradient_through_cross_only():
    gram, cross = _statistics((2,), 100, 8, 3)
    garbage = gram + torch.randn(2, 8, 8, dtype=torch.float64).triu(1)
    cross.requires_grad_(True)
    weights, info = ops.solve_fast_weights_ex(garbage.requires_grad_(True), cross, count=100)
    assert info.method == "cholesky"
    assert_close(weights.detach(), torch.linalg.solve(gram, cross.detach()), torch.float64)
    probe = torch.randn(2, 8, 3, dtype=torch.float64)
    grad_gram, grad_cross = torch.autograd.grad((weights * probe).sum(), [garbage, cross], allow_unused=True)
    assert grad_gram is None
    assert_close(grad_cross, torch.linalg.solve(gram, probe), torch.float64)


@pytest.mark.parametrize(
    ("setting", "method"),
    [
        (None, "cholesky"),
        ("auto", "cholesky"),
        ("torch", "eigh"),
        ("eigh=torch", "eigh"),
        ("accumulate_gram=torch", "cholesky"),
    ],
)
def test_an_eigensolver_named_in_faast_backend_is_used_for_a_cut_that_cuts_nothing(setting, method, monkeypatch):
    if setting is None:
        monkeypatch.delenv("FAAST_BACKEND", raising=False)
    else:
        monkeypatch.setenv("FAAST_BACKEND", setting)
    gram, cross = _statistics((2,), 200, 6, 3)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=200)
    assert info.method == method
    assert_close(weights, _eigh_truncation(gram, cross, 200)[0], torch.float64)
