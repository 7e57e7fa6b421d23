"""Argument validation for faast.ops and faast.FastWeights.

Order matters: types, shapes and devices are checked first, and only then are values scanned (negative scores,
NaN/Inf), so a value scan never runs on a tensor the call is going to reject anyway (e.g. on another device).
"""

from __future__ import annotations

import torch

from .. import _checks


def check_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> None:
    """Types, shapes and devices of one batch of rows: keys [*, N, dk], values [*, N, dv], scores/mask [*, N]."""
    _checks.require_tensor("keys", keys)
    _checks.require_ndim("keys", keys, 2, "[*, N, dim_key]")
    _checks.require_tensor("values", values)
    _checks.require_ndim("values", values, 2, "[*, N, dim_value]")
    if keys.shape[-1] == 0 or values.shape[-1] == 0:
        raise ValueError(
            f"keys/values: expected at least one feature, got dim_key={keys.shape[-1]}, dim_value={values.shape[-1]}"
        )
    rows = tuple(keys.shape[:-1])
    if tuple(values.shape[:-1]) != rows:
        raise ValueError(
            f"values: expected shape [*, N, dim_value] with [*, N] = {list(rows)} as in keys, got {list(values.shape)}"
        )
    if scores is not None:
        _checks.require_tensor("scores", scores)
        _checks.require_shape("scores", scores, rows, "[*, N] (one score per key)")
    if mask is not None:
        _checks.require_tensor("mask", mask, dtypes=(torch.bool,))
        _checks.require_shape("mask", mask, rows, "[*, N] (one flag per key)")
    _checks.require_same_device("keys", keys, values=values, scores=scores, mask=mask)


def check_scores(scores: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """Scores must be non-negative wherever the row is learned (masked-out rows may hold anything)."""
    if scores is None:
        return
    negative = scores < 0
    if mask is not None:
        negative &= mask
    if bool(negative.any()):
        index = [int(i) for i in negative.nonzero()[0]]
        raise ValueError(
            f"scores: expected non-negative weights (e.g. sigmoid outputs), found {scores[tuple(index)].item()} "
            f"at index {index}"
        )


def _nonfinite(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    bad = ~torch.isfinite(t)
    if mask is not None:
        bad &= mask.unsqueeze(-1) if t.dim() > mask.dim() else mask
    return bad


def any_nonfinite(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None
) -> bool:
    """Whether a learned row (mask True) holds NaN/Inf in keys, values or scores."""
    return any(bool(_nonfinite(t, mask).any()) for t in (keys, values, scores) if t is not None)


def explain_nonfinite(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None
) -> ValueError:
    """The error for a batch whose statistics are not finite: names the first bad input, or reports an overflow.

    Only called on the error path; pass the tensors as the caller received them so the index is theirs.
    """
    for name, t in (("keys", keys), ("values", values), ("scores", scores)):
        if t is None:
            continue
        bad = _nonfinite(t, mask)
        if bool(bad.any()):
            index = [int(i) for i in bad.nonzero()[0]]
            return ValueError(
                f"{name}: expected finite values, found {t[tuple(index)].item()} at index {index}; nothing was "
                "learned (pass drop_nonfinite=True to faast.FastWeights to drop such rows instead)"
            )
    return ValueError(
        "keys/values: the statistics of this batch overflow float64 (entries too large to square); nothing was learned"
    )


def check_accumulator(
    name: str, acc: torch.Tensor | None, shape: tuple[int, ...], layout: str, keys: torch.Tensor
) -> None:
    """An in-place accumulator: float32/float64, the right shape and device, and safely writable."""
    if acc is None:
        return
    _checks.require_tensor(name, acc, dtypes=_checks.ACCUMULATOR_DTYPES)
    _checks.require_shape(name, acc, shape, layout)
    _checks.require_same_device("keys", keys, **{name: acc})
    # Checked up front so that a failing in-place add cannot leave the other accumulators half-updated.
    if any(stride == 0 and size > 1 for stride, size in zip(acc.stride(), acc.shape, strict=False)):
        raise ValueError(f"{name}: expected a writable accumulator, got one whose elements share memory "
                         "(e.g. made by .expand()); pass a .clone()")  # fmt: skip
    if acc.requires_grad and acc.is_leaf:
        raise ValueError(f"{name}: expected an accumulator that does not require grad (it is updated in place)")


def per_batch(
    name: str, value: object, batch: tuple[int, ...], *, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A finite, non-negative number or tensor broadcast to the batch shape: [*batch] in `dtype` on `device`."""
    if not isinstance(value, torch.Tensor):
        number = _checks.require_nonnegative_number(name, value)
        return torch.full(batch, number, dtype=dtype, device=device)
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name}: expected a real number or real tensor, got dtype {value.dtype}")
    try:
        expanded = value.detach().to(device=device, dtype=dtype).expand(batch)
    except RuntimeError:
        raise ValueError(
            f"{name}: expected a number or a tensor broadcastable to the batch shape {list(batch)}, "
            f"got shape {list(value.shape)}"
        ) from None
    if not bool(torch.isfinite(expanded).all()) or bool((expanded < 0).any()):
        raise ValueError(f"{name}: expected finite values >= 0, got {value}")
    return expanded


def as_count(count: object, batch: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """N per batch element as float64 [prod(batch)]: a number, or a tensor broadcastable to the batch shape."""
    return per_batch("count", count, batch, device=device, dtype=torch.float64).reshape(-1)


def check_solve_options(alpha: object, rtol: object, ridge: object, target_sqnorm: object) -> None:
    """alpha (number >= 0 or 'auto'), rtol, ridge (number >= 0 or 'auto') and their combinations."""
    if alpha != "auto":
        if isinstance(alpha, str):
            raise ValueError(f"alpha: expected a number >= 0 or 'auto', got {alpha!r}")
        _checks.require_nonnegative_number("alpha", alpha)
    if rtol is not None:
        _checks.require_nonnegative_number("rtol", rtol)
        if alpha == "auto":
            raise ValueError("rtol: a fixed rtol contradicts alpha='auto'; pass one or the other")
    if ridge is not None:
        if ridge != "auto":
            if isinstance(ridge, str):
                raise ValueError(f"ridge: expected None, a number >= 0 or 'auto', got {ridge!r}")
            _checks.require_nonnegative_number("ridge", ridge)
        if rtol is not None or alpha == "auto":
            raise ValueError("ridge: ridge replaces the spectral cut; do not combine it with rtol or alpha='auto'")
    if (alpha == "auto" or ridge == "auto") and target_sqnorm is None:
        raise ValueError(
            "target_sqnorm: alpha='auto' and ridge='auto' choose by generalized cross-validation, which needs the "
            "accumulated squared target norms (pass target_sqnorm= to accumulate_gram and here)"
        )
