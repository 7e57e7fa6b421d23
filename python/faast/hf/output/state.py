"""What one named memory holds for the residual output layer (faast.hf.output.ResidualOutputLayer), apart from it."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ...accumulator import Accumulator
from ...memory import FastWeights
from ..held_out import HeldOutTail


class OutputState(nn.Module):
    """Everything one named memory holds for the residual output layer: its statistics (memory, curvature,
    token_mass, gradient_sum, target_count), its held-out tail, the step, weight and key width restored from a file,
    and what was derived from them (the folded correction and the last tuning), so that switching memories solves
    nothing again.

    Built by ResidualOutputLayer.new_state / swap_state; the layer reads the state bound to it.
    """

    def __init__(
        self,
        memory: FastWeights,
        curvature: Accumulator,
        token_mass: Accumulator,
        gradient_sum: Accumulator,
        held_out: HeldOutTail,
        restored: tuple[float | None, float | None, int | None] = (None, None, None),
        folded: tuple | None = None,
        last_tuning: dict | None = None,
        *,
        target_count: Accumulator,
    ) -> None:
        super().__init__()
        self.memory, self.curvature, self.token_mass = memory, curvature, token_mass
        self.gradient_sum, self.target_count = gradient_sum, target_count
        self.held_out, self.restored, self.folded, self.last_tuning = held_out, restored, folded, last_tuning

    def statistics(self) -> tuple[nn.Module, ...]:
        """The summed statistics, in file order: memory, curvature, token_mass, gradient_sum, target_count."""
        return self.memory, self.curvature, self.token_mass, self.gradient_sum, self.target_count

    def take_derived(self, other: OutputState) -> None:
        """Keep what `other` (the same statistics, read while bound) derived and restored: tail, settings, caches."""
        self.held_out, self.restored, self.folded, self.last_tuning = (
            other.held_out,
            other.restored,
            other.folded,
            other.last_tuning,
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> OutputState:
        self.folded = None  # as the layer does on a device move: the tail and caches stay where they were made
        self.held_out.clear()
        return super()._apply(fn, recurse)


def checked_restored(
    step: float | None, weight: float | None, key_width: int | None, widths: list[int]
) -> tuple[float | None, float | None, int | None]:
    """(step, weight, key_width) as `OutputState.restored` keeps them, each None or checked: a finite step >= 0, a
    weight in [0, 1], a key width among `widths`. ValueError names the first argument that is neither."""
    if step is not None and not (isinstance(step, (int, float)) and math.isfinite(step) and step >= 0):
        raise ValueError(f"step: expected a finite number >= 0 or None, got {step!r}")
    if weight is not None and not (isinstance(weight, (int, float)) and 0.0 <= weight <= 1.0):
        raise ValueError(f"weight: expected a number in [0, 1] or None, got {weight!r}")
    if key_width is not None and (type(key_width) is not int or key_width not in widths):
        raise ValueError(f"key_width: expected one of {widths} or None, got {key_width!r}")
    return None if step is None else float(step), None if weight is None else float(weight), key_width
