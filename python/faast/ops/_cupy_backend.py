"""The ``cupy`` backend: cuSOLVER's batched Jacobi eigensolver (syevjBatched) called through cupy's low-level
bindings, with no compile step. It runs where cupy imports, was built for torch's CUDA major version, and a GPU is
visible; otherwise it is unavailable with that reason (worked out once), `auto` passes over it with one log line and
FAAST_BACKEND=cupy raises with it (faast/ops/_dispatch.py).

What cupy.linalg.eigh does with a stack of matrices: at every n it calls cupyx.cusolver.syevj, which runs
cusolverDn<t>syevjBatched once on the whole batch with cuSOLVER's default tolerance and sweep limit, in cupy's memory
pool, on cupy's current stream, and leaves the per-matrix convergence flags unread unless cupyx.errstate asks. There
is no other batched symmetric eigensolver in cupy 14.2 (no XsyevBatched binding), so this backend calls the same
routine, through the same bindings, but:

* the memory is torch's: the buffers are torch tensors that cupy sees through DLPack (cupy.from_dlpack), so nothing
  is copied and cupy's pool holds nothing;
* the work is enqueued on torch's current stream (cupy's current stream is set to it around the call);
* the tolerance (float64 machine epsilon), sweep limit and ascending sort are set explicitly, not inherited;
* every result is checked before it is returned (the convergence flag, the relative residual ||S E - E Λ||_F / ||S||_F
  and ||E^T E - I||_F / sqrt(d), both at most ACCURACY_REL): a matrix that fails is recomputed by torch.linalg.eigh,
  logged once. That bounds the eigenvalues' normwise relative error by about ACCURACY_REL (Hoffman-Wielandt).

Measured on an H100 (lab/benchmarks/results/gpu_h100_run2_probe.json, cupy.linalg.eigh, the same routine): [48, n, n]
float64 takes 28x less time than torch.linalg.eigh's per-matrix loop at n = 64 and 3x less at n = 256, but 1.08x more
at n = 576, 2.5x at 1152 and 3.9x at 1600 (Jacobi sweeps cost O(n^3) each). The gate keeps `auto` from n = 576 up;
FAAST_BACKEND=cupy still selects it there. In that run its eigenvalues differed from torch's by 1e-14 (n = 64),
4e-13 (256), 1.1e-12 (576) and 3.2e-12 (1600) relative: from n = 576 the check may send matrices back to torch.
"""

from __future__ import annotations

import importlib
import logging
import math
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, cast

import torch

from . import _dispatch

logger = logging.getLogger("faast")

# Jacobi stops when the off-diagonal Frobenius norm falls below TOLERANCE·||S||_F: float64's machine epsilon.
TOLERANCE = 2.0**-52
# cuSOLVER's documented default; ~15 sweeps usually reach machine accuracy.
MAX_SWEEPS = 100
# The accuracy contract of a returned (λ, E): relative residual and loss of orthonormality at most this.
ACCURACY_REL = 1e-12
# From this width on, syevjBatched was measured slower than torch.linalg.eigh's loop (H100, batch 48).
AUTO_BELOW_DIM = 576
# The residual check works on this many float64 elements at a time (256 MiB), bounding its extra memory.
_CHECK_ELEMENTS = 1 << 25
_INSTALL_HINT = "install the cupy wheel for torch's CUDA major version (pip install cupy-cuda12x or cupy-cuda13x)"
_BINDINGS = (
    "createSyevjInfo",
    "destroySyevjInfo",
    "xsyevjSetTolerance",
    "xsyevjSetMaxSweeps",
    "xsyevjSetSortEig",
    "dsyevjBatched_bufferSize",
    "dsyevjBatched",
)

_state: dict[str, object] = {}


def _modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    """(cupy, cupy_backends.cuda.libs.cusolver, cupy_backends.cuda.libs.cublas), imported on first use."""
    return (
        importlib.import_module("cupy"),
        importlib.import_module("cupy_backends.cuda.libs.cusolver"),
        importlib.import_module("cupy_backends.cuda.libs.cublas"),
    )


def _probe() -> str | None:
    try:
        cp, cusolver, _ = _modules()
    except Exception as err:  # noqa: BLE001 - a broken cupy install must not break faast
        return f"cupy is not importable ({type(err).__name__}: {err}); {_INSTALL_HINT}"
    version = getattr(cp, "__version__", "?")
    missing = [name for name in _BINDINGS if not hasattr(cusolver, name)]
    if missing:
        return f"cupy {version} lacks the cuSOLVER bindings {missing}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build, so it cannot share CUDA memory with cupy"
    try:
        runtime = int(cp.cuda.runtime.runtimeGetVersion())
    except Exception as err:  # noqa: BLE001 - e.g. no CUDA runtime library behind the wheel
        return f"cupy {version} cannot load its CUDA runtime ({type(err).__name__}: {err}); {_INSTALL_HINT}"
    cupy_major, torch_major = runtime // 1000, int(torch.version.cuda.split(".")[0])
    if cupy_major != torch_major:
        return (
            f"cupy {version} is built for CUDA {cupy_major}.{runtime % 1000 // 10} but torch for CUDA "
            f"{torch.version.cuda}; {_INSTALL_HINT}"
        )
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


def unavailable_reason() -> str | None:
    """None when the cupy backend can run here; otherwise why not (worked out once, then remembered)."""
    if "reason" not in _state:
        _state["reason"] = _probe()
    return cast("str | None", _state["reason"])


def gate(op: str, call: _dispatch.Call) -> str | None:
    """Why `auto` must not pick cupy's eigh for this call (None: it may, and the measured choice decides)."""
    width = call.shapes[0][-1] if call.shapes and call.shapes[0] else 0
    if op == "eigh" and width >= AUTO_BELOW_DIM:
        return (
            f"syevjBatched was measured slower than torch.linalg.eigh's loop from d = {AUTO_BELOW_DIM} on an H100 "
            f"(d = {width} here); FAAST_BACKEND=cupy selects it"
        )
    return None


class _StreamRef:
    """A CUDA stream pointer in the CUDA stream protocol (what cupy.cuda.Stream.from_external reads)."""

    def __init__(self, pointer: int) -> None:
        self.pointer = pointer

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.pointer


def _stream_pointer(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _cupy_stream(cp: ModuleType, device: torch.device) -> AbstractContextManager[Any]:
    """cupy's view of torch's current stream on `device`, for a `with` block."""
    pointer = _stream_pointer(device)
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamRef(pointer))
    return cp.cuda.ExternalStream(pointer, device.index if device.index is not None else -1)  # cupy < 14


def _syevj_batched(buffer: torch.Tensor, lam: torch.Tensor, info: torch.Tensor) -> None:
    """Overwrite buffer [B, d, d] (row-major float64 copy of S) with the eigenvectors, column by column in its
    column-major reading, and fill lam [B, d] and info [B] int32, with one cuSOLVER call on torch's stream."""
    cp, cusolver, cublas = _modules()
    batch, d = buffer.shape[0], buffer.shape[-1]
    device = buffer.device
    # cuSOLVER reads column-major: the row-major buffer reads as S^T there, so S's lower triangle is its upper one.
    uplo = cublas.CUBLAS_FILL_MODE_UPPER
    jobz = cusolver.CUSOLVER_EIG_MODE_VECTOR
    with cp.cuda.Device(device.index if device.index is not None else 0), _cupy_stream(cp, device):
        a, w, flags = (cp.from_dlpack(t) for t in (buffer, lam, info))
        handle = cp.cuda.device.get_cusolver_handle()
        params = cusolver.createSyevjInfo()
        try:
            cusolver.xsyevjSetTolerance(params, TOLERANCE)
            cusolver.xsyevjSetMaxSweeps(params, MAX_SWEEPS)
            cusolver.xsyevjSetSortEig(params, 1)
            lwork = cusolver.dsyevjBatched_bufferSize(handle, jobz, uplo, d, a.data.ptr, d, w.data.ptr, params, batch)
            # Allocated by torch on its current stream, the stream the solver runs on: freeing it after the call is
            # ordered after the solver by that stream.
            work = torch.empty(max(int(lwork), 1), dtype=torch.float64, device=device)
            cusolver.dsyevjBatched(
                handle, jobz, uplo, d, a.data.ptr, d, w.data.ptr, cp.from_dlpack(work).data.ptr, int(lwork),
                flags.data.ptr, params, batch,
            )  # fmt: skip
        finally:
            cusolver.destroySyevjInfo(params)


def _symmetric_lower(gram: torch.Tensor) -> torch.Tensor:
    return gram.tril() + gram.tril(-1).mT


def _failures(gram: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor, info: torch.Tensor) -> torch.Tensor:
    """bool [B]: the matrices whose result misses the accuracy contract (NaN counts as a miss)."""
    batch, d = lam.shape
    chunk = max(1, _CHECK_ELEMENTS // max(d * d, 1))
    eye = torch.eye(d, dtype=torch.float64, device=lam.device)
    misses = []
    for start in range(0, batch, chunk):
        part = slice(start, start + chunk)
        sym = _symmetric_lower(gram[part].to(torch.float64))
        e, w = vecs[part], lam[part]
        scale = torch.linalg.matrix_norm(sym).clamp_min(torch.finfo(torch.float64).tiny)
        residual = torch.linalg.matrix_norm(sym @ e - e * w.unsqueeze(-2)) / scale
        drift = torch.linalg.matrix_norm(e.mT @ e - eye) / math.sqrt(d)
        misses.append(~((residual <= ACCURACY_REL) & (drift <= ACCURACY_REL)))
    return (info != 0) | torch.cat(misses)


def _log_once(key: str, message: str, *args: object) -> None:
    logged = cast("set[str]", _state.setdefault("logged", set()))
    if key not in logged:
        logged.add(key)
        logger.info(message, *args)


def eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(λ [B, d] ascending, E [B, d, d]) float64 of symmetric gram [B, d, d] (lower triangle read), one syevjBatched.

    gram: float64, or float32 (upcast exactly: the solver runs in float64 only). It is not modified. E comes back
    with column-major strides per matrix, like torch.linalg.eigh's. Matrices whose result misses the accuracy
    contract (module docstring) are recomputed by torch.linalg.eigh.
    """
    if gram.dim() != 3 or gram.shape[-1] != gram.shape[-2]:
        raise ValueError(f"gram: expected symmetric matrices [B, d, d], got shape {list(gram.shape)}")
    if gram.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"gram: expected float32 or float64 (the solver runs in float64), got {gram.dtype}")
    gram = gram.detach()  # not differentiable here, and DLPack exports no tensor that requires grad
    # cuSOLVER overwrites its input with the eigenvectors: always a private float64 copy, never the caller's S.
    buffer = gram.to(torch.float64, memory_format=torch.contiguous_format, copy=True)
    batch, d = buffer.shape[0], buffer.shape[-1]
    if batch == 0 or d == 0:
        return torch.linalg.eigh(buffer)
    lam = torch.empty(batch, d, dtype=torch.float64, device=buffer.device)
    info = torch.zeros(batch, dtype=torch.int32, device=buffer.device)
    _syevj_batched(buffer, lam, info)
    vecs = buffer.mT  # the column-major reading of the buffer: column j of E is eigenvector j
    failed = _failures(gram, lam, vecs, info)
    unsorted = (lam[:, 1:] < lam[:, :-1]).any(-1) & ~failed
    flags = torch.stack([failed, unsorted, info < 0]).cpu()  # one host transfer for every check
    if bool(flags[2].any()):
        raise RuntimeError(f"cusolverDnDsyevjBatched rejected parameter {-int(info.min())} (n = {d}, batch = {batch})")
    _state["recomputed"] = int(flags[0].sum())
    if bool(flags[0].any()):
        index = flags[0].nonzero().squeeze(-1).to(lam.device)
        _log_once(
            "recomputed", "faast: cupy eigh: %d of %d matrices (d = %d) missed the accuracy contract (%g) or did not "
            "converge; recomputed by torch.linalg.eigh (said once)", int(flags[0].sum()), batch, d, ACCURACY_REL,
        )  # fmt: skip
        lam[index], vecs[index] = torch.linalg.eigh(gram[index].to(torch.float64))
    if bool(flags[1].any()):  # cuSOLVER sorts when asked; this keeps the contract if a version does not
        order = lam.argsort(-1)
        lam = lam.gather(-1, order)
        vecs = vecs.gather(-1, order.unsqueeze(-2).expand(-1, d, -1))
    return lam, vecs


def recomputed_in_last_call() -> int:
    """How many matrices of the last eigh call missed the accuracy contract and were recomputed by torch (for
    lab/benchmarks/bench_eigh.py; 0 before the first call)."""
    return int(cast(int, _state.get("recomputed", 0)))


def register() -> None:
    _dispatch.register_backend(
        _dispatch.Backend(
            name="cupy",
            ops={"eigh": eigh},
            devices=("cuda",),
            unavailable_reason=unavailable_reason,
            gate=gate,
        )
    )
