"""apply_faast: attach memory layers to a frozen Hugging Face causal LM, and the FaastModel it returns.

Memory layers are forward pre-hooks on the model's own modules (targets.py), so no modeling code is copied and any
transformers version whose module layout matches the table works. The returned FaastModel wraps the base model:
calls and `generate` go to the base (with the hooks active), and it adds learn / reset / disable / save / load.

The middle layers' statistics live in one MemoryBank (bank.py). While learning, the block hooks only capture each
layer's keys, values and scores; after the backbone pass one bank update learns them all (one Gram accumulation for
every middle layer, one for the output layer), and a solve is one batched eigendecomposition.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from .. import _persist
from .._version import __version__
from ..checkpoint import load_checkpoint, save_state
from ..memory import FastWeights
from .bank import BankCapture
from .config import FaastConfig
from .layers import MemoryLayer, OutputMemoryLayer, memory_bank
from .learn_datasets import LabelledIds, dataset_items, is_dataset
from .modules import BaseModelDelegate, FaastModuleModel, ModuleMemories, wants_module_model
from .output import ResidualOutputLayer, key_state, native_bf16
from .targets import get_submodule, residual_head, target_for
from .tokens import overlapping_windows, pad_rows

_log = logging.getLogger("faast.hf")

CONFIG_NAME = "faast_config.json"
WEIGHTS_NAME = "faast_adapter.safetensors"
FORMAT = "faast.hf.adapter"
FORMAT_VERSION = 1


@dataclass
class LearnStats:
    """What a learn call consumed: tokens fed (real, unpadded; a text cut into w overlapping windows counts its w - 1
    shared tokens twice), pairs added per memory layer (each adjacent pair of the text once), wall time."""

    tokens: int = 0
    pairs: int = 0
    batches: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __iadd__(self, other: LearnStats) -> LearnStats:
        self.tokens += other.tokens
        self.pairs += other.pairs
        self.batches += other.batches
        self.seconds += other.seconds
        return self


@dataclass
class _LearnContext:
    pair_mask: torch.Tensor
    next_embeddings: torch.Tensor | None
    differentiable: bool
    capture: BankCapture | None
    output_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # the output layer's keys and values


class FaastModel(BaseModelDelegate):
    """A causal LM with FAAST memory layers. Build it with `apply_faast(model, config)`.

    Attributes:
        base_model: the wrapped (frozen) transformers model; its modules carry the hooks.
        faast_config: the FaastConfig, with the model's shape filled in.
        memory_bank: MemoryBank(d, d, batch_shape=(L,)), the statistics of the L middle layers (slot i: the i-th
            entry of memory_layers), or None without middle layers.
        memory_layers: nn.ModuleDict block index (str) -> MemoryLayer (`.memory`: the view of its slot of
            memory_bank, `.readout`, `.scorer`). Solve settings (`.memory.alpha`, ...) are shared by all of them.
        output_memory_layer: OutputMemoryLayer or None (`.memory`, a FastWeights of its own).
    Other attributes (config, device, generation_config, ...) are the base model's.
    """

    def __init__(self, base_model: nn.Module, config: FaastConfig):
        super().__init__()
        target = target_for(base_model)
        blocks = get_submodule(base_model, target.blocks, "transformer blocks")
        final_norm = get_submodule(base_model, target.final_norm, "final norm")
        self._backbone_path = target.backbone
        self._documents = 0  # texts learned so far: numbers each window's document (the output layer's step tuning)
        get_submodule(base_model, target.backbone, "decoder backbone")
        hidden = int(base_model.config.hidden_size)
        embeddings = base_model.get_input_embeddings()
        if config.output_layer and config.output_target == "embedding" and embeddings.embedding_dim != hidden:
            raise ValueError(
                f"model: the output memory layer needs input embeddings of the hidden size {hidden}, got "
                f"{embeddings.embedding_dim}; use FaastConfig(output_layer=False)"
            )
        num_params = sum(p.numel() for p in base_model.parameters())
        indices = config.block_indices(len(blocks), num_params)
        key_blocks = config.output_key_blocks(len(blocks))
        self.faast_config = FaastConfig.from_dict(
            {
                **config.to_dict(),
                "layers": indices,
                "output_key_layers": key_blocks,
                "model_type": base_model.config.model_type,
                "hidden_size": hidden,
                "num_hidden_layers": len(blocks),
                "faast_version": __version__,
            }
        )
        device = next(base_model.parameters()).device
        self.base_model = base_model
        for p in base_model.parameters():
            p.requires_grad_(False)
        self.memory_bank = memory_bank(hidden, len(indices), self.faast_config, device) if indices else None
        self.memory_layers = nn.ModuleDict(
            {
                str(i): MemoryLayer(hidden, self.faast_config, i, device=device, bank=self.memory_bank, slot=slot)
                for slot, i in enumerate(indices)
            }
        )
        self.output_memory_layer: OutputMemoryLayer | ResidualOutputLayer | None = None
        if config.output_layer and config.output_target == "residual":
            head = residual_head(base_model, target)  # scaled when the type scales its logits (targets.py)
            if head is None or getattr(head, "weight", None) is None or head.weight.shape[-1] != hidden:
                raise ValueError(
                    f"model: the residual output layer needs an LM head (get_output_embeddings()) reading the hidden"
                    f" size {hidden}; use FaastConfig(output_target='embedding') or output_layer=False"
                )
            vocab = head.weight.shape[0]
            self.output_memory_layer = ResidualOutputLayer(
                hidden, vocab, self.faast_config, device=device, extra_key_size=hidden * len(key_blocks)
            )
            self.output_memory_layer.attach_head(head)
        elif config.output_layer:
            self.output_memory_layer = OutputMemoryLayer(hidden, hidden, self.faast_config, device=device)
        self._disabled_parts = {"all": 0, "middle": 0, "output": 0, "modules": 0}
        self._learn: _LearnContext | None = None
        # Capture buffers [L, B, T-1, d], reused by the next batch of the same shape; learn() drops them at its end.
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # The residual output layer's extra keys: key_state of these blocks' inputs in the current forward pass,
        # taken before a middle memory layer on the same block changes the input (hooks run in registration order).
        self._key_blocks = key_blocks
        self._key_states: list[torch.Tensor | None] = [None] * len(key_blocks)
        self._final_states: torch.Tensor | None = None
        self._handles = [
            blocks[i].register_forward_pre_hook(partial(self._key_hook, slot), with_kwargs=True)
            for slot, i in enumerate(key_blocks)
        ]
        self._handles += [
            blocks[i].register_forward_pre_hook(self._block_hook(layer), with_kwargs=True)
            for i, layer in ((int(k), v) for k, v in self.memory_layers.items())
        ]
        if isinstance(self.output_memory_layer, ResidualOutputLayer):
            self._handles.append(final_norm.register_forward_hook(self._residual_hook))
            # Probability space mixes at the head's output (its input is the final norm's output, as the model
            # slices it, e.g. the last position only while generating).
            self._handles.append(base_model.get_output_embeddings().register_forward_hook(self._head_hook))
        elif self.output_memory_layer is not None:
            self._handles.append(final_norm.register_forward_pre_hook(self._output_hook, with_kwargs=True))
        # Memories on FaastConfig.target_modules (modules.py); empty, with no hooks, when none are configured.
        self.module_memories = ModuleMemories(
            base_model, self.faast_config, enabled=lambda: not self._part_disabled("modules")
        )

    def faast_layers(self) -> Iterator[MemoryLayer | OutputMemoryLayer]:
        """Every memory layer: the middle ones in block order, then the output layer."""
        yield from self.memory_layers.values()
        if self.output_memory_layer is not None:
            yield self.output_memory_layer

    def fast_weights(self) -> list[FastWeights]:
        """The FastWeights holding all learned state: the middle layers' bank, then the output layer's memory (and,
        for the residual output layer, its curvature)."""
        return [memory for _, memory in self._bank_memories()]

    # ------------------------------------------------------------------ hooks

    def _block_hook(self, layer: MemoryLayer):  # noqa: ANN202 - a hook closure
        def hook(module: nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202, ARG001
            if self._part_disabled("middle"):
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            if self._learn is not None:
                # Capture only: the bank learns every layer at once after the pass (_learn_batch).
                self._learn.capture.add(layer.slot, hidden)
                return None
            out = layer(hidden)
            if args:
                return (out, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": out}

        return hook

    def _output_hook(self, module: nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202, ARG002
        if self._part_disabled("output"):
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        if self._learn is not None:
            keep = self._learn.pair_mask.unsqueeze(-1)
            embeddings = self._learn.next_embeddings
            self._learn.output_rows = (
                torch.where(keep, hidden[:, :-1], hidden.new_zeros(())),
                torch.where(keep, embeddings, embeddings.new_zeros(())),
            )
            return None
        out = self.output_memory_layer(hidden)
        if args:
            return (out, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": out}

    def _key_hook(self, slot: int, module: nn.Module, args: tuple, kwargs: dict) -> None:  # noqa: ARG002
        if self._part_disabled("output"):
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        self._key_states[slot] = key_state(hidden)

    def _extra_keys(self, hidden: torch.Tensor, final: torch.Tensor | None = None) -> torch.Tensor | None:
        """The extra keys [B, T', d·len(key blocks)] for hidden [B, T', d], the final norm's output as the head reads
        it (the model may keep only its last T' positions, e.g. one while generating): the last T' positions of the
        key states captured in this forward pass. They are used once: the next pass captures its own. final: the
        final norm's output of the pass [B, T, d], to check that the head reads its last T' positions (a model asked
        for other positions, e.g. logits_to_keep as an index tensor, is refused rather than read misaligned)."""
        if not self._key_blocks:
            return None
        states, self._key_states = self._key_states, [None] * len(self._key_blocks)
        rows = hidden.shape[-2] if hidden.dim() >= 2 else 1
        if final is not None and final.shape[-2] != rows and not torch.equal(final[..., final.shape[-2] - rows :, :],
                                                                             hidden):  # fmt: skip
            raise ValueError(
                "logits_to_keep: the output layer's wider keys (FaastConfig.output_key_layers) align the head's rows "
                "with the last positions of the pass; ask for the last k positions (an int), or use "
                "output_key_layers=[]"
            )
        if any(s is None or s.shape[:-2] != hidden.shape[:-2] or s.shape[-2] < rows for s in states):
            got = [None if s is None else list(s.shape) for s in states]
            raise RuntimeError(
                f"faast: the output layer reads the inputs of blocks {self._key_blocks} of the same forward pass "
                f"(for hidden states of shape {list(hidden.shape)}), but captured {got}: call the model, not its "
                f"head alone"
            )
        return torch.cat([s[..., s.shape[-2] - rows :, :] for s in states], -1)

    def _residual_hook(self, module: nn.Module, args: tuple, output: torch.Tensor):  # noqa: ANN202, ARG002
        if self._part_disabled("output"):
            return None
        if self._learn is not None:
            self._learn.output_rows = (output, None)  # the final norm's output h̃; targets come after the pass
            return None
        if self.output_memory_layer.space == "probability":
            self._final_states = output if self._key_blocks else None  # _head_hook checks the rows it reads
            return None  # read at the head (_head_hook)
        return self.output_memory_layer(output, self._extra_keys(output))

    def _head_hook(self, module: nn.Module, args: tuple, output: torch.Tensor):  # noqa: ANN202, ARG002
        if self._part_disabled("output") or self._learn is not None or not args:
            return None
        if self.output_memory_layer.space != "probability":
            return None  # read after the final norm (_residual_hook)
        layer, hidden = self.output_memory_layer, args[0]
        final, self._final_states = self._final_states, None
        m, _ = layer.solution(hidden.device, hidden.dtype)
        extra = self._extra_keys(hidden, final) if m is not None and m.shape[0] > layer.hidden_size else None
        self._key_states = [None] * len(self._key_blocks)  # used by this pass or not at all
        return layer.read_logits(hidden, output, extra)

    @contextlib.contextmanager
    def disable_faast(self, which: str = "all") -> Iterator[None]:
        """Inside, memory layers neither read nor learn. which='all' (outputs are the base model's, bit for bit),
        'middle' (only the output layer acts), 'output' (only the middle layers act) or 'modules' (the
        target_modules memories pass their modules' outputs through): for ablations."""
        if which not in ("all", "middle", "output", "modules"):
            raise ValueError(f"which: expected 'all', 'middle' or 'output' (or 'modules'), got {which!r}")
        self._disabled_parts[which] += 1
        try:
            yield
        finally:
            self._disabled_parts[which] -= 1

    def _part_disabled(self, part: str) -> bool:
        return self._disabled_parts["all"] > 0 or self._disabled_parts[part] > 0

    def remove_faast(self) -> nn.Module:
        """Detach the hooks for good and return the base model (its parameters stay frozen)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.module_memories.remove_hooks()
        return self.base_model

    # ------------------------------------------------------------------ learning

    def _learn_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        labels: torch.Tensor | None = None,
        differentiable: bool = False,
        documents: torch.Tensor | None = None,
    ) -> LearnStats:
        input_ids, mask = _check_batch(input_ids, attention_mask, self.base_model)
        started = time.perf_counter()
        pair_mask = mask[:, :-1] & mask[:, 1:]
        targets = input_ids[:, 1:]
        if labels is not None:
            labels = _check_labels(labels, input_ids, self.base_model)
            # The Hugging Face convention: labels[:, t+1] is the target after position t; -100 is not learned.
            pair_mask = pair_mask & (labels[:, 1:] != -100)
            targets = torch.where(pair_mask, labels[:, 1:], targets)
        # Positions count real tokens only, so a left-padded row learns exactly what the unpadded text gives.
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        next_embeddings = None
        if isinstance(self.output_memory_layer, OutputMemoryLayer):
            next_embeddings = self.base_model.get_input_embeddings()(input_ids[:, 1:])
        backbone = self.base_model.get_submodule(self._backbone_path)
        capture = None
        if self.memory_bank is not None:
            layers = list(self.memory_layers.values())
            capture = BankCapture(layers, pair_mask, differentiable, workspace=self._workspace)
        self._learn = context = _LearnContext(pair_mask, next_embeddings, differentiable, capture)
        try:
            with (
                torch.set_grad_enabled(differentiable),
                _eval_mode(self.base_model),
                self.module_memories.passthrough(),  # every layer learns from the base model's own activations
                self._learn_autocast(input_ids.device, differentiable),
            ):
                backbone(input_ids=input_ids, attention_mask=mask.long(), position_ids=positions, use_cache=False)
        finally:
            self._learn = None
        # Every statistic is added after the pass, so an error inside it (or in the bank's checks) learns nothing.
        if capture is not None:
            with torch.set_grad_enabled(differentiable):
                step = capture.update(self.memory_bank)
            self._workspace = capture.release()
            if step is not None:
                for layer in self.memory_layers.values():
                    layer.add_step_cross(step[layer.slot])
        if context.output_rows is not None and isinstance(self.output_memory_layer, ResidualOutputLayer):
            extra = self._extra_keys(context.output_rows[0])
            self.output_memory_layer.learn(context.output_rows[0], targets, pair_mask, documents, extra)
        elif context.output_rows is not None:
            self.output_memory_layer.memory.update(*context.output_rows, mask=pair_mask)
        # One host sync for both counts.
        tokens, pairs = torch.stack([mask.sum(), pair_mask.sum()]).tolist()
        return LearnStats(tokens=tokens, pairs=pairs, batches=1, seconds=time.perf_counter() - started)

    def _learn_autocast(self, device: torch.device, differentiable: bool) -> contextlib.AbstractContextManager:
        """bfloat16 autocast for learn()'s forward pass where config.learn_dtype asks for it (never while training the
        readout: its gradients keep the model's precision). The captured states stay float32: the residual stream
        and the norms' outputs are float32 under autocast, only the matrix products inside the blocks round."""
        setting = self.faast_config.learn_dtype
        if differentiable or setting == "model":
            return contextlib.nullcontext()
        if setting == "auto":
            weights = self.base_model.get_input_embeddings().weight
            if weights.dtype != torch.float32 or not native_bf16(device):
                return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

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
            progress: show a tqdm bar with tokens/s (default: when learning from an iterable and stderr is a tty).

        Returns LearnStats (tokens, pairs per layer, batches, seconds, tokens_per_second).
        """
        inputs = _learn_source(inputs, input_ids)
        if isinstance(inputs, torch.Tensor):
            return self._learn_tensor(inputs, attention_mask, labels)
        inputs = _learn_items(inputs, attention_mask, labels, tokenizer, text_column)
        device = self.base_model.get_input_embeddings().weight.device
        batches = _batches(inputs, tokenizer, max_length, batch_size, device)
        return self._learn_stream(batches, progress)

    def _learn_tensor(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
    ) -> LearnStats:
        """learn() on one input_ids batch."""
        try:
            with torch.no_grad():
                return self._learn_batch(input_ids, attention_mask, labels=labels)
        finally:
            self._workspace = None  # the capture buffers live for one learn call

    def _learn_stream(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None]],
        progress: bool | None,
    ) -> LearnStats:
        """learn() on (input_ids, attention_mask, labels, documents) batches, consumed lazily, with an optional
        progress bar."""
        stats = LearnStats()
        bar = _progress_bar(progress)
        # Document numbers continue across learn() calls, so a later call's texts never share one with earlier ones.
        first = self._documents
        try:
            with torch.no_grad():
                for ids, mask, batch_labels, documents in batches:
                    if documents is not None:  # host ints: numbering them costs no device sync
                        self._documents = first + documents[-1] + 1
                        documents = torch.tensor(documents, dtype=torch.long, device=ids.device) + first
                    learned = self._learn_batch(ids, mask, labels=batch_labels, documents=documents)
                    stats += learned
                    if bar is not None:
                        bar.update(learned.tokens)
                        bar.set_postfix_str(f"{stats.tokens_per_second:,.0f} tok/s", refresh=False)
        finally:
            self._workspace = None
            if bar is not None:
                bar.close()
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
        with torch.no_grad(), _eval_mode(self.base_model), contextlib.ExitStack() as stack:
            stack.enter_context(self.disable_faast("middle"))
            stack.enter_context(self.disable_faast("output"))
            return self.module_memories.learn_forward(lambda: self.base_model(*args, **model_inputs), targets, mask)

    def learn_module(
        self, inputs: torch.Tensor, *, targets: torch.Tensor, name: str | None = None, mask: torch.Tensor | None = None
    ) -> int:
        """Learn target module `name` (None: the only one) from its inputs [..., d_in] and targets (float
        [..., d_out] or class ids [...]); the module computes its own output. Returns the rows learned."""
        return self.module_memories.learn_inputs(inputs, targets, name=name, mask=mask)

    def solve(self) -> FaastModel:
        """Solve every memory layer now, for the model's device and dtype; otherwise the first forward pass after
        learning does it. Middle layers: one batched eigendecomposition and the folded W·P; the residual output
        layer: its Newton step and the step tuned on the held-out tail. Cached until the statistics change."""
        weight = self.base_model.get_input_embeddings().weight
        device, dtype = weight.device, weight.dtype
        for layer in self.faast_layers():
            if isinstance(layer, OutputMemoryLayer):
                layer.weights(device, dtype)
            else:
                layer.folded(device, dtype)
        self.module_memories.solve()
        return self

    def reset_fast_weights(self) -> FaastModel:
        """Forget everything learned (the readout and scorer stay)."""
        for memory in self.fast_weights():
            memory.reset()
        if isinstance(self.output_memory_layer, ResidualOutputLayer):
            self.output_memory_layer.forget()  # also its held-out buffer and saved step
        return self

    # ------------------------------------------------------------------ readout training (faast.hf.train)

    def begin_training_step(self) -> None:
        """Solve W = S_eps^+ T of every middle layer in one call, T differentiable in the scorers (S_eps^+ constant).

        The layers then read these W (float32, with the graph) until end_training_step; see MemoryLayer.
        """
        if self.memory_bank is None:
            return
        layers = list(self.memory_layers.values())
        deltas = [layer.step_cross_delta() for layer in layers]
        cross = self.memory_bank.cross
        if any(d is not None for d in deltas):
            zero = torch.zeros_like(cross[0])
            cross = cross + torch.stack([zero if d is None else d for d in deltas])
        weights = self.memory_bank.solve_for(cross).to(torch.float32)
        for layer in layers:
            layer._train_weights = weights[layer.slot]

    def end_training_step(self) -> None:
        """Drop the training step's differentiable T and W: the layers read the folded fast weights again."""
        for layer in self.memory_layers.values():
            layer.end_training_step()

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the FaastConfig (JSON) and the readout + scorer weights (safetensors, fp32), atomically.

        Nothing of the base model is written; load with faast.hf.from_pretrained(base_model, directory). The
        learned fast weights are state of their own: save_fast_weights.
        """
        directory = Path(directory)
        tensors = {}
        for key, layer in self.memory_layers.items():
            tensors[f"layers.{key}.readout.weight"] = layer.readout.weight
            if layer.scorer is not None:
                tensors[f"layers.{key}.scorer.weight"] = layer.scorer.weight
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "faast_version": __version__,
            "config": self.faast_config.to_json(),
        }
        _persist.write_atomic(directory / WEIGHTS_NAME, tensors, metadata)
        self.faast_config.save(directory / CONFIG_NAME)
        return directory

    def load_adapter(self, directory: str | Path) -> FaastModel:
        """Load readout + scorer weights written by save_pretrained into this model (all or nothing)."""
        path = Path(directory) / WEIGHTS_NAME
        tensors, metadata = _persist.read_verified(path)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (format={metadata.get('format')!r})")
        if int(metadata.get("format_version", "0")) > FORMAT_VERSION:
            raise ValueError(f"{path}: written by a newer faast; upgrade faast")
        saved = FaastConfig.from_json(metadata["config"])
        mine = self.faast_config
        for name in ("model_type", "hidden_size", "num_hidden_layers", "layers", "scorer", "output_layer"):
            if getattr(saved, name) != getattr(mine, name):
                raise ValueError(
                    f"{path}: saved for {name}={getattr(saved, name)!r}, this model has {getattr(mine, name)!r}"
                )
        expected = {}
        for key, layer in self.memory_layers.items():
            expected[f"layers.{key}.readout.weight"] = layer.readout.weight
            if layer.scorer is not None:
                expected[f"layers.{key}.scorer.weight"] = layer.scorer.weight
        if set(tensors) != set(expected):
            raise ValueError(f"{path}: expected tensors {sorted(expected)}, found {sorted(tensors)}")
        for name, t in tensors.items():
            if t.shape != expected[name].shape or not t.is_floating_point():
                raise ValueError(
                    f"{path}: tensor {name} has shape {list(t.shape)} {t.dtype}, expected "
                    f"{list(expected[name].shape)} floating point"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{path}: tensor {name} holds NaN/Inf; refusing to load it")
        with torch.no_grad():
            for name, t in tensors.items():
                expected[name].copy_(t)
        return self

    def save_fast_weights(self, path: str | Path) -> Path:
        """Write every memory layer's statistics to one safetensors file, atomically (loads back bit-exact; missing
        parent folders are created).

        The file keeps the per-layer layout (a faast.Checkpoint file with one d×d memory per middle layer, named
        `memory_layers.<block>.memory`, and `output_memory_layer.memory`), so files written before the middle layers
        shared one bank and files written now are interchangeable. With the residual output layer's step or weight
        'auto', the ones in use are written too (its tuning buffer is not), so the loaded model reads exactly like
        this one (and the key width chosen with them: h̃ alone or the full keys).
        """
        extra = {}
        layer = self.output_memory_layer
        if isinstance(layer, ResidualOutputLayer):
            if layer.step == "auto" and (step := layer.chosen_step()) is not None:
                extra["output_step"] = step
            tuned_weight = layer.space == "probability" and layer.weight == "auto"
            if tuned_weight and (weight := layer.chosen_weight()) is not None:
                extra["output_weight"] = weight
            if layer.extra_key_size and (width := layer.chosen_key_width()) is not None:
                extra["output_key_width"] = width
        return save_state(path, self._per_layer_memories(copy=True), extra)

    def load_fast_weights(self, path: str | Path) -> FaastModel:
        """Load statistics written by save_fast_weights (the layers must match; all or nothing).

        Also reads a checkpoint of this model in the bank layout (faast.checkpoint on the FaastModel itself, memories
        `memory_bank` and `output_memory_layer.memory`), ignoring its stream position.
        """
        self.module_memories.prepare_load(path)  # sizes the memories of modules of unknown width
        check = partial(_saved_output_step, path)
        if _saved_memory_names(path) == sorted(name for name, _ in self._bank_memories()):
            self._restore_output_step(load_checkpoint(path, self._bank_holder(), check))
            return self
        holder = self._per_layer_memories(copy=False)
        # validates every memory of the file (and the saved step) before copying any
        self._restore_output_step(load_checkpoint(path, holder, check))
        if self.memory_bank is not None:
            slots = [holder.memory_layers[key].memory for key in self.memory_layers]
            self.memory_bank.load_state_dict(
                {name: torch.stack([getattr(m, name) for m in slots]) for name in self.memory_bank.state_dict()}
            )
        return self

    def _restore_output_step(self, position: dict) -> None:
        """Hand the residual output layer the step saved with its statistics (None in files without one)."""
        layer = self.output_memory_layer
        if isinstance(layer, ResidualOutputLayer):
            layer.restore_step(position.get("output_step"), position.get("output_weight"),
                               position.get("output_key_width"))  # fmt: skip
            layer._tail = []  # positions learned before the load are not in the loaded statistics

    def _bank_memories(self) -> list[tuple[str, FastWeights]]:
        named = [] if self.memory_bank is None else [("memory_bank", self.memory_bank)]
        if self.output_memory_layer is not None:
            named.append(("output_memory_layer.memory", self.output_memory_layer.memory))
        if isinstance(self.output_memory_layer, ResidualOutputLayer):
            named.append(("output_memory_layer.curvature", self.output_memory_layer.curvature))
            named.append(("output_memory_layer.token_mass", self.output_memory_layer.token_mass))
        named.extend(self.module_memories.named_memories())
        return named

    def _bank_holder(self) -> nn.Module:
        holder = nn.Module()
        if self.memory_bank is not None:
            holder.memory_bank = self.memory_bank
        if self.output_memory_layer is not None:
            holder.output_memory_layer = self.output_memory_layer
        holder.module_memories = self.module_memories
        return holder

    def _per_layer_memories(self, *, copy: bool) -> nn.Module:
        """A module with one FastWeights(d, d) per middle layer at `memory_layers.<block>.memory` (copies of the
        bank's slots when `copy`, else empty ones to load into) and the output layer: the per-layer file layout."""
        holder = nn.Module()
        layers = nn.ModuleDict()
        bank = self.memory_bank
        for key, layer in self.memory_layers.items():
            memory = FastWeights(
                bank.dim_key, bank.dim_value, alpha=bank.alpha, rtol=bank.rtol, ridge=bank.ridge,
                compute_dtype=bank.compute_dtype, device=bank.device,
            )  # fmt: skip
            if copy:
                memory.load_state_dict(layer.memory.state_dict())
            slot = nn.Module()
            slot.memory = memory
            layers[key] = slot
        holder.memory_layers = layers
        if self.output_memory_layer is not None:
            holder.output_memory_layer = self.output_memory_layer
        holder.module_memories = self.module_memories
        return holder

    def fast_weight_bytes(self) -> int:
        """Bytes of learned state: the float64 statistics of every memory layer and the residual output layer's
        held-out tail; independent of tokens learned."""
        total = sum(b.numel() * b.element_size() for memory in self.fast_weights() for b in memory.buffers())
        if isinstance(self.output_memory_layer, ResidualOutputLayer):
            total += self.output_memory_layer.tail_capacity_bytes()
        return total


# ---------------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    # Learning reads the frozen model's activations: no dropout even while a readout is being trained.
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _check_batch(input_ids: object, attention_mask: object, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids: expected an int64 tensor [batch, seq], got {_describe(input_ids)}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids: expected a non-empty [batch, seq] tensor, got shape {list(input_ids.shape)}")
    vocab = model.get_input_embeddings().num_embeddings
    if bool(((input_ids < 0) | (input_ids >= vocab)).any()):  # one host sync for both bounds
        raise ValueError(
            f"input_ids: token ids must lie in [0, {vocab}), got [{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    device = model.get_input_embeddings().weight.device
    if input_ids.device != device:
        raise ValueError(f"input_ids: on {input_ids.device}, the model is on {device}")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask: expected a tensor [batch, seq] or None, got {_describe(attention_mask)}")
        if attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask: expected shape {list(input_ids.shape)} like input_ids, got "
                f"{list(attention_mask.shape)}"
            )
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask: on {attention_mask.device}, input_ids on {input_ids.device}")
        if attention_mask.dtype != torch.bool and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask: expected 0/1 (or bool) entries")
        mask = attention_mask.bool()
    return input_ids.long(), mask


def _check_labels(labels: object, input_ids: torch.Tensor, model: nn.Module) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: expected an int64 tensor [batch, seq] like input_ids, got {_describe(labels)}")
    if labels.dim() == 1:
        labels = labels.unsqueeze(0)
    if labels.shape != input_ids.shape or labels.device != input_ids.device:
        raise ValueError(
            f"labels: expected shape {list(input_ids.shape)} on {input_ids.device} like input_ids, got "
            f"{list(labels.shape)} on {labels.device}"
        )
    vocab = model.get_input_embeddings().num_embeddings
    if bool((((labels < 0) & (labels != -100)) | (labels >= vocab)).any()):
        raise ValueError(f"labels: expected token ids in [0, {vocab}) or -100 (not learned)")
    return labels.long()


def _saved_memory_names(path: str | Path) -> list[str] | None:
    """The memory names in a faast.Checkpoint file's header (sorted), or None when the header cannot say; the
    full read (load_checkpoint) then reports what is wrong with the file."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        return sorted(json.loads(metadata["memories"]))
    except Exception:  # noqa: BLE001 - any unreadable header: let the verified read explain it
        return None


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


def _learn_source(inputs: object, input_ids: object) -> object:
    """learn()'s inputs, given either positionally or as the input_ids keyword."""
    if input_ids is not None:
        if inputs is not None:
            raise ValueError("input_ids: give the batch either as inputs or as input_ids, not both")
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected an int64 tensor [batch, seq], got {_describe(input_ids)}")
        inputs = input_ids
    if inputs is None:
        raise ValueError("inputs: nothing to learn (give input_ids, a text or an iterable of texts or batches)")
    return inputs


def _learn_items(
    inputs: object,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    tokenizer: object | None,
    text_column: str | None,
) -> Iterable:
    """learn()'s inputs other than an input_ids tensor as an iterable of items for _batches: a dataset's rows, a
    single text, token-id list or tokenised batch as a list of one, any other iterable as it is."""
    if labels is not None:
        raise ValueError("labels: only valid with an input_ids tensor; a dataset gives them as its labels column")
    if attention_mask is not None:
        raise ValueError("attention_mask: only valid with an input_ids tensor; batches carry their own masks")
    if is_dataset(inputs):
        inputs = dataset_items(inputs, tokenizer, text_column)
    elif text_column is not None:
        raise ValueError(
            f"text_column: only valid with a datasets.Dataset or IterableDataset, not {_describe(inputs)}"
        )
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, Mapping) or (
        isinstance(inputs, list | tuple) and inputs and all(isinstance(t, int) for t in inputs)
    ):
        inputs = [inputs]  # one tokenised batch, or one text as token ids
    return inputs


def _batches(
    inputs: Iterable, tokenizer: object | None, max_length: int, batch_size: int, device: torch.device | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None]]:
    """(input_ids, attention_mask, labels or None, documents or None) batches from texts, id lists, LabelledIds, id
    tensors or tokenised mappings, lazily. documents (B ints) are the index in `inputs` of the text each window was
    cut from (None for a tensor or a mapping: their rows' documents are not known).

    Batches built here from texts or token-id lists are put on `device` (the model's); tensors the caller passes keep
    their device, so a mismatch is reported by the batch check rather than copied silently."""

    def built(x: object) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, device=device)

    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length: expected an int >= 2, got {max_length!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    pending: list[tuple[list[int], list[int] | None]] = []
    for n, item in enumerate(inputs):
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ValueError(f"inputs[{n}]: a tokenised batch needs 'input_ids', got keys {sorted(item)}")
            yield (
                built(item["input_ids"]),
                (None if item.get("attention_mask") is None else built(item["attention_mask"])),
                None,
                None,
            )
            continue
        if isinstance(item, torch.Tensor):
            yield item, None, None, None
            continue
        labels = None
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("tokenizer: required to learn from texts")
            ids = tokenizer(item, add_special_tokens=False)["input_ids"]
        elif isinstance(item, LabelledIds):
            ids, labels = item.input_ids, item.labels
        elif isinstance(item, list | tuple) and all(isinstance(t, int) for t in item):
            ids = item
        else:
            raise TypeError(
                f"inputs[{n}]: expected a text, a list of token ids, an input_ids tensor or a mapping, got "
                f"{type(item).__name__}"
            )
        # Labels are cut into the same windows as the ids: both have the same length.
        label_windows = overlapping_windows(labels, max_length) if labels is not None else None
        for window in overlapping_windows(ids, max_length):
            pending.append((window, None if label_windows is None else next(label_windows), n))
            if len(pending) == batch_size:
                yield _padded(pending, device)
                pending = []
    if pending:
        yield _padded(pending, device)


def _padded(
    windows: list[tuple[list[int], list[int] | None, int]], device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """(input_ids, attention_mask, labels or None) [B, T] and the rows' documents (a list of B ints) from (window,
    labels, document) triples, right padded; labels are padded with -100 and are the ids themselves for a window
    without labels (every pair learned), or None when no window has any."""
    ids, mask = pad_rows([w for w, _, _ in windows])
    labels = None
    if any(lab is not None for _, lab, _ in windows):
        labels, _ = pad_rows([w if lab is None else lab for w, lab, _ in windows], pad_id=-100)
        labels = labels.to(device)
    return ids.to(device), mask.to(device), labels, [doc for _, _, doc in windows]


def _progress_bar(progress: bool | None):  # noqa: ANN202 - tqdm or None
    import sys

    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        _log.info("faast: install tqdm for a progress bar")
        return None
    return tqdm(unit="tok", unit_scale=True, desc="faast learn")


# ---------------------------------------------------------------------------------------------------- entry points


def apply_faast(model: nn.Module, config: FaastConfig | None = None) -> FaastModel | FaastModuleModel:
    """Attach FAAST memory layers to a transformers causal LM and freeze its parameters (the model types of
    faast.hf.targets.TARGETS; others through faast.hf.targets.discover_target, or refused with the reason).

    Args:
        model: a *ForCausalLM model; it is modified in place (hooks on its blocks and final norm).
        config: FaastConfig (default: FaastConfig(), the paper's placement).

    Returns a FaastModel wrapping `model`: call it or `generate` as the base model, plus learn, reset_fast_weights,
    disable_faast, save_pretrained, save_fast_weights / load_fast_weights. With config.target_modules on a model that
    is not an LM (e.g. a BERT classifier), a FaastModuleModel holding only those memories (docs/design.md §6.6).
    """
    if isinstance(model, FaastModel | FaastModuleModel):
        raise ValueError("model: FAAST is already applied to this model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers causal LM (nn.Module), got {type(model).__name__}")
    if config is None:
        config = FaastConfig()
    if not isinstance(config, FaastConfig):
        raise TypeError(f"config: expected a faast.hf.FaastConfig, got {type(config).__name__}")
    if wants_module_model(model, config):
        return FaastModuleModel(model, config)  # e.g. an encoder classifier: only its target_modules get memories
    return FaastModel(model, config)


def _saved_output_step(path: str | Path, position: dict) -> None:
    """Refuse a file whose saved output-layer step is not a finite number >= 0."""
    step = position.get("output_step")
    if step is not None and not (type(step) in (int, float) and math.isfinite(step) and step >= 0):
        raise ValueError(f"{path}: output_step: expected a finite number >= 0, got {step!r}")
    weight = position.get("output_weight")
    if weight is not None and not (type(weight) in (int, float) and 0 <= weight <= 1):
        raise ValueError(f"{path}: output_weight: expected a number in [0, 1], got {weight!r}")
    width = position.get("output_key_width")
    if width is not None and not (type(width) is int and width > 0):
        raise ValueError(f"{path}: output_key_width: expected an int > 0, got {width!r}")


def from_pretrained(base_model: nn.Module, directory: str | Path, **overrides: object) -> FaastModel:
    """Apply the FaastConfig saved in `directory` to `base_model` and load its readout and scorer weights.

    `overrides` replace fields of the saved configuration (e.g. output_target='embedding', alpha=0.8); fields that
    fix the readout's shape (layers, scorer, output_layer) must match what was saved.
    """
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"directory: no {CONFIG_NAME} in {directory} (write one with save_pretrained)")
    config = FaastConfig.load(path)
    if overrides:
        config = FaastConfig.from_dict({**config.to_dict(), **overrides})
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
    except BaseException:
        model.remove_faast()
        raise
    return model
