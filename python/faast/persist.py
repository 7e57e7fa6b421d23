"""Atomic, checksummed safetensors files: how every file of faast is written and read back.

A write goes to a temporary file in the target's folder, is flushed and fsync'ed, then renamed over the target, so a
crash leaves either the old file or the new one, never a torn one. The header records a sha256 of the tensor bytes;
a read recomputes it, so a truncated or bit-flipped file is reported instead of loading wrong statistics. Loading
never executes code (safetensors holds only tensors and string metadata).

Public API: `write_atomic` / `read_verified` for tensors with string metadata, `write_text_atomic` for text files,
and `CorruptFileError`, the ValueError a read raises for a damaged file. Example::

    from faast.persist import read_verified, write_atomic

    write_atomic("stats.safetensors", {"gram": gram}, {"run": "42"})
    tensors, metadata = read_verified("stats.safetensors")  # metadata == {"run": "42"}
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import torch

__all__ = ["CorruptFileError", "read_verified", "write_atomic", "write_text_atomic"]

_DIGEST_KEY = "sha256"


class CorruptFileError(ValueError):
    """The file is not an intact faast safetensors file: unreadable header, cut short, or its bytes changed."""


def _data_section(blob: bytes) -> bytes:
    header_len = int.from_bytes(blob[:8], "little")
    return blob[8 + header_len :]


def write_atomic(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write `tensors` (any dtypes and devices; saved as contiguous CPU copies) and string `metadata` to the
    safetensors file `path` atomically, with a sha256 of the tensor bytes in the metadata. Missing parent folders are
    created. Returns the path."""
    from safetensors.torch import save

    path = Path(path)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    unsigned = save(cpu)
    digest = hashlib.sha256(_data_section(unsigned)).hexdigest()
    blob = save(cpu, metadata={**metadata, _DIGEST_KEY: digest})
    # The tensor section does not depend on the metadata; a mismatch would mean the digest describes other bytes.
    if _data_section(blob) != _data_section(unsigned):
        raise RuntimeError("safetensors laid out the same tensors differently twice; refusing to write")
    return _replace_atomically(path, blob)


def _replace_atomically(path: Path, blob: bytes) -> Path:
    """Write blob to a temporary file beside path, fsync it, rename it over path and fsync the folder. Every save of
    faast goes through here, so all of them create missing parent folders (documented on each save)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write a UTF-8 text file atomically (temporary file, fsync, rename); returns the path."""
    return _replace_atomically(Path(path), text.encode("utf-8"))


def read_verified(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a file written by write_atomic. Raises ValueError naming the path if it is not intact."""
    from safetensors.torch import load

    path = Path(path)
    blob = path.read_bytes()
    try:
        header_len = int.from_bytes(blob[:8], "little")
        if len(blob) < 8 or header_len > len(blob) - 8:
            raise ValueError("the header length points past the end of the file")
        header = json.loads(blob[8 : 8 + header_len])
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise ValueError("the metadata is not a string map")
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{path}: not a readable safetensors file ({err})") from None
    expected = metadata.get(_DIGEST_KEY)
    if expected is None:
        raise ValueError(f"{path}: no {_DIGEST_KEY} in the metadata; it was not written by faast")
    actual = hashlib.sha256(_data_section(blob)).hexdigest()
    if actual != expected:
        raise CorruptFileError(
            f"{path}: checksum mismatch (file corrupted or truncated): expected {expected}, got {actual}"
        )
    try:
        tensors = load(blob)
    except Exception as err:  # safetensors raises its own error type for malformed files
        raise CorruptFileError(f"{path}: malformed safetensors content ({err})") from None
    return tensors, {k: v for k, v in metadata.items() if k != _DIGEST_KEY}
