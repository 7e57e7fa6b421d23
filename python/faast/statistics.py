"""faast.SummedStatistics: the base of every module whose learned state is float64 sums over rows.

faast.FastWeights (S, T, N and the GCV statistic) and faast.Accumulator (named sums and a count) both keep sums,
so the same machinery serves both: faast.distributed.all_reduce adds them across ranks, faast.checkpoint saves,
validates and restores them all or nothing, and `save` / `load` write one of them to a safetensors file through the
codec faast._persist. This module defines what those need from a module of statistics:

- `summed_tensors()`: the buffers that add across ranks, in a fixed order;
- `config()`: the JSON-serialisable constructor arguments (what must agree across ranks and files);
- `fixed_tensors()`: buffers that are configuration, not sums (FastWeights' prior), identical on every rank;
- `not_summable_reason()`: why the statistics cannot be summed across processes, or None;
- `validate_state(tensors, config, source)` / `load_statistics(tensors)`: check a saved state, then copy it in;
- `mark_changed()`, `version`, `state_key`: change tracking for caches of what is derived from the sums.

Float64 buffers follow the device moves of a parent model but never its dtype casts (`model.half()` must not turn
float64 sums into fp16): see `Float64Module`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from . import _persist

Self = TypeVar("Self", bound="SummedStatistics")


class Float64Module(nn.Module):
    """An nn.Module whose buffers move with `.to(device)` / `.cuda()` of a parent but keep their dtype: a cast such
    as `model.half()` is discarded and the original buffer is moved to the cast's device instead."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Float64Module:
        if recurse:
            for child in self.children():
                child._apply(fn, recurse)  # nn.Module's own protocol: each child applies fn to itself
        for name, buf in list(self.named_buffers(recurse=False)):
            moved = fn(buf)
            if moved.dtype != buf.dtype:
                moved = buf.to(device=moved.device)
            setattr(self, name, moved)  # assigning a tensor to a buffer's name replaces the buffer
        return self


class SummedStatistics(Float64Module):
    """Base of faast.FastWeights and faast.Accumulator: float64 sums over rows that add across processes.

    Subclasses set `FORMAT` (the file format name) and implement `config`, `summed_tensors` and
    `_check_structure`; they may extend `fixed_tensors`, `not_summable_reason`, `_check_tensors`,
    `_current_names` and `_from_config`. faast.distributed.find_memories finds every instance inside a module.
    """

    FORMAT: ClassVar[str] = "faast.SummedStatistics"
    # Buffers whose entries are counts or sums of squares: a saved state with a negative entry is refused.
    NONNEGATIVE: ClassVar[tuple[str, ...]] = ("count",)
    # Every subclass registers a float64 buffer `count` (the rows summed); declared so that it types as a tensor.
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self._version = 0

    # ------------------------------------------------------------------ what subclasses describe

    def config(self) -> dict:
        """The JSON-serialisable constructor arguments that rebuild this module (without its tensors)."""
        raise NotImplementedError

    def summed_tensors(self) -> list[torch.Tensor]:
        """The buffers that add across processes (faast.distributed.all_reduce sums them in this order)."""
        raise NotImplementedError

    def fixed_tensors(self) -> dict[str, torch.Tensor]:
        """Buffers that are configuration rather than sums; every rank must hold the same ones. None by default."""
        return {}

    def not_summable_reason(self) -> str | None:
        """Why these statistics cannot be summed across processes (a phrase after the module's name), or None."""
        return None

    # ------------------------------------------------------------------ change tracking

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers())).device

    @property
    def version(self) -> int:
        """Monotonic counter, incremented by every change of the statistics."""
        return self._version

    @property
    def state_key(self) -> tuple:
        """A value that changes whenever the statistics change, in-place edits of the buffers included (through the
        tensors' version counters). Compare it for equality to cache what is derived from the sums."""
        return (self._version, *(t._version for t in self.buffers()))

    def mark_changed(self) -> None:
        """Record a change of the statistics: call it after editing the buffers in place (it bumps `version` and
        invalidates what is cached from them)."""
        self._version += 1

    def empty_like(self: Self) -> Self:
        """A new module of this one's configuration (and configuration tensors, e.g. a prior) holding no statistics,
        on this module's device: a second memory of the same shape."""
        device = next(iter(self.buffers())).device
        return type(self)._from_config(self.config(), dict(self.fixed_tensors()), device)

    @torch.no_grad()
    def subtract(self: Self, other: SummedStatistics) -> Self:
        """Remove statistics that were added before (`other`: a module of the same configuration holding exactly
        what learning some rows added): every summed tensor minus other's. The inverse of `merge`.

        Raises ValueError, with this module untouched, when the configurations differ or when a count would fall
        below zero (beyond float64 rounding: what was never added cannot be removed). Where a count reaches zero
        every sum of that memory is reset to exact zeros, so rounding residue cannot read as data. Returns self.
        """
        if type(other) is not type(self) or other.config() != self.config():
            raise ValueError(f"other: expected a {type(self).__name__} of configuration {self.config()}")
        if (reason := self.not_summable_reason()) is not None:
            raise ValueError(f"subtract: this {type(self).__name__} {reason}")
        mine, theirs = self.summed_tensors(), [t.to(self.count.device) for t in other.summed_tensors()]
        remaining = self.count - other.count.to(self.count.device)
        if bool((remaining < -1e-9 * self.count.abs().clamp_min(1)).any()):
            raise ValueError(
                f"other: holds {other.count.tolist()} rows, this module {self.count.tolist()}; removing them would "
                "leave a negative count, so they were never all added here; nothing was removed"
            )
        for t, d in zip(mine, theirs, strict=True):
            t.sub_(d)
        empty = self.count <= 1e-9 * other.count.abs().to(self.count.device).clamp_min(1)
        if bool(empty.any()):
            for t in mine:
                t.masked_fill_(empty.reshape(empty.shape + (1,) * (t.dim() - empty.dim())), 0)
        self.mark_changed()
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> SummedStatistics:
        super()._apply(fn, recurse)
        self.mark_changed()
        return self

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:  # nn.Module's signature
        super()._load_from_state_dict(*args, **kwargs)
        self.mark_changed()

    # ------------------------------------------------------------------ validating and loading a saved state

    def _current_names(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The saved tensors under this version's state_dict names (subclasses map the names of older files)."""
        return dict(tensors)

    def _check_structure(self, config: Mapping, tensors: Mapping[str, torch.Tensor], source: object) -> None:
        """Raise ValueError naming `source` unless a saved config (and the set of saved tensors) fits this module."""
        raise NotImplementedError

    def _check_tensors(self, tensors: Mapping[str, torch.Tensor], source: object) -> None:
        """Raise ValueError naming `source` unless `tensors` are exactly this module's state in name, shape and
        dtype, finite, with non-negative counters."""
        layout = {name: (tuple(t.shape), t.dtype) for name, t in self.state_dict().items()}
        _persist.check_tensors(tensors, layout, source, nonnegative=self.NONNEGATIVE)

    def validate_state(self, tensors: Mapping[str, torch.Tensor], config: Mapping, source: object = "state") -> None:
        """Raise ValueError naming `source` unless saved tensors + config can be loaded into this module; touches
        nothing. faast.checkpoint validates every module of a file this way before copying any."""
        self._check_structure(config, tensors, source)
        self._check_tensors(self._current_names(tensors), source)

    @torch.no_grad()
    def load_statistics(self: Self, tensors: Mapping[str, torch.Tensor], *, source: object = "state") -> Self:
        """Copy a saved state (this module's state_dict names, shapes and dtypes; older files' names are mapped) into
        this module, onto its device, all or nothing; marks it changed. Raises ValueError naming `source` on a
        mismatch, NaN/Inf or a negative counter, with the module untouched. Returns self."""
        tensors = self._current_names(tensors)
        self._check_tensors(tensors, source)
        self.load_state_dict(tensors)  # each module copies into its own buffers; marks this one changed
        return self

    # ------------------------------------------------------------------ files

    def save(self, path: str | Path) -> Path:
        """Write the statistics and configuration to a safetensors file, atomically (missing parent folders are
        created). Returns the path."""
        return _persist.encode(path, self.FORMAT, self.config(), dict(self.state_dict()))

    @classmethod
    def _from_config(
        cls: type[Self], config: dict, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None
    ) -> Self:
        """A new, empty module built from a saved config (and the saved configuration tensors, e.g. a prior)."""
        build: Callable[..., Self] = cls  # each subclass's constructor takes its config() and device=
        return build(**config, device=device)

    @classmethod
    def load(cls: type[Self], path: str | Path, *, device: torch.device | str | None = None) -> Self:
        """Rebuild a module saved with `save`, bit-exact, on `device` (default CPU)."""
        tensors, config = _persist.decode(path, cls.FORMAT)
        try:
            module = cls._from_config(config, tensors, device)
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            what = cls.FORMAT.removeprefix("faast.")
            raise ValueError(f"{path}: the saved configuration cannot rebuild a {what} ({err})") from None
        return module.load_statistics(tensors, source=path)

    def load_state(self: Self, path: str | Path) -> Self:
        """Load statistics saved with `save` into this module; the file's structure must match this module's."""
        tensors, config = _persist.decode(path, self.FORMAT)
        self.validate_state(tensors, config, path)
        return self.load_statistics(tensors, source=path)
