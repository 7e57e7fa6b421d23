"""Float64 eigendecompositions from a float32 eigh and Ogita–Aishima refinement: torch.refined, a candidate of eigh.

eigh_refined keeps the contract of faast.ops.reference.eigh: symmetric [B, d, d] (lower triangle read, any float
dtype, CPU or CUDA) -> (λ [B, d] float64 ascending, E [B, d, d] float64, eigenvectors in columns). It computes:

1. A, the float64 matrix of gram's lower triangle, scaled by a power of two (exactly) to max |a_ij| in [1/2, 1), so
   its float32 copy neither overflows nor underflows; λ is scaled back at the end, exactly.
2. X, float32 torch.linalg.eigh of that copy: eigenvectors to about 2^-24·‖A‖/gap.
3. Refinement steps in float64 that use only matrix products (T. Ogita and K. Aishima, "Iterative refinement for
   symmetric eigenvalue decomposition", JJIAM 2018): R = I − XᵀX, S = XᵀAX, λ̃_i = s_ii / (1 − r_ii),
   δ = 2(‖S − diag λ̃‖_2 + ‖A‖_2‖R‖_2), Ẽ_ij = (s_ij + λ̃_j r_ij) / (λ̃_j − λ̃_i) where |λ̃_j − λ̃_i| > δ, else
   r_ij / 2, X <- X + XẼ. The 2-norms of S − diag λ̃ and R are bounded by Frobenius norms, ‖A‖_2 is estimated by
   max |λ̃|, and δ is at least 2^-26·max |λ̃| (_SEPARATED). The error squares each step: two steps from float32
   usually suffice.
4. Clusters (Ogita and Aishima, "... II: clustered eigenvalues", JJIAM 2019): eigenvalues within δ of each other
   are only orthogonalised by step 3, and δ cannot fall below the couplings left inside such a group. A cluster
   (a run of sorted λ̃ with steps <= δ) whose block of S still couples its columns by more than a quarter of the
   final check's residual allowance is rotated, in the same step, by the eigenvectors of a small float64 eigh of
   its block (in the basis orthonormalised to first order, shifted by its mean); the next steps separate what the
   rotation resolved. Clusters of one size share one batched eigh.

Accuracy: every matrix is checked before it is returned, in float64, on its own Rayleigh quotients λ̃:
‖AX − X diag λ̃‖_F <= CHECK_C·d·2^-52·‖A‖_F and ‖XᵀX − I‖_F <= CHECK_C·d·2^-52 (CHECK_C = 4), the grade of a
backward-stable float64 eigensolver. A matrix that does not pass within MAX_STEPS steps (or whose float32 eigh
fails) is recomputed by float64 torch.linalg.eigh instead, said once on the faast logger; nothing unchecked is
returned. The check sits at the top of each step, on the products the step needs anyway, so it costs no extra GEMM.

Why: a float32 eigh plus a handful of float64 GEMMs can beat a float64 eigh, since GEMMs run near the machine's peak
while the tridiagonal reduction of syevd is memory-bound; wide clusters (dense small eigenvalues, null spaces whose
blocks carry noise) add block eighs and can erase the gain. Whether it wins is measured, not assumed: faast's
dispatch times it against torch.linalg.eigh (torch) on the call's own matrices, and FAAST_BACKEND=eigh=torch.refined
forces it. Not differentiable: the results carry no graph (faast's callers pass detached statistics).

Devices: every step is a batched torch op on the input's device, so on CUDA the float32 eigh is cuSOLVER's and the
refinement's float64 GEMMs run on FP64 tensor cores (sm_80+); auto times it there against faast._C, cupy and
torch.linalg.eigh like on the CPU. It reads back to the host once for the finiteness check and once per refinement
step (whether any matrix is left, which also sizes the batch of those left, and which clusters to rotate), a few
synchronisations a solve. Not yet measured on a GPU (scripts/gpu_check.sh's eigh step times it at 48 x 1600).
"""

from __future__ import annotations

import logging

import torch

from . import _dispatch, _validate

logger = logging.getLogger("faast")
_logged: set[str] = set()

UNIT = 2.0**-52
# Refinement steps before a matrix is handed to float64 eigh: two reach float64 from float32, a cluster adds one or
# two; more would only chase a matrix that is not converging.
MAX_STEPS = 8
# Pairs closer than this fraction of ‖A‖ always count as clustered, whatever δ says: S's rounding (about 2^-52·‖A‖
# an entry) over their gap would make entries of Ẽ above 2^-26, and a step's own orthogonality defect, ẼᵀẼ, would
# then stay above 2^-52 at every step. A cluster is rotated by an orthogonal matrix instead, which has no such defect.
_SEPARATED = 2.0**-26
# The final check's constant c (module docstring), in units of d·2^-52 (·‖A‖_F for the residual). Both measures carry
# the rounding of their own float64 products: on tests/test_refined_eigh.py's matrices (d = 60 to 257) LAPACK's
# float64 eigh measures up to 0.10 (residual) and 0.97 (orthogonality: d^2 entries of about 2^-52 each), the refined
# pairs up to 0.18 and 0.22, float32 pairs about 1e8. c = 4 passes anything as good as LAPACK's with a 4x margin and
# rejects float32-grade pairs by eight orders of magnitude.
CHECK_C = 4.0


def refined_cannot_run(call: _dispatch.Call) -> str | None:
    """faast.ops._dispatch cannot_run for eigh's torch.refined (call: a _dispatch.Call): CPU and CUDA only."""
    device_type = call.device.type
    if device_type in ("cpu", "cuda"):
        return None
    return f"torch.refined runs on cpu and cuda tensors, not {device_type}"


def _log_once(key: str, message: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


def _float32_start(a: torch.Tensor) -> torch.Tensor | None:
    """Float32 eigenvectors [B, d, d] of the scaled float64 a, as float64; None if the float32 solver fails."""
    try:
        return torch.linalg.eigh(a.to(torch.float32)).eigenvectors.to(torch.float64)
    except torch.linalg.LinAlgError:
        return None


def _permute(m: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """m [B, d, d] with rows and columns both taken in order [B, d]."""
    rows = m.gather(1, order.unsqueeze(-1).expand_as(m))
    return rows.gather(2, order.unsqueeze(1).expand_as(m))


def _rotate_clusters(
    x: torch.Tensor, s: torch.Tensor, r: torch.Tensor, rows: list[int], starts: list[int], sizes: list[int]
) -> None:
    """Rotate, in place, each listed cluster's columns of x [B, d, d] (columns starts..starts+size of matrix rows)
    by the eigenvectors of its block of S [B, d, d] in the basis orthonormalised by Ẽ = R/2: (I + R/2) S (I + R/2).
    Clusters of one size share one batched float64 eigh."""
    d = x.shape[-1]
    every_row = torch.arange(d, device=x.device).view(1, d, 1)
    for size in sorted(set(sizes)):
        picked = [i for i, n in enumerate(sizes) if n == size]
        mats = torch.tensor([rows[i] for i in picked], device=x.device)
        first = torch.tensor([starts[i] for i in picked], device=x.device)
        cols = first.unsqueeze(-1) + torch.arange(size, device=x.device)  # [n, size]
        where = (mats.view(-1, 1, 1), cols.unsqueeze(-1), cols.unsqueeze(1))
        block, half = s[where], r[where] / 2
        block = block + half @ block + block @ half
        block = (block + block.mT) / 2
        # The mean shift takes the cluster's common part out, so eigh's rounding scales with the cluster's width.
        shift = block.diagonal(dim1=-2, dim2=-1).mean(-1)
        block = block - shift.view(-1, 1, 1) * torch.eye(size, dtype=block.dtype, device=block.device)
        turn = torch.linalg.eigh(block).eigenvectors
        place = (mats.view(-1, 1, 1), every_row, cols.unsqueeze(1))
        x[place] = x[place] @ turn


def _step(x: torch.Tensor, s: torch.Tensor, r: torch.Tensor, lam: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """One refinement step of X [B, d, d] given its R, S [B, d, d] and λ̃ [B, d]; budget [B] is the residual a
    cluster's couplings may leave (clusters above it are rotated). Returns the new X, columns in ascending λ̃."""
    d = lam.shape[-1]
    order = lam.argsort(-1)
    lam = lam.gather(-1, order)
    x = x.gather(2, order.unsqueeze(1).expand_as(x))
    s, r = _permute(s, order), _permute(r, order)
    # ‖·‖_2 <= ‖·‖_F for S − diag λ̃ and R; ‖A‖_2 is estimated by max |λ̃| (Rayleigh quotients of a float32-accurate
    # basis). δ only decides which pairs the formula may divide by: the final check guards the result either way.
    norm_a = lam.abs().amax(-1)
    delta = 2 * (torch.linalg.matrix_norm(s - torch.diag_embed(lam)) + norm_a * torch.linalg.matrix_norm(r))
    delta = torch.maximum(delta, _SEPARATED * norm_a)
    gap = lam.unsqueeze(1) - lam.unsqueeze(2)  # [b, i, j] = λ̃_j − λ̃_i
    near = gap.abs() <= delta.view(-1, 1, 1)
    # Clusters: maximal runs of the sorted λ̃ whose consecutive steps are <= δ; cid numbers them per matrix.
    opens = torch.ones_like(lam, dtype=torch.bool)
    opens[:, 1:] = lam.diff(dim=-1) > delta.unsqueeze(-1)
    cid = opens.cumsum(-1) - 1
    same = cid.unsqueeze(2) == cid.unsqueeze(1)
    off_diagonal = ~torch.eye(d, dtype=torch.bool, device=lam.device)
    coupled = torch.where(same & off_diagonal, s, 0).square().sum(-1)
    mass = torch.zeros_like(lam).scatter_add_(1, cid, coupled)
    size = torch.zeros_like(cid).scatter_add_(1, cid, torch.ones_like(cid))
    position = torch.arange(d, device=lam.device).expand_as(cid)
    start = torch.full_like(cid, d).scatter_reduce_(1, cid, position, "amin")
    treat = (size >= 2) & (mass > budget.square().unsqueeze(-1))  # [b, cluster]
    # Inside a rotated cluster every pair takes r/2, so that the block the rotation diagonalises is (I+R/2)S(I+R/2).
    inside = same & treat.gather(1, cid).unsqueeze(-1)
    flat = near | inside
    e = torch.where(flat, r / 2, (s + lam.unsqueeze(1) * r) / torch.where(flat, 1.0, gap))
    x = x + x @ e
    mats, ks = treat.nonzero(as_tuple=True)
    if mats.numel():
        _rotate_clusters(x, s, r, mats.tolist(), start[mats, ks].tolist(), size[mats, ks].tolist())
    return x


def _refine(a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refine eigenvectors x [B, d, d] of symmetric float64 a [B, d, d] until each matrix passes the final check.
    Returns (λ̃ [B, d], X [B, d, d], passed [B] bool); matrices that did not pass within MAX_STEPS are left zero."""
    b, d = a.shape[0], a.shape[-1]
    eye = torch.eye(d, dtype=a.dtype, device=a.device)
    bound = CHECK_C * d * UNIT
    norm = torch.linalg.matrix_norm(a)
    lam_out, x_out = a.new_zeros(b, d), a.new_zeros(b, d, d)
    passed = torch.zeros(b, dtype=torch.bool, device=a.device)
    active = torch.arange(b, device=a.device)
    for step in range(MAX_STEPS + 1):
        ax = a[active] @ x
        # Symmetrised: Ẽ + Ẽᵀ must equal R exactly, and an asymmetric S would add (s_ij − s_ji)/gap to it.
        r = eye - x.mT @ x
        r = (r + r.mT) / 2
        s = x.mT @ ax
        s = (s + s.mT) / 2
        lam = s.diagonal(dim1=-2, dim2=-1) / (1 - r.diagonal(dim1=-2, dim2=-1))
        residual = torch.linalg.matrix_norm(ax - x * lam.unsqueeze(1))
        ok = (residual <= bound * norm[active]) & (torch.linalg.matrix_norm(r) <= bound)
        done = active[ok]
        lam_out[done], x_out[done], passed[done] = lam[ok], x[ok], True
        left = ~ok
        if step == MAX_STEPS or not bool(left.any()):
            break
        active = active[left]
        # A cluster whose couplings alone would use a quarter of the residual allowance is rotated.
        x = _step(x[left], s[left], r[left], lam[left], bound * norm[active] / 4)
    return lam_out, x_out, passed


def eigh_refined(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 eigendecomposition of symmetric gram [B, d, d] (lower triangle read; any float dtype; CPU or CUDA).

    Returns (λ [B, d] float64 ascending, E [B, d, d] float64, eigenvectors in columns), each matrix checked to the
    float64 grade in the module docstring (or recomputed by float64 torch.linalg.eigh). Raises ValueError naming
    gram for NaN/Inf in its lower triangle.
    """
    b, d = gram.shape[0], gram.shape[-1]
    low = gram.detach().to(torch.float64).tril()
    a = low + low.tril(-1).mT
    if b == 0 or d == 0:
        return a.new_zeros(b, d), a.new_zeros(b, d, d)
    top = a.abs().amax(dim=(-2, -1))
    if not bool(torch.isfinite(top).all()):
        _validate.require_finite("gram", gram.detach().tril())
    _, exponent = torch.frexp(top)
    # The zero matrix keeps scale 1; the clamp keeps 2^-exponent a finite, non-zero float64 for subnormal input.
    scale = torch.exp2(-torch.where(top > 0, exponent, 0).clamp(-1000, 1000).to(torch.float64))
    scaled = a * scale.view(-1, 1, 1)
    x = _float32_start(scaled)
    if x is None:
        _log_once("float32", "faast: eigh torch.refined: float32 eigh failed on a batch of %d (d = %d); it was "
                  "solved by float64 torch.linalg.eigh instead (said once)", b, d)  # fmt: skip
        return torch.linalg.eigh(a)
    lam, vecs, passed = _refine(scaled, x)
    lam = lam / scale.unsqueeze(-1)
    if not bool(passed.all()):
        failed = (~passed).nonzero().squeeze(-1)
        _log_once("check", "faast: eigh torch.refined: %d of %d matrices (d = %d) did not pass the float64 check "
                  "within %d refinement steps; they were recomputed by float64 torch.linalg.eigh (said once)",
                  failed.numel(), b, d, MAX_STEPS)  # fmt: skip
        lam[failed], vecs[failed] = torch.linalg.eigh(a[failed])
    # Stable, so that equal eigenvalues keep the order float64 eigh gave them.
    lam, order = lam.sort(dim=-1, stable=True)
    return lam, vecs.gather(2, order.unsqueeze(1).expand_as(vecs))
