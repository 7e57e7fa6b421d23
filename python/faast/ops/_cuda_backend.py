"""The ``cuda`` backend: faast._C, the optional C++/CUDA extension of csrc/ (cuSOLVER's batched symmetric eigensolver).

The extension registers ``torch.ops.faast.batched_eigh`` and ``torch.ops.faast.batched_eigh_info`` with TORCH_LIBRARY
when `faast._C` is imported; their fake implementations (shapes only, for torch.compile and meta tensors) are
registered here. It is loaded on first use, once. Loading fails with a reason that names the cause:

* not built (no faast._C module),
* built but not loadable: a missing symbol (built against another torch) or a missing shared library,
* built for another torch or CUDA than the running one (the module records the versions it was built with; they are
  compared before any op is called, because an extension built for another torch may load and then crash).

`auto` then falls back to torch.linalg.eigh with one log line, and FAAST_BACKEND=cuda raises with the reason
(faast/ops/_dispatch.py does both).

Arguments are checked here before the op is called, and a layer cuSOLVER could not decompose is reported from its
`info` here: no error of faast's own use has to be thrown through the extension (the one crash seen on a GPU, in
lab/benchmarks/results/gpu_h100_run2_log.txt.gz, was the extension's first throw; csrc/README.md).
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import cast

import torch

from . import _dispatch

_state: dict[str, object] = {}
_fakes: dict[str, bool] = {}
_BUILD_HINT = "setup.py builds it where a CUDA toolkit and a CUDA build of torch are present"
_REBUILD_HINT = "rebuild it in this environment (python setup.py build_ext --inplace, or pip install -e .)"

ALGORITHMS = ("auto", "syevj_batched", "syev_batched", "syevd_streams")
#: cusolverDnDsyevjBatched is documented for d <= 32; XsyevBatched for L * d * d <= 2**31 - 1 (cuSOLVER 11.7+).
JACOBI_MAX_DIM = 32
_INT32_MAX = 2**31 - 1
_SYEV_BATCHED_CUSOLVER = (11, 7, 1)
_BUILD_KEYS = ("torch_version", "cuda_version", "cusolver_version", "compiler")


def _import_extension() -> ModuleType:
    return importlib.import_module("faast._C")  # its static initialisers register torch.ops.faast.*


def _running_torch() -> str:
    return f"torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU build'})"


def _release(version: str) -> str:
    """'2.11.0' of '2.11.0+cu130' or '2.11.0a0+git1234'."""
    found = re.match(r"\d+\.\d+\.\d+", version)
    return found.group(0) if found else version


def build_mismatch(record: object) -> str | None:
    """Why a faast._C that records `record` (its torch_version and cuda_version attributes) must not be used with
    the running torch; None when it matches (same torch release, same CUDA major version)."""
    built_torch = getattr(record, "torch_version", None)
    built_cuda = getattr(record, "cuda_version", None)
    if not isinstance(built_torch, str) or not isinstance(built_cuda, str):
        return f"faast._C has no build record (built by an older faast); {_REBUILD_HINT}"
    built = f"torch {built_torch} with CUDA {built_cuda}"
    if _release(torch.__version__) != _release(built_torch):
        return f"faast._C was built for {built}, but this is {_running_torch()}; {_REBUILD_HINT}"
    if torch.version.cuda is None:
        return f"faast._C was built for {built}, but this is {_running_torch()}; install a CUDA build of torch"
    if torch.version.cuda.split(".")[0] != built_cuda.split(".")[0]:
        return f"faast._C was built for {built}, but this is {_running_torch()}; {_REBUILD_HINT}"
    return None


def _load() -> str | None:
    try:
        module = _import_extension()
    except ModuleNotFoundError as err:
        if err.name not in (None, "faast._C"):  # the module exists; something it imports does not
            return f"faast._C failed to load: {type(err).__name__}: {err}"
        return f"faast._C is not built ({err}); {_BUILD_HINT}"
    except ImportError as err:
        if "undefined symbol" in str(err):
            return (
                f"faast._C does not load: {err}: it was built against another torch than this {_running_torch()}; "
                f"{_REBUILD_HINT}"
            )
        return f"faast._C does not load: {err}; {_REBUILD_HINT}"
    except Exception as err:  # noqa: BLE001 - a broken build must not crash the import of faast
        return f"faast._C failed to load: {type(err).__name__}: {err}"
    mismatch = build_mismatch(module)
    if mismatch is not None:
        return mismatch
    _state["build"] = {key: getattr(module, key, None) for key in _BUILD_KEYS}
    try:
        _register_fake()
    except Exception as err:  # noqa: BLE001 - e.g. a build whose schema differs from this faast's
        return f"faast._C loaded but its ops do not match this faast: {type(err).__name__}: {err}; {_REBUILD_HINT}"
    return None


def load_error() -> str | None:
    """None when faast._C is loaded and matches the running torch; otherwise why not (tried once, then remembered)."""
    if "error" not in _state:
        _state["error"] = _load()
    return cast("str | None", _state["error"])


def build_record() -> dict | None:
    """What the loaded faast._C was built with (torch_version, cuda_version, cusolver_version, compiler); None when it
    is not loaded."""
    return None if load_error() is not None else cast("dict | None", _state.get("build"))


def _register_fake(lib: torch.library.Library | None = None) -> None:
    """The ops' fake implementations (shapes, dtypes, strides, devices), once per process; with `lib`, tied to that
    library instead (tests define the schema themselves and destroy it afterwards)."""
    if lib is None and _fakes.get("registered"):
        return

    def check(gram: torch.Tensor) -> None:
        torch._check(gram.dim() == 3 and gram.shape[1] == gram.shape[2], lambda: "gram must be [L, d, d]")
        torch._check(gram.dtype == torch.float64, lambda: "gram must be float64")

    def eigh_fake(gram: torch.Tensor, algorithm: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        check(gram)
        # Eigenvectors come back column-major (the kernel returns the transpose of cuSOLVER's buffer), like
        # torch.linalg.eigh: the fake must report the same strides.
        return gram.new_empty(gram.shape[:-1]), gram.new_empty(gram.shape).transpose(-2, -1)

    def eigh_info_fake(gram: torch.Tensor, algorithm: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lam, vecs = eigh_fake(gram, algorithm)
        return lam, vecs, gram.new_empty(gram.shape[:1], dtype=torch.int32, device="cpu")

    torch.library.register_fake("faast::batched_eigh", eigh_fake, lib=lib)
    torch.library.register_fake("faast::batched_eigh_info", eigh_info_fake, lib=lib)
    if lib is None:
        _fakes["registered"] = True


def _cusolver_at_least(version: tuple[int, ...]) -> bool:
    built = (build_record() or {}).get("cusolver_version") or "0"
    return tuple(int(part) for part in re.findall(r"\d+", built)[:3]) >= version


def algorithm_error(algorithm: object, layers: int, d: int, *, syev_batched_available: bool = True) -> str | None:
    """Why the op would reject `algorithm` for a [layers, d, d] batch (the same limits as csrc/cuda/batched_eigh.cu),
    so that it is said here instead of thrown from the extension; None when it is accepted."""
    if algorithm not in ALGORITHMS:
        return f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}"
    if algorithm == "syevj_batched" and (d > JACOBI_MAX_DIM or layers > _INT32_MAX):
        return f"algorithm='syevj_batched' supports d <= {JACOBI_MAX_DIM} and L < 2**31, got L = {layers}, d = {d}"
    if algorithm == "syev_batched" and not syev_batched_available:
        return "algorithm='syev_batched' needs faast._C built with cuSOLVER 11.7 (CUDA 12.6) or newer"
    if algorithm == "syev_batched" and layers * d * d > _INT32_MAX:
        return f"algorithm='syev_batched' supports L * d * d <= 2**31 - 1, got {layers} * {d}**2"
    return None


def _check_gram(gram: object) -> None:
    if not isinstance(gram, torch.Tensor):
        raise TypeError(f"gram: expected a torch.Tensor, got {type(gram).__name__}")
    if gram.dim() != 3 or gram.shape[1] != gram.shape[2]:
        raise ValueError(f"gram: expected shape [L, d, d], got {list(gram.shape)}")
    if gram.device.type != "cuda":
        raise ValueError(f"gram: expected a CUDA tensor (the cuda backend runs cuSOLVER), got one on {gram.device}")
    if not gram.dtype.is_floating_point:
        raise ValueError(f"gram: expected a real floating-point tensor, got {gram.dtype}")


def batched_eigh(gram: torch.Tensor, algorithm: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(λ [L, d] ascending, E [L, d, d] as columns) float64 of symmetric gram [L, d, d] (lower triangle read) in one
    cuSOLVER call; algorithm picks the routine (ALGORITHMS; benchmarks force each one).

    Raises TypeError/ValueError for bad arguments before the extension is called, RuntimeError when faast._C is not
    loaded, and torch.linalg.LinAlgError naming the first layer cuSOLVER could not decompose (NaN/Inf or far from
    symmetric statistics). float32 and 16-bit statistics are upcast to float64 here, exactly."""
    _check_gram(gram)
    reason = load_error()
    if reason is not None:
        raise RuntimeError(reason)
    problem = algorithm_error(
        algorithm, gram.shape[0], gram.shape[1], syev_batched_available=_cusolver_at_least(_SYEV_BATCHED_CUSOLVER)
    )
    if problem is not None:
        raise ValueError(problem)
    lam, vecs, info = torch.ops.faast.batched_eigh_info(gram.to(torch.float64), algorithm)
    _raise_for_info(info, algorithm)
    _raise_for_nonfinite(lam, algorithm)
    return lam, vecs


def _raise_for_nonfinite(lam: torch.Tensor, algorithm: str) -> None:
    """torch.linalg.LinAlgError naming the first layer of λ [L, d] with a NaN/Inf eigenvalue. Jacobi (syevjBatched,
    d <= 32) may report success on NaN input; info was read on the host already, so this adds no wait for the
    decomposition, only for its own reduction."""
    bad = ~torch.isfinite(lam).all(-1)
    if bool(bad.any()):
        layer = int(torch.nonzero(bad).flatten()[0])
        raise torch.linalg.LinAlgError(
            f"faast cuda eigh ({algorithm}): layer {layer} of gram has non-finite eigenvalues (NaN/Inf statistics)"
        )


def _raise_for_info(info: torch.Tensor, algorithm: str) -> None:
    """torch.linalg.LinAlgError naming the first layer whose cuSOLVER info (int32 [L], on the CPU) is nonzero."""
    failed = torch.nonzero(info).flatten()
    if failed.numel() == 0:
        return
    layer = int(failed[0])
    code = int(info[layer])
    why = (
        "did not converge: the statistics may hold NaN/Inf or be far from symmetric"
        if code > 0
        else "invalid argument"
    )
    raise torch.linalg.LinAlgError(
        f"faast cuda eigh ({algorithm}): cuSOLVER could not decompose layer {layer} of gram (info = {code}: {why})"
    )


def eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(λ [B, d] ascending, E [B, d, d]) float64 of symmetric gram [B, d, d] in one cuSOLVER call (see batched_eigh).

    The op accepts float64 only (a float32 eigensolver loses every direction below ~1e-5·λmax): float32 statistics are
    upcast here, exactly."""
    return batched_eigh(gram, "auto")


def gate(op: str, call: _dispatch.Call) -> str | None:
    """Nothing keeps `auto` from timing the extension: on an H100 (lab/benchmarks/results/gpu_h100_run3.md) faast's
    path through it (arguments checked here, failures reported through info, never a throw across the extension) passed
    the eigen-equation tests from d = 20 to 1600 and ran 2.4x (d = 1600) to 73x (d = 64) faster than
    torch.linalg.eigh on 48 layers. Two raw-op error-path cases of the child-process harness failed there, with
    details the run did not keep (csrc/README.md); faast does not call the op that way."""
    return None


def register() -> None:
    _dispatch.register_backend(
        _dispatch.Backend(
            name="cuda",
            ops={"eigh": eigh},
            devices=("cuda",),
            unavailable_reason=load_error,
            gate=gate,
        )
    )
