"""Generalized cross-validation from streamed statistics against brute force on the stored rows."""

from __future__ import annotations

import pytest
import torch

from faast import FastWeights, ops
from tolerances import GCV_RSS_REL, GCV_SEARCH_REL, assert_close, rel


def targets(values, scores, wls):
    """The regression problem each weighting solves, as (row scale for K, targets Y)."""
    if scores is None:
        return torch.ones(values.shape[0], dtype=torch.float64), values
    if wls:
        root = scores.sqrt()
        return root, root.unsqueeze(-1) * values
    return torch.ones_like(scores), scores.unsqueeze(-1) * values


def brute_force_truncation(keys, y):
    """GCV(k) = N·RSS(k)/(N-k)² for every rank k < N, from explicit truncated SVD fits."""
    n = keys.shape[0]
    u, s, vh = torch.linalg.svd(keys, full_matrices=False)
    scores, fits = [], []
    for k in range(min(n, s.shape[0] + 1)):
        w = vh[:k].T @ ((u[:, :k].T @ y) / s[:k].unsqueeze(-1))
        rss = (y - keys @ w).square().sum()
        scores.append(float(n * rss / (n - k) ** 2))
        fits.append(w)
    return torch.tensor(scores, dtype=torch.float64), fits


def ridge_gcv(keys, y, mu):
    n, d = keys.shape
    hat = keys @ torch.linalg.solve(keys.T @ keys + mu * torch.eye(d, dtype=torch.float64), keys.T)
    rss = (y - hat @ y).square().sum()
    return float(n * rss / (n - torch.trace(hat)) ** 2)


def problem(n, d, dv, rank, noise, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.logspace(0, -2, d, dtype=torch.float64)
    signal = torch.randn(d, dv, generator=g, dtype=torch.float64)
    signal[rank:] = 0
    values = keys @ signal * 10 + noise * torch.randn(n, dv, generator=g, dtype=torch.float64)
    scores = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
    return keys, values, scores


def statistics(keys, values, scores, wls):
    sqnorm = torch.zeros((), dtype=torch.float64)
    gram, cross = ops.accumulate_gram(keys, values, scores, target_sqnorm=sqnorm, weighted_least_squares=wls)
    return gram, cross, sqnorm


CASES = [
    pytest.param(80, 20, 3, None, False, id="N80-d20"),
    pytest.param(25, 30, 2, None, False, id="N25<d30"),
    pytest.param(80, 20, 3, "scores", False, id="scored-values"),
    pytest.param(80, 20, 3, "scores", True, id="scored-wls"),
]


@pytest.mark.parametrize("n,d,dv,score_mode,wls", CASES)
def test_truncation_picks_the_brute_force_gcv_minimum(n, d, dv, score_mode, wls):
    keys, values, scores = problem(n, d, dv, rank=6, noise=3.0, seed=n + d)
    scores = scores if score_mode else None
    gram, cross, sqnorm = statistics(keys, values, scores, wls)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=n, alpha="auto", target_sqnorm=sqnorm)
    root, y = targets(values, scores, wls)
    curve, fits = brute_force_truncation(root.unsqueeze(-1) * keys, y)
    best = int(curve.argmin())
    assert int(info.rank) == best
    assert abs(float(info.gcv) - float(curve[best])) <= GCV_RSS_REL * float(curve[best])
    assert_close(weights, fits[best], torch.float64)


@pytest.mark.parametrize("n,d,dv,score_mode,wls", CASES)
def test_ridge_finds_the_gcv_minimum(n, d, dv, score_mode, wls):
    keys, values, scores = problem(n, d, dv, rank=6, noise=3.0, seed=n * d)
    scores = scores if score_mode else None
    gram, cross, sqnorm = statistics(keys, values, scores, wls)
    weights, info = ops.solve_fast_weights_ex(gram, cross, count=n, ridge="auto", target_sqnorm=sqnorm)
    root, y = targets(values, scores, wls)
    k = root.unsqueeze(-1) * keys
    mu = float(info.ridge)
    # The reported score is the GCV of the returned solution...
    assert abs(float(info.gcv) - ridge_gcv(k, y, mu)) <= GCV_RSS_REL * float(info.gcv)
    assert_close(weights, torch.linalg.solve(k.T @ k + mu * torch.eye(d, dtype=torch.float64), k.T @ y), torch.float64)
    # ...and no point of a dense brute-force grid does better.
    lam_max = float(torch.linalg.eigvalsh(gram)[-1])
    grid = [ridge_gcv(k, y, lam_max * 10.0**e) for e in torch.linspace(-10, 2, 600).tolist()]
    assert float(info.gcv) <= min(grid) * (1 + GCV_SEARCH_REL)


def test_recovers_the_signal_rank():
    # Keys with exactly known right singular vectors (the columns of q) and targets that live in the top 5 of them:
    # adding any of the other 25 directions only fits noise, which GCV should decline (up to a few chance picks).
    g = torch.Generator().manual_seed(1)
    n, d = 4000, 30
    u, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    keys = u @ torch.diag(torch.logspace(1, -1, d, dtype=torch.float64)) @ q.T
    signal = q[:, :5] @ torch.randn(5, 4, generator=g, dtype=torch.float64)
    values = keys @ signal + 0.01 * torch.randn(n, 4, generator=g, dtype=torch.float64)
    auto = FastWeights(d, 4, alpha="auto", dtype=torch.float64).update(keys, values)
    auto.solve()
    assert 5 <= int(auto.solve_info.rank) <= 8
    fixed = FastWeights(d, 4, dtype=torch.float64).update(keys, values)
    fixed.solve()
    assert int(fixed.solve_info.rank) == d  # the N^-1 cut keeps every direction here


def test_pure_noise_keeps_nothing():
    keys = torch.randn(500, 40, dtype=torch.float64)
    values = torch.randn(500, 3, dtype=torch.float64)
    memory = FastWeights(40, 3, alpha="auto", dtype=torch.float64).update(keys, values)
    memory.solve()
    assert int(memory.solve_info.rank) <= 2
    mu_memory = FastWeights(40, 3, ridge="auto", dtype=torch.float64).update(keys, values)
    mu_memory.solve()
    assert float(mu_memory.solve_info.ridge) > float(torch.linalg.eigvalsh(mu_memory.gram)[-1])


def _dip_problem(n: int, seed: int = 3, d: int = 120):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(d, d, generator=g, dtype=torch.float64)
    cov = basis @ torch.diag(torch.logspace(0, -3, d, dtype=torch.float64)) @ basis.T / d
    chol = torch.linalg.cholesky(cov + 1e-12 * torch.eye(d, dtype=torch.float64))
    truth = torch.randn(d, 5, generator=g, dtype=torch.float64)

    def draw(rows):
        x = torch.randn(rows, d, generator=g, dtype=torch.float64) @ chol.T
        return x, x @ truth + 0.5 * torch.randn(rows, 5, generator=g, dtype=torch.float64) * (x @ truth).std()

    return draw(n), draw(4000)


def _test_errors(n: int) -> dict[str, float]:
    (keys, values), (test_keys, test_values) = _dip_problem(n)
    errors = {}
    for name, kwargs in {"fixed": {"alpha": 1.0}, "auto": {"alpha": "auto"}, "ridge": {"ridge": "auto"}}.items():
        memory = FastWeights(keys.shape[-1], 5, dtype=torch.float64, **kwargs).update(keys, values)
        errors[name] = rel(test_keys @ memory.weights, test_values)
    return errors


def test_gcv_avoids_the_interpolation_dip():
    # N = d with noisy targets: the fixed N^-1 cut keeps almost every direction and fits the noise (the double-descent
    # dip the issue measured at 20 shots x 16 classes on 384-d embeddings). Both GCV modes should not.
    errors = _test_errors(120)
    assert errors["auto"] < 0.7 * errors["fixed"]
    assert errors["ridge"] < 0.7 * errors["fixed"]


def test_gcv_costs_nothing_with_plenty_of_data():
    errors = _test_errors(1000)
    assert errors["auto"] < 1.02 * errors["fixed"]
    assert errors["ridge"] < 1.02 * errors["fixed"]


def test_auto_needs_the_target_statistic():
    gram, cross = ops.accumulate_gram(torch.randn(10, 3), torch.randn(10, 2))
    with pytest.raises(ValueError, match="target_sqnorm"):
        ops.solve_fast_weights(gram, cross, count=10, alpha="auto")
