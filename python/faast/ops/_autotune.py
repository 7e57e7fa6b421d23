"""Measured choice between candidate implementations of an op, remembered on disk.

When more than one candidate may run a call (docs/backends.md, "How auto chooses"), faast.ops._dispatch times each on
a small sample of the call's own inputs the first time it meets a (device, op, shape class), keeps the fastest, and
writes the choice to a JSON file so that later processes skip the measurement:

    $FAAST_AUTOTUNE_CACHE   (default: autotune.json in faast's cache folder: $FAAST_CACHE, else
                             $XDG_CACHE_HOME/faast, else ~/.cache/faast)

The file's entries are keyed by the device and the torch, triton and faast versions, so an upgrade or another machine
measures afresh: a GPU by its name, a CPU by its model, instruction-set flags and torch threads (faast.hardware.
machine_key). A file that cannot be read or parsed is ignored with one warning (and replaced on the next
write); FAAST_AUTOTUNE=0 turns measuring off (auto then takes the first eligible candidate in preference order).

The timer is a module-level function so that tests can substitute a fake one (`set_timer`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from .. import _version
from ..hardware import machine_key
from ..persist import write_text_atomic

CACHE_ENV = "FAAST_AUTOTUNE_CACHE"
ENABLE_ENV = "FAAST_AUTOTUNE"
FILE_NAME = "autotune.json"
FORMAT = 1
# Timing: one warm-up call (it compiles a Triton kernel, fills caches), then the median of REPS calls.
REPS = 3
SLOW_S = 0.25

Timer = Callable[[str, Callable[[], object]], float]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_timer(device: torch.device) -> Timer:
    """Seconds per call of `run` on `device`: one warm-up, then the median of REPS synchronised calls."""

    def timer(_name: str, run: Callable[[], object]) -> float:
        start = time.perf_counter()
        run()
        synchronize(device)
        # A slow candidate (a float64 eigh of 48 x 1600 takes ~1 s) is timed once: the gap it loses by is wide.
        reps = 1 if time.perf_counter() - start > SLOW_S else REPS
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return timer


_timer: list[Callable[[torch.device], Timer]] = [default_timer]


def set_timer(factory: Callable[[torch.device], Timer] | None) -> None:
    """Replace how candidates are timed (tests pass a fake); None restores the wall-clock timer."""
    _timer[0] = factory or default_timer


def timer_for(device: torch.device) -> Timer:
    return _timer[0](device)


def enabled() -> bool:
    value = os.environ.get(ENABLE_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{ENABLE_ENV}: expected 0 or 1, got {value!r}")
    return value not in ("0", "false", "off")


def cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.environ.get("FAAST_CACHE"):
        return Path(os.environ["FAAST_CACHE"]) / FILE_NAME
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "faast" / FILE_NAME


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu: {machine_key()}"
    return device.type


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - absent or broken: part of the key either way
        return "none"


def context_key(device: torch.device) -> str:
    """What a cached choice depends on besides the shape: the device and the versions of torch, triton and faast."""
    versions = f"torch {torch.__version__} | triton {_triton_version()} | faast {_version.__version__}"
    return f"{device_name(device)} | {versions}"


def size_class(n: int) -> int:
    """Sizes within a factor of two share a choice: the power of two at or above n (0 for n <= 0)."""
    return 0 if n <= 0 else 1 << math.ceil(math.log2(n))


# ---------------------------------------------------------------------------------------------------- the file


_memory: dict[str, dict] = {}  # path -> parsed file, read once per process
_warned: set[str] = set()


def _read(path: Path) -> dict:
    key = str(path)
    if key not in _memory:
        data: dict = {"format": FORMAT, "entries": {}}
        if path.exists():
            try:
                loaded = json.loads(path.read_text())
                if (
                    not isinstance(loaded, dict)
                    or loaded.get("format") != FORMAT
                    or not isinstance(loaded.get("entries"), dict)
                ):
                    raise ValueError(f"expected {{'format': {FORMAT}, 'entries': {{...}}}}")
                data = loaded
            except (OSError, ValueError) as err:
                if key not in _warned:
                    _warned.add(key)
                    warnings.warn(
                        f"faast: ignoring the autotune cache {path} ({type(err).__name__}: {err}); choices are "
                        "measured again and the file is rewritten",
                        RuntimeWarning,
                        stacklevel=4,
                    )
        _memory[key] = data
    return _memory[key]


def forget_memory() -> None:
    """Drop what this process read from cache files (tests; or after editing the file by hand)."""
    _memory.clear()
    _warned.clear()


def entry(device: torch.device, op: str, shape_class: str) -> dict | None:
    """The cached {'choice': name, 'seconds': {candidate: seconds or why it failed}} of (op, shape class) for this
    device and versions, or None."""
    found = _read(cache_path()).get("entries", {}).get(context_key(device), {}).get(f"{op} {shape_class}")
    return found if isinstance(found, dict) else None


def lookup(device: torch.device, op: str, shape_class: str) -> str | None:
    found = entry(device, op, shape_class)
    return None if found is None else found.get("choice")


def store(device: torch.device, op: str, shape_class: str, choice: str, times: dict[str, float | str]) -> None:
    """Remember a choice in memory and on disk (atomically; an unwritable cache folder only costs re-measuring)."""
    path = cache_path()
    data = _read(path)
    data.setdefault("entries", {}).setdefault(context_key(device), {})[f"{op} {shape_class}"] = {
        "choice": choice,
        "seconds": times,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as err:
        if str(path) not in _warned:
            _warned.add(str(path))
            warnings.warn(f"faast: cannot write the autotune cache {path} ({err})", RuntimeWarning, stacklevel=4)
