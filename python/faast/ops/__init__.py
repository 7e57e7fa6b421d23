"""Functional ops of faast.

Conventions (docs/design.md §1): keys K [*, N, dk], values V [*, N, dv], fast weights W [*, dk, dv]; a query
q [..., dk] reads q @ W. Every op accepts leading batch dims (one per memory layer, or per task), which must agree
between arguments. The implementation of each op is chosen by faast.ops._dispatch (FAAST_BACKEND); the pure-torch
backend in faast.ops.reference runs everywhere and is the oracle for the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import (
    _autotune,
    _cuda_backend,
    _cupy_backend,
    _dispatch,
    _triton_backend,
    _validate,
    gram_modes,
    int8,
    mixture,
    paths,
    reference,
    refined_eigh,
)  # fmt: skip
from ._validate import (
    as_count,
    check_accumulator,
    check_rows,
    check_scores,
    check_solve_options,
    explain_nonfinite,
)
from .solve import SolveInfo, solve_fixed_ridge, solve_from_eigh, solve_uncut

__all__ = [
    "BACKEND_ENV_VAR",
    "SolveInfo",
    "accumulate_gram",
    "accumulate_gram_unchecked",
    "eigh_gram",
    "fold_readout",
    "mix_probabilities",
    "native_extension_error",
    "residual_project",
    "solve_fast_weights",
    "solve_fast_weights_ex",
]

_dispatch.register_backend(
    _dispatch.Backend(
        name="torch",
        ops={
            "accumulate_gram": reference.accumulate_gram_streaming,
            "eigh": reference.eigh,
            "residual_project": reference.residual_project,
            "mix_probabilities": mixture.mix_probabilities_torch,
        },
    )
)
# Variants of the torch backend's Gram that compete with it under auto (docs/backends.md, "How auto chooses").
_dispatch.register_variant(
    "torch", "accumulate_gram", "syrk", gram_modes.accumulate_gram_syrk,
    cannot_run=gram_modes.syrk_cannot_run, gate=gram_modes.syrk_gate,
)  # fmt: skip
_dispatch.register_variant(
    "torch", "accumulate_gram", "exact16", gram_modes.accumulate_gram_exact16,
    cannot_run=gram_modes.exact16_cannot_run, gate=gram_modes.exact16_gate,
)  # fmt: skip
_dispatch.register_variant(
    "torch", "eigh", "refined", refined_eigh.eigh_refined, cannot_run=refined_eigh.refined_cannot_run,
)  # fmt: skip
_triton_backend.register()
# The int8-slice Gram: float64-grade by its own bound, so its gate replaces the triton backend's (docs/numerics.md §4).
_dispatch.register_variant(
    "triton", "accumulate_gram", "int8", _triton_backend.accumulate_gram_int8,
    cannot_run=_triton_backend.int8_cannot_run, gate=_triton_backend.int8_gate, own_gate=True,
)  # fmt: skip
_cuda_backend.register()
_cupy_backend.register()
int8.register()
paths.register()

#: The environment variable that chooses backends: "torch", "triton", "cuda", or per op ("eigh=cuda,torch").
BACKEND_ENV_VAR = _dispatch.ENV_VAR


def native_extension_error() -> str | None:
    """Why the native extension faast._C (cuSOLVER's batched eigensolver) cannot be used here; None when it loads."""
    return _cuda_backend.load_error()


# The measured choice (faast.ops._autotune) times candidates on this many rows / matrices of a call's inputs.
_GRAM_SAMPLE = {"cuda": 8192}
_GRAM_SAMPLE_DEFAULT = 2048
# Batched eigensolvers gain with the batch, so on a GPU eigh is timed on the whole batch (up to this many matrices); a
# CPU solves the matrices one after another, so two stand for any batch (48 of d = 1600 take ~45 s there).
_EIGH_SAMPLE = 64
_EIGH_SAMPLE_CPU = 2
_RESIDUAL_SAMPLE = 8192
# The fused mixture runs one program per row, so its time hardly shrinks below a GPU's worth of rows while the torch
# composition's passes shrink with the rows: a 256-row sample tied them on an H100 where 1,024-row read chunks ran
# the kernel 4.4x faster (lab/benchmarks/results/gpu_h100_run5.md). The sample is one whole read chunk.
_MIXTURE_SAMPLE = 1024


def eigh_call(flat: torch.Tensor) -> _dispatch.Call:
    """The dispatch's description of eigh_gram on flat [B, d, d] (benchmarks pass it to _dispatch.explain)."""
    b, d = flat.shape[0], flat.shape[-1]
    return _dispatch.Call(
        "eigh", flat.device, (flat.dtype,), (tuple(flat.shape),), shape_class=f"B{_autotune.size_class(b)} d{d}"
    )


def residual_call(x: torch.Tensor, m: torch.Tensor) -> _dispatch.Call:
    """The dispatch's description of residual_project(x [..., d], m [d, d])."""
    d = x.shape[-1]
    rows = x.numel() // max(d, 1)
    return _dispatch.Call(
        "residual_project", x.device, (x.dtype, m.dtype), (tuple(x.shape), tuple(m.shape)),
        shape_class=f"rows{_autotune.size_class(min(rows, _RESIDUAL_SAMPLE))} d{d} {x.dtype}/{m.dtype}",
    )  # fmt: skip


def mixture_call(z: torch.Tensor, dz: torch.Tensor) -> _dispatch.Call:
    """The dispatch's description of mix_probabilities(z [n, V], dz [n, V], ...)."""
    n, v = z.shape
    return _dispatch.Call(
        "mix_probabilities", z.device, (z.dtype, dz.dtype), (tuple(z.shape), tuple(dz.shape)),
        shape_class=f"rows{_autotune.size_class(min(n, _MIXTURE_SAMPLE))} V{v} {z.dtype}/{dz.dtype}",
    )  # fmt: skip


def gram_call(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None, mask: torch.Tensor | None = None,
    *, weighted_least_squares: bool = False, compute_dtype: torch.dtype = torch.float64,
) -> _dispatch.Call:  # fmt: skip
    """The dispatch's description of accumulate_gram on these rows (keys [*, N, dk], values [*, N, dv])."""
    options = {"weighted_least_squares": weighted_least_squares, "compute_dtype": compute_dtype}
    return _gram_call(_flat_rows(keys, values, scores, mask), options)


def _gram_call(flat: tuple, options: dict) -> _dispatch.Call:
    keys, values, scores, mask = flat
    n = keys.shape[1]
    rows = min(n, _GRAM_SAMPLE.get(keys.device.type, _GRAM_SAMPLE_DEFAULT))
    opts = {**options, "masked": mask is not None, "scored": scores is not None,
            "scores_dtype": None if scores is None else scores.dtype}  # fmt: skip
    shape_class = (
        f"B{keys.shape[0]} N{_autotune.size_class(rows)} dk{keys.shape[2]} dv{values.shape[2]} "
        f"{keys.dtype}/{values.dtype} compute {options['compute_dtype']} mask {int(mask is not None)} "
        f"scores {int(scores is not None)} wls {int(options['weighted_least_squares'])}"
    )
    return _dispatch.Call(
        "accumulate_gram", keys.device, (keys.dtype, values.dtype), (tuple(keys.shape), tuple(values.shape)), opts,
        shape_class,
    )  # fmt: skip


def _gram_sample(flat: tuple, options: dict) -> Callable[[Callable], object]:  # a closure for faast.ops._dispatch
    rows = _GRAM_SAMPLE.get(flat[0].device.type, _GRAM_SAMPLE_DEFAULT)
    part = tuple(None if t is None else t[:, :rows] for t in flat)
    return lambda fn: fn(*part, **options)


def _flat_rows(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The rows with their leading dims folded into one, as the backends take them: [L, N, d] and [L, N]."""
    batch = tuple(keys.shape[:-2])
    n, dk, dv = keys.shape[-2], keys.shape[-1], values.shape[-1]
    size = math.prod(batch)  # explicit: reshape(-1, 0, dk) is ambiguous when N = 0
    return (
        keys.reshape(size, n, dk),
        values.reshape(size, n, dv),
        None if scores is None else scores.reshape(size, n),
        None if mask is None else mask.reshape(size, n),
    )


def accumulate_gram(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None = None,
    *,
    gram: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
    target_sqnorm: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    weighted_least_squares: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one batch of rows to the streamed statistics: S += K^T K and T += K^T diag(scores) V, in place.

    The checked entry: every argument is validated and the accumulators are untouched when it raises. Differentiable
    in values and scores when they require grad (e.g. scores from a trained scorer).

    Args:
        keys: [*, N, dk], any floating dtype (upcast per chunk: a Gram is never formed in fp16/bf16).
        values: [*, N, dv], same leading dims as keys.
        scores: [*, N] non-negative weights or None (all ones). They weight the values only, reproducing the
            authors' vals * score; S stays unweighted and N counts rows, not the sum of scores.
        gram: [*, dk, dk] float32/float64 accumulator, updated in place; None creates float64 zeros.
        cross: [*, dk, dv] float32/float64 accumulator, updated in place; None creates float64 zeros.
        target_sqnorm: optional [*] float32/float64 accumulator of the squared target norms (sum ||s_n v_n||^2,
            or sum s_n ||v_n||^2 with weighted least squares), which alpha='auto' and ridge='auto' need; updated in
            place when given.
        mask: [*, N] bool or None; rows where it is False are skipped entirely (padding).
        weighted_least_squares: use S = K^T diag(s) K instead (a different estimator, explicitly opt-in).
        compute_dtype: float64 (default, exact products and sums) or float32 (per-4096-row float32 GEMMs summed in
            float64: faster, but loses directions below ~1e-7·λmax; docs/numerics.md §1).

    Returns:
        (gram, cross): the updated accumulators (the given tensors, or new float64 ones).

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype, shape or device, negative scores, or
        NaN/Inf in a row that is not masked out. The accumulators are untouched when it raises.
    """
    check_rows(keys, values, scores, mask)
    batch, dk, dv = tuple(keys.shape[:-2]), keys.shape[-1], values.shape[-1]
    check_accumulator("gram", gram, (*batch, dk, dk), "[*, dim_key, dim_key]", keys)
    check_accumulator("cross", cross, (*batch, dk, dv), "[*, dim_key, dim_value]", keys)
    check_accumulator("target_sqnorm", target_sqnorm, batch, "[*] (the batch dims of keys)", keys)
    check_scores(scores, mask)
    if compute_dtype not in (torch.float32, torch.float64):
        raise TypeError(f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}")
    # Computed apart and added only once known finite, so a bad batch leaves the accumulators untouched; the rows
    # are scanned only then, to name the first bad input.
    d_gram, d_cross, d_sqnorm = accumulate_gram_unchecked(
        keys, values, scores, mask, weighted_least_squares=weighted_least_squares, compute_dtype=compute_dtype
    )
    finite = torch.isfinite(d_gram).all() & torch.isfinite(d_cross).all() & torch.isfinite(d_sqnorm).all()
    if not bool(finite):
        raise explain_nonfinite(keys, values, scores, mask)
    if gram is None:
        gram = d_gram
    else:
        gram.add_(d_gram)
    if cross is None:
        cross = d_cross
    else:
        cross.add_(d_cross)
    if target_sqnorm is not None:
        target_sqnorm.add_(d_sqnorm)
    return gram, cross


def accumulate_gram_unchecked(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    gram: torch.Tensor | None = None,
    cross: torch.Tensor | None = None,
    target_sqnorm: torch.Tensor | None = None,
    weighted_least_squares: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """accumulate_gram for callers that validated the arguments (faast.FastWeights): no checks, no value scans, no
    host synchronisation. The results may be non-finite if the rows were.

    keys [*, N, dk], values [*, N, dv], scores / mask [*, N]. Rows with mask False contribute nothing even if they
    hold NaN/Inf. With gram [*, dk, dk], cross [*, dk, dv] and target_sqnorm [*] all given, the batch is added to
    them in place (one launch when the backend has an in-place kernel and they are contiguous float64: the Triton
    backend on CUDA). With all three None, the batch's own float64 statistics are returned (dS, dT, dyy), e.g. for
    FastWeights.forget; they are differentiable in values and scores when those require grad.

    Returns (gram, cross, target_sqnorm): the given accumulators, or the new statistics.
    """
    given = [t is not None for t in (gram, cross, target_sqnorm)]
    if any(given) and not all(given):
        raise ValueError("gram, cross, target_sqnorm: pass all three accumulators, or none for new statistics")
    batch, dk, dv = tuple(keys.shape[:-2]), keys.shape[-1], values.shape[-1]
    size = math.prod(batch)
    flat = _flat_rows(keys, values, scores, mask)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in flat[:3])
    options = {"weighted_least_squares": weighted_least_squares, "compute_dtype": compute_dtype}
    name, impl = _dispatch.resolve(
        "accumulate_gram", keys.device, _gram_call(flat, options), None if needs_grad else _gram_sample(flat, options)
    )
    in_place = _dispatch.implementation(name, "accumulate_gram_") if all(given) and not needs_grad else None
    # The None tests repeat what `given` says, for the type checker.
    if (
        in_place is not None and gram is not None and cross is not None and target_sqnorm is not None
        and all(t.dtype == torch.float64 and t.is_contiguous() for t in (gram, cross, target_sqnorm))
    ):  # fmt: skip
        in_place(*flat, gram.reshape(size, dk, dk), cross.reshape(size, dk, dv), target_sqnorm.reshape(size),
                 **options)  # fmt: skip
        return gram, cross, target_sqnorm
    # The torch backend's streaming kernel is not differentiable, and no kernel differentiates with respect to keys.
    # Variants (torch.syrk, triton.int8, ...) are not differentiable either.
    if needs_grad and (name.partition(".")[0] == "torch" or _dispatch.VARIANT_SEPARATOR in name or keys.requires_grad):
        impl = reference.accumulate_gram_differentiable
    d_gram, d_cross, d_sqnorm = impl(*flat, **options)
    d_gram = d_gram.to(torch.float64).reshape(*batch, dk, dk)
    d_cross = d_cross.to(torch.float64).reshape(*batch, dk, dv)
    d_sqnorm = d_sqnorm.to(torch.float64).reshape(batch)
    if gram is None or cross is None or target_sqnorm is None:  # none given (checked above: all or none)
        return d_gram, d_cross, d_sqnorm
    gram.add_(d_gram)
    cross.add_(d_cross)
    target_sqnorm.add_(d_sqnorm)
    return gram, cross, target_sqnorm


def eigh_gram(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 eigendecomposition of symmetric matrices [*, d, d]: (λ [*, d] ascending, E [*, d, d]).

    Only the lower triangle is read. Batched across the leading dims by the selected backend (the cuSOLVER batched
    solver where available). Never runs in float32: it would lose every direction below ~1e-5·λmax.
    """
    _validate.require_tensor("gram", gram, dtypes=_validate.ACCUMULATOR_DTYPES)
    _validate.require_ndim("gram", gram, 2, "[*, d, d]")
    d = gram.shape[-1]
    if gram.shape[-2] != d:
        raise ValueError(f"gram: expected square matrices [*, d, d], got {list(gram.shape)}")
    flat = gram.reshape(-1, d, d)
    sample = flat[: _EIGH_SAMPLE_CPU if flat.device.type == "cpu" else _EIGH_SAMPLE].to(torch.float64)
    _, impl = _dispatch.resolve("eigh", gram.device, eigh_call(flat), lambda fn: fn(sample))
    lam, vecs = impl(flat)
    return lam.reshape(*gram.shape[:-1]), vecs.reshape(gram.shape)


def solve_fast_weights_ex(
    gram: torch.Tensor,
    cross: torch.Tensor,
    *,
    count: float | torch.Tensor,
    alpha: float | str = 1.0,
    rtol: float | None = None,
    ridge: float | str | None = None,
    target_sqnorm: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, SolveInfo]:
    """solve_fast_weights that also returns a SolveInfo (kept rank, cut, ridge, GCV score, method) per batch element.

    A fixed ridge μ > 0 is solved without a spectrum, by one batched float64 Cholesky solve of S + μI (SolveInfo.method
    'cholesky'; solve.solve_fixed_ridge says how its rank and rtol read); when S + μI is not numerically positive
    definite for some element, the whole call takes the eigendecomposition path instead, logged once. A truncation
    (alpha a number, or rtol) proven to cut nothing in every element is S⁻¹T, also by Cholesky (solve.solve_uncut:
    two factorisations, one of them the proof) unless FAAST_BACKEND names a backend for eigh; otherwise, and for
    ridge=0, ridge='auto' and alpha='auto', the spectrum decides: method 'eigh'.
    """
    _validate.require_tensor("gram", gram, dtypes=_validate.ACCUMULATOR_DTYPES)
    _validate.require_ndim("gram", gram, 2, "[*, dim_key, dim_key]")
    dk = gram.shape[-1]
    if gram.shape[-2] != dk or dk == 0:
        raise ValueError(f"gram: expected a non-empty square matrix [*, dim_key, dim_key], got {list(gram.shape)}")
    batch = tuple(gram.shape[:-2])
    _validate.require_tensor("cross", cross, dtypes=_validate.ACCUMULATOR_DTYPES)
    _validate.require_ndim("cross", cross, 2, "[*, dim_key, dim_value]")
    if tuple(cross.shape[:-1]) != (*batch, dk) or cross.shape[-1] == 0:
        raise ValueError(
            f"cross: expected shape [*, dim_key, dim_value] with [*, dim_key] = {[*batch, dk]} as in gram, "
            f"got {list(cross.shape)}"
        )
    check_solve_options(alpha, rtol, ridge, target_sqnorm)
    if target_sqnorm is not None:
        _validate.require_tensor("target_sqnorm", target_sqnorm, dtypes=_validate.ACCUMULATOR_DTYPES)
        _validate.require_shape("target_sqnorm", target_sqnorm, batch, "[*] (the batch dims of gram)")
    _validate.require_same_device("gram", gram, cross=cross, target_sqnorm=target_sqnorm)
    _validate.require_finite("gram", gram)
    _validate.require_finite("cross", cross)
    counts = as_count(count, batch, gram.device)
    flat_cross = cross.reshape(-1, dk, cross.shape[-1])
    # The gradient flows through T only: S^+ is a constant, as in the authors' detached pinv (docs/design.md §6).
    solved = None
    if ridge is not None and not isinstance(ridge, str) and ridge > 0:  # a str is 'auto' (check_solve_options)
        solved = solve_fixed_ridge(gram.detach().reshape(-1, dk, dk), flat_cross, counts, float(ridge))
    elif ridge is None and alpha != "auto" and _dispatch.requested_backend("eigh") == "auto":
        # An eigensolver named in FAAST_BACKEND is a request for the spectrum (to use or measure it): honoured.
        solved = solve_uncut(gram.detach().reshape(-1, dk, dk), flat_cross, counts, float(alpha), rtol)
    if solved is None:
        lam, vecs = eigh_gram(gram.detach())
        lam, vecs = lam.reshape(-1, dk), vecs.reshape(-1, dk, dk)
        yy = None if target_sqnorm is None else target_sqnorm.detach().reshape(-1).to(torch.float64)
        solved = solve_from_eigh(lam, vecs, flat_cross, counts, alpha=alpha, rtol=rtol, ridge=ridge, target_sqnorm=yy)
    weights, info = solved
    weights = weights.reshape(*batch, dk, cross.shape[-1]).to(out_dtype or cross.dtype)
    return weights, info.map_tensors(lambda f: f.reshape(batch))


def solve_fast_weights(
    gram: torch.Tensor,
    cross: torch.Tensor,
    *,
    count: float | torch.Tensor,
    alpha: float | str = 1.0,
    rtol: float | None = None,
    ridge: float | str | None = None,
    target_sqnorm: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fast weights W = pinv_eps(K) diag(s) V from the streamed statistics, via a float64 eigendecomposition of S.

    Args:
        gram: S [*, dk, dk] float32/float64 (only the lower triangle is read). The eigensolver always runs in
            float64: in float32 it loses every direction below ~1e-5·λmax (docs/numerics.md §1).
        cross: T [*, dk, dv] float32/float64.
        count: N, the number of rows learned (a number, or a tensor broadcastable to the batch dims); it sets
            eps = N^-alpha. N = 0 gives W = 0.
        alpha: spectral filter exponent (keep σ > N^-alpha·σmax, i.e. λ > N^-2alpha·λmax), or 'auto' to choose the
            kept rank by generalized cross-validation (needs target_sqnorm). alpha = 0 keeps nothing (W = 0).
        rtol: a fixed relative cut on singular values instead of N^-alpha (like torch.linalg.pinv(rtol=...)).
        ridge: None for the truncated pseudo-inverse (default); a penalty μ >= 0 for W = (S + μI)^+ T; or 'auto'
            for the μ that minimises GCV (needs target_sqnorm). Ridge replaces the N^-alpha cut, so alpha is unused.
        target_sqnorm: [*] squared target norms accumulated by accumulate_gram(target_sqnorm=...).
        out_dtype: dtype of W (default: cross.dtype). W is computed in float64 and cast once.

    Returns:
        W: [*, dk, dv]. Eigenvalues are kept when λ > max(eps², dk·2^-52)·max(λmax, 0), strictly, exactly like
        torch.linalg.pinv(K, atol=0, rtol=eps) on the stored keys.
    """
    weights, _ = solve_fast_weights_ex(
        gram, cross, count=count, alpha=alpha, rtol=rtol, ridge=ridge, target_sqnorm=target_sqnorm,
        out_dtype=out_dtype,
    )  # fmt: skip
    return weights


def residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """h = x + x @ m: a memory layer's output with the readout folded in (m = W·P, see fold_readout).

    Args:
        x: [..., d] hidden states, any floating dtype.
        m: [d, d] folded projection, any floating dtype.

    Returns:
        [..., d] in x.dtype, accumulated in float32 (float64 if either input is float64).
    """
    _validate.require_tensor("x", x)
    _validate.require_ndim("x", x, 1, "[..., d]")
    _validate.require_tensor("m", m)
    d = x.shape[-1]
    _validate.require_shape("m", m, (d, d), "[d, d] with d = x.shape[-1]")
    _validate.require_same_device("x", x, m=m)
    sample = x.reshape(-1, d)[:_RESIDUAL_SAMPLE]
    _, impl = _dispatch.resolve("residual_project", x.device, residual_call(x, m), lambda fn: fn(sample, m))
    return impl(x, m)


def fold_readout(
    weights: torch.Tensor, readout: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """M = W @ P, folded once per solve so that inference costs one GEMM: h + (h W) P = h + h M.

    Args:
        weights: W [*, dk, dv].
        readout: P [dv, d_out] or [*, dv, d_out], row convention. For an nn.Linear `proj` (y = x A^T) pass
            proj.weight.mT.
        out_dtype: dtype of M (default: the promoted dtype of the inputs). The product is computed in float64.

    Returns:
        M [*, dk, d_out].
    """
    _validate.require_tensor("weights", weights)
    _validate.require_ndim("weights", weights, 2, "[*, dim_key, dim_value]")
    _validate.require_tensor("readout", readout)
    _validate.require_ndim("readout", readout, 2, "[dim_value, d_out]")
    batch = tuple(weights.shape[:-2])
    if readout.shape[-2] != weights.shape[-1] or (readout.dim() > 2 and tuple(readout.shape[:-2]) != batch):
        raise ValueError(
            f"readout: expected shape [dim_value, d_out] or [*, dim_value, d_out] with dim_value = "
            f"{weights.shape[-1]} and * = {list(batch)} as in weights, got {list(readout.shape)}"
        )
    _validate.require_same_device("weights", weights, readout=readout)
    dtype = out_dtype or torch.promote_types(weights.dtype, readout.dtype)
    return (weights.to(torch.float64) @ readout.to(torch.float64)).to(dtype)


def mix_probabilities(
    z: torch.Tensor,
    dz: torch.Tensor,
    log_odds: torch.Tensor,
    log_rest: torch.Tensor,
    full: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """The probability-space read of a residual output memory, per row: log((1 − λ)·softmax(z·s) + λ·softmax(z·s +
    dz)) / s, and log_softmax(z·s + dz) / s on `full` rows (λ = 1). No gradient (faast/hf/mixture.py keeps the
    differentiable path in torch).

    Args:
        z: [n, V] the head's logits, any floating dtype.
        dz: [n, V] the correction's head products, any floating dtype.
        log_odds: [n] log(λ / (1 − λ)) per row, float32 or float64.
        log_rest: [n] log(1 − λ) per row, float32 or float64.
        full: [n] bool, rows read with λ = 1 (their log_odds / log_rest are ignored); None: no such row.
        scale: s, the model type's logit scale (a finite number > 0).

    Returns:
        [n, V] in z.dtype, computed in float32 (float64 for float64 z, on the torch backend).
    """
    _validate.require_tensor("z", z)
    if z.dim() != 2:
        raise ValueError(f"z: expected a tensor of shape [n, V], got {list(z.shape)}")
    _validate.require_tensor("dz", dz)
    _validate.require_shape("dz", dz, tuple(z.shape), "[n, V] as z")
    n = z.shape[0]
    for name, t in (("log_odds", log_odds), ("log_rest", log_rest)):
        _validate.require_tensor(name, t, dtypes=(torch.float32, torch.float64))
        _validate.require_shape(name, t, (n,), "[n], one value per row of z")
    if full is not None:
        _validate.require_tensor("full", full, dtypes=(torch.bool,))
        _validate.require_shape("full", full, (n,), "[n], one flag per row of z")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite number > 0, got {scale!r}")
    _validate.require_same_device("z", z, dz=dz, log_odds=log_odds, log_rest=log_rest, full=full)
    k = min(n, _MIXTURE_SAMPLE)
    flags = None if full is None else full[:k]

    def sample(fn: Callable) -> object:
        return fn(z[:k], dz[:k], log_odds[:k], log_rest[:k], flags, float(scale))

    _, impl = _dispatch.resolve("mix_probabilities", z.device, mixture_call(z, dz), sample)
    return impl(z, dz, log_odds, log_rest, full, float(scale))
