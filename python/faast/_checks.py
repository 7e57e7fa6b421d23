"""Argument checks shared by the ops and the streaming memory.

Every check raises before any state is touched, and every message names the argument, what was expected and what
was received, so that a user can fix the call without reading our source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Accumulators hold sums of squares over many rows: fp16 overflows (an outlier of 3000 squared is above 65504) and
# bf16 keeps 8 bits, so only float32 and float64 are accepted for S and T.
ACCUMULATOR_DTYPES = (torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def require_tensor(name: str, value: object, *, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> torch.Tensor:
    """Raise TypeError unless `value` is a tensor whose dtype is one of `dtypes`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {str(value.dtype).replace('torch.', '')}")
    return value


def require_ndim(name: str, t: torch.Tensor, min_ndim: int, layout: str) -> None:
    if t.dim() < min_ndim:
        raise ValueError(f"{name}: expected a tensor of shape {layout} (at least {min_ndim} dims), got {_shape(t)}")


def require_shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        want = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ValueError(f"{name}: expected shape {layout} = {want}, got {_shape(t)}")


def require_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name}: expected device {reference.device} (the device of {reference_name}), got {t.device}"
            )


def first_nonfinite(t: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first NaN/Inf entry of `t`, or None. Only called on the error path."""
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def require_finite(name: str, t: torch.Tensor) -> None:
    index = first_nonfinite(t)
    if index is not None:
        raise ValueError(f"{name}: expected finite values, found {t[index].item()} at index {list(index)}")


def require_nonnegative_number(name: str, value: object, *, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number {bound}, got {value}")
    return value


def require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return value
