"""lab/experiments/lm_token_bias_probe.py's pieces: the (κ, γ) grid against a float64 hand computation of the biased
mixture, and the validation means and report against hand sums."""

from __future__ import annotations

import math

import torch

from faast_lab.experiments.lm_token_bias_probe import GAMMAS, KAPPAS, bias_grid, grid_key, mean_changes, report
from tolerances import ELEMENTWISE


def _hand_ppl(z0, z1, ys, step, weight, bias):  # noqa: ANN001, ANN202
    """exp(mean −log[(1 − λ)·softmax(z0 + b) + λ·softmax(z0 + b + η·z1)][y]) in float64."""
    z = z0.double() + bias
    mix = (1 - weight) * torch.softmax(z, -1) + weight * torch.softmax(z + step * z1.double(), -1)
    return math.exp(float(-torch.log(mix.gather(-1, ys[:, None])).mean()))


def _case(n: int = 9, vocab: int = 13):  # noqa: ANN202
    g = torch.Generator().manual_seed(3)
    z0, z1 = torch.randn(n, vocab, generator=g) * 2, torch.randn(n, vocab, generator=g)
    ys = torch.randint(0, vocab, (n,), generator=g)
    counts = torch.randint(0, 6, (vocab,), generator=g).double()  # some tokens never learned
    mass = torch.rand(vocab, generator=g, dtype=torch.float64) * 4
    return z0, z1, ys, counts, mass


def test_bias_grid_is_the_biased_mixture_at_every_kappa_and_gamma():
    z0, z1, ys, counts, mass = _case()
    got = bias_grid(z0, z1, ys, 0.7, 0.4, counts, mass, kappas=(0.1, 1.0), gammas=(0.0, 0.3, 2.0))
    rtol = ELEMENTWISE[torch.float32][1] * 10  # float32 logits through a log-sum-exp
    assert math.isclose(got["none"], _hand_ppl(z0, z1, ys, 0.7, 0.4, 0.0), rel_tol=rtol)
    for kappa in (0.1, 1.0):
        for gamma in (0.0, 0.3, 2.0):
            bias = gamma * torch.log((counts + kappa) / (mass + kappa))
            want = _hand_ppl(z0, z1, ys, 0.7, 0.4, bias)
            assert math.isclose(got[grid_key(kappa, gamma)], want, rel_tol=rtol), (kappa, gamma)
    # The grid reads something: a large γ moves the perplexity away from the unbiased one.
    assert abs(got[grid_key(0.1, 2.0)] / got["none"] - 1) > 1e-3


def test_bias_grid_without_the_memory_step_is_the_biased_base_model():
    z0, z1, ys, counts, mass = _case(n=4, vocab=7)
    got = bias_grid(z0, z1, ys, 0.0, 0.5, counts, mass, kappas=(0.3,), gammas=(0.3,))
    bias = 0.3 * torch.log((counts + 0.3) / (mass + 0.3))
    # η = 0: held_out_nll reads the base component alone, here the biased base logits.
    z = z0.double() + bias
    want = math.exp(float(-(torch.log_softmax(z, -1).gather(-1, ys[:, None])).mean()))
    assert math.isclose(got[grid_key(0.3, 0.3)], want, rel_tol=ELEMENTWISE[torch.float32][1] * 10)


def _row(domain: str, tokens: int, base: float, grid: dict) -> dict:
    return {"domain": domain, "tokens": tokens, "ppl_base": base, "ppl_read": grid.get(grid_key(0.3, 0.3), base),
            "grid": grid}  # fmt: skip


def test_mean_changes_average_the_named_domains_at_one_point_only():
    a, b = grid_key(0.3, 0.3), grid_key(0.1, 0.2)
    rows = [_row("email", 32768, 10.0, {"none": 9.0, a: 8.0, b: 8.5}),
            _row("licenses", 32768, 20.0, {"none": 18.0, a: 19.0, b: 17.0}),
            _row("licenses", 8192, 20.0, {"none": 1.0, a: 1.0, b: 1.0}),  # another point
            _row("tkinter", 32768, 5.0, {"none": 1.0, a: 1.0, b: 1.0}),  # not named
            _row("email", 2048, 10.0, {})]  # memory off: no grid  # fmt: skip
    means = mean_changes(rows, ("email", "licenses"), 32768)
    assert means.keys() == {"none", a, b}
    assert math.isclose(means[a], ((8 / 10 - 1) + (19 / 20 - 1)) / 2)
    assert math.isclose(means[b], ((8.5 / 10 - 1) + (17 / 20 - 1)) / 2)
    assert mean_changes(rows, ("email",), 2048) == {}


def test_report_bolds_the_validation_best_and_lists_other_domains_apart():
    grid = {grid_key(k, g): 10.0 for k in KAPPAS for g in GAMMAS} | {"none": 10.0}
    best = grid_key(KAPPAS[0], GAMMAS[-1])
    email = _row("email", 32768, 10.0, {**grid, best: 9.0})
    tkinter = _row("tkinter", 32768, 10.0, {**grid, grid_key(KAPPAS[-1], GAMMAS[0]): 8.0})
    lines = report([email, tkinter], grid_key(0.3, 0.3))
    text = "\n".join(lines)
    assert "mean over validation (the choice): email" in text
    assert "mean over other domains (information only): tkinter" in text
    validation = text.split("### 32,768 learned tokens, mean over validation")[1].split("###")[0]
    assert "**-10.00%**" in validation and f"Best: {best}." in validation
    others = text.split("mean over other domains")[1].split("###")[0]
    assert "**-20.00%**" in others
    assert "| email | 32,768 | 10.000 | 10.000 | 10.000 | 10.000 | " + best + " | 9.000 |" in text
