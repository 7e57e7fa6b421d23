"""faast.ops.refined_eigh, eigh's torch.refined candidate: float32 eigh + Ogita–Aishima refinement in float64.

Its eigenpairs must be float64-grade (residual, orthogonality, eigenvalues against LAPACK's float64 eigh), its fast
weights those of float64 eigh, a refinement that cannot finish must fall back to float64 eigh (logged once), and the
dispatch must run it when FAAST_BACKEND asks for it. Single-threaded, the whole file takes a few seconds.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import spectra
from faast import ops
from faast.ops import _dispatch, refined_eigh
from faast.ops.refined_eigh import eigh_refined
from faast.ops.solve import solve_from_eigh
from tolerances import (
    EIGH_PAIR_UNITS,
    EIGH_VALUE_UNITS,
    REFINED_W_REL,
    REFINED_W_TRUTH_ABS,
    REFINED_W_TRUTH_FACTOR,
    W_DETERMINED_KAPPA_U,
    rel,
)

UNIT = 2.0**-52
D_CONSTRUCTED = 160


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q


def _constructed(lam: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Q diag(lam) Qᵀ [d, d] in float64 for a random orthogonal Q (rounded once per entry)."""
    q = _orthogonal(lam.numel(), seed)
    a = (q * lam) @ q.T
    return (a + a.T) / 2


def _spectrum(name: str, d: int = D_CONSTRUCTED) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    lam = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    if name == "ill_conditioned":
        return torch.logspace(0, -12, d, dtype=torch.float64)
    if name == "repeated_20":  # 20 exactly equal eigenvalues (before rounding), amid distinct ones
        lam[40:60] = 1.25
    elif name == "near_cluster":  # 1 + k·1e-9: below float32's resolution, far above float64's
        lam[40:60] = 1 + torch.arange(20, dtype=torch.float64) * 1e-9
    elif name == "rank_half":  # rank d/2, the rest exactly 0 before rounding
        lam[d // 2 :] = 0
    return lam


CONSTRUCTED = ("random_spd", "ill_conditioned", "repeated_20", "near_cluster", "rank_half")
GRAM_CASES = [(kind, d) for kind in spectra.SPECTRA for d in (60, 257)]


@functools.cache
def _keys_gram(kind: str, d: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(S = KᵀK [1, d, d], T = KᵀV [1, d, 16], rows) in float64 from the suite's keys of this spectrum (4d rows)."""
    keys, _ = spectra.make_keys(kind, 4 * d, d)
    values = spectra.make_values(keys, 16)
    k, v = keys.double(), values.double()
    return (k.T @ k).unsqueeze(0), (k.T @ v).unsqueeze(0), keys.shape[0]


def _constructed_gram(name: str) -> torch.Tensor:
    if name == "random_spd":
        x = torch.randn(2 * D_CONSTRUCTED, D_CONSTRUCTED, generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)  # fmt: skip
        return (x.T @ x).unsqueeze(0)
    return _constructed(_spectrum(name)).unsqueeze(0)


def pair_errors(a: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per matrix of a [B, d, d]: the residual ‖AE − EΛ‖_F in units of d·2^-52·‖A‖_F, the orthogonality ‖EᵀE − I‖_F
    in units of d·2^-52, and max |λ − λ_LAPACK| in units of d·2^-52·‖A‖_2."""
    d = a.shape[-1]
    unit = d * UNIT
    norm = torch.linalg.matrix_norm(a)
    residual = torch.linalg.matrix_norm(a @ vecs - vecs * lam.unsqueeze(-2))
    residual = torch.where(norm > 0, residual / (unit * norm.clamp_min(1e-300)), residual)
    orth = torch.linalg.matrix_norm(vecs.mT @ vecs - torch.eye(d, dtype=torch.float64)) / unit
    exact = torch.linalg.eigvalsh(a)
    scale = exact.abs().amax(-1)
    values = (lam - exact).abs().amax(-1)
    values = torch.where(scale > 0, values / (unit * scale.clamp_min(1e-300)), values)
    return residual, orth, values


def assert_float64_pairs(a: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor) -> None:
    assert lam.dtype == vecs.dtype == torch.float64
    assert lam.shape == a.shape[:-1] and vecs.shape == a.shape
    assert bool((lam.diff(dim=-1) >= 0).all()), "eigenvalues not ascending"
    residual, orth, values = pair_errors(a, lam, vecs)
    assert float(residual.max()) <= EIGH_PAIR_UNITS
    assert float(orth.max()) <= EIGH_PAIR_UNITS
    assert float(values.max()) <= EIGH_VALUE_UNITS


def _weights(lam: torch.Tensor, vecs: torch.Tensor, cross: torch.Tensor, count: float, **kwargs) -> tuple:
    counts = torch.full((lam.shape[0],), float(count), dtype=torch.float64)
    options = {"alpha": 1.0, "rtol": None, "ridge": None, "target_sqnorm": None, **kwargs}
    return solve_from_eigh(lam, vecs, cross, counts, **options)


# ---------------------------------------------------------------------------------------------------- eigenpairs


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """The faast log, with refined_eigh's said-once memory emptied."""
    monkeypatch.setattr(refined_eigh, "_logged", set())
    caplog.set_level(logging.INFO, logger="faast")
    return caplog


def _faast_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "faast"]


@pytest.mark.parametrize("kind,d", GRAM_CASES, ids=[f"{k}-d{d}" for k, d in GRAM_CASES])
def test_eigenpairs_of_key_grams_are_float64_grade_without_fallback(kind, d, fresh_log):
    gram, _, _ = _keys_gram(kind, d)
    assert_float64_pairs(gram, *eigh_refined(gram))
    assert _faast_records(fresh_log) == []  # refined, not recomputed by float64 eigh


@pytest.mark.parametrize("name", CONSTRUCTED)
def test_eigenpairs_of_constructed_spectra_are_float64_grade_without_fallback(name, fresh_log):
    gram = _constructed_gram(name)
    assert_float64_pairs(gram, *eigh_refined(gram))
    assert _faast_records(fresh_log) == []


def test_eigenpairs_of_a_batch_mixing_kinds_are_float64_grade_per_matrix(fresh_log):
    grams = [_constructed_gram(name) for name in CONSTRUCTED]
    grams.append(torch.zeros(1, D_CONSTRUCTED, D_CONSTRUCTED, dtype=torch.float64))
    grams.append(1e30 * _constructed_gram("random_spd"))  # scaled far out of float32's range: the power-of-two scaling
    batch = torch.cat(grams)
    lam, vecs = eigh_refined(batch)
    assert_float64_pairs(batch, lam, vecs)
    assert bool((lam[-2] == 0).all())
    assert _faast_records(fresh_log) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_input_is_solved_in_float64(dtype):
    gram = _constructed_gram("random_spd").to(dtype)
    lam, vecs = eigh_refined(gram)
    assert_float64_pairs(gram.double(), lam, vecs)


def test_one_by_one_is_exact():
    gram = torch.tensor([[[3.5]], [[-2.0]], [[0.0]]], dtype=torch.float64)
    lam, vecs = eigh_refined(gram)
    assert torch.equal(lam, gram[:, :, 0])
    assert torch.equal(vecs.abs(), torch.ones(3, 1, 1, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(0, 5, 5), (3, 0, 0), (0, 0, 0)])
def test_empty_input_gives_empty_float64_results(shape):
    lam, vecs = eigh_refined(torch.zeros(shape, dtype=torch.float32))
    assert lam.shape == shape[:2] and vecs.shape == shape
    assert lam.dtype == vecs.dtype == torch.float64


def test_zero_matrix_gives_zero_eigenvalues_and_an_orthonormal_basis():
    zeros = torch.zeros(2, 7, 7)
    lam, vecs = eigh_refined(zeros)
    assert torch.equal(lam, torch.zeros(2, 7, dtype=torch.float64))
    assert_float64_pairs(zeros.double(), lam, vecs)


def test_non_contiguous_input_gives_the_contiguous_result():
    dense = _constructed_gram("near_cluster")
    wide = torch.zeros(1, D_CONSTRUCTED, 2 * D_CONSTRUCTED, dtype=torch.float64)
    wide[:, :, ::2] = dense
    view = wide[:, :, ::2]
    assert not view.is_contiguous()
    for got, want in zip(eigh_refined(view), eigh_refined(dense), strict=True):
        assert torch.equal(got, want)


def test_only_the_lower_triangle_is_read():
    gram = _constructed_gram("repeated_20")
    garbage = gram.clone()
    upper = torch.ones_like(gram, dtype=torch.bool).triu(1)
    garbage[upper] = torch.randn(int(upper.sum()), dtype=torch.float64) * 1e3
    garbage[0, 0, 5], garbage[0, 1, 9] = float("nan"), float("inf")
    for got, want in zip(eigh_refined(garbage), eigh_refined(gram), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_lower_triangle_raises_naming_gram(bad):
    gram = _constructed_gram("random_spd")
    gram[0, 7, 3] = bad
    with pytest.raises(ValueError, match=r"gram: expected finite values.*\[0, 7, 3\]"):
        eigh_refined(gram)


# ---------------------------------------------------------------------------------------------------- fast weights


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def _exact_problem(profile: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """An S [1, d, d] whose eigendecomposition is exact in float64, with targets: (S, T [1, d, 16], λ [d], H [d, d]).

    S = H diag(λ) Hᵀ / d with H a row-permuted Sylvester-Hadamard matrix (entries ±1, d a power of two) and λ the
    profile rounded to integer multiples of 2^-40·max(profile): every product and sum is then an exact binary
    fraction, so S is stored without rounding and Q = H/√d, λ are its exact eigenpairs. T mimics KᵀV: a part along
    S and a part with √λ-sized components."""
    d = profile.numel()
    g = torch.Generator().manual_seed(seed)
    lam = torch.round(profile.clamp_min(0) / profile.max() * 2.0**40) * 2.0**-40
    h = _hadamard(d)[torch.randperm(d, generator=g)]
    gram = (h * lam) @ h.T / d
    along = gram @ torch.randn(d, 16, generator=g, dtype=torch.float64) / d**0.5
    noise = h @ (lam.sqrt().unsqueeze(-1) * torch.randn(d, 16, generator=g, dtype=torch.float64)) / d
    return gram.unsqueeze(0), (along + noise).unsqueeze(0), lam, h


def assert_weights_against_exact_truth(profile: torch.Tensor, count: float, **kwargs) -> None:
    """W_true = Q diag(1/λ_kept) Qᵀ T from the exact eigenpairs of _exact_problem; refined eigh's W must be no
    further from it than REFINED_W_TRUTH_FACTOR × float64 eigh's own error + REFINED_W_TRUTH_ABS."""
    gram, cross, lam, h = _exact_problem(profile)
    d = lam.numel()
    rtol = kwargs.get("rtol")
    cut = max(rtol**2 if rtol is not None else count**-2.0, d * UNIT)
    keep = lam > cut * lam.max()
    inverse = torch.where(keep, 1 / torch.where(keep, lam, 1.0), 0.0)
    truth = h @ (inverse.unsqueeze(-1) * (h.T @ cross[0])) / d
    w_ref, info_ref = _weights(*eigh_refined(gram), cross, count, **kwargs)
    w_lap, info_lap = _weights(*torch.linalg.eigh(gram), cross, count, **kwargs)
    assert int(info_ref.rank) == int(info_lap.rank) == int(keep.sum())
    assert rel(w_ref[0], truth) <= REFINED_W_TRUTH_FACTOR * rel(w_lap[0], truth) + REFINED_W_TRUTH_ABS


def _kept_condition(lam: torch.Tensor, count: float) -> float:
    """λmax / λmin over the eigenvalues the truncation keeps (count^-2 cut, solve_from_eigh)."""
    top = float(lam.max())
    kept = lam[lam > max(count**-2.0, lam.numel() * UNIT) * top]
    return top / float(kept.min())


@pytest.mark.parametrize("kind,d", GRAM_CASES, ids=[f"{k}-d{d}" for k, d in GRAM_CASES])
def test_weights_of_key_grams_equal_float64_eigh_weights(kind, d):
    """W from the refined pairs equals float64 eigh's within REFINED_W_REL where float64 eigh's W is determined to
    that accuracy, i.e. where the kept spectrum's condition κ satisfies κ·2^-52 <= W_DETERMINED_KAPPA_U.

    Elsewhere (the power-law spectra keep κ up to ~1e6 at 4d rows, so any two backward-stable float64 eigensolvers
    give W differing by ~κ·2^-52 ≈ 2e-10) the two cannot agree to 1e-10, and both are instead compared with an exact
    truth: this spectrum's eigenvalue profile (d -> the next power of two) on an S whose eigenpairs are exact."""
    gram, cross, count = _keys_gram(kind, d)
    lam_lap, vecs_lap = torch.linalg.eigh(gram)
    if _kept_condition(lam_lap[0], count) * UNIT <= W_DETERMINED_KAPPA_U:
        w_ref, info_ref = _weights(*eigh_refined(gram), cross, count)
        w_lap, info_lap = _weights(lam_lap, vecs_lap, cross, count)
        assert torch.equal(info_ref.rank, info_lap.rank)
        assert rel(w_ref, w_lap) <= REFINED_W_REL
        return
    power = 64 if d <= 64 else 256
    profile = torch.linalg.eigvalsh(_keys_gram(kind, power)[0][0])
    assert_weights_against_exact_truth(profile, count)


@pytest.mark.parametrize("name", [n for n in CONSTRUCTED if n != "ill_conditioned"])
def test_weights_of_constructed_spectra_equal_float64_eigh_weights(name):
    gram = _constructed_gram(name)
    lam_lap, vecs_lap = torch.linalg.eigh(gram)
    assert _kept_condition(lam_lap[0], 1e6) * UNIT <= W_DETERMINED_KAPPA_U  # determined: see the test above
    cross = gram @ torch.randn(1, D_CONSTRUCTED, 16, dtype=torch.float64)
    w_ref, _ = _weights(*eigh_refined(gram), cross, 1e6)
    w_lap, _ = _weights(lam_lap, vecs_lap, cross, 1e6)
    assert rel(w_ref, w_lap) <= REFINED_W_REL


def test_weights_of_an_ill_conditioned_spectrum_against_an_exact_truth():
    """λ logspaced from 1 to 1e-12, all kept (κ ≈ 1e12): float64 eigh's own W is only good to ~κ·2^-52 ≈ 1e-4, so
    the refined W must be as close to the exact truth as float64 eigh's (not close to float64 eigh's W)."""
    assert_weights_against_exact_truth(torch.logspace(0, -12, 256, dtype=torch.float64), 1e6, rtol=1e-7)


# ---------------------------------------------------------------------------------------------------- the fallback


def test_float32_pairs_fail_the_check_that_refined_pairs_pass(monkeypatch):
    # What the fallback test below relies on: with no refinement step, the check rejects the float32 pairs.
    gram = _constructed_gram("random_spd")
    start = refined_eigh._float32_start(gram)
    assert bool(refined_eigh._refine(gram, start)[2].all())
    monkeypatch.setattr(refined_eigh, "MAX_STEPS", 0)
    assert not bool(refined_eigh._refine(gram, start)[2].any())


def test_unfinished_refinement_falls_back_to_float64_eigh_and_logs_once(monkeypatch, fresh_log):
    monkeypatch.setattr(refined_eigh, "MAX_STEPS", 0)
    diagonal = torch.diag(torch.arange(1.0, D_CONSTRUCTED + 1, dtype=torch.float64)).unsqueeze(0)
    batch = torch.cat([diagonal, _constructed_gram("near_cluster")])  # float32 eigh is exact on the diagonal one
    lam, vecs = eigh_refined(batch)
    assert_float64_pairs(batch, lam, vecs)
    want = torch.linalg.eigh(batch[1:])
    assert torch.equal(lam[1:], want.eigenvalues) and torch.equal(vecs[1:], want.eigenvectors)
    eigh_refined(batch)
    records = _faast_records(fresh_log)
    assert len(records) == 1
    assert "1 of 2 matrices" in records[0].getMessage() and "float64 torch.linalg.eigh" in records[0].getMessage()


def test_failing_float32_eigh_falls_back_to_float64_eigh_and_logs_once(monkeypatch, fresh_log):
    monkeypatch.setattr(refined_eigh, "_float32_start", lambda a: None)
    gram = _constructed_gram("rank_half")
    for _ in range(2):
        lam, vecs = eigh_refined(gram)
        assert_float64_pairs(gram, lam, vecs)
    records = _faast_records(fresh_log)
    assert len(records) == 1 and "float32 eigh failed" in records[0].getMessage()


def test_converging_refinement_logs_nothing(fresh_log):
    eigh_refined(torch.cat([_constructed_gram(name) for name in CONSTRUCTED]))
    assert _faast_records(fresh_log) == []


# ---------------------------------------------------------------------------------------------------- dispatch


@pytest.fixture
def refinements(monkeypatch):
    """Counts the matrices eigh_refined refines (its float32 start is taken for every call that reaches it)."""
    seen = []
    real = refined_eigh._refine

    def counting(a, x):
        seen.append(a.shape[0])
        return real(a, x)

    monkeypatch.setattr(refined_eigh, "_refine", counting)
    monkeypatch.setenv("FAAST_AUTOTUNE", "0")  # eigh=torch then takes the torch backend's first candidate, unmeasured
    return seen


def test_the_torch_backend_registers_the_refined_variant():
    variant = _dispatch._REGISTRY["torch"].variants["eigh"]["refined"]
    assert variant.fn is eigh_refined and variant.cannot_run is refined_eigh.refined_cannot_run


def test_faast_backend_refined_runs_eigh_refined(monkeypatch, refinements):
    gram = _constructed_gram("near_cluster").expand(2, 3, -1, -1)
    monkeypatch.setenv("FAAST_BACKEND", "eigh=torch")
    ops.eigh_gram(gram)
    assert refinements == []
    monkeypatch.setenv("FAAST_BACKEND", "eigh=torch.refined")
    lam, vecs = ops.eigh_gram(gram)
    assert refinements == [6]
    assert lam.shape == gram.shape[:-1] and vecs.shape == gram.shape
    assert_float64_pairs(gram.reshape(6, D_CONSTRUCTED, D_CONSTRUCTED), lam.reshape(6, -1), vecs.flatten(0, 1))


def test_public_solve_with_refined_eigh_gives_float64_eigh_weights(monkeypatch, refinements):
    gram, cross, count = _keys_gram("gauss", 60)
    monkeypatch.setenv("FAAST_BACKEND", "eigh=torch")
    w_lap, info_lap = ops.solve_fast_weights_ex(gram, cross, count=count)
    assert refinements == [] and info_lap.method == "eigh"
    monkeypatch.setenv("FAAST_BACKEND", "eigh=torch.refined")
    w_ref, info_ref = ops.solve_fast_weights_ex(gram, cross, count=count)
    assert refinements == [1] and info_ref.method == "eigh"
    assert rel(w_ref, w_lap) <= REFINED_W_REL


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_refined_can_run_on_cpu_and_cuda(device):
    assert refined_eigh.refined_cannot_run(_dispatch.Call("eigh", torch.device(device))) is None


def test_refined_cannot_run_elsewhere_and_a_request_for_it_raises(monkeypatch):
    meta = torch.device("meta")
    reason = refined_eigh.refined_cannot_run(_dispatch.Call("eigh", meta))
    assert reason is not None and "meta" in reason
    monkeypatch.setenv("FAAST_BACKEND", "eigh=torch.refined")
    with pytest.raises(RuntimeError, match="FAAST_BACKEND=torch.refined was requested for eigh on meta, but torch"):
        _dispatch.resolve("eigh", meta, _dispatch.Call("eigh", meta))


# ---------------------------------------------------------------------------------------------------- batched, CUDA


def test_one_batched_call_gives_each_matrix_float64_eigh_weights():
    """The batched path (one float32 eigh and one refinement for all matrices, matrices converging at different
    steps, clusters rotated in some only) gives each matrix float64 eigh's W within REFINED_W_REL, as it does on a GPU
    where the batch is what the device runs at once."""
    names = [n for n in CONSTRUCTED if n != "ill_conditioned"]
    gram = torch.cat([_constructed_gram(n) for n in names])
    cross = gram @ torch.randn(len(names), D_CONSTRUCTED, 16, generator=torch.Generator().manual_seed(11),
                               dtype=torch.float64)  # fmt: skip
    lam_lap, vecs_lap = torch.linalg.eigh(gram)
    w_ref, _ = _weights(*eigh_refined(gram), cross, 1e6)
    w_lap, _ = _weights(lam_lap, vecs_lap, cross, 1e6)
    for i, name in enumerate(names):
        assert rel(w_ref[i], w_lap[i]) <= REFINED_W_REL, name


def test_refined_competes_in_the_cuda_eigh_auto_choice():
    """On CUDA, torch.refined is a candidate of eigh beside faast._C, cupy and torch, with nothing keeping auto from
    timing it (no GPU is needed to read the dispatch's candidates)."""
    call = _dispatch.Call("eigh", torch.device("cuda"), (torch.float64,), ((48, 1600, 1600),))
    found = {name: why for name, _, why in _dispatch._candidates("torch", "eigh", call)}
    assert found == {"torch": None, "torch.refined": None}
