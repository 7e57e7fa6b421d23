"""faast.Accumulator: named float64 sums of fixed shapes and a count, handled like a FastWeights' statistics.

Some learned state is a sum over positions that is not a regression: the residual output layer keeps the head's
curvature Σ μμᵀ [d, d] and the token mass Σ p [V], each with the number of positions. An Accumulator holds such sums
in float64; being a faast.SummedStatistics, it is found inside a model, summed across ranks by
faast.distributed.all_reduce, saved and restored by faast.checkpoint, and written by `save` / `load`, exactly as a
FastWeights is. Example::

    curvature = faast.Accumulator({"gram": (d, d)})
    curvature.add(count=positions, gram=mu.T @ mu)
    mean = curvature.gram / curvature.count
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from . import _persist
from .ops import _validate
from .statistics import SummedStatistics


class Accumulator(SummedStatistics):
    """Named float64 sums of fixed shapes, plus the float64 count of what was summed.

    Args:
        sums: {name: shape} of the sums, e.g. {"gram": (d, d)}; each name becomes a float64 buffer of that shape
            (read it as `accumulator.<name>` or through `sums()`). Names are identifiers other than 'count' and
            the module's own attributes.
        device: device of the buffers.

    `count` is a float64 scalar buffer. Device moves of a parent model move the buffers; its dtype casts leave them
    float64. After editing a buffer in place, call `mark_changed()`; `state_key` changes either way.
    """

    FORMAT = "faast.Accumulator"
    NONNEGATIVE = ("count",)

    def __init__(self, sums: Mapping[str, Sequence[int]], *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(sums, Mapping) or not sums:
            raise TypeError(f"sums: expected a non-empty mapping {{name: shape}}, got {sums!r}")
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in sums.items():
            if not isinstance(name, str) or not name.isidentifier() or name == "count" or hasattr(self, name):
                raise ValueError(
                    f"sums: expected identifiers other than 'count' and the Accumulator's attributes, got {name!r}"
                )
            if isinstance(shape, int | str) or not isinstance(shape, Sequence):
                raise TypeError(f"sums: the shape of {name!r} must be a sequence of ints, got {shape!r}")
            if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
                raise ValueError(f"sums: the shape of {name!r} must hold ints >= 0, got {list(shape)}")
            shapes[name] = tuple(shape)
        self._shapes = shapes
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=torch.float64, device=device))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64, device=device))

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the sums, in construction order."""
        return tuple(self._shapes)

    def sums(self) -> dict[str, torch.Tensor]:
        """{name: float64 sum} (the buffers themselves, not copies)."""
        return {name: getattr(self, name) for name in self._shapes}

    def config(self) -> dict:
        """{'sums': {name: shape}}: the constructor arguments that rebuild this accumulator."""
        return {"sums": {name: list(shape) for name, shape in self._shapes.items()}}

    def summed_tensors(self) -> list[torch.Tensor]:
        """Every sum, then the count: what faast.distributed sums across ranks."""
        return [*self.sums().values(), self.count]

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{name}={list(shape)}" for name, shape in self._shapes.items())
        return f"{shapes}, count={float(self.count)}"

    # ------------------------------------------------------------------ changing the sums

    @torch.no_grad()
    def add(self, *, count: float | torch.Tensor, **sums: torch.Tensor) -> Accumulator:
        """Add one batch: count += `count` (a number or a 0-d tensor >= 0) and each sum += its tensor.

        Every sum must be given, with its shape, on this accumulator's device, any floating dtype (added in
        float64), finite. Raises TypeError / ValueError naming the argument, with the accumulator untouched; the
        values are checked with one host synchronisation per call. Returns self.
        """
        if set(sums) != set(self._shapes):
            raise ValueError(f"sums: expected keyword arguments {sorted(self._shapes)}, got {sorted(sums)}")
        for name, t in sums.items():
            _validate.require_tensor(name, t)
            _validate.require_shape(name, t, self._shapes[name], "(as constructed)")
            _validate.require_same_device("the accumulator", self.count, **{name: t})
        if isinstance(count, torch.Tensor):
            _validate.require_tensor("count", count, dtypes=(*_validate.FLOAT_DTYPES, torch.int32, torch.int64))
            _validate.require_shape("count", count, (), "[] (a scalar)")
            _validate.require_same_device("the accumulator", self.count, count=count)
            n = count.detach().to(torch.float64)
        else:
            n = torch.tensor(_validate.require_nonnegative_number("count", count), dtype=torch.float64)
            n = n.to(self.count.device)
        flags = [torch.isfinite(t).all() for t in sums.values()]
        if not bool(torch.stack([*flags, torch.isfinite(n) & (n >= 0)]).all()):  # the one host synchronisation
            for name, t in sums.items():
                _validate.require_finite(name, t)
            raise ValueError(f"count: expected a finite number >= 0, got {float(n)}")
        for name, t in sums.items():
            getattr(self, name).add_(t.detach().to(torch.float64))
        self.count.add_(n)
        self.mark_changed()
        return self

    @torch.no_grad()
    def merge(self, other: Accumulator) -> Accumulator:
        """Add another accumulator's sums and count (another process, device or shard). Returns self."""
        if not isinstance(other, Accumulator):
            raise TypeError(f"other: expected a faast.Accumulator, got {type(other).__name__}")
        if other.config() != self.config():
            raise ValueError(f"other: expected sums {self.config()['sums']}, got {other.config()['sums']}")
        for mine, theirs in zip(self.summed_tensors(), other.summed_tensors(), strict=True):
            mine.add_(theirs.to(mine.device))
        self.mark_changed()
        return self

    @torch.no_grad()
    def apply_discount(self, gamma: float) -> Accumulator:
        """Multiply every sum and the count by gamma in (0, 1] (forgets old batches geometrically). Returns self."""
        gamma = _validate.require_fraction("gamma", gamma)
        for t in self.summed_tensors():
            t.mul_(gamma)
        self.mark_changed()
        return self

    @torch.no_grad()
    def reset(self) -> Accumulator:
        """Zero every sum and the count. Returns self."""
        for t in self.summed_tensors():
            t.zero_()
        self.mark_changed()
        return self

    # ------------------------------------------------------------------ saved states (faast.statistics)

    def _check_structure(self, config: Mapping, tensors: Mapping[str, torch.Tensor], source: object) -> None:
        _persist.check_config(config, self.config(), ("sums",), source, "this accumulator")

    @classmethod
    def _from_config(
        cls, config: dict, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None
    ) -> Accumulator:
        sums = config["sums"]
        if not isinstance(sums, dict):
            raise TypeError(f"sums: expected an object, got {sums!r}")
        return cls({name: tuple(shape) for name, shape in sums.items()}, device=device)
