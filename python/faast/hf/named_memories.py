"""Named memories of a FaastModel: select, delete, learn into, forget and merge them (docs/serving.md).

A FaastModel holds one `NamedMemories`: it owns the MemoryStore (faast/hf/memory_store.py: the unbound memories,
their ledgers and which one is bound) and a `BoundLayers`, the model's parts that read and learn the bound memory
(given to it by the model; it swaps their state through their public methods `use_bank`, `swap_state` and
`swap_states`). Every memory has its own fixed-size statistics and caches; binding one to the layers swaps
references, so selecting a memory copies and solves nothing.

What forget and merge do to the output layer's step tuning (docs/serving.md):
- forget subtracts the statistics learning the texts added, removes them from the memory's ledger, and drops their
  positions from the held-out tail. The step is then tuned on what remains of the tail, or, where too little
  remains, takes the default rule (a step restored from a file is dropped too: it was chosen with the forgotten text).
- merge sums the sources' statistics and joins their tails in the order given, which is what one memory that learned
  the sources' streams one after the other would hold; the merged memory tunes its own step on that tail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from ..accumulator import Accumulator
from ..memory import FastWeights
from .bank import MemoryBank
from .inputs import batches, describe, learn_items, learn_source
from .layers import MemoryLayer, OutputMemoryLayer
from .learning import Learner, LearnStats
from .memory_store import BASE, Ledger, MemoryStore, StoredMemory, check_name, fingerprints
from .modules import ModuleMemories
from .output import OutputState, ResidualOutputLayer
from .progress import Metered
from .rows import RowMemories

__all__ = ["BASE", "BoundLayers", "NamedMemories"]

_SCRATCH = "__scratch__"  # the memory forget() learns the texts into, to subtract them


class BoundLayers:
    """The parts of a FaastModel that read and learn the bound memory, and the swap that binds another one.

    Args:
        bank: the middle layers' MemoryBank (the bound memory's), or None without middle layers.
        middle: the middle MemoryLayers, which share `bank` (one slot each).
        output: the output layer (the residual one or the paper's) or None.
        module_memories: the memories on FaastConfig.target_modules.
        learner: the Learner; it learns into the bound bank.
        on_bank: told each bank bound after this one. FaastModel keeps the bound bank as its submodule `memory_bank`,
            so that `.to()` and a checkpoint of the model itself (faast.checkpoint) see it.
    """

    def __init__(
        self,
        bank: MemoryBank | None,
        middle: Iterable[MemoryLayer],
        output: ResidualOutputLayer | OutputMemoryLayer | None,
        module_memories: ModuleMemories,
        learner: Learner,
        on_bank: Callable[[MemoryBank], None],
    ) -> None:
        self.bank = bank
        self.middle = list(middle)
        self.output = output
        self.module_memories = module_memories
        self.learner = learner
        self._on_bank = on_bank

    def current(self) -> StoredMemory:
        """The bound memory's state (its live objects, not copies)."""
        layer = self.output
        output = layer.current_state() if isinstance(layer, ResidualOutputLayer) else getattr(layer, "memory", None)
        return StoredMemory(self.bank, output, self.module_memories.current_states())

    def new(self) -> StoredMemory:
        """An empty memory of the layers' shapes."""
        bank = None if self.bank is None else self.bank.empty_like()
        output = None if self.output is None else self.output.new_state()
        return StoredMemory(bank, output, self.module_memories.new_states())

    def swap_in(self, state: StoredMemory) -> StoredMemory:
        """Read and learn `state` from now on; returns the state read before (no copies)."""
        bank = self.bank
        if bank is not None:
            incoming = state.bank
            if incoming is None:
                raise ValueError("state: expected a memory with a MemoryBank for the middle layers")
            for layer in self.middle:
                layer.use_bank(incoming)
            self.learner.use_bank(incoming)
            self.bank = incoming
            self._on_bank(incoming)
        output: OutputState | FastWeights | None = None
        # each layer checks that the state is its own kind (memories of one model are alike)
        if isinstance(self.output, ResidualOutputLayer):
            output = self.output.swap_state(cast(OutputState, state.output))
        elif self.output is not None:
            output = self.output.swap_state(cast(FastWeights, state.output))
        modules = self.module_memories.swap_states(state.module_states())
        return StoredMemory(bank, output, modules)

    def learned_state(self) -> list[tuple[str, FastWeights | Accumulator]]:
        """Every piece of the bound memory's learned state by name, in file order: the middle layers' bank, the
        output layer's memory (and, for the residual output layer, its curvature, token-mass, gradient-sum and
        target-count accumulators), then the module memories."""
        named: list[tuple[str, FastWeights | Accumulator]] = [] if self.bank is None else [("memory_bank", self.bank)]
        layer = self.output
        if layer is not None:
            named.append(("output_memory_layer.memory", layer.memory))
        if isinstance(layer, ResidualOutputLayer):
            named.append(("output_memory_layer.curvature", layer.curvature))
            named.append(("output_memory_layer.token_mass", layer.token_mass))
            named.append(("output_memory_layer.gradient_sum", layer.gradient_sum))
            named.append(("output_memory_layer.target_count", layer.target_count))
        named.extend(self.module_memories.named_memories())
        return named

    def begin_training_step(self) -> None:
        """FaastModel.begin_training_step: every middle layer's W = S_eps^+ T solved in one call, T differentiable in
        the scorers; the layers read them until end_training_step."""
        if self.bank is None:
            return
        deltas = [layer.step_cross_delta() for layer in self.middle]
        cross = self.bank.cross
        if any(d is not None for d in deltas):
            zero = torch.zeros_like(cross[0])
            cross = cross + torch.stack([zero if d is None else d for d in deltas])
        weights = self.bank.solve_for(cross).to(torch.float32)
        for layer in self.middle:
            layer.set_training_weights(weights[layer.slot])

    def end_training_step(self) -> None:
        """Drop the training step's differentiable T and W: the layers read the folded fast weights again."""
        for layer in self.middle:
            layer.end_training_step()

    @contextlib.contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """An exception inside (a bad item after good batches) leaves the bound memory as it was, held-out tail
        included."""
        saved = [(m, {k: v.clone() for k, v in m.state_dict().items()}) for _, m in self.learned_state()]
        output = self.output
        tail = output.held_out.snapshot() if isinstance(output, ResidualOutputLayer) else None
        try:
            yield
        except BaseException:
            with torch.no_grad():
                for memory, state in saved:
                    memory.load_state_dict(state)
                    memory.mark_changed()
            if tail is not None and isinstance(output, ResidualOutputLayer):
                output.held_out.restore(tail)
            raise


class NamedMemories:
    """A FaastModel's named memories: their store, which one the layers read, and learning into them.

    Args:
        layers: the model's BoundLayers.
        device: the device learn() puts token ids on (the base model's input embeddings').

    Attributes:
        store: the MemoryStore (FaastModel registers it as its submodule `memory_store`, so the unbound memories
            move with the model).
    """

    def __init__(self, layers: BoundLayers, device: Callable[[], torch.device]) -> None:
        self.layers = layers
        self.store = MemoryStore()  # 'default' is bound to the layers; the others wait here
        self._device = device
        # (memory, texts numbered) after the last learn() call that learned texts: what learn(continues=True) needs.
        self._continuable: tuple[str, int] | None = None

    # ------------------------------------------------------------------ selecting

    @property
    def names(self) -> list[str]:
        """The names of every memory, in creation order ('default' first unless deleted)."""
        return self.store.names

    @property
    def active(self) -> str:
        """The memory plain forward and generate read."""
        return self.store.bound

    def select(self, name: str) -> None:
        """Bind memory `name` to the layers; unknown names raise ValueError listing the memories."""
        self.bind(self.store.require(name))

    def delete(self, name: str) -> None:
        """Remove memory `name` and everything it learned; the selected memory cannot be deleted."""
        name = self.store.require(name)
        if name == self.active:
            raise ValueError(f"memory: {name!r} is the selected memory; set_memory() another before deleting it")
        self.store.delete(name)

    def state(self, name: str) -> StoredMemory:
        """The state of memory `name` (its live objects, not copies)."""
        name = self.store.require(name)
        if name != self.store.bound:
            return self.store.get(name)
        return self.layers.current()

    # ------------------------------------------------------------------ binding

    def bind(self, name: str) -> None:
        """Bind existing memory `name` to the layers (the one bound before goes back to the store)."""
        store = self.store
        if name == store.bound:
            return
        incoming = store.take(name)
        try:
            outgoing = self.layers.swap_in(incoming)
        except BaseException:
            store.put(name, incoming)
            raise
        store.put(store.bound, outgoing)
        store.bound = name

    @contextlib.contextmanager
    def bound(self, name: str) -> Iterator[None]:
        """Inside, the layers read and learn memory `name`; the previous one is bound again after."""
        previous = self.store.bound
        self.bind(name)
        try:
            yield
        finally:
            self.bind(previous)

    def creating(self, name: str) -> bool:
        """Create memory `name` when it does not exist; returns whether it did."""
        if name in self.store:
            return False
        self.store.create(name, self.layers.new())
        return True

    def clear_ledger(self) -> None:
        """Empty the bound memory's ledger (its statistics were reset)."""
        self.store.ledgers[self.store.bound] = Ledger()

    @contextlib.contextmanager
    def learning_recorded(self) -> Iterator[None]:
        """Inside, every batch the learner learns into the bound memory is recorded in its ledger, and learning is all
        or nothing: an exception leaves every memory, its held-out tail and the ledger as they were."""
        ledger = self.store.ledgers[self.store.bound]
        before = ledger.copy()

        def record(ids: torch.Tensor, mask: torch.Tensor, pairs: torch.Tensor, documents: torch.Tensor | None) -> None:
            docs = [-1] * ids.shape[0] if documents is None else documents.tolist()
            ledger.add(fingerprints(ids, mask, pairs), docs)

        try:
            with self.layers.all_or_nothing(), self.layers.learner.recording(record):
                yield
        except BaseException:
            self.store.ledgers[self.store.bound] = before
            raise

    def rows(self, names: object, args: tuple, kwargs: dict) -> RowMemories:
        """The memories of one forward or generate call's rows (its memory_names), checked against the memories and
        the batch (args, kwargs: the call's inputs)."""
        if isinstance(names, str) or not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"memory_names: expected a list of memory names, one per row, got {names!r}")
        unknown = sorted({n for n in names if n != BASE and n not in self.store})
        if unknown:
            raise ValueError(f"memory_names: no memories named {unknown}; the memories are {self.names} (and "
                             f"{BASE!r}, the base model)")  # fmt: skip
        first = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        rows = getattr(first, "shape", (None,))[0]
        if rows is not None and rows != len(names):
            raise ValueError(f"memory_names: expected one name per row of the batch ({rows} rows), got {len(names)}")
        if len(self.layers.module_memories):
            raise ValueError("memory_names: not supported with target_modules memories; use set_memory")
        if any(layer.training_weights is not None for layer in self.layers.middle):
            raise ValueError("memory_names: not supported inside a readout training step")
        return RowMemories(list(names), self.state, self.layers.output)

    def load(
        self, files: dict[str, Path], ledgers: dict[str, Ledger], selected: str | None,
        load: Callable[[Path], object], source: str,
    ) -> None:  # fmt: skip
        """Load memory files (name -> path, each read into its memory, created or replaced, by `load`) with their
        ledgers, then select `selected` (None: the selection stays); all or nothing: on an error the memories and
        the selection are as they were (a memory replaced part way keeps what `load` left: it loads all or nothing).
        source: the folder, for errors."""
        for name in files:
            check_name(name, f"{source}: memories")
        before, created = self.active, []
        try:
            for name, path in files.items():
                if self.creating(name):
                    created.append(name)
                with self.bound(name):
                    load(path)
                self.store.ledgers[name] = ledgers[name]
        except BaseException:
            self.select(before)
            for name in created:
                self.store.delete(name)
            raise
        if selected is not None:
            self.select(selected)

    # ------------------------------------------------------------------ learning

    @contextlib.contextmanager
    def into(self, name: str) -> Iterator[None]:
        """Inside, the layers read and learn memory `name`, created when it does not exist; an exception removes a
        memory created here (learn and read_stream into a new name are all or nothing)."""
        created = self.creating(name)
        try:
            with self.bound(name):
                yield
        except BaseException:
            if created:
                self.store.delete(name)
            raise

    def learn_bound(
        self,
        inputs: torch.Tensor | str | Iterable | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        tokenizer: object | None = None,
        text_column: str | None = None,
        max_length: int = 1024,
        batch_size: int = 8,
        progress: bool | None = None,
        continues: bool = False,
    ) -> LearnStats:
        """learn() into the bound memory, recording each learned window in its ledger (all or nothing)."""
        source_inputs = learn_source(inputs, input_ids)
        source = describe(source_inputs)
        if continues and isinstance(source_inputs, torch.Tensor):
            raise ValueError("continues: the first input must be a text or a token-id list, got an input_ids tensor "
                             "(its rows' documents are unknown)")  # fmt: skip
        learner = self.layers.learner
        if continues:
            self._check_continues()
        with self.learning_recorded():
            if isinstance(source_inputs, torch.Tensor):
                stats = learner.learn_tensor(source_inputs, attention_mask, labels)
            else:
                meter = Metered(learn_items(source_inputs, attention_mask, labels, tokenizer, text_column))
                stream = batches(meter, tokenizer, max_length, batch_size, self._device())
                stats = learner.learn_stream(stream, progress, continues, meter)
        if stats.tokens == 0:
            raise ValueError(f"inputs: nothing to learn: the {source} held no tokens")
        self._continuable = (self.store.bound, learner.documents_numbered) if learner.ends_on_text else None
        return stats

    def _check_continues(self) -> None:
        """learn(continues=True) into the bound memory is possible: the call before learned texts into it (forget,
        which learns into a scratch memory, and a merge, which makes a new one, are calls into other memories)."""
        name = self.store.bound
        if self._continuable != (name, self.layers.learner.documents_numbered):
            raise ValueError(f"continues: memory {name!r} has no text to continue: the previous learn() call did not "
                             f"learn texts into it (or a forget or merge came between)")  # fmt: skip

    # ------------------------------------------------------------------ forget and merge

    def forget(self, inputs: Any, attention_mask: Any, memory: str, **learn_options: Any) -> LearnStats:
        """FaastModel.forget: unlearn texts learned before into `memory`, exactly (all or nothing)."""
        name = self.store.require(memory)
        self.store.create(_SCRATCH, self.layers.new())
        try:
            mine, scratch_output = self.state(name).output, self.state(_SCRATCH).output
            if isinstance(mine, OutputState) and isinstance(scratch_output, OutputState):
                scratch_output.held_out.folds.follow(mine.held_out.folds)  # each text to the fold it fell into
            with self.bound(_SCRATCH):
                stats = self.learn_bound(inputs, attention_mask, **learn_options)
            scratch = self.state(_SCRATCH)
            prints = [f for f, _ in self.store.ledgers[_SCRATCH].entries]
            ledger, documents = self.store.ledgers[name].without(prints)
            target = self.state(name)
            pairs = list(_paired_statistics(target, scratch))
            for mine, theirs in pairs:  # all counts checked before any is changed
                if bool((theirs.count > mine.count * (1 + 1e-9) + 1e-9).any()):
                    raise ValueError(f"inputs: more rows to forget than memory {name!r} holds; nothing was forgotten")
            for mine, theirs in pairs:
                mine.subtract(theirs)
            self.store.ledgers[name] = ledger
            if isinstance(target.output, OutputState):
                with self.bound(name):
                    layer = cast(ResidualOutputLayer, self.layers.output)  # an OutputState is that layer's
                    learned = cast(OutputState, scratch.output).held_out  # the forgotten text's folds
                    layer.held_out.drop_documents(documents, learned)
                    layer.restore_step(None, None, None)  # chosen with the forgotten text: not to be read again
        finally:
            self.store.delete(_SCRATCH)
        return stats

    def merge(self, names: object, into: str) -> None:
        """FaastModel.merge_memories: create memory `into` holding the union of memories `names`, in order."""
        if isinstance(names, str) or not isinstance(names, list | tuple) or not names:
            raise ValueError(f"names: expected a non-empty list of memory names, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"names: each memory once, got {names!r}")
        sources = [self.store.require(n, "names") for n in names]
        into = check_name(into, "into")
        if into in self.store:
            raise ValueError(f"into: a memory named {into!r} exists already; delete it or choose a new name")
        merged = self.layers.new()
        states = [self.state(n) for n in sources]
        for state in states:
            for mine, theirs in _paired_statistics(merged, state):
                mine.merge(theirs)
        if isinstance(merged.output, OutputState):
            tail = merged.output.held_out
            for state in states:  # memories of one model hold the same kind of output state
                tail = tail.extended(cast(OutputState, state.output).held_out)
            merged.output.held_out = tail
        self.store.create(into, merged)
        ledger = self.store.ledgers[into]
        for n in sources:
            ledger = ledger.joined(self.store.ledgers[n])
        self.store.ledgers[into] = ledger


def _paired_statistics(a: StoredMemory, b: StoredMemory) -> Iterator[tuple[Any, Any]]:
    """(a's, b's) summed statistics of two memories of one model, pair by pair: two of one kind (FastWeights,
    MemoryBank or Accumulator; typed Any since each kind merges only with its own)."""
    if a.bank is not None:
        yield a.bank, b.bank
    if isinstance(a.output, OutputState):
        yield from zip(a.output.statistics(), cast(OutputState, b.output).statistics(), strict=True)
    elif a.output is not None:
        yield a.output, b.output
    mine, theirs = a.module_states(), b.module_states()
    for key, memory in theirs.items():
        if memory is None:
            continue
        if mine[key] is None:
            raise ValueError(f"target module {key!r}: sized in one memory and not in the other; learn it first")
        yield mine[key], memory
