"""Named memories of a FaastModel: select, delete, forget and merge them (docs/serving.md).

`NamedMemories` is a part of FaastModel (it inherits it): the methods here act on the model's layers, its
MemoryStore (faast/hf/memory_store.py) and its learning core, and use the layers' public state swapping
(`use_bank`, `swap_state`, `swap_states`). Every memory has its own fixed-size statistics and caches; binding one to
the layers swaps references, so `set_memory` copies and solves nothing.

What forget and merge do to the output layer's step tuning (docs/serving.md):
- forget subtracts the statistics learning the texts added, removes them from the memory's ledger, and drops their
  positions from the held-out tail. The step is then tuned on what remains of the tail, or, where too little
  remains, takes the default rule (a step restored from a file is dropped too: it was chosen with the forgotten text).
- merge sums the sources' statistics and joins their tails in the order given, which is what one memory that learned
  the sources' streams one after the other would hold; the merged memory tunes its own step on that tail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .learning import LearnStats
from .memory_store import BASE, StoredMemory, check_name, fingerprints
from .output import ResidualOutputLayer
from .output_state import OutputState

_SCRATCH = "__scratch__"  # the memory forget() learns the texts into, to subtract them


class NamedMemories:
    """FaastModel's named memories. Needs the model's memory_store, memory_bank, memory_layers,
    output_memory_layer, module_memories, learner, learned_state and _learn_core."""

    # ------------------------------------------------------------------ selecting

    @property
    def memories(self) -> list[str]:
        """The names of every memory, in creation order ('default' first unless deleted)."""
        return self.memory_store.names

    @property
    def active_memory(self) -> str:
        """The memory plain forward and generate read (set_memory selects it)."""
        return self.memory_store.bound

    def set_memory(self, name: str) -> NamedMemories:
        """Read memory `name` in plain forward and generate from now on. Nothing is copied or solved: each memory
        keeps its solution. Unknown names raise ValueError listing the memories."""
        self._bind(self.memory_store.require(name))
        return self

    def delete_memory(self, name: str) -> NamedMemories:
        """Remove memory `name` and everything it learned. The selected memory cannot be deleted (select another
        first)."""
        name = self.memory_store.require(name)
        if name == self.active_memory:
            raise ValueError(f"memory: {name!r} is the selected memory; set_memory() another before deleting it")
        self.memory_store.delete(name)
        return self

    def memory_state(self, name: str) -> StoredMemory:
        """The state of memory `name` (its live objects, not copies): the bank, the output layer's state and the
        target modules' memories."""
        name = self.memory_store.require(name)
        if name != self.memory_store.bound:
            return self.memory_store.get(name)
        layer = self.output_memory_layer
        output = layer.current_state() if isinstance(layer, ResidualOutputLayer) else getattr(layer, "memory", None)
        return StoredMemory(self.memory_bank, output, self.module_memories.current_states())

    # ------------------------------------------------------------------ binding (internal)

    def _new_memory(self) -> StoredMemory:
        bank = None if self.memory_bank is None else self.memory_bank.empty_like()
        output = None if self.output_memory_layer is None else self.output_memory_layer.new_state()
        return StoredMemory(bank, output, self.module_memories.new_states())

    def _swap_in(self, state: StoredMemory) -> StoredMemory:
        bank = self.memory_bank
        if bank is not None:
            self.memory_bank = state.bank
            for layer in self.memory_layers.values():
                layer.use_bank(state.bank)
            self.learner.use_bank(state.bank)
        output = None
        if self.output_memory_layer is not None:
            output = self.output_memory_layer.swap_state(state.output)
        modules = self.module_memories.swap_states(state.module_states())
        return StoredMemory(bank, output, modules)

    def _bind(self, name: str) -> None:
        store = self.memory_store
        if name == store.bound:
            return
        incoming = store.take(name)
        try:
            outgoing = self._swap_in(incoming)
        except BaseException:
            store.put(name, incoming)
            raise
        store.put(store.bound, outgoing)
        store.bound = name

    @contextlib.contextmanager
    def _bound(self, name: str) -> Iterator[None]:
        """Inside, the layers read and learn memory `name`; the previous one is bound again after."""
        previous = self.memory_store.bound
        self._bind(name)
        try:
            yield
        finally:
            self._bind(previous)

    @contextlib.contextmanager
    def _learning_recorded(self) -> Iterator[None]:
        """Inside, every batch the learner learns into the bound memory is recorded in its ledger, and learning is all
        or nothing: an exception leaves every memory, its held-out tail and the ledger as they were."""
        ledger = self.memory_store.ledgers[self.memory_store.bound]
        before = ledger.copy()

        def record(ids: torch.Tensor, mask: torch.Tensor, pairs: torch.Tensor, documents: torch.Tensor | None) -> None:
            docs = [-1] * ids.shape[0] if documents is None else documents.tolist()
            ledger.add(fingerprints(ids, mask, pairs), docs)

        try:
            with self._all_or_nothing(), self.learner.recording(record):
                yield
        except BaseException:
            self.memory_store.ledgers[self.memory_store.bound] = before
            raise

    @contextlib.contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """A learn call that raises part way (a bad item after good batches) leaves every memory as it was."""
        saved = [(m, {k: v.clone() for k, v in m.state_dict().items()}) for _, m in self.learned_state()]
        output = self.output_memory_layer
        tail = output.held_out.snapshot() if isinstance(output, ResidualOutputLayer) else None
        try:
            yield
        except BaseException:
            with torch.no_grad():
                for memory, state in saved:
                    memory.load_state_dict(state)
                    memory.mark_changed()
            if tail is not None:
                output.held_out.restore(tail)
            raise

    def _creating(self, name: str) -> bool:
        """Create memory `name` when it does not exist; returns whether it did."""
        if name in self.memory_store:
            return False
        self.memory_store.create(name, self._new_memory())
        return True

    # ------------------------------------------------------------------ forget and merge

    def forget(self, inputs: object = None, attention_mask: object = None, *, memory: str = "default",
               **learn_options: object) -> LearnStats:  # fmt: skip
        """Unlearn texts learned before into `memory`, exactly: the statistics learning them added are subtracted,
        so the model reads as if it had never learned them (within float64 summation error; docs/serving.md).

        Takes what learn() takes (inputs, attention_mask, input_ids, labels, tokenizer, text_column, max_length,
        batch_size), and the windows must be those learn() cut (the same max_length and labels). Windows never learned
        into this memory are refused (ValueError, nothing changed), as is a forget that would leave a negative count.
        Returns LearnStats of what was unlearned.
        """
        name = self.memory_store.require(memory)
        self.memory_store.create(_SCRATCH, self._new_memory())
        try:
            with self._bound(_SCRATCH):
                stats = self._learn_core(inputs, attention_mask, **learn_options)
            scratch = self.memory_state(_SCRATCH)
            prints = [f for f, _ in self.memory_store.ledgers[_SCRATCH].entries]
            ledger, documents = self.memory_store.ledgers[name].without(prints)
            target = self.memory_state(name)
            pairs = list(_paired_statistics(target, scratch))
            for mine, theirs in pairs:  # all counts checked before any is changed
                if bool((theirs.count > mine.count * (1 + 1e-9) + 1e-9).any()):
                    raise ValueError(f"inputs: more rows to forget than memory {name!r} holds; nothing was forgotten")
            for mine, theirs in pairs:
                mine.subtract(theirs)
            self.memory_store.ledgers[name] = ledger
            if isinstance(target.output, OutputState):
                with self._bound(name):
                    layer = self.output_memory_layer
                    layer.held_out.drop_documents(documents)
                    layer.restore_step(None, None, None)  # chosen with the forgotten text: not to be read again
        finally:
            self.memory_store.delete(_SCRATCH)
        return stats

    def merge_memories(self, names: list[str], *, into: str) -> NamedMemories:
        """Create memory `into` holding the union of memories `names` (in that order): its statistics are their
        sums, so it equals one memory that learned their streams one after the other (within float64 summation
        error). The sources are kept. `into` must be a new name."""
        if isinstance(names, str) or not isinstance(names, list | tuple) or not names:
            raise ValueError(f"names: expected a non-empty list of memory names, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"names: each memory once, got {names!r}")
        sources = [self.memory_store.require(n, "names") for n in names]
        into = check_name(into, "into")
        if into in self.memory_store:
            raise ValueError(f"into: a memory named {into!r} exists already; delete it or choose a new name")
        merged = self._new_memory()
        states = [self.memory_state(n) for n in sources]
        for state in states:
            for mine, theirs in _paired_statistics(merged, state):
                mine.merge(theirs)
        if isinstance(merged.output, OutputState):
            tail = merged.output.held_out
            for state in states:
                tail = tail.extended(state.output.held_out)
            merged.output.held_out = tail
        self.memory_store.create(into, merged)
        ledger = self.memory_store.ledgers[into]
        for n in sources:
            ledger = ledger.joined(self.memory_store.ledgers[n])
        self.memory_store.ledgers[into] = ledger
        return self


def _paired_statistics(a: StoredMemory, b: StoredMemory) -> Iterator[tuple[nn.Module, nn.Module]]:
    """(a's, b's) summed statistics of two memories of one model, pair by pair."""
    if a.bank is not None:
        yield a.bank, b.bank
    if isinstance(a.output, OutputState):
        yield from zip(a.output.statistics(), b.output.statistics(), strict=True)
    elif a.output is not None:
        yield a.output, b.output
    mine, theirs = a.module_states(), b.module_states()
    for key, memory in theirs.items():
        if memory is None:
            continue
        if mine[key] is None:
            raise ValueError(f"target module {key!r}: sized in one memory and not in the other; learn it first")
        yield mine[key], memory


__all__ = ["BASE", "NamedMemories"]
