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
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .ops import _validate
from .ops.solve import SolveInfo
from .statistics import Float64Module

# Rows whose entries exceed this could overflow float64 when squared and summed over ~1e8 rows. One call may fold and
# append several chunks and must not stop half-way, so FastWeights' door rejects such rows up front (max_abs).
MAX_ABS = 1e145

# state_dict names of files written before the window became the submodule `blend` (faast <= the flat layout).
LEGACY_NAMES = {
    "blend_gram": "blend.gram",
    "blend_cross": "blend.cross",
    "blend_sqnorm": "blend.sqnorm",
    "blend_rows": "blend.rows",
    "blend_cursor": "blend.cursor",
    "folded_weights": "blend.folded_weights",
    "folded_count": "blend.folded_count",
}
# Buffers of the window holding counts or sums of squares (a saved state with a negative entry is refused).
NONNEGATIVE = ("sqnorm", "rows", "folded_count")

# (gram, cross, count, target_sqnorm, options) -> (float64 W [*batch, dk, dv], SolveInfo): FastWeights' solver.
SolveFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, SolveInfo]]
# (keys, values, scores) -> float64 (dS, dT, dyy), raising if they overflow: FastWeights' statistics of rows.
StatisticsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


def check_options(window: int, chunk: int, discount: float, drop_nonfinite: bool) -> None:
    """Raise ValueError, naming the argument, when FastWeights(mode='blend') is given options it cannot honour."""
    if window < chunk:
        raise ValueError(f"blend_window: expected >= blend_chunk ({chunk}), got {window}")
    if discount != 1.0:
        raise ValueError("discount: mode='blend' discounts through blend_discount; leave discount at 1.0")
    if drop_nonfinite:
        raise ValueError("drop_nonfinite: not supported with mode='blend' (its chunks count rows exactly)")


class WindowSums(NamedTuple):
    """The statistics of the rows in the window (what FastWeights holds in gram, cross, count, target_sqnorm)."""

    gram: torch.Tensor  # [*batch, dk, dk] float64
    cross: torch.Tensor  # [*batch, dk, dv] float64
    # Not `count`: a NamedTuple field of that name would shadow tuple.count.
    row_count: torch.Tensor  # [*batch] float64
    target_sqnorm: torch.Tensor  # [*batch] float64


def capacity(window: int, chunk: int) -> int:
    # The window holds < window + chunk rows: at most ceil(window / chunk) full chunks plus one open chunk.
    return math.ceil(window / chunk) + 2


class BlendWindow(Float64Module):
    """The per-chunk statistics of the window and the folded W0 of FastWeights(mode='blend').

    Buffers (float64 unless noted): `gram` [slots, *batch, dk, dk], `cross` [slots, *batch, dk, dv], `sqnorm`
    [slots, *batch], `rows` [slots] (rows per chunk), `cursor` int64 [2] (oldest slot, slots in use),
    `folded_weights` W0 [*batch, dk, dv] and `folded_count` N0 []. It never touches the memory: `update` is handed
    the memory's window sums, its solver and its statistics function, and returns the new window sums.
    """

    # The buffers registered in __init__ (nn.Module resolves them through __getattr__, which types them loosely).
    gram: torch.Tensor
    cross: torch.Tensor
    sqnorm: torch.Tensor
    rows: torch.Tensor
    cursor: torch.Tensor
    folded_weights: torch.Tensor
    folded_count: torch.Tensor

    def __init__(
        self,
        dim_key: int,
        dim_value: int,
        batch_shape: tuple[int, ...],
        *,
        window: int,
        chunk: int,
        discount: float,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.window, self.chunk, self.discount, self.batch_shape = window, chunk, discount, batch_shape
        slots = capacity(window, chunk)
        dk, dv, batch = dim_key, dim_value, batch_shape
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
        self.register_buffer("gram", torch.zeros((slots, *batch, dk, dk), **f64))
        self.register_buffer("cross", torch.zeros((slots, *batch, dk, dv), **f64))
        self.register_buffer("sqnorm", torch.zeros((slots, *batch), **f64))
        self.register_buffer("rows", torch.zeros((slots,), **f64))
        self.register_buffer("cursor", torch.zeros((2,), dtype=torch.int64, device=device))
        self.register_buffer("folded_weights", torch.zeros((*batch, dk, dv), **f64))
        self.register_buffer("folded_count", torch.zeros((), **f64))

    @property
    def slots(self) -> int:
        return self.rows.shape[0]

    @torch.no_grad()
    def reset(self, prior: torch.Tensor | None, prior_count: float) -> None:
        """Empty the window; W0 = prior (zeros without one) with pseudo-count N0 = prior_count."""
        for t in (self.gram, self.cross, self.sqnorm, self.rows, self.cursor):
            t.zero_()
        if prior is None:
            self.folded_weights.zero_()
        else:
            self.folded_weights.copy_(prior)
        self.folded_count.fill_(prior_count)

    def _cursor(self) -> tuple[int, int]:
        head, used = self.cursor.tolist()
        return head, used

    def _open_slot(self) -> int:
        head, used = self._cursor()
        if used:
            last = (head + used - 1) % self.slots
            if float(self.rows[last]) < self.chunk:
                return last
        if used == self.slots:
            raise RuntimeError("faast internal error: the blend window outgrew its slots")
        new = (head + used) % self.slots  # vacated slots are zeroed by _fold_oldest and reset
        self.cursor[1] = used + 1
        return new

    def _window_from_slots(self, sums: WindowSums) -> None:
        """Recompute the window sums as the sum of the slots in use (exact after a fold, no drift)."""
        head, used = self._cursor()
        occupied = torch.tensor([(head + i) % self.slots for i in range(used)], dtype=torch.long,
                                device=self.rows.device)  # fmt: skip
        sums.gram.copy_(self.gram.index_select(0, occupied).sum(0))
        sums.cross.copy_(self.cross.index_select(0, occupied).sum(0))
        sums.target_sqnorm.copy_(self.sqnorm.index_select(0, occupied).sum(0))
        sums.row_count.fill_(float(self.rows.index_select(0, occupied).sum()))

    def _fold_oldest(self, sums: WindowSums, solve: SolveFn, options: dict) -> None:
        head, used = self._cursor()
        rows = self.rows[head]
        counts = rows.expand(self.batch_shape)
        chunk_weights, _ = solve(self.gram[head], self.cross[head], counts, self.sqnorm[head], options)
        previous = self.discount * self.folded_count
        share = rows / (previous + rows)
        self.folded_weights.lerp_(chunk_weights, share)
        self.folded_count.copy_(previous + rows)
        for t in (self.gram, self.cross, self.sqnorm, self.rows):
            t[head].zero_()
        self.cursor[0] = (head + 1) % self.slots
        self.cursor[1] = used - 1
        self._window_from_slots(sums)

    @torch.no_grad()
    def update(
        self, rows: _validate.Rows, window: WindowSums, *, statistics: StatisticsFn, solve: SolveFn, options: dict
    ) -> WindowSums:
        """Learn rows checked by FastWeights' door (finite, below MAX_ABS, one mask for every memory).

        window: the memory's current window sums (left untouched). statistics: the memory's float64 statistics of
        rows; solve: its solver, with `options` (alpha, rtol, ridge) for the chunks folded on the way. Returns the
        new window sums, for the memory to copy into its own buffers.
        """
        sums = WindowSums(*(t.clone() for t in window))
        keys, values, scores = _compact(rows)
        n, chunk = keys.shape[-2], self.chunk
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            while float(self.rows.sum()) >= self.window:
                self._fold_oldest(sums, solve, options)
            pos = start
            while pos < end:
                slot = self._open_slot()
                stop = min(end, pos + chunk - int(self.rows[slot]))
                part = (slice(None),) * len(self.batch_shape) + (slice(pos, stop),)
                # Products of three entries below MAX_ABS can still overflow: statistics raises before this chunk
                # is added.
                d_gram, d_cross, d_sqnorm = statistics(
                    keys[part], values[part], None if scores is None else scores[part]
                )
                for total, per_slot, delta in (
                    (sums.gram, self.gram, d_gram),
                    (sums.cross, self.cross, d_cross),
                    (sums.target_sqnorm, self.sqnorm, d_sqnorm),
                ):
                    per_slot[slot] += delta
                    total += delta
                self.rows[slot] += stop - pos
                sums.row_count.add_(stop - pos)
                pos = stop
        return sums

    def blend(self, window_weights: torch.Tensor) -> torch.Tensor:
        """The memory's W: the window's solution W1 [*batch, dk, dv] float64 blended with W0 by
        r = N1 / (γ·N0 + N1); W0 alone when the window is empty."""
        rows = self.rows.sum()
        previous = self.discount * self.folded_count
        if float(rows) == 0:  # nothing in the window: W0 alone (and no 0/0 when nothing was folded either)
            return self.folded_weights.clone()
        # lerp is exact at its ends: with no folded history (previous = 0) this is the window's solution bit for bit.
        return torch.lerp(self.folded_weights, window_weights, rows / (previous + rows))


def check_cursor(cursor: torch.Tensor, slots: int, source: object, name: str = "blend.cursor") -> None:
    """Raise ValueError naming `source` unless a saved cursor (oldest slot, slots in use) fits `slots` slots."""
    head, used = cursor.tolist()
    if not (0 <= head < slots and 0 <= used <= slots):
        raise ValueError(f"{source}: tensor {name} {[head, used]} is out of range; refusing to load it")


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
