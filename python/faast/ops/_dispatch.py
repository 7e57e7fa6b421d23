"""The one place that chooses which implementation runs an op.

Backends: ``torch`` (pure PyTorch, any device: the CPU path and the test oracle), ``triton`` (faast_kernels),
``cuda`` (the cuSOLVER extension faast._C) and ``cupy`` (cuSOLVER through cupy). Each registers itself; a backend may
also register named variants of an op (``torch.syrk``, ``torch.exact16``): together they are the op's candidates.

``FAAST_BACKEND`` (default auto) overrides the choice for every op; a comma-separated list of ``op=candidate``
entries overrides it per op, with an optional bare name for the others (``FAAST_BACKEND=accumulate_gram=triton``,
``eigh=cupy,torch``, ``accumulate_gram=torch.syrk``):

* ``auto`` walks the device's preference list. A backend that cannot run (missing, fails to load, wrong device) is
  skipped; so is a candidate whose gate declines the call (it does not compile on this device class, or fails the
  float64 fidelity suite for the requested compute dtype). Each skip is logged once. When several candidates remain,
  the first call of a (device, op, shape class) times them on a small sample of its own inputs and keeps the fastest
  (faast.ops._autotune, which remembers the choice on disk); a candidate that fails while being timed is dropped.
* a backend name is a request: if that backend is missing, not installed, fails to load or does not run on the
  tensors' device, the call raises with the reason; otherwise its own candidates are chosen among as above. An op
  the backend does not provide by design (eigh has no Triton kernel) takes the automatic choice, logged once.
* ``backend.variant`` asks for exactly that candidate, and raises if it cannot run the call.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from . import _autotune

ENV_VAR = "FAAST_BACKEND"
BACKEND_NAMES = ("torch", "triton", "cuda", "cupy")
VARIANT_SEPARATOR = "."

logger = logging.getLogger("faast")


@dataclass(frozen=True)
class Call:
    """What a gate and the measured choice know of a call: the op, the device, the inputs' dtypes and shapes, the
    options that change the arithmetic (e.g. compute_dtype, masked) and the shape class that shares a choice."""

    op: str
    device: torch.device
    dtypes: tuple[torch.dtype, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    options: Mapping[str, object] = field(default_factory=dict)
    shape_class: str = ""

    @property
    def capability(self) -> tuple[int, int] | None:
        """The CUDA compute capability of the device, None elsewhere."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_capability(self.device)


def _never(*_args: object) -> str | None:
    return None


@dataclass
class Variant:
    """A named alternative implementation of an op within a backend. cannot_run(call) says why it cannot run the
    call at all (explicit requests raise with it, auto passes over it silently); gate(call) why auto must not pick
    it (explicit requests still get it). own_gate: the variant's gate replaces the backend's instead of adding to it
    (a variant whose arithmetic the backend's gate does not describe, e.g. triton.int8 beside the fp64 Gram mode)."""

    fn: Callable
    cannot_run: Callable[[Call], str | None] = _never
    gate: Callable[[Call], str | None] = _never
    own_gate: bool = False


@dataclass
class Backend:
    """A set of op implementations and a probe that says why they cannot run (None when they can)."""

    name: str
    ops: dict[str, Callable] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None  # None: any device type
    unavailable_reason: Callable[[], str | None] = lambda: None
    # gate(op, call): why `auto` must not pick this backend's implementation of op for this call although it can
    # run (it does not compile there, fails fidelity, or is not verified on this device); None: eligible.
    gate: Callable[[str, Call], str | None] = _never
    variants: dict[str, dict[str, Variant]] = field(default_factory=dict)  # op -> variant name -> Variant


_REGISTRY: dict[str, Backend] = {}
# The order auto tries backends in, and the choice when nothing is measured. torch is last: it runs everywhere.
_PREFERENCE = {"cuda": ("cuda", "cupy", "triton", "torch")}
_DEFAULT_PREFERENCE = ("torch",)
_logged: set[tuple[str, ...]] = set()


def register_backend(backend: Backend) -> None:
    if backend.name not in BACKEND_NAMES:
        raise ValueError(f"backend.name: expected one of {BACKEND_NAMES}, got {backend.name!r}")
    _REGISTRY[backend.name] = backend


def register_variant(
    backend: str,
    op: str,
    variant: str,
    fn: Callable,
    *,
    cannot_run: Callable[[Call], str | None] | None = None,
    gate: Callable[[Call], str | None] | None = None,
    own_gate: bool = False,
) -> None:
    """Add `backend.variant` as a candidate for op in this process (the backend must be registered first): fn takes
    the op's arguments; cannot_run(call) and gate(call) say why it cannot run, or why auto must not pick it, for a
    call (None: it can); the backend's gate applies too unless own_gate. Public as
    faast.ops.backends.register_variant."""
    if backend not in _REGISTRY:
        raise ValueError(f"backend: expected a registered backend among {sorted(_REGISTRY)}, got {backend!r}")
    if not variant or VARIANT_SEPARATOR in variant:
        raise ValueError(f"variant: expected a non-empty name without {VARIANT_SEPARATOR!r}, got {variant!r}")
    _REGISTRY[backend].variants.setdefault(op, {})[variant] = Variant(
        fn, cannot_run or _never, gate or _never, own_gate
    )


@contextmanager
def assume_loadable(*backends: str) -> Iterator[None]:
    """Within the block, the registered `backends` answer that they can run in this process (their
    unavailable_reason is None) and are restored on leaving, however the block ends: a test or a report shows what
    auto decides where they load (explain, the gates) on a machine where they do not. Calling their implementations
    still needs their packages. Public as faast.ops.backends.assume_loadable."""
    for name in backends:
        if name not in _REGISTRY:
            raise ValueError(f"backends: expected registered backends among {sorted(_REGISTRY)}, got {name!r}")
    saved = {name: _REGISTRY[name] for name in backends}
    try:
        for name, backend in saved.items():
            # a copy, so that the registered object (which other code may hold) is never changed
            _REGISTRY[name] = replace(backend, unavailable_reason=_never)
        yield
    finally:
        _REGISTRY.update(saved)


PER_OP_SEPARATOR = "="
# A candidate whose first (warm-up) call takes this many times the best time measured so far is not timed again.
GIVE_UP = 3.0


def _valid_name(name: str) -> bool:
    return name == "auto" or name.partition(VARIANT_SEPARATOR)[0] in BACKEND_NAMES


def requested_backend(op: str | None = None) -> str:
    """What FAAST_BACKEND asks for `op` (or for every op, with op=None), validated: 'auto', a backend of
    BACKEND_NAMES, or 'backend.variant'."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    choices = f"auto, {', '.join(BACKEND_NAMES)} (or backend.variant)"
    if PER_OP_SEPARATOR not in value:
        if not _valid_name(value):
            raise ValueError(f"{ENV_VAR}: expected one of {choices}, or op=backend entries; got {value!r}")
        return value
    default, per_op = "auto", {}
    for entry in (e.strip() for e in value.split(",") if e.strip()):
        name, sep, backend = entry.partition(PER_OP_SEPARATOR)
        backend = backend.strip() if sep else name.strip()
        if not _valid_name(backend):
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
    if op not in backend.ops and op not in backend.variants:
        return f"the {name} backend does not implement {op}"
    if backend.devices is not None and device.type not in backend.devices:
        return f"the {name} backend does not run on {device.type} tensors"
    return backend.unavailable_reason()


def implementation(backend: str, op: str) -> Callable | None:
    """The backend's implementation of an auxiliary op (e.g. an in-place variant), or None if it has none."""
    found = _REGISTRY.get(backend)
    return None if found is None else found.ops.get(op)


def _candidates(name: str, op: str, call: Call) -> list[tuple[str, Callable, str | None]]:
    """The backend's candidates for the call that can run it: (name, implementation, why auto must not pick it)."""
    backend = _REGISTRY[name]
    found = []
    if op in backend.ops:
        found.append((name, backend.ops[op], backend.gate(op, call)))
    for variant, v in backend.variants.get(op, {}).items():
        if v.cannot_run(call) is None:
            why = v.gate(call) if v.own_gate else backend.gate(op, call) or v.gate(call)
            found.append((f"{name}{VARIANT_SEPARATOR}{variant}", v.fn, why))
    return found


def explain(op: str, device: torch.device, call: Call | None = None) -> list[tuple[str, str | None]]:
    """For reports (python -m faast.env): each candidate of the device's preference list and why auto would pass
    over it (None for those it would choose among). Logs nothing, measures nothing."""
    call = call or Call(op, device)
    out: list[tuple[str, str | None]] = []
    for name in _PREFERENCE.get(device.type, _DEFAULT_PREFERENCE):
        reason = _why_not(name, op, device)
        if reason is not None:
            out.append((name, reason))
            continue
        out.extend((cand, why) for cand, _, why in _candidates(name, op, call))
    return out


def _log_once(key: tuple[str, ...], message: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


def _choose(
    op: str,
    call: Call,
    eligible: list[tuple[str, Callable]],
    sample: Callable[[Callable], object] | None,
    prefer_first: float = 0.0,
) -> tuple[str, Callable]:
    """The fastest of the eligible candidates on a sample of the call (remembered), or the first when there is
    one candidate, nothing to sample, or measuring is off. prefer_first: the first candidate is kept unless another is
    faster by more than this share of its time (modes that trade accuracy for speed must win clearly)."""
    if len(eligible) == 1 or sample is None or not _autotune.enabled():
        return eligible[0]
    by_name = dict(eligible)
    cached = _autotune.lookup(call.device, op, call.shape_class)
    if cached in by_name:
        return cached, by_name[cached]
    timer = _autotune.timer_for(call.device)
    times: dict[str, float | str] = {}
    with torch.no_grad():
        for name, fn in eligible:
            best = min((t for t in times.values() if isinstance(t, float)), default=math.inf)
            first: list[float] = []

            def run(fn: Callable = fn, best: float = best, first: list[float] = first) -> None:
                # A candidate whose first call already took GIVE_UP× the best time so far has lost: the timer's
                # repetitions skip it, and that first call's time is what is recorded.
                if first and first[0] > GIVE_UP * best:
                    return
                start = time.perf_counter()
                sample(fn)
                _autotune.synchronize(call.device)
                first.append(time.perf_counter() - start)

            try:
                seconds = float(timer(name, run))
                times[name] = first[0] if first and first[0] > GIVE_UP * best else seconds
            except Exception as err:  # noqa: BLE001 - a candidate that fails here is dropped, with its reason
                times[name] = f"failed: {type(err).__name__}: {err}"[:300]
                _log_once((op, name, "failed"), "faast: %s: the %s candidate failed while being timed: %s", op,
                          name, times[name])  # fmt: skip
    timed = {n: t for n, t in times.items() if isinstance(t, float)}
    if not timed:
        return eligible[0]
    choice = min(timed, key=timed.__getitem__)
    head = eligible[0][0]
    if head in timed and timed[head] <= (1 + prefer_first) * timed[choice]:
        choice = head
    _autotune.store(call.device, op, call.shape_class, choice, times)
    logger.info("faast: %s on %s (%s): auto chose %s by measurement %s", op, call.device.type, call.shape_class,
                choice, times)  # fmt: skip
    return choice, by_name[choice]


def resolve(
    op: str,
    device: torch.device,
    call: Call | None = None,
    sample: Callable[[Callable], object] | None = None,
    prefer_first: float = 0.0,
) -> tuple[str, Callable]:
    """Return (candidate name, implementation) for `op` on `device`, following FAAST_BACKEND.

    call describes the inputs for gates and the cache (default: the op and device alone); sample(fn) runs a
    candidate on a small slice of the inputs, for the measured choice (None: no measuring); prefer_first: keep the
    first eligible candidate unless another is faster by more than this share of its time (`_choose`)."""
    call = call or Call(op, device)
    requested = requested_backend(op)
    if requested != "auto":
        backend_name, _, variant = requested.partition(VARIANT_SEPARATOR)
        backend = _REGISTRY.get(backend_name)
        if variant:
            reason = _why_not(backend_name, op, device)
            found = None if backend is None else backend.variants.get(op, {}).get(variant)
            if reason is None and found is None:
                known = sorted(backend.variants.get(op, {})) if backend else []
                reason = f"the {backend_name} backend has no variant {variant!r} of {op} (it has: {known})"
            if reason is None and found is not None:  # found is None only with a reason set above
                reason = found.cannot_run(call)
            if reason is not None or found is None:
                raise RuntimeError(f"{ENV_VAR}={requested} was requested for {op} on {device.type}, but {reason}")
            return requested, found.fn
        if backend is None or op in backend.ops or op in backend.variants:
            reason = _why_not(backend_name, op, device)
            if reason is not None:
                raise RuntimeError(f"{ENV_VAR}={requested} was requested for {op} on {device.type}, but {reason}")
            own = _candidates(backend_name, op, call)
            if not own:
                raise RuntimeError(f"{ENV_VAR}={requested} was requested for {op} on {device.type}, but none of "
                                   f"the {backend_name} backend's variants of {op} can run this call")  # fmt: skip
            eligible = [(n, f) for n, f, why in own if why is None] or [(n, f) for n, f, _ in own[:1]]
            return _choose(op, call, eligible, sample, prefer_first)
        # The requested backend has no version of this op by design (e.g. eigh is not a Triton kernel): the op
        # takes the automatic choice, said once, so that FAAST_BACKEND=triton still runs a whole FastWeights.
        _log_once((op, f"{requested}-lacks"), "faast: %s=%s has no %s; %s takes the automatic choice", ENV_VAR,
                  requested, op, op)  # fmt: skip
    eligible = []
    for name in _PREFERENCE.get(device.type, _DEFAULT_PREFERENCE):
        reason = _why_not(name, op, device)
        if reason is not None:
            _log_once((op, name), "faast: %s on %s skips the %s backend: %s", op, device.type, name, reason)
            continue
        for cand, fn, why in _candidates(name, op, call):
            if why is None:
                eligible.append((cand, fn))
            else:
                _log_once((op, cand, why), "faast: %s on %s skips the %s backend: %s", op, device.type, cand, why)
    if not eligible:
        raise RuntimeError(f"no faast backend can run {op} on {device.type}")
    return _choose(op, call, eligible, sample, prefer_first)
