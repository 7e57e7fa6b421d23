"""The ``triton`` backend: faast_kernels' fused Gram and residual kernels behind faast.ops' backend signatures.

Registered lazily: importing faast does not import Triton; the kernels are loaded on the first call. It runs on CUDA
tensors, and on CPU tensors too under TRITON_INTERPRET=1 (Triton's interpreter: slow, used by the tests).
compute_dtype float64 selects the kernel's "fp64" mode (float64 products and sums: the mode that passes the float64
fidelity suite, so it is the default); float32 selects "tf32x3" (tensor-core products at float32 accuracy, float32
sums flushed into float64 every 256 rows), which FastWeights already warns about below its resolution floor.
"""

from __future__ import annotations

import warnings

import torch

from . import _dispatch

_PRECISION = {torch.float64: "fp64", torch.float32: "tf32x3"}
_warned: list[bool] = []


def _warn_opt_in_mode() -> None:
    if _warned:
        return
    _warned.append(True)
    warnings.warn(
        "faast triton backend: compute_dtype=float32 runs the opt-in tf32x3 Gram mode, which fails the float64 "
        "fidelity suite on power-law spectra (9 of 26 cases; relW up to 1.2e-3 against 1e-5; "
        "benchmarks/results/triton_fidelity_interpreter.md). Use compute_dtype=float64 (the default) for exact "
        "statistics.",
        RuntimeWarning,
        stacklevel=4,
    )


def _kernels():  # noqa: ANN202 - the faast_kernels.ops module
    import faast_kernels.ops

    return faast_kernels.ops


def accumulate_gram(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    weighted_least_squares: bool,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dS [B, dk, dk], dT [B, dk, dv], dyy [B]) float64 of flattened rows keys [B, N, dk] etc."""
    _kernels()
    if compute_dtype == torch.float32:
        _warn_opt_in_mode()
    gram, cross = torch.ops.faast_kernels.gram_statistics(
        keys, values, scores, mask, weighted_least_squares, _PRECISION[compute_dtype]
    )
    # The GCV statistic is O(N·dv): plain torch, float64.
    v2 = values.to(torch.float64).square().sum(-1)
    if scores is not None:
        s = scores.to(torch.float64)
        v2 = v2 * (s if weighted_least_squares else s.square())
    if mask is not None:
        v2 = torch.where(mask, v2, 0.0)
    return gram, cross, v2.sum(-1)


def residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    _kernels()
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.faast_kernels.residual_project(flat, m).reshape(x.shape)


_load_error: list[str] = []


def _unavailable() -> str | None:
    """Why the kernels cannot run, or None; tries the import once (a broken Triton install is reported, not hit)."""
    import faast_kernels

    if not faast_kernels.HAS_TRITON:
        return "Triton is not installed (pip install triton)"
    if not _load_error:
        try:
            _kernels()
            _load_error.append("")
        except Exception as err:  # noqa: BLE001 - any import failure makes the backend unavailable, with its reason
            _load_error.append(f"faast_kernels failed to load: {type(err).__name__}: {err}")
    return _load_error[0] or None


def _devices() -> tuple[str, ...]:
    import faast_kernels

    return ("cuda", "cpu") if faast_kernels.interpreting() else ("cuda",)


def _not_for_auto() -> str | None:
    # The kernels are verified (interpreter tests, fidelity suite) but their GPU speed against cuBLAS is unmeasured:
    # until benchmarks/bench_kernels.py shows them faster on a GPU, `auto` keeps the torch path there.
    return "its GPU speed is not measured yet (benchmarks/bench_kernels.py); FAAST_BACKEND=triton selects it"


def register() -> None:
    _dispatch.register_backend(
        _dispatch.Backend(
            name="triton",
            ops={"accumulate_gram": accumulate_gram, "residual_project": residual_project},
            devices=_devices(),
            unavailable_reason=_unavailable,
            auto_reason=_not_for_auto,
        )
    )
