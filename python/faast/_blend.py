"""FastWeights(mode='blend'): the authors' capped memory with blended chunk solutions, for reproducing the paper.

Their code (docs/authors.md §2.3–2.5) keeps at most `max_memory_size` raw rows and solves them jointly; at the start of
each learn call, while the buffer holds at least that many rows, the oldest `reader_update_size` rows are solved on
their own (eps = u^-alpha) and folded into a running W0 with r = u / (γ·N0 + u), N0 ← γ·N0 + u. A query blends the
window's solution with W0 by r = N1 / (γ·N0 + N1).

Here the window is held as per-chunk statistics in a ring of slots instead of raw rows, so the result is the same up
to float rounding while memory stays O(d^2) (slots·(d² + d·dv) doubles). One difference: the authors fold only
between learn calls, so one call can overfill their buffer without bound; here a call is split into sub-calls of at
most one chunk, each preceded by the fold check. The two agree whenever calls hold at most `blend_chunk` rows (their
LM batches hold 8·1023 ≤ 8192).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import ops
from .ops import _validate
from .ops.solve import SolveInfo

if TYPE_CHECKING:  # type-only: memory.py imports this module at run time, never the reverse
    from .memory import FastWeights

# Rows whose entries exceed this could overflow float64 when squared and summed over ~1e8 rows. One call may fold and
# append several chunks and must not stop half-way, so FastWeights' door rejects such rows up front (max_abs).
MAX_ABS = 1e145


def capacity(window: int, chunk: int) -> int:
    # The window holds < window + chunk rows: at most ceil(window / chunk) full chunks plus one open chunk.
    return math.ceil(window / chunk) + 2


def register_state(fw: FastWeights, device: object) -> None:
    slots = capacity(fw.blend_window, fw.blend_chunk)
    dk, dv, batch = fw.dim_key, fw.dim_value, fw.batch_shape
    f64 = {"dtype": torch.float64, "device": device}
    fw.register_buffer("blend_gram", torch.zeros((slots, *batch, dk, dk), **f64))
    fw.register_buffer("blend_cross", torch.zeros((slots, *batch, dk, dv), **f64))
    fw.register_buffer("blend_sqnorm", torch.zeros((slots, *batch), **f64))
    fw.register_buffer("blend_rows", torch.zeros((slots,), **f64))
    # (index of the oldest slot, number of slots in use)
    fw.register_buffer("blend_cursor", torch.zeros((2,), dtype=torch.int64, device=device))
    fw.register_buffer("folded_weights", torch.zeros((*batch, dk, dv), **f64))
    fw.register_buffer("folded_count", torch.zeros((), **f64))
    reset(fw)


def reset(fw: FastWeights) -> None:
    for name in ("blend_gram", "blend_cross", "blend_sqnorm", "blend_rows", "blend_cursor"):
        getattr(fw, name).zero_()
    if fw.prior is None:
        fw.folded_weights.zero_()
    else:
        fw.folded_weights.copy_(fw.prior)
    fw.folded_count.fill_(fw.prior_count)


def _compact(rows: _validate.Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Drop masked rows. The chunks count rows, so the door has checked the mask is the same for every memory."""
    if rows.mask is None:
        return rows.keys, rows.values, rows.scores
    keep = rows.mask.reshape(-1, rows.mask.shape[-1])[0].nonzero().squeeze(-1)
    return (
        rows.keys.index_select(-2, keep),
        rows.values.index_select(-2, keep),
        None if rows.scores is None else rows.scores.index_select(-1, keep),
    )


def _cursor(fw: FastWeights) -> tuple[int, int]:
    head, used = fw.blend_cursor.tolist()
    return head, used


def _open_slot(fw: FastWeights) -> int:
    slots = fw.blend_rows.shape[0]
    head, used = _cursor(fw)
    if used:
        last = (head + used - 1) % slots
        if float(fw.blend_rows[last]) < fw.blend_chunk:
            return last
    if used == slots:
        raise RuntimeError("faast internal error: the blend window outgrew its slots")
    new = (head + used) % slots  # vacated slots are zeroed by _fold_oldest and reset
    fw.blend_cursor[1] = used + 1
    return new


def _window_from_slots(fw: FastWeights) -> None:
    """Recompute the window statistics as the sum of the slots in use (exact after a fold, no drift)."""
    slots = fw.blend_rows.shape[0]
    head, used = _cursor(fw)
    occupied = torch.tensor([(head + i) % slots for i in range(used)], dtype=torch.long, device=fw.device)
    fw.gram.copy_(fw.blend_gram.index_select(0, occupied).sum(0))
    fw.cross.copy_(fw.blend_cross.index_select(0, occupied).sum(0))
    fw.target_sqnorm.copy_(fw.blend_sqnorm.index_select(0, occupied).sum(0))
    fw.count.fill_(float(fw.blend_rows.index_select(0, occupied).sum()))


def _fold_oldest(fw: FastWeights) -> None:
    head, used = _cursor(fw)
    rows = fw.blend_rows[head]
    counts = rows.expand(fw.batch_shape)
    options = {"alpha": fw.alpha, "rtol": fw.rtol, "ridge": fw.ridge}
    chunk_weights, _ = fw._solve_statistics(
        fw.blend_gram[head], fw.blend_cross[head], counts, fw.blend_sqnorm[head], options
    )
    previous = fw.blend_discount * fw.folded_count
    share = rows / (previous + rows)
    fw.folded_weights.lerp_(chunk_weights, share)
    fw.folded_count.copy_(previous + rows)
    for name in ("blend_gram", "blend_cross", "blend_sqnorm", "blend_rows"):
        getattr(fw, name)[head].zero_()
    fw.blend_cursor[0] = (head + 1) % fw.blend_rows.shape[0]
    fw.blend_cursor[1] = used - 1
    _window_from_slots(fw)


def update(fw: FastWeights, rows: _validate.Rows) -> None:
    """Learn rows checked by FastWeights' door (finite, below MAX_ABS, one mask for every memory)."""
    keys, values, scores = _compact(rows)
    n, chunk = keys.shape[-2], fw.blend_chunk
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        while float(fw.blend_rows.sum()) >= fw.blend_window:
            _fold_oldest(fw)
        pos = start
        while pos < end:
            slot = _open_slot(fw)
            stop = min(end, pos + chunk - int(fw.blend_rows[slot]))
            part = (slice(None),) * len(fw.batch_shape) + (slice(pos, stop),)
            d_gram, d_cross, d_sqnorm = ops._statistics(
                keys[part], values[part], None if scores is None else scores[part], None,
                weighted_least_squares=fw.weighted_least_squares, compute_dtype=fw.compute_dtype,
            )  # fmt: skip
            # Products of three entries below MAX_ABS can still overflow: raise before this chunk is added.
            _validate.require_finite_statistics(d_gram, d_cross, d_sqnorm)
            for window, per_slot, delta in (
                (fw.gram, fw.blend_gram, d_gram),
                (fw.cross, fw.blend_cross, d_cross),
                (fw.target_sqnorm, fw.blend_sqnorm, d_sqnorm),
            ):
                per_slot[slot] += delta
                window += delta
            fw.blend_rows[slot] += stop - pos
            fw.count += stop - pos
            pos = stop


def weights(fw: FastWeights, options: dict) -> tuple[torch.Tensor, SolveInfo]:
    window, info = fw._solve_statistics(fw.gram, fw.cross, fw.count, fw.target_sqnorm, options)
    rows = fw.blend_rows.sum()
    previous = fw.blend_discount * fw.folded_count
    if float(rows) == 0:  # nothing in the window: W0 alone (and no 0/0 when nothing was folded either)
        return fw.folded_weights.clone(), info
    # lerp is exact at its ends, so with no folded history (previous = 0) this is the window's solution bit for bit.
    return torch.lerp(fw.folded_weights, window, rows / (previous + rows)), info
