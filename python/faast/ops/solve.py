"""Fast weights from an eigendecomposition of S = K^T K: the spectral filter, ridge, and their choice by GCV.

Everything here is float64 and backend-independent: a backend supplies (λ, E) and this module does the rest.
Shapes use one flattened batch dim B: λ [B, d] ascending, E [B, d, d], T [B, d, dv], counts [B].

With P = E^T T (the targets' coefficients in the eigenbasis), c_i = ||P_i||^2 and g_i = c_i / λ_i (the part of
||Y||^2 that direction i explains), the least-squares fit of the targets Y (Y = diag(s) V, so T = K^T Y) has
    RSS(k) = RSS⊥ + sum_{i > k} g_i                      keeping the top-k directions (df = k),
    RSS(μ) = RSS⊥ + sum_i g_i (μ / (λ_i + μ))^2          with ridge μ (N - df = N - r + sum_i μ / (λ_i + μ)),
where r counts the directions above the noise floor and RSS⊥ = ||Y||^2 - sum_i g_i is what no direction explains
(exactly 0 when r >= N: the keys then have full row rank). Writing them as sums of what is left out, rather than as
||Y||^2 minus what is explained, keeps them accurate when the fit nearly interpolates (N close to or below d).
Generalized cross-validation, GCV = N·RSS / (N - df)^2 (Golub, Heath & Wahba 1979), therefore needs only the
streamed statistics plus ||Y||^2 (`target_sqnorm`), and every candidate costs O(d) once P is known.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import NamedTuple, cast

import torch

logger = logging.getLogger("faast")
_logged: set[str] = set()

# Eigenvalues at or below d·2^-52·λmax are rounding noise of a float64 eigensolver: never invert them.
MACHINE_FLOOR = 2.0**-52
# A truncated solve that would cut nothing is S⁻¹T, taken by Cholesky once a factorisation of S − c·I succeeds with
# c = CERTIFY_MARGIN·cut·trace(S): every eigenvalue then lies above the cut (trace(S) >= λmax) with room for the
# factorisation's own rounding (about d·2^-52·λmax, at most the floor of the cut).
CERTIFY_MARGIN = 4.0
# GCV ridge search: a log grid over μ/λmax, then two zoom rounds around the best point.
_RIDGE_GRID = torch.linspace(-12.0, 2.0, 141, dtype=torch.float64)
_RIDGE_ZOOM_POINTS = 41
_RIDGE_ZOOM_ROUNDS = 2


class SolveInfo(NamedTuple):
    """What a solve kept. Every tensor field has the batch shape of the solve.

    rank:   int64, eigen-directions used (for ridge: those above the float64 noise floor). The Cholesky paths
            (method 'cholesky') invert on every direction: d, and for a fixed ridge 0 for an empty memory (count 0
            or S = 0).
    rtol:   float64, relative singular-value cut: directions with σ > rtol·σmax are kept. For alpha='auto' it is
            σ_(k+1)/σmax of the first dropped direction; for ridge, the noise floor sqrt(d·2^-52); 0 on the
            fixed ridge's Cholesky path, which cuts nothing; the cut itself on the uncut truncation's.
    ridge:  float64 penalty μ in units of S (W = (S + μI)^+ T), or None for a truncated solve.
    gcv:    float64 GCV score of the returned solution, or None when it was not computed (it is computed only when
            alpha='auto' or ridge='auto' chose by it; never for a fixed ridge, on either path).
    method: 'eigh' (from an eigendecomposition of S) or 'cholesky' (no spectrum: a fixed ridge μ > 0, a Cholesky
            solve of S + μI, solve_fixed_ridge; or a truncation proven to cut nothing, S⁻¹T, solve_uncut).
    """

    rank: torch.Tensor
    rtol: torch.Tensor
    ridge: torch.Tensor | None
    gcv: torch.Tensor | None
    method: str = "eigh"

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SolveInfo:
        """The same info with fn applied to every tensor field (e.g. a reshape to the batch shape, or one slot)."""
        return SolveInfo._make(f if f is None or isinstance(f, str) else fn(f) for f in self)


# docs/numerics.md §1: statistics summed from float32 GEMMs resolve eigenvalues only down to this fraction of λmax.
FLOAT32_EPS2_FLOOR = 1e-7


def float32_cut_warning(options: dict, count: float) -> str | None:
    """Why a solve with these options (alpha, rtol, ridge) of float32-summed statistics of `count` rows (the largest
    in the batch) may not be exact: its cut ε² lies below FLOAT32_EPS2_FLOOR; None where it does not (a ridge, GCV)."""
    if options["ridge"] is not None or (options["rtol"] is None and options["alpha"] == "auto"):
        return None
    if options["rtol"] is not None:
        eps2 = options["rtol"] ** 2
    else:
        eps2 = count ** (-2 * options["alpha"]) if count > 0 else 1.0
    if eps2 >= FLOAT32_EPS2_FLOOR:
        return None
    return (f"FastWeights(compute_dtype=float32): eps² = {eps2:.2e} is below the ~{FLOAT32_EPS2_FLOOR:g}·λmax "
            "resolution of float32 GEMMs; rank-deficient memories (repeated rows, N < d, LayerNorm outputs) can gain "
            "spurious directions. Use the float64 default for exact results.")  # fmt: skip


def _safe_inverse(lam: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, 1.0 / torch.where(keep, lam, torch.ones_like(lam)), torch.zeros_like(lam))


def _truncation_cut(count: torch.Tensor, alpha: float, rtol: float | None, floor: float) -> torch.Tensor:
    """Relative eigenvalue cut max(eps², floor) with eps = rtol or count^-alpha (count > 0)."""
    if rtol is not None:
        eps2 = torch.full_like(count, float(rtol) * float(rtol))
    else:
        # float64 pow: eps² reaches ~1e-16 at N = 1e8, below what float32 can even represent next to 1.
        safe = torch.where(count > 0, count, torch.ones_like(count))
        eps2 = safe.pow(-2.0 * float(alpha))
    return eps2.clamp_min(floor)


def _explained(lam: torch.Tensor, coef_sq: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [B, d]: directions above the noise floor, g [B, d]: c_i / λ_i on them, 0 elsewhere)."""
    lam_max = lam[:, -1].clamp_min(0)
    valid = lam > floor * lam_max.unsqueeze(-1)
    gain = torch.where(valid, coef_sq / torch.where(valid, lam, torch.ones_like(lam)), torch.zeros_like(lam))
    return valid, gain


def _unexplained(
    gain: torch.Tensor, valid: torch.Tensor, count: torch.Tensor, target_sqnorm: torch.Tensor
) -> torch.Tensor:
    """RSS⊥ [B]: the residual of the full fit; exactly 0 when the valid directions reach the row count."""
    residual = (target_sqnorm - gain.sum(-1)).clamp_min(0)
    return torch.where(valid.sum(-1).to(count.dtype) >= count, torch.zeros_like(residual), residual)


def gcv_truncation(
    lam: torch.Tensor, coef_sq: torch.Tensor, count: torch.Tensor, target_sqnorm: torch.Tensor, floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank k in 0..d minimising GCV(k) = N·RSS(k)/(N-k)^2, per batch element. Returns (k [B] int64, gcv [B]).

    Only k < N and directions above the noise floor are candidates; ties go to the smaller k.
    """
    dim = lam.shape[-1]
    valid, gain = _explained(lam, coef_sq, floor)
    # Descending order: RSS(k) = RSS⊥ + (sum of g over the directions after the k-th largest).
    gain_desc = gain.flip(-1)
    tail = gain_desc.flip(-1).cumsum(-1).flip(-1)  # tail[j] = sum_{i >= j} g_desc[i]
    left_out = torch.cat([tail, torch.zeros_like(tail[:, :1])], dim=-1)  # [B, d+1], index k
    rss = _unexplained(gain, valid, count, target_sqnorm).unsqueeze(-1) + left_out
    k = torch.arange(dim + 1, device=lam.device, dtype=torch.float64)
    n = count.unsqueeze(-1)
    allowed = (k <= valid.sum(-1, keepdim=True)) & (k < n)
    score = torch.where(allowed, n * rss / (n - k).clamp_min(1e-300).square(), math.inf)
    best = score.argmin(-1)
    return best, score.gather(-1, best.unsqueeze(-1)).squeeze(-1)


def _ridge_gcv(
    lam: torch.Tensor,
    gain: torch.Tensor,
    valid: torch.Tensor,
    count: torch.Tensor,
    rss_perp: torch.Tensor,
    mu: torch.Tensor,
) -> torch.Tensor:
    """GCV(μ) for candidates mu [B, G]; lam/gain/valid [B, d]. Returns [B, G]."""
    lam_ = torch.where(valid, lam, torch.zeros_like(lam)).unsqueeze(1)  # [B, 1, d]
    gain_ = gain.unsqueeze(1)
    m = mu.unsqueeze(-1)  # [B, G, 1]
    shrink = torch.where(valid.unsqueeze(1), m / (lam_ + m), torch.zeros_like(lam_))  # μ / (λ + μ), 0 off-support
    rss = rss_perp.unsqueeze(-1) + (gain_ * shrink.square()).sum(-1)
    residual_df = (count - valid.sum(-1)).unsqueeze(-1) + shrink.sum(-1)  # N - df
    return torch.where(residual_df > 0, count.unsqueeze(-1) * rss / residual_df.clamp_min(1e-300).square(), math.inf)


def gcv_ridge(
    lam: torch.Tensor, coef_sq: torch.Tensor, count: torch.Tensor, target_sqnorm: torch.Tensor, floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge penalty μ minimising GCV(μ), searched over λmax·10^[-12, 2]. Returns (μ [B], gcv [B])."""
    lam_max = lam[:, -1].clamp_min(0)
    valid, gain = _explained(lam, coef_sq, floor)
    rss_perp = _unexplained(gain, valid, count, target_sqnorm)
    scale = torch.where(lam_max > 0, lam_max, torch.ones_like(lam_max)).unsqueeze(-1)
    exps = _RIDGE_GRID.to(lam.device).expand(lam.shape[0], -1)
    score = _ridge_gcv(lam, gain, valid, count, rss_perp, scale * 10.0**exps)
    best = score.argmin(-1, keepdim=True)
    step = float(_RIDGE_GRID[1] - _RIDGE_GRID[0])
    centre = exps.gather(-1, best)
    for _ in range(_RIDGE_ZOOM_ROUNDS):
        offsets = torch.linspace(-step, step, _RIDGE_ZOOM_POINTS, dtype=torch.float64, device=lam.device)
        exps = centre + offsets
        score = _ridge_gcv(lam, gain, valid, count, rss_perp, scale * 10.0**exps)
        best = score.argmin(-1, keepdim=True)
        centre = exps.gather(-1, best)
        step = step / ((_RIDGE_ZOOM_POINTS - 1) / 2)
    return (scale * 10.0**centre).squeeze(-1), score.gather(-1, best).squeeze(-1)


def solve_from_eigh(
    lam: torch.Tensor,
    vecs: torch.Tensor,
    cross: torch.Tensor,
    count: torch.Tensor,
    *,
    alpha: float | str,
    rtol: float | None,
    ridge: float | str | None,
    target_sqnorm: torch.Tensor | None,
) -> tuple[torch.Tensor, SolveInfo]:
    """W [B, d, dv] float64 from λ [B, d] (ascending), E [B, d, d], T [B, d, dv], counts [B] float64.

    Truncation (ridge None): keep λ_i > max(eps², d·2^-52)·max(λmax, 0) with eps = rtol, or count^-alpha, or the
    GCV-best rank for alpha='auto'. Ridge: W = Σ_i E_i E_i^T T / (λ_i + μ) over λ_i above the noise floor, μ fixed
    or chosen by GCV (ridge='auto'). Empty memories (count 0) and all-zero keys give W = 0.
    """
    dim = lam.shape[-1]
    floor = dim * MACHINE_FLOOR
    cross = cross.to(torch.float64)
    coef = vecs.mT @ cross  # P = E^T T, [B, d, dv]
    lam_max = lam[:, -1].clamp_min(0)
    live = ((count > 0) & (lam_max > 0)).unsqueeze(-1)
    gcv_score = None
    ridge_used = None
    if ridge is None and alpha != "auto":
        cut = _truncation_cut(count, cast(float, alpha), rtol, floor)  # not 'auto' here: a number
        keep = (lam > (cut * lam_max).unsqueeze(-1)) & live
        inverse = _safe_inverse(lam, keep)
        rtol_used = cut.sqrt()
    elif ridge is None:
        coef_sq = coef.square().sum(-1)
        # alpha='auto' comes with target_sqnorm (the callers' check_solve_options).
        rank, gcv_score = gcv_truncation(lam, coef_sq, count, cast(torch.Tensor, target_sqnorm), floor)
        position = torch.arange(dim, device=lam.device)
        keep = (position >= dim - rank.unsqueeze(-1)) & live
        inverse = _safe_inverse(lam, keep)
        # σ of the first dropped direction relative to σmax: the cut that reproduces this rank.
        dropped = lam.flip(-1).gather(-1, rank.clamp_max(dim - 1).unsqueeze(-1)).squeeze(-1)
        ratio = torch.where(rank < dim, dropped.clamp_min(0) / torch.where(lam_max > 0, lam_max, 1.0), floor)
        rtol_used = ratio.clamp_min(floor).sqrt()
    else:
        keep = (lam > floor * lam_max.unsqueeze(-1)) & live
        if ridge == "auto":
            coef_sq = coef.square().sum(-1)
            # ridge='auto' comes with target_sqnorm (the callers' check_solve_options).
            mu, gcv_score = gcv_ridge(lam, coef_sq, count, cast(torch.Tensor, target_sqnorm), floor)
        else:
            mu = torch.full_like(count, float(ridge))
        ridge_used = mu
        inverse = _safe_inverse(lam + mu.unsqueeze(-1), keep)
        rtol_used = torch.full_like(count, math.sqrt(floor))
    weights = vecs @ (inverse.unsqueeze(-1) * coef)
    info = SolveInfo(rank=keep.sum(-1), rtol=rtol_used, ridge=ridge_used, gcv=gcv_score)
    return weights, info


def _lower_symmetric(gram: torch.Tensor) -> torch.Tensor:
    """A float64 copy of S [B, d, d] built from its lower triangle alone, as the eigh path reads it; the Cholesky
    solves never see the caller's tensor."""
    system = gram.to(torch.float64).tril()
    system += system.tril(-1).mT
    return system


def solve_fixed_ridge(
    gram: torch.Tensor, cross: torch.Tensor, count: torch.Tensor, ridge: float
) -> tuple[torch.Tensor, SolveInfo] | None:
    """W = (S + μI)^-1 T [B, d, dv] float64 by a batched Cholesky solve, for a fixed ridge μ > 0: no eigensolver.

    gram S [B, d, d] (lower triangle read), cross T [B, d, dv], count [B] float64; float32 statistics are upcast.
    Differentiable in T (S is a constant, as on the eigh path). Returns None, after one log line per process, when
    S + μI is not numerically positive definite for some batch element (μ below the rounding noise of an S with
    null directions, or an S that is not positive semi-definite): the caller then takes the eigh path for the whole
    call, whose noise floor handles such S.

    It is solve_from_eigh's ridge branch without the spectrum: both give Σ_i E_i E_i^T T / (λ_i + μ), and W = 0 for
    an empty memory (count 0, or S = 0). The eigh path also drops the directions with λ_i <= d·2^-52·λmax, which
    this path keeps: for statistics of real rows, T's component along them is float64 rounding of T, so the two
    differ by about 2^-52·λmax/μ relative, and by rounding alone (~1e-15) when S has no such directions.
    """
    dim = gram.shape[-1]
    system = _lower_symmetric(gram)
    system.diagonal(dim1=-2, dim2=-1).add_(ridge)
    factor, info = torch.linalg.cholesky_ex(system)
    # For a symmetric positive semi-definite S, a positive diagonal entry is equivalent to λmax > 0.
    live = (count > 0) & (gram.diagonal(dim1=-2, dim2=-1).amax(-1) > 0)
    if bool((info > 0).any()):
        if "cholesky" not in _logged:
            _logged.add("cholesky")
            logger.info(
                "faast: ridge=%g: S + μI is not positive definite to float64 precision for %d of %d memories "
                "(d = %d); this and later such solves take the eigendecomposition path (said once)",
                ridge, int((info > 0).sum()), info.numel(), dim,
            )  # fmt: skip
        return None
    weights = torch.cholesky_solve(cross.to(torch.float64), factor)
    weights = torch.where(live.view(-1, 1, 1), weights, torch.zeros_like(weights))
    info_out = SolveInfo(
        rank=torch.where(live, dim, 0).to(torch.int64),
        rtol=torch.zeros_like(count),
        ridge=torch.full_like(count, float(ridge)),
        gcv=None,
        method="cholesky",
    )
    return weights, info_out


def solve_uncut(
    gram: torch.Tensor, cross: torch.Tensor, count: torch.Tensor, alpha: float, rtol: float | None
) -> tuple[torch.Tensor, SolveInfo] | None:
    """W = S⁻¹T [B, d, dv] float64 by a batched Cholesky solve, for a truncated solve (alpha a number, or rtol) that
    keeps every direction of every batch element: then the truncated pseudo-inverse is the inverse, and no spectrum
    is needed. gram S [B, d, d] (lower triangle read), cross T [B, d, dv], count [B] float64.

    The truncation keeps λ_i > cut·λmax (cut = max(eps², d·2^-52), solve_from_eigh). A successful factorisation of
    S − CERTIFY_MARGIN·cut·trace(S)·I proves λ_min above it, since trace(S) >= λmax for S positive semi-definite.
    Returns None when that cannot be proven for some element (a direction at or near the cut, an empty memory, S
    not positive definite): the caller takes the eigh path for the whole call, which decides direction by
    direction. That is the usual case with few rows per key dimension, so it is not logged. Differentiable in T (S
    is a constant, as on the eigh path). Both paths give Σ_i E_i E_i^T T / λ_i over every direction: they differ
    by rounding, about κ(S)·2^-52 relative.
    """
    dim = gram.shape[-1]
    system = _lower_symmetric(gram)
    trace = system.diagonal(dim1=-2, dim2=-1).sum(-1)
    if not bool(((count > 0) & (trace > 0)).all()):
        return None
    cut = _truncation_cut(count, alpha, rtol, dim * MACHINE_FLOOR)
    shift = CERTIFY_MARGIN * cut * trace
    eye = torch.eye(dim, dtype=torch.float64, device=gram.device)
    _, proof = torch.linalg.cholesky_ex(system - shift.view(-1, 1, 1) * eye)
    if bool((proof > 0).any()):
        return None
    factor, info = torch.linalg.cholesky_ex(system)
    if bool((info > 0).any()):  # cannot follow from the proof above except by rounding; decide by the spectrum
        return None
    weights = torch.cholesky_solve(cross.to(torch.float64), factor)
    info_out = SolveInfo(rank=torch.full_like(count, dim, dtype=torch.int64), rtol=cut.sqrt(), ridge=None, gcv=None,
                         method="cholesky")  # fmt: skip
    return weights, info_out
