"""What faast's dispatch offers for each op and what it measured: the public view benchmarks and reports read
(docs/backends.md).

Each op of faast.ops (accumulate_gram, eigh, residual_project, mix_probabilities, and the measured paths of
faast.ops.paths) has candidates: a backend ('torch', 'triton', 'cuda', 'cupy') or a backend's variant
('torch.syrk'). 'auto' times the candidates that can run on a call's device and shape class once per machine and caches
the fastest; FAAST_BACKEND (`BACKEND_ENV_VAR`) pins one.

- `Call`: what the dispatch sees of one call (op, device, inputs' dtypes and shapes, options); faast.ops.gram_call,
  eigh_call, residual_call and mixture_call build the ones the ops themselves make.
- `explain(op, device, call=None)`: every candidate for the call with why auto keeps it out (None: it competes).
- `unavailable_reason(backend)`: why a backend cannot run in this process (None: it can, on its devices).
- `implementation(backend, op)`: a backend's function for an op, to call directly (e.g. a kernel timed against the
  torch composition); None where the backend has none.
- `register_variant(backend, op, variant, fn, cannot_run=None, gate=None)`: add `backend.variant` as a candidate of
  op in this process (a benchmark's extra candidate).
- `assume_loadable(*backends)`: a context manager within which those backends answer that they can run here, to show
  what auto decides on a machine where they load (tests, dry runs of a report).
- `AUTOTUNE_CACHE_ENV`, `AUTOTUNE_FILE_NAME`, `autotune_cache_path()`, `measured_choices(path=None)` and
  `forget_measurements()`: the cache file of measured choices, what it holds, and dropping what this process read of
  it; `write_measured_choices(entries, path=None)` writes such a file (a test's, or one carried from another machine).
- `cupy_eigh_recomputed()`: how many matrices of the cupy backend's last eigh missed its accuracy contract and were
  recomputed by torch (a benchmark's diagnostic).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..persist import write_text_atomic
from . import _autotune, _cupy_backend, _dispatch
from ._dispatch import (
    assume_loadable,
    register_variant,
)  # public names of the dispatch's own functions (documented there)

__all__ = [
    "AUTOTUNE_CACHE_ENV",
    "AUTOTUNE_FILE_NAME",
    "BACKEND_ENV_VAR",
    "Call",
    "assume_loadable",
    "autotune_cache_path",
    "cupy_eigh_recomputed",
    "explain",
    "forget_measurements",
    "implementation",
    "measured_choices",
    "register_variant",
    "unavailable_reason",
    "write_measured_choices",
]

BACKEND_ENV_VAR = _dispatch.ENV_VAR
AUTOTUNE_CACHE_ENV = _autotune.CACHE_ENV
AUTOTUNE_FILE_NAME = _autotune.FILE_NAME
Call = _dispatch.Call


def explain(op: str, device: torch.device, call: Call | None = None) -> list[tuple[str, str | None]]:
    """Each candidate of `op` on `device` in the order auto prefers them, with why auto would pass over it for `call`
    (None for those it chooses among). Logs nothing, measures nothing."""
    return _dispatch.explain(op, device, call)


def unavailable_reason(backend: str) -> str | None:
    """Why `backend` cannot run in this process (a missing package or extension), None when it can on its devices."""
    if backend not in _dispatch.BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {_dispatch.BACKEND_NAMES}, got {backend!r}")
    found = _dispatch._REGISTRY.get(backend)
    return "not registered" if found is None else found.unavailable_reason()


def implementation(backend: str, op: str) -> Callable | None:
    """`backend`'s function for `op`, None where it has none."""
    return _dispatch.implementation(backend, op)


def autotune_cache_path() -> Path:
    """The cache file of measured choices: $FAAST_AUTOTUNE_CACHE, else $FAAST_CACHE/autotune.json, else
    ~/.cache/faast/autotune.json."""
    return _autotune.cache_path()


def measured_choices(path: Path | None = None) -> dict[str, dict]:
    """Every measured choice in the cache file (default `autotune_cache_path()`) by '<op> <shape class>', across
    machines and versions: {'choice': candidate, 'seconds': {candidate: seconds or why it failed}}. {} where the file
    is absent or unreadable."""
    path = autotune_cache_path() if path is None else path
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    entries = data.get("entries", {}) if isinstance(data, dict) else {}
    return {key: entry for context in entries.values() if isinstance(context, dict) for key, entry in context.items()}


def write_measured_choices(entries: Mapping[str, Mapping[str, Mapping]], path: Path | None = None) -> Path:
    """Write a cache file (default `autotune_cache_path()`, replaced atomically) holding `entries`: {machine and
    versions context: {'<op> <shape class>': {'choice': candidate, 'seconds': {candidate: seconds or why it
    failed}}}}, the layout the dispatch reads (contexts as faast keys them are '<device> | torch .. | triton .. |
    faast ..'; any string is kept). Forgets what this process read of cache files, so the next call reads this one.
    Returns the path."""
    layout = "{context: {'<op> <shape class>': {'choice': str, 'seconds': {...}}}}"
    if not isinstance(entries, Mapping) or not all(
        isinstance(c, str) and isinstance(v, Mapping) for c, v in entries.items()
    ):
        raise ValueError(f"entries: expected {layout}, got {entries!r}")
    for context, choices in entries.items():
        for key, entry in choices.items():
            if not isinstance(key, str) or not isinstance(entry, Mapping) or not isinstance(entry.get("choice"), str):
                raise ValueError(f"entries[{context!r}][{key!r}]: expected {layout}, got {entry!r}")
    path = autotune_cache_path() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": _autotune.FORMAT, "entries": {c: {k: dict(e) for k, e in v.items()} for c, v in entries.items()}}
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))
    forget_measurements()
    return path


def forget_measurements() -> None:
    """Drop what this process read from cache files (after pointing AUTOTUNE_CACHE_ENV elsewhere, or editing one)."""
    _autotune.forget_memory()


def cupy_eigh_recomputed() -> int:
    """How many matrices of the cupy backend's last eigh call missed its accuracy contract and were recomputed by
    torch.linalg.eigh (0 before the first call)."""
    return _cupy_backend.recomputed_in_last_call()
