"""Progress of long work: a tqdm bar on stderr with tokens/s and the time left, for learn() and read_stream() (and the
experiments, which learn through them), and a line for a solve that takes over a second.

`progress=None` (the default of learn and read_stream) shows it when stderr is a terminal; True always, False never.
Nothing is ever written to stdout, so a captured stdout holds only what the program printed. A bar opens on the
second batch: an input of one batch shows none.

The time left needs a total. A list of token-id lists (or tensors, or tokenised mappings) has an exact one; a list of
texts has its characters, and the total in tokens is estimated from the tokens per character read so far; a sized
dataset has its rows. An unsized iterable shows the rate and the tokens so far, with no time left.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["Bar", "Metered", "enabled", "say_slow"]

_log = logging.getLogger("faast.hf")
# A solve that takes longer than this says how long it took (with progress on).
SLOW_SOLVE_S = 1.0


def enabled(progress: bool | None) -> bool:
    """Whether to show progress for `progress` (None: when stderr is a terminal); ValueError for anything else."""
    if progress is None:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    if not isinstance(progress, bool):
        raise ValueError(f"progress: expected True, False or None (when stderr is a terminal), got {progress!r}")
    return progress


def _work(item: object) -> int | None:
    """How much of an input one item is: characters of a text, tokens of a token-id list, tensor or tokenised
    mapping; None when it cannot be told without reading it."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, torch.Tensor):
        return item.numel()
    if isinstance(item, Mapping):
        ids = item.get("input_ids")
        return None if ids is None else _work(ids)
    if isinstance(item, list | tuple) and all(isinstance(t, int) for t in item):
        return len(item)
    ids = getattr(item, "ids", None)  # LabelledIds
    return len(ids) if isinstance(ids, list) else None


class Metered:
    """An input's items, counting how much of it has been handed on: `fraction()` of the whole when its size is known
    (module docstring), else None."""

    def __init__(self, items: Iterable) -> None:
        self.items = items
        self.total: int | None = None
        self.by_work = False
        self.done = 0
        if isinstance(items, list | tuple):
            works = [_work(x) for x in items]
            self.by_work = all(w is not None for w in works)
            self.total = sum(w for w in works if w is not None) if self.by_work else len(items)
        elif hasattr(items, "__len__"):
            self.total = len(cast(Sized, items))

    def __iter__(self) -> Iterator:
        for item in self.items:
            self.done += (_work(item) or 0) if self.by_work else 1
            yield item

    def fraction(self) -> float | None:
        """The share of the input handed on so far, None when its size is unknown (or zero)."""
        return None if not self.total else min(1.0, self.done / self.total)


class Bar:
    """A tqdm bar in tokens (stderr), opened on the second `update` when `show`, with tokens/s and, given the share of
    the input done, the total it implies and the time left."""

    def __init__(self, show: bool, desc: str) -> None:
        self.show, self.desc = show, desc
        self.tokens, self.updates = 0, 0
        self._bar: tqdm[Any] | None = None

    def update(self, tokens: int, fraction: float | None = None) -> None:
        """Add `tokens` done; fraction: the share of the input done so far (None: unknown)."""
        self.tokens += tokens
        self.updates += 1
        if not self.show or self.updates < 2:
            return
        total = max(self.tokens, round(self.tokens / fraction)) if fraction else None
        if self._bar is None:
            self._bar = _open(self.desc, self.tokens - tokens, total)
            if self._bar is None:
                self.show = False
                return
        self._bar.total = total
        self._bar.update(tokens)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _open(desc: str, initial: int, total: int | None) -> tqdm[Any] | None:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        _log.info("faast: install tqdm for a progress bar")
        return None
    return tqdm(desc=desc, unit="tok", unit_scale=True, initial=initial, total=total, file=sys.stderr,
                dynamic_ncols=True)  # fmt: skip


def say_slow(what: str, seconds: float, show: bool) -> None:
    """Write `faast: <what> took <seconds> s` to stderr when it took over SLOW_SOLVE_S and `show`."""
    if show and seconds > SLOW_SOLVE_S:
        print(f"faast: {what} took {seconds:.1f} s", file=sys.stderr, flush=True)
