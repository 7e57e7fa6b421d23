"""Learning posted texts or files in pieces, so that a long learn can report its progress (docs/serving.md, "Learning
from a file, with progress").

FaastModel.learn cuts each text into windows of `max_length` tokens that overlap by one token and learns them
`batch_size` windows at a time; a call reports nothing until it returns. The server cuts the same windows itself and
hands learn() one batch of windows per call (`pieces`): a text cut between two pieces goes on in the next one with
`continues=True`, so the memory holds what one call over all the texts gives, bit for bit (the same batches, in the
same order, numbered as the same documents), and forget() of the same texts finds every window in the ledger.
`Meter` turns the tokens learned so far into progress events.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..hf.model import FaastModel

# learn()'s own window length and batch size: forget() cuts the texts it is given with these, so the server's windows
# must be the same for a forget of posted texts to find them.
_LEARN = inspect.signature(FaastModel.learn).parameters
MAX_LENGTH: int = _LEARN["max_length"].default
BATCH_SIZE: int = _LEARN["batch_size"].default


@dataclass
class Piece:
    """One learn() call: token-id lists (a text, or the part of one that falls in this piece), whether the first is
    the rest of the last text of the piece before, and the tokens learn() counts for it (the windows' lengths)."""

    texts: list[list[int]]
    continues: bool
    tokens: int


def pieces(texts: Sequence[Sequence[int]], max_length: int = MAX_LENGTH, batch_size: int = BATCH_SIZE) -> list[Piece]:
    """The texts' token ids cut into pieces of `batch_size` windows each (the last may hold fewer), as
    faast.hf.tokens.overlapping_windows cuts them: learning the pieces one after another, each with its `continues`,
    is one learn() call over `texts`. A text too short for a window (under 2 tokens) stays in its place, so that the
    texts after it keep their document numbers; with no window at all the result is empty."""
    step = max_length - 1
    out: list[Piece] = []
    current: list[list[int]] = []
    continues, windows, tokens = False, 0, 0
    for ids in texts:
        starts = list(range(0, max(len(ids) - 1, 1), step)) if len(ids) >= 2 else []
        if not starts:
            current.append(list(ids))
            continue
        while starts:
            take, starts = starts[: batch_size - windows], starts[batch_size - windows :]
            if windows == 0 and take[0] > 0:
                continues = True  # this piece begins inside a text the piece before cut
            end = min(len(ids), take[-1] + max_length)
            current.append(list(ids[take[0] : end]))
            tokens += sum(min(len(ids), s + max_length) - s for s in take)
            windows += len(take)
            if windows == batch_size:
                out.append(Piece(current, continues, tokens))
                current, continues, windows, tokens = [], False, 0, 0
    if windows:
        out.append(Piece(current, continues, tokens))
    elif current and out:
        out[-1].texts.extend(current)  # windowless texts at the end: they change nothing, as in one call
    return out


class Meter:
    """Progress of a learn of `total` tokens: each `event` is a dict for the client (tokens learned so far, the total,
    tokens/s since the start, seconds left at that rate)."""

    def __init__(self, memory: str, total: int) -> None:
        self.memory, self.total, self.done = memory, total, 0
        self.started = time.perf_counter()

    def event(self, phase: str) -> dict:
        """The progress event of `phase`: 'learning' (after each piece), 'solving' or 'saving' (then the learning is
        done and seconds_left is None: a solve's time is not known in advance)."""
        elapsed = time.perf_counter() - self.started
        rate = self.done / elapsed if elapsed > 0 and self.done else None
        left = (self.total - self.done) / rate if rate and phase == "learning" else None
        return {
            "object": "memory.progress",
            "memory": self.memory,
            "phase": phase,
            "tokens": self.done,
            "total_tokens": self.total,
            "tokens_per_second": None if rate is None else round(rate, 1),
            "seconds_left": None if left is None else round(left, 2),
        }
