"""The ``cuda`` backend: faast._C, the optional C++/CUDA extension of csrc/ (cuSOLVER's batched symmetric eigensolver).

The extension registers ``torch.ops.faast.batched_eigh`` with TORCH_LIBRARY when `faast._C` is imported; its fake
implementation (shapes only, for torch.compile and meta tensors) is registered here. It is loaded on first use. A
missing or broken extension leaves the backend unavailable with the load error as its reason: `auto` then falls back to
torch.linalg.eigh with one log line, and FAAST_BACKEND=cuda raises with that error (faast/ops/_dispatch.py).
"""

from __future__ import annotations

import importlib

import torch

from . import _dispatch

_state: dict[str, object] = {}
_BUILD_HINT = "setup.py builds it where a CUDA toolkit and a CUDA build of torch are present"


def _import_extension() -> None:
    importlib.import_module("faast._C")  # its static initialisers register torch.ops.faast.*


def load_error() -> str | None:
    """None when faast._C is loaded; otherwise why not (tried once, then remembered)."""
    if "error" not in _state:
        try:
            _import_extension()
            _register_fake()
            _state["error"] = None
        except ImportError as err:
            _state["error"] = f"faast._C is not built ({err}); {_BUILD_HINT}"
        except Exception as err:  # noqa: BLE001 - a broken build must not crash the import of faast
            _state["error"] = f"faast._C failed to load: {type(err).__name__}: {err}"
    return _state["error"]  # type: ignore[return-value]


def _register_fake() -> None:
    @torch.library.register_fake("faast::batched_eigh")
    def _(gram: torch.Tensor, algorithm: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        torch._check(gram.dim() == 3 and gram.shape[1] == gram.shape[2], lambda: "gram must be [L, d, d]")
        torch._check(gram.dtype == torch.float64, lambda: "gram must be float64")
        # Eigenvectors come back column-major (the kernel returns the transpose of cuSOLVER's buffer), like
        # torch.linalg.eigh: the fake must report the same strides.
        return gram.new_empty(gram.shape[:-1]), gram.new_empty(gram.shape).transpose(-2, -1)


def eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(λ [B, d] ascending, E [B, d, d]) float64 of symmetric gram [B, d, d] in one cuSOLVER call.

    The op accepts float64 only (a float32 eigensolver loses every direction below ~1e-5·λmax): float32 statistics are
    upcast here, exactly."""
    return torch.ops.faast.batched_eigh(gram.to(torch.float64), "auto")


def _not_for_auto() -> str | None:
    # Compile-checked in CI. On the one GPU run so far (benchmarks/results/gpu_h100_run1.md) it built but did not load
    # (a torch symbol it used is not exported by torch 2.11+cu130; fixed since): never timed. Until
    # benchmarks/bench_eigh.py shows it faster than torch.linalg.eigh on a GPU, `auto` keeps the torch path.
    return (
        "its GPU speed against torch.linalg.eigh is not measured yet (benchmarks/bench_eigh.py); "
        "FAAST_BACKEND=cuda selects it"
    )


def register() -> None:
    _dispatch.register_backend(
        _dispatch.Backend(
            name="cuda",
            ops={"eigh": eigh},
            devices=("cuda",),
            unavailable_reason=load_error,
            auto_reason=_not_for_auto,
        )
    )
