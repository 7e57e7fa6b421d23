"""The residual output layer's step search (faast.hf.output.tuning.tune_step_rows) on synthetic held-out logits:
its minimum against a brute-force grid, the passes it makes over the [n, V] logits, and the fallback steps."""

import math

import pytest
import torch

from faast.hf import OutputPolicy
from faast.hf.output import tuning
from tolerances import STEP_SEARCH_NLL_ABS, STEP_SEARCH_REL, assert_close

POLICY = OutputPolicy()


def held_out_logits(n: int, vocab: int = 96, signal: float = 2.0, noise: float = 1.5, seed: int = 0):
    """(Logits, log_base) of n held-out rows: z1 points at the target on most rows, plus noise, so that a small step
    helps and a large one hurts (an interior minimum)."""
    g = torch.Generator().manual_seed(seed)
    z0 = torch.randn(n, vocab, generator=g) * 2.0
    ys = torch.randint(0, vocab, (n,), generator=g)
    right = torch.rand(n, generator=g) < 0.7
    z1 = torch.randn(n, vocab, generator=g) * noise
    z1[torch.arange(n), ys] += signal * right
    logits = (z0, z1, z0.gather(-1, ys[:, None]).squeeze(-1), z1.gather(-1, ys[:, None]).squeeze(-1))
    return logits, tuning.base_log_targets(logits)


def nll_float64(logits, eta: float, weight: float) -> float:
    """Mean NLL of (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1) at the targets, all in float64 (the oracle)."""
    z0, z1, t0, t1 = (part.double() for part in logits)
    log_base = t0 - torch.logsumexp(z0, -1)
    log_memory = t0 + eta * t1 - torch.logsumexp(z0 + eta * z1, -1)
    if weight >= 1.0:
        return float(-log_memory.mean())
    return float(-torch.logaddexp(log_base + math.log1p(-weight), log_memory + math.log(weight)).mean())


def brute_force_minimum(logits, weight: float) -> tuple[float, float]:
    """(η, NLL) of the grid minimum on [0, max_step]: 81 points, then 81 around the best, twice (spacing ~1e-4)."""
    low, high = 0.0, POLICY.max_step
    for _ in range(3):
        grid = torch.linspace(low, high, 81).tolist()
        values = [nll_float64(logits, e, weight) for e in grid]
        i = min(range(len(grid)), key=values.__getitem__)
        low, high = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    return grid[i], values[i]


def counting(monkeypatch) -> list[int]:
    """Rows read by each pass over the logits (tuning.step_rows), in order."""
    passes: list[int] = []
    original = tuning.step_rows

    def rows(logits, eta):
        passes.append(int(logits[0].shape[0]))
        return original(logits, eta)

    monkeypatch.setattr(tuning, "step_rows", rows)
    return passes


@pytest.mark.parametrize("weight", [0.5, 1.0])
@pytest.mark.parametrize("n", [300, 1100])  # below and above search_sample_min_rows
@pytest.mark.parametrize("start", [0.0, 3.0])
def test_the_searched_step_is_the_brute_force_minimum_of_the_held_out_nll(weight, n, start):
    logits, log_base = held_out_logits(n)
    eta, trace, rows = tuning.tune_step_rows(logits, weight, log_base, start)
    best, best_nll = brute_force_minimum(logits, weight)
    assert 0.05 < best < 0.9 * POLICY.max_step  # an interior minimum: the search is really tested
    assert abs(eta - best) <= STEP_SEARCH_REL * best
    assert nll_float64(logits, eta, weight) <= best_nll + STEP_SEARCH_NLL_ABS
    assert rows.eta == eta and trace[-1][0] == eta  # the rows returned are the last point's, over all rows
    assert rows.log_memory.shape == (n,)


def test_above_the_sample_size_the_search_reads_the_full_logits_at_most_three_times(monkeypatch):
    n = 2048
    logits, log_base = held_out_logits(n)
    passes = counting(monkeypatch)
    tuning.tune_step_rows(logits, 0.5, log_base, 0.0)
    sampled = [p for p in passes if p == n // POLICY.search_sample_stride]
    full = [p for p in passes if p == n]
    assert len(sampled) + len(full) == len(passes) and sampled and passes[: len(sampled)] == sampled
    assert len(full) <= 3
    assert sum(passes) <= 5 * n  # before the sample and the fallback steps: 7-8 full passes on SmolLM2's logits


def test_below_the_sample_size_every_pass_reads_all_rows(monkeypatch):
    n = POLICY.search_sample_min_rows - 1
    logits, log_base = held_out_logits(n)
    passes = counting(monkeypatch)
    tuning.tune_step_rows(logits, 0.5, log_base, 0.0)
    assert passes and set(passes) == {n}


def test_the_policy_given_sets_the_sample_size_and_the_range(monkeypatch):
    # The shipped policy samples 2048 rows; one whose sample starts above them reads every row in every pass, and a
    # range below the interior minimum ends the search at its top.
    n = 2048
    logits, log_base = held_out_logits(n)
    passes = counting(monkeypatch)
    unsampled = OutputPolicy(search_sample_min_rows=n + 1)
    best, _, _ = tuning.tune_step_rows(logits, 0.5, log_base, 0.0, policy=unsampled)
    assert passes and set(passes) == {n}
    capped, _, _ = tuning.tune_step_rows(logits, 0.5, log_base, 0.0, policy=OutputPolicy(max_step=best / 2))
    assert best / 2 * (1 - 3 * POLICY.step_tol) <= capped <= best / 2  # the bracket closes within a few step_tol


def test_golden_section_finds_a_unimodal_minimum_with_one_new_point_per_step():
    calls = []

    def f(x: float) -> float:
        calls.append(x)
        return (x - 0.3) ** 2 + 1.0

    x, fx = tuning.golden_section(f, -2.0, 2.0, 30)
    assert len(calls) == 32 and fx == (x - 0.3) ** 2 + 1.0 and abs(x - 0.3) < 4.0 * 0.618**30
    assert tuning.golden_section(f, -2.0, 2.0, 0)[0] == calls[33] > 0  # no step: the better of the two first points
    # A monotone function ends at the bracket's low end, within the bracket's width after the steps.
    low, _ = tuning.golden_section(lambda u: u, 1.0, 5.0, 20)
    assert 1.0 <= low < 1.0 + 4.0 * 0.618**20


def test_a_step_that_does_not_help_is_zero_with_or_without_the_sample():
    # z1 is noise: no step helps beyond chance, so the search ends at 0 or the significance test sets η to 0. Above
    # the sample size the full rows' search starts at the sample's best point, which noise can put above 0.
    for n in (300, 1100):
        logits, log_base = held_out_logits(n, signal=0.0)
        eta, trace, rows = tuning.tune_step_rows(logits, 0.5, log_base, 0.0)
        assert eta == 0.0 and rows.eta == trace[-1][0]
        assert nll_float64(logits, 0.0, 0.5) <= min(nll for _, nll in trace) + 2 * float(
            (tuning.log_mixture(log_base, rows.log_memory, 0.5) - log_base).std()) / n**0.5  # fmt: skip


def test_the_fallback_takes_the_gauss_newton_step_inside_the_bracket_else_bisects():
    # the Gauss-Newton step 0.2 + 1/5 lies inside (0.2, 4)
    assert tuning._fallback_step(0.2, -1.0, 5.0, 0.2, 4.0) == pytest.approx(0.4)
    # it leaves the bracket: geometric bisection above 0, arithmetic from 0; no curvature: the same
    assert tuning._fallback_step(0.2, -1.0, 0.1, 0.2, 1.8) == pytest.approx(0.6)
    assert tuning._fallback_step(0.0, -1.0, 0.1, 0.0, 1.0) == pytest.approx(0.5)
    assert tuning._fallback_step(0.2, -1.0, 0.0, 0.2, 1.8) == pytest.approx(0.6)


@pytest.mark.parametrize("change_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 64, 130], ids=lambda n: f"{n}-rows")
def test_moments_match_float64(rows, change_dtype):
    # Per row of z = z0 + η·z1: logsumexp z, E_p[z1] and E_p[z1²] under p = softmax(z), against float64; 130 rows
    # leave a ragged last block of `_moments`' 64-row blocks, and a vocabulary of 1,001 no vector-width multiple. A
    # bfloat16 z1 (the head products' dtype, StepChoice.change_weight) widens exactly: the reference reads it.
    g = torch.Generator().manual_seed(rows)
    z0 = torch.randn(rows, 1001, generator=g) * 3.0
    z1 = (torch.randn(rows, 1001, generator=g) * 2.0).to(change_dtype)
    eta = 0.37
    lse, m1, m2 = tuning._moments(z0, z1, eta)
    z = z0.double() + eta * z1.double()
    p = torch.softmax(z, -1)
    expected = (torch.logsumexp(z, -1), (p * z1.double()).sum(-1), (p * z1.double() ** 2).sum(-1))
    for got, want in zip((lse, m1, m2), expected, strict=True):
        assert got.shape == (rows,) and got.dtype == torch.float32
        assert_close(got, want, torch.float32)
