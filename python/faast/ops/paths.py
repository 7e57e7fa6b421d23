"""Measured choices between ways of computing a learning step that are not a single op: the precision of the
learning pass's linears (``learn_pass``), of the LM head's logits (``head_logits``), and whether p·H pools the
vocabulary columns no position gives much probability (``head_pool``).

Each is an op of faast.ops._dispatch whose candidates are the torch backend's variants named after the modes, so the
one dispatch point chooses them as it chooses a kernel: the first use on a machine times every mode that can run
(on the model's own shapes: the caller says how, `choose`'s `time_mode`), keeps the fastest (a less exact mode
only when it wins by more than PRECISION_MARGIN) and caches it under the
machine's model, ISA flags and torch threads (faast.ops._autotune); ``FAAST_BACKEND`` pins one
(``learn_pass=torch.int8,head_logits=torch.float32``) and raises when it cannot run; ``FAAST_AUTOTUNE=0`` takes the
first mode of `PATHS`. A CPU flag never picks a mode: bfloat16 is timed on a CPU that emulates it, and loses there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _autotune, _dispatch

__all__ = ["PATHS", "cached", "candidates", "choose", "current", "runnable"]

# The modes of each choice, in the order taken when nothing is measured (the exact or widest one first).
PATHS: dict[str, tuple[str, ...]] = {
    "learn_pass": ("float32", "bfloat16", "int8"),
    "head_logits": ("float32", "bfloat16", "int8"),
    "head_pool": ("exact", "pooled"),
}
# A mode other than the first (the most exact) is taken only when it is faster by more than this share: the timings
# of one sample vary by a few percent, and a tie must not trade accuracy away.
PRECISION_MARGIN = 0.05


def _int8_cannot_run(call: _dispatch.Call) -> str | None:
    if call.device.type != "cpu":
        return f"int8 products run on the CPU only (faast.ops.int8), got {call.device.type}"
    if call.op == "learn_pass" and not call.options.get("int8_linears", 0):
        return "the model has no nn.Linear the int8 pass takes (inputs at most the hidden size wide)"
    return None


def _mode(name: str) -> Callable[[], str]:
    def mode() -> str:
        return name

    mode.__name__ = f"mode_{name}"
    return mode


def register() -> None:
    """Add every mode of PATHS as a variant of the torch backend (faast.ops registers the backend first)."""
    for op, modes in PATHS.items():
        for name in modes:
            cannot_run = _int8_cannot_run if name == "int8" else None
            _dispatch.register_variant("torch", op, name, _mode(name), cannot_run=cannot_run)


def choose(
    op: str,
    device: torch.device,
    shape_class: str,
    time_mode: Callable[[str], object] | None,
    options: dict | None = None,
) -> str:
    """The mode of `op` (a key of PATHS) to run on `device`: FAAST_BACKEND's pin, else the cached or measured
    fastest. time_mode(mode) runs one sample of the work in that mode (called only when measuring; None: nothing can
    be timed, so the pin or else the first mode that can run). What a mode forms once (weights in its dtype, its own
    measured choices) belongs before the call: see `current`. shape_class: what
    the work's cost depends on (the model's shapes), which keys the cache; options: what the modes' gates read
    (learn_pass: int8_linears, how many linears an int8 pass takes)."""
    if op not in PATHS:
        raise ValueError(f"op: expected one of {sorted(PATHS)}, got {op!r}")
    call = _dispatch.Call(op, device, options=options or {}, shape_class=shape_class)
    sample = None if time_mode is None else lambda fn: time_mode(fn())
    _, mode = _dispatch.resolve(op, device, call, sample, prefer_first=PRECISION_MARGIN)
    return mode()


def cached(op: str, device: torch.device, shape_class: str) -> str | None:
    """The mode a measurement chose and cached for this machine and shape class, without measuring; None if none."""
    name = _autotune.lookup(device, op, shape_class)
    return None if name is None else name.partition(_dispatch.VARIANT_SEPARATOR)[2]


def current(op: str, device: torch.device, shape_class: str, options: dict | None = None) -> str | None:
    """The mode `choose` would take now without measuring: FAAST_BACKEND's pin, the cached choice, or the first mode
    when measuring is off; None when the next use will measure (reports)."""
    if _dispatch.requested_backend(op) != "auto" or not _autotune.enabled():
        return choose(op, device, shape_class, None, options)
    return cached(op, device, shape_class)


def runnable(op: str, device: torch.device, options: dict | None = None) -> list[str]:
    """The modes of `op` that can run on `device` (those `choose` would time)."""
    return [mode for mode, why in candidates(op, device, options) if why is None]


def candidates(op: str, device: torch.device, options: dict | None = None) -> list[tuple[str, str | None]]:
    """Each mode of `op` with why it cannot run on `device` (None for those `auto` times), for reports."""
    call = _dispatch.Call(op, device, options=options or {})
    return [(name, _int8_cannot_run(call) if name == "int8" else None) for name in PATHS[op]]
