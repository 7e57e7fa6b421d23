"""Where a FaastModel keeps its named memories (docs/serving.md).

A named memory is everything one stream of learning produced: the middle layers' MemoryBank, the output layer's
state (faast.hf.output.OutputState, or the paper's layer's FastWeights), the target modules' memories, and a
ledger of what was learned. Every memory has the same fixed-size state whatever it learned. One memory at a time is
*bound* to the layers (they read and learn it); the others wait here, registered as submodules so that they move
with the model (`.to(device)`) and are found by faast.distributed and faast.checkpoint. Switching is a swap of
references: no statistics are copied and no solution is recomputed (each memory carries its own caches).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from ..memory import FastWeights
from .bank import MemoryBank
from .output import OutputState

DEFAULT = "default"  # the memory learn() and a new model use
BASE = "__base__"  # in memory_names: the row reads the base model
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # also a file name and a submodule name


def check_name(name: object, what: str = "memory") -> str:
    """`name` when it is a valid memory name: 1-64 letters, digits, '_' or '-', starting with a letter or digit."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"{what}: expected a memory name of 1-64 letters, digits, '_' or '-' starting with a letter or digit, "
            f"got {name!r}"
        )
    return name


def fingerprints(input_ids: torch.Tensor, mask: torch.Tensor, learned: torch.Tensor) -> list[str]:
    """One fingerprint per row of a learned batch: the SHA-1 of its real tokens and of which of its pairs were
    learned, so that padding, batch composition and device do not change it.

    Args:
        input_ids: [B, T] int64; mask: [B, T] bool, the real tokens; learned: [B, T-1] bool, the pairs learned.
    """
    ids, mask, learned = input_ids.cpu(), mask.cpu(), learned.cpu()
    out = []
    for row_ids, row_mask, row_pairs in zip(ids, mask, learned, strict=True):
        digest = hashlib.sha1(row_ids[row_mask].to(torch.int64).numpy().tobytes())
        digest.update(b"|" + row_pairs[row_mask[1:]].numpy().tobytes())
        out.append(digest.hexdigest())
    return out


class Ledger:
    """What one memory learned, window by window: (fingerprint, document number) per learned row, in order.

    forget() refuses rows that are not here (what was never learned cannot be unlearned) and uses their document
    numbers to drop their positions from the output layer's held-out tail. A few dozen bytes per learned window.
    """

    def __init__(self, entries: Iterable[tuple[str, int]] = ()) -> None:
        self.entries: list[tuple[str, int]] = [(str(f), int(d)) for f, d in entries]

    def __len__(self) -> int:
        return len(self.entries)

    def copy(self) -> Ledger:
        return Ledger(self.entries)

    def add(self, prints: list[str], documents: list[int]) -> None:
        self.entries.extend(zip(prints, documents, strict=True))

    def joined(self, later: Ledger) -> Ledger:
        return Ledger([*self.entries, *later.entries])

    def without(self, prints: list[str]) -> tuple[Ledger, set[int]]:
        """(this ledger less one entry per fingerprint in `prints`, the documents of the entries removed); ValueError
        naming how many rows were never learned here, this ledger untouched."""
        wanted = Counter(prints)
        held = Counter(f for f, _ in self.entries)
        missing = sum((wanted - held).values())
        if missing:
            raise ValueError(
                f"inputs: {missing} of the {len(prints)} windows to forget were never learned into this memory (or "
                "were learned with another max_length or labels); nothing was forgotten"
            )
        kept, documents = [], set()
        for entry in reversed(self.entries):  # the most recent copy of a window repeated in the stream goes first
            if wanted[entry[0]] > 0:
                wanted[entry[0]] -= 1
                documents.add(entry[1])
            else:
                kept.append(entry)
        return Ledger(reversed(kept)), documents

    def to_json(self) -> list[list]:
        return [[f, d] for f, d in self.entries]

    @classmethod
    def from_json(cls, data: object, source: object) -> Ledger:
        ok = isinstance(data, list) and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int for e in data
        )
        if not ok:
            raise ValueError(f"{source}: the ledger must be a list of [fingerprint, document] pairs")
        return cls((f, d) for f, d in cast(list, data))  # a list of pairs: checked above


class StoredMemory(nn.Module):
    """One named memory's state, as swapped in and out of a FaastModel's layers.

    Attributes:
        bank: the middle layers' MemoryBank, or None without middle layers.
        output: the output layer's state (OutputState, or the paper's layer's FastWeights), or None.
        module_memories: target module key -> FastWeights (absent: a module whose width is not known yet).
    """

    def __init__(
        self,
        bank: MemoryBank | None,
        output: OutputState | FastWeights | None,
        modules: dict[str, FastWeights | None],
    ) -> None:
        super().__init__()
        self.bank, self.output = bank, output
        self.module_memories = nn.ModuleDict({k: m for k, m in modules.items() if m is not None})
        self.module_keys = list(modules)

    def module_states(self) -> dict[str, FastWeights | None]:
        memories = cast("dict[str, FastWeights]", self.module_memories)  # an nn.ModuleDict of FastWeights
        return {k: memories[k] if k in memories else None for k in self.module_keys}


class MemoryStore(nn.Module):
    """The named memories of a FaastModel: their order, ledgers, which one is bound, and the unbound ones' state.

    Attributes:
        bound: the name of the memory the layers read now.
        stored: nn.ModuleDict name -> StoredMemory of every other memory.
        ledgers: name -> Ledger, for every memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bound = DEFAULT
        self.stored = nn.ModuleDict()
        self.ledgers: dict[str, Ledger] = {DEFAULT: Ledger()}
        self._order = [DEFAULT]

    @property
    def names(self) -> list[str]:
        """Every memory's name, in creation order."""
        return list(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self.ledgers

    def require(self, name: object, what: str = "memory") -> str:
        """`name` when it names a memory; else ValueError listing the memories."""
        if not isinstance(name, str) or name not in self.ledgers:
            raise ValueError(f"{what}: no memory named {name!r}; the memories are {self.names}")
        return name

    def create(self, name: str, state: StoredMemory) -> None:
        """Add memory `name` holding `state` (unbound)."""
        if name in self.ledgers:
            raise ValueError(f"memory: a memory named {name!r} exists already")
        self.stored[name] = state
        self.ledgers[name] = Ledger()
        self._order.append(name)

    def take(self, name: str) -> StoredMemory:
        """Remove and return the state of unbound memory `name` (to bind it)."""
        return cast(StoredMemory, self.stored.pop(name))  # self.stored holds StoredMemory modules

    def put(self, name: str, state: StoredMemory) -> None:
        """Keep the state of memory `name`, just unbound."""
        self.stored[name] = state

    def get(self, name: str) -> StoredMemory:
        """The state of unbound memory `name` (read it; it stays here)."""
        return cast(StoredMemory, self.stored[name])

    def delete(self, name: str) -> None:
        """Remove unbound memory `name` and its ledger."""
        if name == self.bound:
            raise ValueError(f"memory: {name!r} is bound to the layers; bind another first")
        del self.stored[name]
        del self.ledgers[name]
        self._order.remove(name)
