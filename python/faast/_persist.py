"""The file codec of faast's statistics: one safetensors file holding a module's tensors and its configuration.

A pure codec over plain data (a config dict and a dict of tensors): `encode` writes them, `decode` reads them back
after checking the format and its version, and `check_config` / `check_tensors` compare saved data with what a module
expects (passed in as plain data), so that a module is either fully loaded or untouched. The modules themselves
(faast.statistics.SummedStatistics and its subclasses) decide what is expected and copy the tensors in.
The file is written and verified by faast.persist (atomic rename, sha256 of the tensor bytes).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch

from ._version import __version__
from .persist import read_verified, write_atomic

FORMAT_VERSION = 1


def encode(path: str | Path, fmt: str, config: Mapping, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write `tensors` and the JSON-serialisable `config` as a `fmt` file at `path`, atomically; returns the path."""
    metadata = {
        "format": fmt,
        "format_version": str(FORMAT_VERSION),
        "faast_version": __version__,
        "config": json.dumps(dict(config), sort_keys=True),
    }
    return write_atomic(path, dict(tensors), metadata)


def decode(path: str | Path, fmt: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config) of a `fmt` file written by `encode`; raises ValueError naming the path if it is not one."""
    tensors, metadata = read_verified(path)
    if metadata.get("format") != fmt:
        raise ValueError(f"{path}: not a {fmt} file (format={metadata.get('format')!r})")
    try:
        version = int(metadata.get("format_version", "0"))
        config = json.loads(metadata["config"])
    except (ValueError, KeyError) as err:
        raise ValueError(f"{path}: malformed {fmt} metadata ({err!r})") from None
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{path}: written by a newer faast (format_version {version}, this version reads {FORMAT_VERSION}); "
            "upgrade faast"
        )
    if not isinstance(config, dict):
        raise ValueError(f"{path}: malformed {fmt} metadata (config is not an object)")
    return tensors, config


def check_config(config: Mapping, expected: Mapping, fields: Sequence[str], source: object, holder: str) -> None:
    """Raise ValueError naming `source` unless the saved `config` equals `expected` on every one of `fields`
    (the configuration that fixes the shape or meaning of the tensors). `holder` names the receiver, e.g.
    'this memory'."""
    for field in fields:
        if config.get(field) != expected[field]:
            raise ValueError(f"{source}: saved with {field}={config.get(field)!r}, {holder} has {expected[field]!r}")


def check_tensors(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[Sequence[int], torch.dtype]],
    source: object,
    *,
    nonnegative: Collection[str] = (),
) -> None:
    """Raise ValueError naming `source` unless `tensors` are exactly the `expected` {name: (shape, dtype)}, hold
    finite values, and hold no negative entry in the tensors named in `nonnegative`."""
    if set(tensors) != set(expected):
        raise ValueError(f"{source}: expected tensors {sorted(expected)}, found {sorted(tensors)}")
    for name, t in tensors.items():
        shape, dtype = expected[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"{source}: tensor {name} has shape {list(getattr(t, 'shape', []))} {getattr(t, 'dtype', None)}, "
                f"expected {list(shape)} {dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{source}: tensor {name} holds NaN/Inf; refusing to load it")
        if name in nonnegative and bool((t < 0).any()):
            raise ValueError(f"{source}: tensor {name} holds negative entries; refusing to load it")
