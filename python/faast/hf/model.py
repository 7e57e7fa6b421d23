"""apply_faast: attach memory layers to a frozen Hugging Face causal LM, and the FaastModel it returns.

The FaastModel wraps the base model: calls and `generate` go to the base model (with the hooks active), and it adds
learn / solve / reset / disable / save / load. Its parts are objects it holds, each owning its state (docs/design.md
§6.6): the hooks (hooks.py: attachment), the Learner (learning.py: one backbone pass per batch, statistics added after
it), the NamedMemories (named_memories.py: select, learn into, forget, merge, and the swap that binds a memory) and the
StreamReader (reading.py: read_stream); persistence.py writes and reads the adapter folder and the fast-weights file.

The middle layers' statistics live in one MemoryBank (bank.py): a learning pass captures every middle layer's pairs,
one bank update learns them all (one Gram accumulation for every middle layer, one for the output layer), and a solve
is one batched eigendecomposition.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .._version import __version__
from ..accumulator import Accumulator
from ..memory import FastWeights
from . import persistence
from .bank import MemoryBank
from .base import CONFIG_NAME, WRAPPED_BASE_MODELS, FaastModelBase, eval_mode, freeze
from .config import EmbeddingOutput, FaastConfig, ResidualOutput
from .hooks import ModelHooks
from .layers import MemoryLayer, OutputMemoryLayer, memory_bank
from .learning import Learner, LearnStats
from .lm import as_lm, input_embeddings
from .memory_store import DEFAULT, Ledger, StoredMemory, check_name
from .modules import FaastModuleModel, ModuleMemories, wants_module_model
from .named_memories import BoundLayers, NamedMemories
from .output import ResidualOutputLayer
from .reading import ReadReport, StreamReader
from .targets import LMHead, get_submodule, residual_head, target_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["FaastModel", "LearnStats", "apply_faast", "from_pretrained"]


class FaastModel(FaastModelBase):
    """A causal LM with FAAST memory layers. Build it with `apply_faast(model, config)`.

    Attributes:
        base_model: the wrapped (frozen) transformers model; its modules carry the hooks.
        faast_config: the FaastConfig, with the model's shape filled in.
        memory_bank: MemoryBank(d, d, batch_shape=(L,)), the statistics of the L middle layers (slot i: the i-th
            entry of memory_layers), or None without middle layers.
        memory_layers: nn.ModuleDict block index (str) -> MemoryLayer (`.memory`: the view of its slot of
            memory_bank, `.readout`, `.scorer`). Solve settings (`.memory.alpha`, ...) are shared by all of them.
        output_memory_layer: the ResidualOutputLayer (the default), the paper's OutputMemoryLayer, or None.
        module_memories: the memories on FaastConfig.target_modules (empty when none are configured).
        faast_hooks: the ModelHooks that attach the layers; learner: the Learner running learn().
        named_memories: the NamedMemories (their store is also registered here as `memory_store`);
        stream_reader: the StreamReader running read_stream().
    Other attributes (config, device, generation_config, ...) are the base model's.
    """

    def __init__(self, base_model: nn.Module, config: FaastConfig) -> None:
        super().__init__(base_model)
        pretrained, lm = cast("PreTrainedModel", base_model), as_lm(base_model)
        target = target_for(pretrained)
        blocks = cast(nn.ModuleList, get_submodule(pretrained, target.blocks, "transformer blocks"))
        final_norm = get_submodule(pretrained, target.final_norm, "final norm")
        backbone = get_submodule(pretrained, target.backbone, "decoder backbone")
        hidden = int(lm.config.hidden_size)
        embeddings = lm.get_input_embeddings()
        if isinstance(config.output, EmbeddingOutput) and embeddings.embedding_dim != hidden:
            raise ValueError(
                f"model: the output memory layer needs input embeddings of the hidden size {hidden}, got "
                f"{embeddings.embedding_dim}; use FaastConfig(output=None)"
            )
        num_params = sum(p.numel() for p in base_model.parameters())
        indices = config.block_indices(len(blocks), num_params)
        key_blocks = config.output_key_blocks(len(blocks))
        # The configuration as built: the blocks chosen and the output keys resolved, so a saved readout reloads
        # onto the same layers whatever rule picked them. Its groups are copies: changing the caller's config later
        # must not change the model's record.
        middle, output = config.middle, config.output
        if middle is not None:
            middle = dataclasses.replace(middle, layers=indices) if indices else dataclasses.replace(middle)
        if isinstance(output, ResidualOutput):
            output = dataclasses.replace(output, key_layers=key_blocks)
        elif output is not None:
            output = dataclasses.replace(output)
        self.faast_config = dataclasses.replace(
            config, middle=middle, output=output, regulariser=dataclasses.replace(config.regulariser),
            model_type=lm.config.model_type, hidden_size=hidden, num_hidden_layers=len(blocks),
            faast_version=__version__,
        )  # fmt: skip
        device = next(base_model.parameters()).device
        freeze(base_model)
        self.memory_bank = memory_bank(hidden, len(indices), self.faast_config, device) if indices else None
        middle_layers = {
            str(i): MemoryLayer(hidden, self.faast_config, i, device=device, bank=self.memory_bank, slot=slot)
            for slot, i in enumerate(indices)
        }
        self.memory_layers = nn.ModuleDict(middle_layers)
        self.output_memory_layer: OutputMemoryLayer | ResidualOutputLayer | None = None
        if isinstance(config.output, ResidualOutput):
            head = residual_head(pretrained, target)  # scaled when the type scales its logits (targets.py)
            weight = getattr(head, "weight", None)
            if head is None or weight is None or weight.shape[-1] != hidden:
                raise ValueError(
                    f"model: the residual output layer needs an LM head (get_output_embeddings()) reading the hidden"
                    f" size {hidden}; use FaastConfig(output=EmbeddingOutput()) or output=None"
                )
            vocab = int(weight.shape[0])
            self.output_memory_layer = ResidualOutputLayer(
                hidden, vocab, self.faast_config, device=device, extra_key_size=hidden * len(key_blocks)
            )
            # Its weight [V, hidden] is checked above: an LMHead, whatever the head's declared type.
            self.output_memory_layer.attach_head(cast(LMHead, head))
        elif config.output is not None:
            self.output_memory_layer = OutputMemoryLayer(hidden, hidden, self.faast_config, device=device)
        self.faast_hooks = ModelHooks(
            base_model, blocks, final_norm, {int(k): v for k, v in middle_layers.items()},
            self.output_memory_layer, key_blocks,
        )  # fmt: skip
        # Memories on FaastConfig.target_modules (modules.py); empty, with no hooks, when none are configured.
        self.module_memories = ModuleMemories(
            base_model, self.faast_config, enabled=lambda: not self.faast_hooks.disabled("modules")
        )
        self.learner = Learner(
            base_model, backbone, self.faast_hooks, self.memory_bank, list(middle_layers.values()),
            self.output_memory_layer, self.module_memories, self.faast_config.learn_dtype,
        )  # fmt: skip
        # The named memories (named_memories.py): 'default' is bound to the layers, the others wait in the store.
        bound = BoundLayers(self.memory_bank, middle_layers.values(), self.output_memory_layer,
                            self.module_memories, self.learner, on_bank=self._hold_bank)  # fmt: skip
        self.named_memories = NamedMemories(bound, device=lambda: input_embeddings(base_model).weight.device)
        self.memory_store = self.named_memories.store  # registered: the unbound memories move with the model
        self.stream_reader = StreamReader(base_model, self.output_memory_layer, len(self.memory_layers),
                                          self.learner, self.named_memories)  # fmt: skip

    def _hold_bank(self, bank: MemoryBank) -> None:
        # The bound memory's bank is this module's submodule, so `.to()` and a checkpoint of the model see it.
        self.memory_bank = bank

    def faast_layers(self) -> Iterator[MemoryLayer | OutputMemoryLayer | ResidualOutputLayer]:
        """Every memory layer: the middle ones in block order, then the output layer."""
        yield from self.named_memories.layers.middle
        if self.output_memory_layer is not None:
            yield self.output_memory_layer

    def learned_state(self) -> list[tuple[str, FastWeights | Accumulator]]:
        """Every piece of learned state by name, in file order: the middle layers' bank, the output layer's memory
        (and, for the residual output layer, its curvature, token-mass, gradient-sum and target-count accumulators),
        then the module memories."""
        return self.named_memories.layers.learned_state()

    def fast_weights(self) -> list[FastWeights]:
        """The FastWeights memories holding the learned associations: the middle layers' bank, the output layer's
        memory, then the module memories (learned_state() also lists the residual output layer's accumulators)."""
        return [state for _, state in self.learned_state() if isinstance(state, FastWeights)]

    @contextlib.contextmanager
    def disable_faast(self, which: str = "all") -> Iterator[None]:
        """Inside, memory layers neither read nor learn. which='all' (outputs are the base model's, bit for bit),
        'middle' (only the output layer acts), 'output' (only the middle layers act) or 'modules' (the
        target_modules memories pass their modules' outputs through): for ablations."""
        with self.faast_hooks.disable(which):
            yield

    def remove_faast(self) -> nn.Module:
        """Detach the hooks for good and return the base model (its parameters stay frozen)."""
        self.faast_hooks.remove()
        self.module_memories.remove_hooks()
        WRAPPED_BASE_MODELS.discard(self.base_model)
        return self.base_model

    # ------------------------------------------------------------------ learning

    def learn(
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
        memory: str = DEFAULT,
        solve: bool = False,
        continues: bool = False,
    ) -> LearnStats:
        """Stream statistics from text into every memory layer; no keys are kept and hidden states are unchanged.

        Args:
            inputs: input_ids [B, T] (int64) with an optional attention_mask [B, T] (left or right padding: a pair
                counts only if both tokens are real); or a text, or an iterable of texts, of token-id lists, of
                input_ids tensors, or of tokenised batches (mappings with input_ids and optionally attention_mask);
                or a datasets.Dataset / IterableDataset (see text_column). Texts are tokenised with `tokenizer`;
                texts and token-id lists are split into windows of `max_length` tokens that overlap by one token (so
                no pair is lost) and learned `batch_size` windows at a time; an iterable or a dataset is consumed
                lazily, so a corpus never has to fit in memory.
            input_ids: the input_ids tensor by keyword, so `model.learn(**tokenizer(texts, return_tensors="pt",
                padding=True))` works; give either inputs or input_ids.
            labels: [B, T] int64 with an input_ids tensor, as for a Hugging Face causal LM: the pair predicting
                position t is learned only where labels[:, t] != -100 (e.g. an instruction dataset learns answers
                only), and labels are the targets of the residual output layer.
            text_column: with a dataset, the column of texts to learn (tokenised with `tokenizer`, which must take a
                list of texts, as transformers tokenizers do; rows are read and tokenised 64 at a time). By default
                the dataset's `input_ids` column (one token-id list per row, with its `labels` column if present,
                -100 marking pairs not learned, and its `attention_mask` column if present, left or right padding),
                else its only string column. Learning a dataset learns what the same texts (or rows) as a list do.
            progress: a bar on stderr with tokens/s and time left (None: if stderr is a terminal); see solve().
            memory: the named memory to learn into, created on first use (docs/serving.md); the selected memory
                (set_memory) does not change.
            solve: solve the memory before returning (else the first read after learning does), and return its
                residual output layer's tuning in LearnStats.tuning (as solve() reports it): whether the memory
                ended up off, or at a step far below what one of its texts would take, and why.
            continues: the first text is the rest of the last text the previous call learned into this memory (a
                long text learned in pieces): the step's tuning then holds out the end of the whole text, as one call
                would, not the end of every piece (docs/design.md §6.3). ValueError when the previous learn() call
                did not learn texts into this memory (a forget or merge between counts as another memory's), or when
                the first input is a tensor (its rows' documents are unknown).

        All or nothing: a call that raises (a bad item after good batches) leaves every memory as it was, and a
        memory it created is removed. Inputs that hold no tokens raise ValueError.
        Returns LearnStats (tokens, pairs per layer, batches, seconds, tokens_per_second).
        """
        name = check_name(memory)
        for arg, value in (("solve", solve), ("continues", continues)):
            if not isinstance(value, bool):
                raise TypeError(f"{arg}: expected True or False, got {value!r}")
        with self.named_memories.into(name):
            stats = self.named_memories.learn_bound(inputs, attention_mask, input_ids=input_ids, labels=labels,
                                                    tokenizer=tokenizer, text_column=text_column,
                                                    max_length=max_length, batch_size=batch_size, progress=progress,
                                                    continues=continues)  # fmt: skip
        if solve:
            stats.tuning = self.solve(memories=[name], progress=progress)[name]
        return stats

    def learn_modules(
        self,
        *args: object,
        targets: torch.Tensor | Mapping[str, torch.Tensor],
        mask: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
        **model_inputs: object,
    ) -> int:
        """Learn the target_modules memories from one forward pass of the base model on `model_inputs` (eval mode,
        no grad; the LM memory layers pass through): each target module's input is paired with its targets, a tensor
        (one target module) or a mapping name -> tensor, float [..., d_out] or class ids [...] (-100 not learned),
        row for row with the module's input (for lm_head: targets[:, t] is what position t should predict).
        Returns the rows learned. See docs/design.md §6.6."""
        with torch.no_grad(), eval_mode(self.base_model), contextlib.ExitStack() as stack:
            stack.enter_context(self.disable_faast("middle"))
            stack.enter_context(self.disable_faast("output"))
            return self.module_memories.learn_forward(lambda: self.base_model(*args, **model_inputs), targets, mask)

    def learn_module(
        self, inputs: torch.Tensor, *, targets: torch.Tensor, name: str | None = None, mask: torch.Tensor | None = None
    ) -> int:
        """Learn target module `name` (None: the only one) from its inputs [..., d_in] and targets (float
        [..., d_out] or class ids [...]); the module computes its own output. Returns the rows learned."""
        return self.module_memories.learn_inputs(inputs, targets, name=name, mask=mask)

    def solve(self, memories: list[str] | None = None, progress: bool | None = None) -> dict[str, dict | None]:
        """Solve every memory layer now, for the model's device and dtype; otherwise the first forward pass after
        learning does it. Middle layers: one batched eigendecomposition and the folded W·P; the residual output
        layer: its Newton step and the step tuned on the held-out text. Every named memory is solved (memories: only
        these), and each keeps its solution until its statistics change, so switching memories solves nothing.

        Returns {memory name: its residual output layer's tuning, or None without one}: a copy of last_tuning with
        step, weight, tuned, key_width and, when tuned, held_out_tokens / held_out_documents / document_gap_tokens /
        fitted_tokens, tail_step and document_shrink (step = tail_step × document_shrink, < 1 where each held-out text
        has much fitted text of its own), off (the step or weight is 0: the memory reads as the base model),
        held_out_gain and its standard error, parts (the step each large held-out text would take alone) and warning
        (why the memory is off or far below one of its texts' steps; also issued once as a MemoryOffWarning). progress:
        a solve over a second says so on stderr (None: when stderr is a terminal)."""
        if memories is not None and not isinstance(memories, (list, tuple)):
            raise TypeError(f"memories: expected a list of memory names or None, got {memories!r}")
        names = self.memories if memories is None else [self.memory_store.require(n, "memories") for n in memories]
        weight, output = input_embeddings(self.base_model).weight, self.output_memory_layer
        device, dtype, report = weight.device, weight.dtype, dict[str, dict | None]()
        residual = output if isinstance(output, ResidualOutputLayer) else None
        with residual.saying(progress) if residual is not None else contextlib.nullcontext():
            for name in names:
                with self.named_memories.bound(name):
                    for layer in self.faast_layers():
                        if isinstance(layer, OutputMemoryLayer):
                            layer.weights(device, dtype)
                        else:
                            layer.folded(device, dtype)
                    self.module_memories.solve()
                    tuning = residual.last_tuning if residual is not None else None
                    report[name] = None if tuning is None else copy.deepcopy(tuning)
        return report

    def reset_fast_weights(self) -> FaastModel:
        """Forget everything the selected memory learned (the readout, the scorer and the other memories stay)."""
        for _, state in self.learned_state():
            state.reset()
        if isinstance(self.output_memory_layer, ResidualOutputLayer):
            self.output_memory_layer.forget()  # also its held-out buffer and saved step
        self.named_memories.clear_ledger()
        return self

    # ------------------------------------------------------------------ named memories (faast/hf/named_memories.py)

    @property
    def memories(self) -> list[str]:
        """The names of every memory, in creation order ('default' first unless deleted)."""
        return self.named_memories.names

    @property
    def active_memory(self) -> str:
        """The memory plain forward and generate read (set_memory selects it)."""
        return self.named_memories.active

    def set_memory(self, name: str) -> FaastModel:
        """Read memory `name` in plain forward and generate from now on. Nothing is copied or solved: each memory
        keeps its solution. Unknown names raise ValueError listing the memories."""
        self.named_memories.select(name)
        return self

    def delete_memory(self, name: str) -> FaastModel:
        """Remove memory `name` and everything it learned. The selected memory cannot be deleted (select another
        first)."""
        self.named_memories.delete(name)
        return self

    def memory_state(self, name: str) -> StoredMemory:
        """The state of memory `name` (its live objects, not copies): the bank, the output layer's state and the
        target modules' memories."""
        return self.named_memories.state(name)

    def forget(self, inputs: object = None, attention_mask: object = None, *, memory: str = "default",
               **learn_options: object) -> LearnStats:  # fmt: skip
        """Unlearn texts learned before into `memory`, exactly: the statistics learning them added are subtracted,
        so the model reads as if it had never learned them (within float64 summation error; docs/serving.md).

        Takes what learn() takes (inputs, attention_mask, input_ids, labels, tokenizer, text_column, max_length,
        batch_size), and the windows must be those learn() cut (the same max_length and labels). Windows never learned
        into this memory are refused (ValueError, nothing changed), as is a forget that would leave a negative count.
        Returns LearnStats of what was unlearned.
        """
        return self.named_memories.forget(inputs, attention_mask, memory, **learn_options)

    def merge_memories(self, names: list[str], *, into: str) -> FaastModel:
        """Create memory `into` holding the union of memories `names` (in that order): its statistics are their
        sums, so it equals one memory that learned their streams one after the other (within float64 summation
        error). The sources are kept. `into` must be a new name."""
        self.named_memories.merge(names, into)
        return self

    def read_stream(
        self,
        stream: str | torch.Tensor | Sequence[int],
        *,
        tokenizer: object | None = None,
        chunk: int = 1024,
        memory: str = DEFAULT,
        on_chunk: Callable[[int, ReadReport], None] | None = None,
        progress: bool | None = None,
    ) -> ReadReport:
        """Read a long text or token stream in order, in chunks of `chunk` tokens: score each chunk with the memory
        learned from everything before it, then learn it (faast/hf/reading.py). After the call the memory holds every
        chunk's statistics (what `learn` gives on the same windows, `chunk_windows`, with learn_dtype='model' and
        head_dtype='float32': the statistics come from the scoring pass, at the model's precision, where `learn`'s
        'auto' runs bfloat16 on a CPU that multiplies it natively) and reads with the last tuned step, so generation
        uses what was read.

        Args:
            stream: a text (tokenised with `tokenizer`, no special tokens), or token ids: a 1-D int64 tensor ([1, N]
                accepted) or a list of ints.
            chunk: C, tokens per chunk, >= 2; C + 1 must fit the model's context window (each window holds one token
                of the previous chunk).
            memory: the named memory to read into (created on first use). Text it learned before is part of what
                the first chunk is scored with; its held-out tail is dropped (the stream tunes the step itself).
            on_chunk: called after each chunk is learned with (its index, the report so far).
            progress: a tqdm bar on stderr with tokens/s and the time left from the second chunk on (None: when
                stderr is a terminal; False: never; faast/hf/progress.py).

        Returns a ReadReport (per-chunk NLL, every token's NLL, read and update seconds, the step used).
        Needs the residual output layer and no middle layers. Bad input raises before anything is learned; an error
        part way leaves the memory as it was before the call.
        """
        return self.stream_reader.read(stream, tokenizer=tokenizer, chunk=chunk, memory=memory, on_chunk=on_chunk,
                                       progress=progress)  # fmt: skip

    # ------------------------------------------------------------------ reading: one memory per row

    def forward(self, *args: object, memory_names: list[str] | None = None, **kwargs: object) -> object:
        """The base model's forward with the memories active. memory_names: one memory name per row of the batch
        (row i reads memory_names[i]; "__base__": the base model alone), read with one batched product per layer;
        None: every row reads the selected memory (set_memory)."""
        if memory_names is None:
            return self.base_model(*args, **kwargs)
        with self.faast_hooks.routing(self.named_memories.rows(memory_names, args, kwargs)):
            return self.base_model(*args, **kwargs)

    def generate(self, *args: object, memory_names: list[str] | None = None, **kwargs: object) -> object:
        """The base model's generate with the memories active; memory_names as in forward (rows expanded by beams
        or num_return_sequences keep their row's memory)."""
        if memory_names is None:
            return as_lm(self.base_model).generate(*args, **kwargs)
        with self.faast_hooks.routing(self.named_memories.rows(memory_names, args, kwargs)):
            return as_lm(self.base_model).generate(*args, **kwargs)

    def fast_weight_bytes(self) -> int:
        """Bytes of learned state: the float64 statistics of every memory layer and the residual output layer's
        held-out tail; independent of tokens learned."""
        total = sum(b.numel() * b.element_size() for _, state in self.learned_state() for b in state.buffers())
        if isinstance(self.output_memory_layer, ResidualOutputLayer):
            total += self.output_memory_layer.tail_capacity_bytes()
        return total

    # ------------------------------------------------------------------ readout training (faast.hf.train)

    def learn_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, differentiable: bool = False
    ) -> LearnStats:
        """Learn one batch input_ids [B, T] (attention_mask [B, T] or None) with gradients enabled when
        `differentiable`: each middle layer then keeps this step's T = Kᵀdiag(s)V with the graph to its scorer, for
        begin_training_step (faast.hf.train). learn() is the way to learn text."""
        return self.learner.learn_batch(input_ids, attention_mask, differentiable=differentiable)

    def begin_training_step(self) -> None:
        """Solve W = S_eps^+ T of every middle layer in one call, T differentiable in the scorers (S_eps^+ constant).

        The layers then read these W (float32, with the graph) until end_training_step; see MemoryLayer.
        """
        self.named_memories.layers.begin_training_step()

    def end_training_step(self) -> None:
        """Drop the training step's differentiable T and W: the layers read the folded fast weights again."""
        self.named_memories.layers.end_training_step()

    # ------------------------------------------------------------------ persistence (faast/hf/persistence.py)

    def save_pretrained(self, directory: str | Path, *, memories: bool = True) -> Path:
        """Write everything this model is beyond its base model, each file atomically (docs/serving.md):

        - faast_config.json: the FaastConfig; faast_adapter.safetensors: the readout + scorer weights (fp32);
        - memories/<name>.safetensors: every named memory's statistics with the settings chosen when it was solved
          (the output layer's step, mixture weight and key width) and its ledger;
        - faast_manifest.json, written last: the format version, the base model's shape, the selected memory and
          each memory file's size and sha256.

        memories=False writes the configuration and trained weights only (the manifest then names no memories).
        Nothing of the base model is written; FaastModel.from_pretrained(base_model, directory) (or
        faast.hf.from_pretrained) gives back the same logits, bit for bit.
        """
        directory = Path(directory)
        written = {}
        if memories:
            for name in self.memories:
                with self.named_memories.bound(name):
                    path = persistence.memory_file(directory, name)
                    ledger = self.memory_store.ledgers[name].to_json()
                    written[name] = persistence.save_fast_weights(self, path, ledger=ledger)
        persistence.save_pretrained(self, directory)
        persistence.write_manifest(self, directory, written, self.active_memory if memories else None)
        return directory

    @classmethod
    def from_pretrained(
        cls, base_model: nn.Module, directory: str | Path, **overrides: Any
    ) -> FaastModel | FaastModuleModel:
        """faast.hf.from_pretrained: apply the saved FaastConfig to base_model and load what was saved with it."""
        return from_pretrained(base_model, directory, **overrides)

    def load_adapter(self, directory: str | Path) -> FaastModel:
        """Load readout + scorer weights written by save_pretrained into this model (all or nothing)."""
        persistence.load_adapter(self, directory)
        return self

    def load_memories(self, directory: str | Path) -> FaastModel:
        """Load the memories a save_pretrained folder holds (all or nothing: on an error the memories are as they
        were): each file is checked against the manifest first; memories of the same name are replaced, and the
        saved selection is restored. A folder written before manifests loads its one memories file as 'default'."""
        directory = Path(directory)
        manifest = persistence.read_manifest(directory)
        if manifest is None:
            legacy = directory / persistence.MEMORIES_NAME
            if legacy.is_file():
                with self.named_memories.bound(DEFAULT) if DEFAULT in self.memory_store else contextlib.nullcontext():
                    self.load_fast_weights(legacy)
            return self
        persistence.check_base(manifest, self, directory)
        files = {e["name"]: persistence.verified_memory_file(directory, e) for e in manifest["memories"]}
        ledgers = {name: Ledger.from_json(persistence.saved_ledger(path), path) for name, path in files.items()}
        self.named_memories.load(files, ledgers, manifest["selected"], self.load_fast_weights, str(directory))
        return self

    def save_fast_weights(self, path: str | Path) -> Path:
        """Write the selected memory's statistics to one safetensors file, atomically (loads back bit-exact; missing
        parent folders are created). save_pretrained writes every memory this way, with a manifest: it is the way
        to save a model.

        The file keeps the per-layer layout (a faast.Checkpoint file with one d×d memory per middle layer, named
        `memory_layers.<block>.memory`, and `output_memory_layer.memory`), so files written before the middle layers
        shared one bank and files written now are interchangeable. With the residual output layer's step or weight
        'auto', the ones in use are written too (its tuning buffer is not), so the loaded model reads exactly like
        this one (and the key width chosen with them: h̃ alone or the full keys).
        """
        return persistence.save_fast_weights(self, path)

    def load_fast_weights(self, path: str | Path) -> FaastModel:
        """Load statistics written by save_fast_weights (the layers must match; all or nothing).

        Also reads a checkpoint of this model in the bank layout (faast.checkpoint on the FaastModel itself, memories
        `memory_bank` and `output_memory_layer.memory`), ignoring its stream position.
        """
        persistence.load_fast_weights(self, path)
        return self


# ---------------------------------------------------------------------------------------------------- entry points


def apply_faast(model: nn.Module, config: FaastConfig | None = None) -> FaastModel | FaastModuleModel:
    """Attach FAAST memory layers to a transformers causal LM and freeze its parameters (the model types of
    faast.hf.targets.TARGETS; others through faast.hf.targets.discover_target, or refused with the reason).

    Args:
        model: a *ForCausalLM model; it is modified in place (hooks on its blocks and final norm).
        config: FaastConfig (default: FaastConfig(): the residual output layer alone, no middle layers).

    Returns a FaastModel wrapping `model`: call it or `generate` as the base model, plus learn, reset_fast_weights,
    disable_faast, save_pretrained, save_fast_weights / load_fast_weights. With config.target_modules on a model that
    is not an LM (e.g. a BERT classifier), a FaastModuleModel holding only those memories (docs/design.md §6.6).
    """
    if isinstance(model, FaastModel | FaastModuleModel):
        raise ValueError("model: FAAST is already applied to this model")
    if model in WRAPPED_BASE_MODELS:
        raise ValueError(
            "model: FAAST is already applied to this base model (it is the base_model of a faast model); call "
            "remove_faast() on that model first"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers causal LM (nn.Module), got {type(model).__name__}")
    if config is None:
        config = FaastConfig()
    if not isinstance(config, FaastConfig):
        raise TypeError(f"config: expected a faast.hf.FaastConfig, got {type(config).__name__}")
    wrapped: FaastModel | FaastModuleModel
    if wants_module_model(model, config):
        wrapped = FaastModuleModel(model, config)  # e.g. an encoder classifier: only its target_modules get memories
    else:
        wrapped = FaastModel(model, config)
    WRAPPED_BASE_MODELS.add(model)
    return wrapped


def from_pretrained(base_model: nn.Module, directory: str | Path, **overrides: Any) -> FaastModel | FaastModuleModel:
    """Apply the FaastConfig saved in `directory` to `base_model` and load its readout and scorer weights, and what
    it had learned when save_pretrained wrote its memories (all or nothing: on any error the base model is restored).

    `overrides` replace fields of the saved configuration (e.g. output=EmbeddingOutput(),
    regulariser=Regulariser(alpha=0.8)); what fixes the readout's shape (the middle layers' blocks and scorer, whether
    there is an output layer) must match what was saved.
    """
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"directory: no {CONFIG_NAME} in {directory} (write one with save_pretrained)")
    config = FaastConfig.load(path)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    model = apply_faast(base_model, config)
    for name in ("model_type", "hidden_size", "num_hidden_layers"):
        if getattr(config, name) is not None and getattr(config, name) != getattr(model.faast_config, name):
            model.remove_faast()
            raise ValueError(
                f"{directory}: saved for {name}={getattr(config, name)!r}, the base model has "
                f"{getattr(model.faast_config, name)!r}"
            )
    try:
        model.load_adapter(directory)
        if isinstance(model, FaastModuleModel):  # one set of module memories, in one file
            if (directory / persistence.MEMORIES_NAME).is_file():
                model.load_fast_weights(directory / persistence.MEMORIES_NAME)
            return model
        model.load_memories(directory)
        manifest = persistence.read_manifest(directory)
        saved = [] if manifest is None else [entry["name"] for entry in manifest["memories"]]
        if saved and DEFAULT not in saved:
            model.delete_memory(DEFAULT)  # the saved model had deleted it: give back the same memories
    except BaseException:
        model.remove_faast()
        raise
    return model
