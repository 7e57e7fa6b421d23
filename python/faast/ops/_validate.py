"""Argument validation for faast: the ops, faast.FastWeights, the checkpoints and the classifiers.

Every check raises before any state is touched, and every message names the argument, what was expected and what
was received, so that a user can fix the call without reading our source. Order matters: types, shapes and devices
are checked first, and only then are values scanned (negative scores, NaN/Inf), so a value scan never runs on a tensor
the call is going to reject anyway (e.g. on another device).

`memory_rows` is the door of FastWeights.update / forget: it checks one batch of rows once and hands back the
flattened rows that the ops then take unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Accumulators hold sums of squares over many rows: fp16 overflows (an outlier of 3000 squared is above 65504) and
# bf16 keeps 8 bits, so only float32 and float64 are accepted for S and T.
ACCUMULATOR_DTYPES = (torch.float32, torch.float64)

# ---------------------------------------------------------------------------------------------------- single values


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


def require_same_device(
    reference_name: str, reference: torch.Tensor | torch.device, **others: torch.Tensor | None
) -> None:
    """Every tensor of `others` on the device of `reference` (a tensor, or the device itself)."""
    device = reference if isinstance(reference, torch.device) else reference.device
    for name, t in others.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected device {device} (the device of {reference_name}), got {t.device}")


def all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether no entry of the given float tensors (None skipped) is NaN or ±Inf, with one host synchronisation.

    One min/max reduction per tensor, not an isfinite mask: NaN propagates through both and an infinity becomes one
    of them, so both are finite exactly when every entry is. It reads each tensor once without a mask temporary
    (on a 2-core CPU, 0.4 ms against 8 ms for isfinite(t).all() on a [4096, 768] float32 batch).
    """
    ends = [torch.stack(torch.aminmax(t)) for t in tensors if t is not None and t.numel()]
    return not ends or bool(torch.isfinite(torch.cat([e.to(torch.float64) for e in ends])).all())


def first_nonfinite(t: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first NaN/Inf entry of `t`, or None. Only called on the error path."""
    if all_finite(t):
        return None
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


def require_fraction(name: str, value: object) -> float:
    """A number in (0, 1], e.g. a discount factor."""
    value = require_nonnegative_number(name, value, allow_zero=False)
    if value > 1:
        raise ValueError(f"{name}: expected a number in (0, 1], got {value}")
    return value


def require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return value


# ---------------------------------------------------------------------------------------------------- rows


def check_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> None:
    """Types, shapes and devices of one batch of rows: keys [*, N, dk], values [*, N, dv], scores/mask [*, N]."""
    require_tensor("keys", keys)
    require_ndim("keys", keys, 2, "[*, N, dim_key]")
    require_tensor("values", values)
    require_ndim("values", values, 2, "[*, N, dim_value]")
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
        require_tensor("scores", scores)
        require_shape("scores", scores, rows, "[*, N] (one score per key)")
    if mask is not None:
        require_tensor("mask", mask, dtypes=(torch.bool,))
        require_shape("mask", mask, rows, "[*, N] (one flag per key)")
    require_same_device("keys", keys, values=values, scores=scores, mask=mask)


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


def overflow_error() -> ValueError:
    """The error for finite rows whose statistics are not finite."""
    return ValueError(
        "keys/values: the statistics of this batch overflow float64 (entries too large to square); nothing was learned"
    )


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
    return overflow_error()


def require_finite_statistics(*statistics: torch.Tensor) -> None:
    """Raise the overflow error unless every statistic is finite (their rows were checked finite already)."""
    if not all_finite(*statistics):
        raise overflow_error()


# ------------------------------------------------------------------------------------------------- the memory's door


class Rows(NamedTuple):
    """One checked batch of a FastWeights memory, its row dims flattened to one."""

    keys: torch.Tensor  # [*batch_shape, n, dk]
    values: torch.Tensor  # [*batch_shape, n, dv]
    scores: torch.Tensor | None  # [*batch_shape, n]
    mask: torch.Tensor | None  # [*batch_shape, n] bool, the rows to learn; None: all of them
    dropped: torch.Tensor  # int64 [*batch_shape]: rows left out as non-finite (drop_nonfinite)
    # int64 [*batch_shape] when checked on the device: 0 if the memory's batch is clean, else REJECTED's code of its
    # first bad input (its rows are then masked out). None when checked eagerly (a bad batch raised instead).
    rejected: torch.Tensor | None


# Codes of the deferred checks, by the argument they name.
REJECTED = {1: "keys", 2: "values", 3: "scores", 4: "scores"}
_NEGATIVE_SCORE = 4


def _bad_row_flags(keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Per input (keys, values, scores), which rows [*batch, n] hold a NaN/Inf (None for absent scores)."""
    return [
        None if t is None else (~torch.isfinite(t)).any(-1) if t.dim() > keys.dim() - 1 else ~torch.isfinite(t)
        for t in (keys, values, scores)
    ]


def memory_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    batch_shape: tuple[int, ...],
    dim_key: int,
    dim_value: int,
    device: torch.device,
    drop_nonfinite: bool = False,
    eager: bool = True,
    max_abs: float | None = None,
    same_mask: bool = False,
) -> Rows:
    """Check one batch of rows for a FastWeights memory once, and flatten its row dims.

    keys [*batch_shape, ..., dk], values [*batch_shape, ..., dv], scores / mask [*batch_shape, ...] (every dim after
    the batch dims indexes rows). Types, dtypes, shapes, devices and empty feature dims always raise TypeError /
    ValueError naming the argument. Values (NaN/Inf in a learned row, negative scores) raise here when `eager`; else
    they are checked on the device without a host synchronisation and reported in `Rows.rejected`.

    drop_nonfinite: rows with a NaN/Inf are left out of the mask and counted instead. max_abs: also reject learned
    entries above it in magnitude. same_mask: require the same mask for every memory of the batch.
    """
    original = (keys, values, scores, mask)
    check_rows(keys, values, scores, mask)
    require_same_device("the memory", device, keys=keys)
    batch, dk, dv = batch_shape, dim_key, dim_value
    layout = "[" + ", ".join([*map(str, batch), "...", "{}"]) + "]"
    if keys.shape[-1] != dk or keys.dim() < len(batch) + 2 or tuple(keys.shape[: len(batch)]) != batch:
        raise ValueError(
            f"keys: expected shape {layout.format(dk)} (batch_shape, rows, dim_key), got {list(keys.shape)}"
        )
    if values.shape[-1] != dv:
        raise ValueError(
            f"values: expected shape {layout.format(dv)} (batch_shape, rows, dim_value), got {list(values.shape)}"
        )
    n = math.prod(keys.shape[len(batch) : -1])
    keys, values = keys.reshape(*batch, n, dk), values.reshape(*batch, n, dv)
    scores = None if scores is None else scores.reshape(*batch, n)
    mask = None if mask is None else mask.reshape(*batch, n)

    dropped = torch.zeros(batch, dtype=torch.int64, device=device)
    if eager and all_finite(keys, values, scores):
        # The common case, settled by one cheap pass: no row to drop, and no error to explain.
        check_scores(scores, mask)
        return _eager_tail(keys, values, scores, mask, dropped, n=n, max_abs=max_abs, same_mask=same_mask)
    # One scan for NaN/Inf serves all three uses: dropping rows, the deferred codes and the eager error.
    flags = _bad_row_flags(keys, values, scores)
    key_bad, value_bad = cast(torch.Tensor, flags[0]), cast(torch.Tensor, flags[1])  # only scores' may be None
    bad = key_bad | value_bad if flags[2] is None else key_bad | value_bad | flags[2]
    if drop_nonfinite:
        considered = torch.ones_like(bad) if mask is None else mask
        dropped = (considered & bad).sum(-1)
        mask = considered & ~bad
    if not eager:
        mask, rejected = _deferred(keys, scores, mask, flags)
        return Rows(keys, values, scores, mask, dropped, rejected)
    check_scores(scores, mask)
    if not drop_nonfinite and bool((bad if mask is None else bad & mask).any()):
        # Explained against the caller's tensors (their indices) and the mask actually used.
        used = None if mask is None else mask.reshape(original[0].shape[:-1])
        raise explain_nonfinite(*original[:3], used)
    return _eager_tail(keys, values, scores, mask, dropped, n=n, max_abs=max_abs, same_mask=same_mask)


def _eager_tail(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    dropped: torch.Tensor,
    *,
    n: int,
    max_abs: float | None,
    same_mask: bool,
) -> Rows:
    """memory_rows' last eager checks, once the learned rows are known finite: blend's mask and magnitude bounds."""
    if same_mask and mask is not None:
        flat = mask.reshape(-1, n)
        if not bool((flat == flat[:1]).all()):
            raise ValueError("mask: mode='blend' needs the same mask for every memory in batch_shape")
    if max_abs is not None:
        for name, t in (("keys", keys), ("values", values), ("scores", scores)):
            if t is None or t.numel() == 0:
                continue
            learned = None if mask is None else mask.unsqueeze(-1) if t.dim() > mask.dim() else mask
            size = t.abs() if learned is None else torch.where(learned, t.abs(), 0)
            if float(size.max()) > max_abs:
                raise ValueError(
                    f"{name}: entries above {max_abs:g} in magnitude would overflow the float64 statistics"
                )
    return Rows(keys, values, scores, mask, dropped, None)


def _deferred(
    keys: torch.Tensor, scores: torch.Tensor | None, mask: torch.Tensor | None, flags: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value checks on the device, never read back to the host: (the rows to learn [*batch, n], the code of
    each memory [*batch]). A memory whose batch holds a bad learned row gets a nonzero code and learns none of it."""
    learned = torch.ones(keys.shape[:-1], dtype=torch.bool, device=keys.device) if mask is None else mask
    code = torch.zeros(keys.shape[:-2], dtype=torch.int64, device=keys.device)
    for number, bad in enumerate(flags, start=1):
        if bad is not None:
            code = torch.where((code == 0) & (bad & learned).any(-1), number, code)
    if scores is not None:
        code = torch.where((code == 0) & ((scores < 0) & learned).any(-1), _NEGATIVE_SCORE, code)
    return learned & (code == 0).unsqueeze(-1), code


def rejected_error(rejected: torch.Tensor, batch_shape: tuple[int, ...]) -> ValueError | None:
    """The error of the first update a memory's deferred checks rejected, or None. rejected: int64
    [*batch_shape, 2], per memory the code of its first rejected input (REJECTED) and that update's number."""
    flat_rejected = rejected.reshape(-1, 2)
    if flat_rejected.numel() == 0 or not bool((flat_rejected[:, 0] != 0).any()):
        return None
    flat = int((flat_rejected[:, 0] != 0).nonzero()[0, 0])
    code, number = (int(x) for x in flat_rejected[flat])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), batch_shape)]
    where = f" (memory {index})" if batch_shape else ""
    expected = "non-negative weights" if code == _NEGATIVE_SCORE else "finite values"
    found = "a negative score" if code == _NEGATIVE_SCORE else "NaN/Inf"
    return ValueError(
        f"{REJECTED[code]}: expected {expected}, found {found} in a learned row of update #{number}{where}; "
        "that batch was not learned by this memory, every other batch was (checks are deferred to the next solve "
        "on CUDA; FastWeights(eager_checks=True) raises in update, drop_nonfinite=True drops such rows)"
    )


def memory_prior(
    prior: object, *, dim_key: int, dim_value: int, batch_shape: tuple[int, ...], device: torch.device | str | None
) -> torch.Tensor | None:
    """FastWeights' prior argument as float64 [*batch_shape, dk, dv] on `device` (None stays None): a tensor
    [dk, dv] or [*batch_shape, dk, dv] (finite), or 'identity' (dk == dv)."""
    dk, dv, batch = dim_key, dim_value, batch_shape
    if prior is None:
        return None
    if isinstance(prior, str):
        if prior != "identity":
            raise ValueError(f"prior: expected a tensor [dim_key, dim_value], 'identity' or None, got {prior!r}")
        if dk != dv:
            raise ValueError(f"prior: 'identity' needs dim_key == dim_value, got {dk} and {dv}")
        return torch.eye(dk, dtype=torch.float64, device=device).expand(*batch, dk, dk).clone()
    prior = require_tensor("prior", prior)
    if tuple(prior.shape) not in ((dk, dv), (*batch, dk, dv)):
        raise ValueError(
            f"prior: expected shape [dim_key, dim_value] = {[dk, dv]} or {[*batch, dk, dv]}, got {list(prior.shape)}"
        )
    require_finite("prior", prior)
    return prior.detach().to(device=device, dtype=torch.float64).expand(*batch, dk, dv).clone()


# ---------------------------------------------------------------------------------------------------- op arguments


def check_accumulator(
    name: str, acc: torch.Tensor | None, shape: tuple[int, ...], layout: str, keys: torch.Tensor
) -> None:
    """An in-place accumulator: float32/float64, the right shape and device, and safely writable."""
    if acc is None:
        return
    require_tensor(name, acc, dtypes=ACCUMULATOR_DTYPES)
    require_shape(name, acc, shape, layout)
    require_same_device("keys", keys, **{name: acc})
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
        number = require_nonnegative_number(name, value)
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
        require_nonnegative_number("alpha", alpha)
    if rtol is not None:
        require_nonnegative_number("rtol", rtol)
        if alpha == "auto":
            raise ValueError("rtol: a fixed rtol contradicts alpha='auto'; pass one or the other")
    if ridge is not None:
        if ridge != "auto":
            if isinstance(ridge, str):
                raise ValueError(f"ridge: expected None, a number >= 0 or 'auto', got {ridge!r}")
            require_nonnegative_number("ridge", ridge)
        if rtol is not None or alpha == "auto":
            raise ValueError("ridge: ridge replaces the spectral cut; do not combine it with rtol or alpha='auto'")
    if (alpha == "auto" or ridge == "auto") and target_sqnorm is None:
        raise ValueError(
            "target_sqnorm: alpha='auto' and ridge='auto' choose by generalized cross-validation, which needs the "
            "accumulated squared target norms (pass target_sqnorm= to accumulate_gram and here)"
        )
