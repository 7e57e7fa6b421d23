"""FastWeights on disk: one safetensors file holding the memory's buffers (its state_dict) and its configuration.

The file is written and verified by faast.persist (atomic rename, sha256 of the tensor bytes). Reading checks the
format, its version and every tensor (names, shapes, dtypes, finite values, non-negative counters) before anything is
copied into a memory, so a memory is either fully loaded or untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ._version import __version__

# faast.persist is the public home of these; they stay importable from here for modules that predate it.
from .persist import CorruptFileError, read_verified, write_atomic, write_text_atomic  # noqa: F401

if TYPE_CHECKING:
    from .memory import FastWeights

FORMAT = "faast.FastWeights"
FORMAT_VERSION = 1

_NONNEGATIVE = ("count", "target_sqnorm", "num_dropped", "blend_sqnorm", "blend_rows", "folded_count")
# Configuration that fixes the shape or meaning of the statistics: a file must match it to be loaded into a memory.
_STRUCTURE = ("dim_key", "dim_value", "batch_shape", "mode", "blend_window", "blend_chunk", "weighted_least_squares")


def save(memory: FastWeights, path: str | Path) -> Path:
    """Write the memory's statistics and configuration to `path` atomically; returns the path."""
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "faast_version": __version__,
        "config": json.dumps(memory.config(), sort_keys=True),
    }
    return write_atomic(path, dict(memory.state_dict()), metadata)


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config) of a file written by `save`; raises ValueError naming the path if it is not one."""
    tensors, metadata = read_verified(path)
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format={metadata.get('format')!r})")
    try:
        version = int(metadata.get("format_version", "0"))
        config = json.loads(metadata["config"])
    except (ValueError, KeyError) as err:
        raise ValueError(f"{path}: malformed {FORMAT} metadata ({err!r})") from None
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{path}: written by a newer faast (format_version {version}, this version reads {FORMAT_VERSION}); "
            "upgrade faast"
        )
    if not isinstance(config, dict):
        raise ValueError(f"{path}: malformed {FORMAT} metadata (config is not an object)")
    return tensors, config


def load(cls: type[FastWeights], path: str | Path, device: torch.device | str | None) -> FastWeights:
    """A new memory of class `cls` rebuilt from a file written by `save`, bit-exact, on `device`."""
    tensors, config = read(path)
    try:
        for key in ("compute_dtype", "dtype"):
            config[key] = getattr(torch, config[key])
        memory = cls(**config, prior=tensors.get("prior"), device=device)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise ValueError(f"{path}: the saved configuration cannot rebuild a FastWeights ({err})") from None
    load_tensors(memory, tensors, path)
    return memory


def load_state(memory: FastWeights, path: str | Path) -> FastWeights:
    """Load a file written by `save` into `memory`, whose structure must match the file's; returns the memory."""
    tensors, config = read(path)
    check_compatible(memory, tensors, config, path)
    load_tensors(memory, tensors, path)
    return memory


def check_compatible(memory: FastWeights, tensors: dict[str, torch.Tensor], config: dict, source: object) -> None:
    """Raise ValueError naming `source` unless saved tensors + config fit the memory's structure."""
    mine = memory.config()
    for field in _STRUCTURE:
        if config.get(field) != mine[field]:
            raise ValueError(f"{source}: saved with {field}={config.get(field)!r}, this memory has {mine[field]!r}")
    if ("prior" in tensors) != (memory.prior is not None):
        raise ValueError(f"{source}: saved {'with' if 'prior' in tensors else 'without'} a prior, this memory differs")
    validate_tensors(memory, tensors, source)


def load_tensors(memory: FastWeights, tensors: dict[str, torch.Tensor], source: object) -> None:
    """Validate saved buffers against the memory's, then copy them in (all or nothing)."""
    validate_tensors(memory, tensors, source)
    copy_tensors(memory, tensors)


def validate_tensors(memory: FastWeights, tensors: dict[str, torch.Tensor], source: object) -> None:
    """Raise ValueError naming `source` unless `tensors` are exactly the memory's buffers in name, shape and dtype,
    finite, with non-negative counters and an in-range blend cursor."""
    expected = dict(memory.state_dict())
    if set(tensors) != set(expected):
        raise ValueError(f"{source}: expected tensors {sorted(expected)}, found {sorted(tensors)}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape or t.dtype != expected[name].dtype:
            raise ValueError(
                f"{source}: tensor {name} has shape {list(t.shape)} {t.dtype}, expected "
                f"{list(expected[name].shape)} {expected[name].dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{source}: tensor {name} holds NaN/Inf; refusing to load it")
        if name in _NONNEGATIVE and bool((t < 0).any()):
            raise ValueError(f"{source}: tensor {name} holds negative entries; refusing to load it")
    if "blend_cursor" in tensors:
        head, used = tensors["blend_cursor"].tolist()
        if not (0 <= head < memory.blend_rows.shape[0] and 0 <= used <= memory.blend_rows.shape[0]):
            raise ValueError(f"{source}: tensor blend_cursor {[head, used]} is out of range; refusing to load it")


@torch.no_grad()
def copy_tensors(memory: FastWeights, tensors: dict[str, torch.Tensor]) -> None:
    """Copy validated buffers into the memory (onto its device) and invalidate its cached solution."""
    for name, t in tensors.items():
        memory._buffers[name].copy_(t)
    memory._changed()
