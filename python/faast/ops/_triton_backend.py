"""The ``triton`` backend: faast_kernels' fused Gram, residual and mixture kernels behind faast.ops' backend
signatures.

Registered lazily: importing faast does not import Triton; the kernels are loaded on the first call. It runs on CUDA
tensors, and on CPU tensors too under TRITON_INTERPRET=1 (Triton's interpreter: slow, used by the tests).
compute_dtype float64 selects the kernel's "fp64" mode (float64 products and sums: the mode that passes the float64
fidelity suite, so it is the default). float32 selects, for bf16/fp16 keys and values, "exact16" (native 16-bit
tensor-core products, exact in float32, summed in float32 over at most faast_kernels.gram.FLUSH_ROWS rows and then in
float64), and for float32/float64 inputs "tf32x3" (tensor-core products at float32 accuracy); FastWeights already
warns about float32 compute below its resolution floor.

On an H100 (lab/benchmarks/results/gpu_h100_run2.md) the fp64 mode does not compile with 16-bit inputs or a mask, and
no float32-accumulating mode passes the float64 fidelity suite (tensor cores truncate). `gate` keeps auto away from
what is known not to work; elsewhere auto times the kernels against cuBLAS (faast.ops._dispatch). A failure of the
fp64 mode on a GPU is raised naming the ways around it (`fp64_failure_explained`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import cast

import torch

from . import _dispatch

_warned: list[bool] = []


def precision_for(compute_dtype: torch.dtype, input_dtype: torch.dtype) -> str:
    """The kernel mode that implements compute_dtype for inputs of input_dtype."""
    if compute_dtype == torch.float64:
        return "fp64"
    return "exact16" if input_dtype in (torch.float16, torch.bfloat16) else "tf32x3"


def _warn_opt_in_mode() -> None:
    if _warned:
        return
    _warned.append(True)
    warnings.warn(
        "faast triton backend: compute_dtype=float32 with float32 inputs runs the opt-in tf32x3 Gram mode, which "
        "fails "
        "the float64 fidelity suite (interpreter: 9 of 26 cases; H100: all 26, relW up to 1.7e-2 against 1e-5; "
        "lab/benchmarks/results/gpu_h100_run1.md). Use compute_dtype=float64 (the default) for exact statistics.",
        RuntimeWarning,
        stacklevel=4,
    )


@contextlib.contextmanager
def fp64_failure_explained(precision: str, device: torch.device) -> Iterator[None]:
    """Re-raise a failure of the fp64 Gram mode on a CUDA device (where Triton's float64 dot may not compile) as a
    RuntimeError that names the fix, chained to the original; other modes and devices, and out-of-memory errors,
    pass through unchanged. `auto` does not pick the fp64 mode where it is known not to compile (`gate`) and drops
    a kernel that fails while being timed, so this is what an explicit FAAST_BACKEND=triton gets instead of a
    fallback."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:
        if precision != "fp64" or device.type != "cuda":
            raise
        raise RuntimeError(
            f"faast triton backend: the float64 Gram mode ('fp64', compute_dtype=torch.float64) failed on {device} "
            f"({type(err).__name__}: {err}). Triton's float64 dot did not compile on sm_90 with Triton 3.6 "
            "(lab/benchmarks/results/gpu_h100_run1.md). Set FAAST_BACKEND=torch (cuBLAS float64 GEMMs, exact), or "
            "pass compute_dtype=torch.float32 to keep the Triton kernels (16-bit inputs: the exact16 mode; float32 "
            "inputs: the tf32x3 mode, which fails the float64 fidelity suite)"
        ) from err


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
    same16 = keys.dtype == values.dtype and keys.dtype in (torch.float16, torch.bfloat16)
    precision = precision_for(compute_dtype, keys.dtype if same16 else torch.float32)
    if precision == "tf32x3":
        _warn_opt_in_mode()
    # One launch gives S, T and the GCV statistic ‖Y‖².
    with fp64_failure_explained(precision, keys.device):
        return torch.ops.faast_kernels.gram_statistics(keys, values, scores, mask, weighted_least_squares, precision)


def accumulate_gram_(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    gram: torch.Tensor,
    cross: torch.Tensor,
    sqnorm: torch.Tensor,
    *,
    weighted_least_squares: bool,
    compute_dtype: torch.dtype,
) -> None:
    """In place: gram [B, dk, dk] += Kᵀ K, cross [B, dk, dv] += Kᵀ diag(s) V, sqnorm [B] += ‖Y‖², one launch."""
    _kernels()
    same16 = keys.dtype == values.dtype and keys.dtype in (torch.float16, torch.bfloat16)
    precision = precision_for(compute_dtype, keys.dtype if same16 else torch.float32)
    if precision == "tf32x3":
        _warn_opt_in_mode()
    with fp64_failure_explained(precision, keys.device):
        torch.ops.faast_kernels.gram_accumulate_(
            keys, values, scores, mask, gram, cross, sqnorm, weighted_least_squares, precision
        )


# ---------------------------------------------------------------------------------------------------- int8 slices

_INT8_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def _int8_kernels():  # noqa: ANN202 - the faast_kernels.gram_int8 module
    import faast_kernels.gram_int8

    return faast_kernels.gram_int8


def accumulate_gram_int8(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    weighted_least_squares: bool,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """triton.int8: (dS [B, dk, dk], dT [B, dk, dv], dyy [B]) float64 from int8 slices of keys [B, N, dk] and
    values [B, N, dv] (bf16 / fp16 / float32), float64-grade by faast_kernels.gram_int8's bound whatever
    compute_dtype asks (docs/numerics.md §4). Not differentiable."""
    del compute_dtype  # one grade: the bound's
    return _int8_kernels().gram_accumulate_int8(
        keys, values, scores, mask, weighted_least_squares=weighted_least_squares
    )


def _int8_bound() -> float:
    from faast_kernels.int8_slices import BOUND

    return BOUND


def int8_cannot_run(call: _dispatch.Call) -> str | None:
    """faast.ops._dispatch cannot_run for triton.int8: keys and values bf16, fp16 or float32."""
    if len(call.dtypes) < 2 or any(d not in _INT8_INPUTS for d in call.dtypes[:2]):
        return f"triton.int8 slices bfloat16, float16 or float32 keys and values, got {call.dtypes[:2]}"
    return None


def int8_worst_bound(input_dtype: torch.dtype, scores_dtype: torch.dtype | None) -> float:
    """The largest error of one row's product, relative to 2^(E_i+E_j), that triton.int8 can make on inputs of
    these dtypes (any values): the slices' bound at the most slices, plus the float64 rounding of a scored product
    s·x whose bits do not fit in float64 (float64 scores). Pure torch: does not import Triton."""
    from faast_kernels import int8_slices as g8

    bound = g8.error_bound(g8.MAX_SLICES, g8.MAX_SLICES, False, False)
    if scores_dtype is not None:
        bits = g8.SIGNIFICANT_BITS[input_dtype] + g8.SIGNIFICANT_BITS.get(scores_dtype, 53)
        if bits > 53:
            bound += 2.0**-53
    return bound


def int8_gate(call: _dispatch.Call) -> str | None:
    """Why `auto` must not pick triton.int8 for this call (it replaces the triton backend's gate).

    compute_dtype=float64 may take it only where its bound (faast_kernels.gram_int8: every row's product within
    2^-53 of 2^(E_i+E_j), the column maxima's exponents) holds for the inputs' dtypes: float64 scores make s·x a
    rounded float64 number and break it. The CPU interpreter is for tests; int8 tensor cores need sm_80 or later
    here (Triton's int8 dot on older GPUs was never measured)."""
    if call.device.type != "cuda":
        return "Triton's CPU interpreter is for tests: auto never picks triton.int8 on the CPU"
    capability = call.capability
    if capability is not None and capability < (8, 0):
        return f"triton.int8 needs int8 tensor cores of sm_80 or later, got sm_{capability[0]}{capability[1]}"
    if int8_cannot_run(call) is not None:
        return int8_cannot_run(call)
    compute = cast(torch.dtype, call.options.get("compute_dtype", torch.float64))
    scores_dtype = cast("torch.dtype | None", call.options.get("scores_dtype"))
    if call.options.get("scored") and scores_dtype is None:
        scores_dtype = torch.float64  # not said: assume the worst
    bound = int8_worst_bound(call.dtypes[0], scores_dtype)
    if compute == torch.float64 and bound > _int8_bound():
        return (
            f"triton.int8 is not float64-grade for {call.dtypes[0]} rows scored by {scores_dtype}: the product s·x is "
            f"rounded to float64 (bound {bound:.2e} > 2^-53 of the column maxima's product per row)"
        )
    return None


def residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    _kernels()
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.faast_kernels.residual_project(flat, m).reshape(x.shape)


def mix_probabilities(
    z: torch.Tensor,
    dz: torch.Tensor,
    log_odds: torch.Tensor,
    log_rest: torch.Tensor,
    full: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """faast.ops.mix_probabilities through the fused kernel (float32 arithmetic; `gate` keeps float64 logits on the
    torch path)."""
    _kernels()
    flags = torch.zeros(z.shape[0], dtype=torch.bool, device=z.device) if full is None else full
    return torch.ops.faast_kernels.mixture_logits(z, dz, log_odds.float(), log_rest.float(), flags, float(scale))


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


def gate(op: str, call: _dispatch.Call) -> str | None:
    """Why `auto` must not pick a kernel for this call (explicit requests still get it), None when it may compete.

    Measured on an H100 (lab/benchmarks/results/gpu_h100_run2.md): the float64 dot does not compile on sm_90 with
    16-bit inputs or a mask (Triton 3.6: MMAv2 "fp64 don't support largeK MMA"); the tf32x3 mode fails the float64
    fidelity suite on every device. Where no gate applies, auto times the kernels against cuBLAS and keeps the
    faster."""
    if call.device.type != "cuda":
        return "Triton's CPU interpreter is for tests: auto never picks it on the CPU"
    if op == "mix_probabilities" and call.dtypes and call.dtypes[0] == torch.float64:
        return "the fused mixture computes in float32; float64 logits keep the torch path's float64 arithmetic"
    if op != "accumulate_gram" or not call.dtypes:
        return None
    keys, values = call.dtypes[0], call.dtypes[-1]
    same16 = keys == values and keys in (torch.float16, torch.bfloat16)
    compute = cast(torch.dtype, call.options.get("compute_dtype", torch.float64))
    precision = precision_for(compute, keys if same16 else torch.float32)
    if precision == "tf32x3":
        return "its tf32x3 mode (float32 compute on float32 inputs) fails the float64 fidelity suite (0/26 on an H100)"
    capability = call.capability
    masked = bool(call.options.get("masked", False))
    sixteen = keys in (torch.float16, torch.bfloat16) or values in (torch.float16, torch.bfloat16)
    if precision == "fp64" and capability is not None and capability >= (8, 0) and (masked or sixteen):
        return (
            f"Triton {_triton_version()}'s float64 dot does not compile on sm_{capability[0]}{capability[1]} with "
            "16-bit inputs or a mask (measured on an H100: lab/benchmarks/results/gpu_h100_run2.md)"
        )
    return None


def _triton_version() -> str:
    import triton

    return triton.__version__


def register() -> None:
    _dispatch.register_backend(
        _dispatch.Backend(
            name="triton",
            ops={
                "accumulate_gram": accumulate_gram,
                "accumulate_gram_": accumulate_gram_,
                "residual_project": residual_project,
                "mix_probabilities": mix_probabilities,
            },  # fmt: skip
            devices=_devices(),
            unavailable_reason=_unavailable,
            gate=gate,
        )
    )
