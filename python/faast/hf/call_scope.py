"""What one learn() call forms once and shares between its batches (the head's casts and buffers, an int8 pass's
weights): held while a `CallScope` is entered, freed when its outermost use ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class CallScope:
    """Whether what a holder forms is kept now. The holder (HeadBuffers, Int8Weights) owns one and gives it the
    function that frees what it holds; `kept()` holds until the outermost use ends, then calls it. Outside `kept()`
    (`active` False) the holder forms afresh and holds nothing.

    Args:
        drop: frees what the holder holds (called on leaving the outermost `kept()`).
    """

    def __init__(self, drop: Callable[[], None]) -> None:
        if not callable(drop):
            raise ValueError(f"drop: expected a callable that frees what is held, got {drop!r}")
        self.active = False
        self._drop = drop

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Hold what is formed inside; free it on leaving the outermost block."""
        outer = self.active
        self.active = True
        try:
            yield
        finally:
            self.active = outer
            if not outer:
                self._drop()
