"""The one place that chooses which backend runs an op.

Backends: ``torch`` (pure PyTorch, any device: the CPU path and the test oracle), ``triton`` (faast_kernels) and
``cuda`` (the cuSOLVER extension). ``triton`` registers itself from faast.ops._triton_backend (accumulate_gram and
residual_project; CUDA tensors, and CPU tensors under TRITON_INTERPRET=1), ``cuda`` from faast.ops._cuda_backend (eigh;
CUDA tensors, when the optional extension faast._C is built).

``FAAST_BACKEND`` (auto | torch | triton | cuda, default auto) overrides the choice for every op; a comma-separated
list of ``op=backend`` entries overrides it per op, with an optional bare name for the others
(``FAAST_BACKEND=accumulate_gram=triton,eigh=cuda`` or ``eigh=cuda,torch``):

* ``auto`` walks a per-device preference list and takes the first backend that is available, implements the op and
  is eligible for automatic choice (a backend may decline it, e.g. kernels whose speed is not measured yet).
  Skipping a preferred backend is logged once per (op, backend), so a silent slow path cannot go unnoticed.
* an explicit name is a request: if that backend is missing, not installed, fails to load or does not run on the
  tensors' device, the call raises with the reason. An op the backend does not provide by design (eigh has no
  Triton kernel) takes the automatic choice, logged once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ENV_VAR = "FAAST_BACKEND"
BACKEND_NAMES = ("torch", "triton", "cuda")

logger = logging.getLogger("faast")


@dataclass
class Backend:
    """A set of op implementations and a probe that says why they cannot run (None when they can)."""

    name: str
    ops: dict[str, Callable] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None  # None: any device type
    unavailable_reason: Callable[[], str | None] = lambda: None
    # Why `auto` should not pick it yet although it can run (e.g. its speed is unmeasured); explicit requests still
    # get it. None: eligible for auto.
    auto_reason: Callable[[], str | None] = lambda: None


_REGISTRY: dict[str, Backend] = {}
# Fastest first. torch is last everywhere because it runs on every device.
_PREFERENCE = {"cuda": ("cuda", "triton", "torch")}
_DEFAULT_PREFERENCE = ("torch",)
_logged: set[tuple[str, str]] = set()


def register_backend(backend: Backend) -> None:
    if backend.name not in BACKEND_NAMES:
        raise ValueError(f"backend.name: expected one of {BACKEND_NAMES}, got {backend.name!r}")
    _REGISTRY[backend.name] = backend


PER_OP_SEPARATOR = "="


def requested_backend(op: str | None = None) -> str:
    """What FAAST_BACKEND asks for `op` (or for every op, with op=None), validated: 'auto' or one of BACKEND_NAMES."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    choices = f"auto, {', '.join(BACKEND_NAMES)}"
    if PER_OP_SEPARATOR not in value:
        if value != "auto" and value not in BACKEND_NAMES:
            raise ValueError(f"{ENV_VAR}: expected one of {choices}, or op=backend entries; got {value!r}")
        return value
    default, per_op = "auto", {}
    for entry in (e.strip() for e in value.split(",") if e.strip()):
        name, sep, backend = entry.partition(PER_OP_SEPARATOR)
        backend = backend.strip() if sep else name.strip()
        if backend != "auto" and backend not in BACKEND_NAMES:
            raise ValueError(f"{ENV_VAR}: entry {entry!r}: expected a backend among {choices}; got {value!r}")
        if sep:
            per_op[name.strip()] = backend
        else:
            default = backend
    return default if op is None else per_op.get(op, default)


def _why_not(name: str, op: str, device: torch.device) -> str | None:
    backend = _REGISTRY.get(name)
    if backend is None:
        return f"this version of faast has no {name} backend"
    if op not in backend.ops:
        return f"the {name} backend does not implement {op}"
    if backend.devices is not None and device.type not in backend.devices:
        return f"the {name} backend does not run on {device.type} tensors"
    return backend.unavailable_reason()


def implementation(backend: str, op: str) -> Callable | None:
    """The backend's implementation of an auxiliary op (e.g. an in-place variant), or None if it has none."""
    found = _REGISTRY.get(backend)
    return None if found is None else found.ops.get(op)


def explain(op: str, device: torch.device) -> list[tuple[str, str | None]]:
    """For reports (python -m faast.env): each backend of the device's preference list and why it would be skipped
    by `auto` (None for the one chosen and those after it that could run). Logs nothing."""
    out = []
    for name in _PREFERENCE.get(device.type, _DEFAULT_PREFERENCE):
        reason = _why_not(name, op, device)
        if reason is None:
            reason = _REGISTRY[name].auto_reason()
        out.append((name, reason))
    return out


def resolve(op: str, device: torch.device) -> tuple[str, Callable]:
    """Return (backend name, implementation) for `op` on `device`, following FAAST_BACKEND."""
    requested = requested_backend(op)
    if requested != "auto":
        backend = _REGISTRY.get(requested)
        if backend is None or op in backend.ops:
            reason = _why_not(requested, op, device)
            if reason is not None:
                raise RuntimeError(f"{ENV_VAR}={requested} was requested for {op} on {device.type}, but {reason}")
            return requested, backend.ops[op]
        # The requested backend has no version of this op by design (e.g. eigh is not a Triton kernel): the op
        # takes the automatic choice, said once, so that FAAST_BACKEND=triton still runs a whole FastWeights.
        if (op, f"{requested}-lacks") not in _logged:
            _logged.add((op, f"{requested}-lacks"))
            logger.info("faast: %s=%s has no %s; %s takes the automatic choice", ENV_VAR, requested, op, op)
    for name in _PREFERENCE.get(device.type, _DEFAULT_PREFERENCE):
        reason = _why_not(name, op, device)
        if reason is None:
            reason = _REGISTRY[name].auto_reason()
        if reason is None:
            return name, _REGISTRY[name].ops[op]
        if (op, name) not in _logged:
            _logged.add((op, name))
            logger.info("faast: %s on %s skips the %s backend: %s", op, device.type, name, reason)
    raise RuntimeError(f"no faast backend can run {op} on {device.type}")
