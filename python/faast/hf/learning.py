"""The learning loop of a FaastModel: one forward pass of the decoder per batch, statistics added after it.

A batch's pass runs the backbone without the LM head (the residual output layer computes the head's logits for the
learned positions itself), in eval mode, with the module memories passing through, so every layer learns from the base
model's own activations. The hooks only capture during the pass (faast/hf/hooks.py); every statistic is added after
it, so an error inside the pass learns nothing from that batch. Hidden states are left unchanged (docs/design.md §6.4).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ..hardware import native_bf16
from ..ops import paths
from .bank import MemoryBank
from .base import eval_mode
from .capture import BankCapture
from .hooks import LearnPass, ModelHooks
from .inputs import Batch, check_batch, check_labels
from .int8_pass import Int8Pass, Int8Weights
from .layers import MemoryLayer, OutputMemoryLayer
from .lm import input_embeddings
from .modules import ModuleMemories
from .output import ResidualOutputLayer
from .output.head import head_shape_class, pool_shape_class, pool_threshold, products_dtype
from .pass_choice import learn_pass_mode, linear_shapes, shape_class
from .progress import Bar, Metered, enabled

_log = logging.getLogger("faast.hf")


# A stream reading a learning pass (Learner.learn_batch): (h̃, extra keys, targets, pair_mask) -> the head's logits.
Reader = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LearnStats:
    """What a learn call consumed: tokens fed (real, unpadded; a text cut into w overlapping windows counts its w - 1
    shared tokens twice), pairs added per memory layer (each adjacent pair of the text once), wall time; with
    learn(solve=True), the memory's residual output tuning as FaastModel.solve reports it (else None)."""

    tokens: int = 0
    pairs: int = 0
    batches: int = 0
    seconds: float = 0.0
    tuning: dict | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __iadd__(self, other: LearnStats) -> LearnStats:
        self.tokens += other.tokens
        self.pairs += other.pairs
        self.batches += other.batches
        self.seconds += other.seconds
        return self


class Learner:
    """Runs a FaastModel's learning passes and owns the loop's state: the document numbering (the residual output
    layer's step tuning keeps texts apart) and the capture buffers reused within one learn call.

    Args:
        base_model: the transformers model; backbone: its decoder without the LM head.
        hooks: the model's ModelHooks; bank: the middle layers' MemoryBank (None without middle layers);
        middle_layers: the MemoryLayers in slot order; output_layer: the output layer or None;
        module_memories: the target_modules memories (they pass through while the LM layers learn);
        learn_dtype: FaastConfig.learn_dtype ('auto', 'model', 'bfloat16' or 'int8').
    """

    def __init__(
        self,
        base_model: nn.Module,
        backbone: nn.Module,
        hooks: ModelHooks,
        bank: MemoryBank | None,
        middle_layers: list[MemoryLayer],
        output_layer: ResidualOutputLayer | OutputMemoryLayer | None,
        module_memories: ModuleMemories,
        learn_dtype: str,
    ) -> None:
        self.base_model, self.backbone, self.hooks = base_model, backbone, hooks
        self.bank, self.middle_layers, self.output_layer = bank, list(middle_layers), output_layer
        self.module_memories, self.learn_dtype = module_memories, learn_dtype
        self._documents = 0  # texts learned so far: numbers each window's document
        self._ends_on_text = False  # the last batch learned held texts (their documents known)
        self._unknown_rows = 0  # rows of unknown documents learned so far (a tensor's rows)
        # Told about every batch learned (validated ids, real tokens, learned pairs, documents): the ledger.
        self._sink: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None
        # Capture buffers [L, B, T-1, d], reused by the next batch of the same shape; dropped at the end of a call.
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._int8 = Int8Weights()  # the decoder's int8 weights of an int8 pass, kept for one learn call
        self._int8_count: int | None = None  # the backbone's linears an int8 pass takes (counted once)
        self._said_no_int8 = False  # 'auto' found none of them: logged once

    @contextlib.contextmanager
    def recording(
        self, sink: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]
    ) -> Iterator[None]:
        """Inside, sink(input_ids [B, T], mask [B, T] bool, pair_mask [B, T-1] bool, documents [B] int64 or None) is
        called after each batch is learned (FaastModel keeps a ledger of what each memory learned)."""
        self._sink = sink
        try:
            yield
        finally:
            self._sink = None

    def use_bank(self, bank: MemoryBank | None) -> None:
        """Learn the middle layers into `bank` from now on (FaastModel switching named memories)."""
        self.bank = bank

    @property
    def documents_numbered(self) -> int:
        """Texts numbered so far: the next learn_stream call numbers its texts from here."""
        return self._documents

    @property
    def ends_on_text(self) -> bool:
        """Whether the last batch learned held texts (not a tensor's or a mapping's rows): a later call may continue
        the last of them (learn_stream's `continues`)."""
        return self._ends_on_text

    def learn_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        labels: torch.Tensor | None = None,
        differentiable: bool = False,
        documents: torch.Tensor | None = None,
        reader: Reader | None = None,
    ) -> LearnStats:
        """Learn one batch: input_ids [B, T] int64, attention_mask [B, T] (None: all real), labels [B, T] (-100: the
        pair predicting that position is not learned), documents [B] int64 (each row's text, for the step tuning).
        differentiable: keep each middle layer's T with the graph to its scorer (readout training). reader: a stream
        reading the batch (faast/hf/reading.py): called after the pass with (h̃ [B, T, d], the extra keys or None,
        targets, pair_mask), before the residual output layer learns; it scores the batch with what was learned
        before and returns the head's logits [B, T-1, V] float32, which the layer then learns from rather than
        forming them again (and keeps no held-out tail: the stream tunes the step itself). With a reader the pass
        runs in the model's own dtype, so the scores are what the model reads."""
        input_ids, mask = check_batch(input_ids, attention_mask, self.base_model)
        # A pass or head dtype the device cannot run raises here, before any statistic changes.
        self.pass_precision(input_ids.device)
        if isinstance(self.output_layer, ResidualOutputLayer):
            layer = self.output_layer
            products_dtype(layer.head_dtype, input_embeddings(self.base_model).weight, layer.head.weight)
        started = time.perf_counter()
        if documents is None:
            # Rows of unknown texts: numbered -2, -3, ... (negative: the step tuning treats them as unknown, as it
            # does -1), so that the positions of each can still be told apart (forget drops them from the tail).
            documents = -2 - self._unknown_rows - torch.arange(input_ids.shape[0], device=input_ids.device)
            self._unknown_rows += input_ids.shape[0]
        pair_mask = mask[:, :-1] & mask[:, 1:]
        targets = input_ids[:, 1:]
        if labels is not None:
            labels = check_labels(labels, input_ids, self.base_model)
            # The Hugging Face convention: labels[:, t+1] is the target after position t; -100 is not learned.
            pair_mask = pair_mask & (labels[:, 1:] != -100)
            targets = torch.where(pair_mask, labels[:, 1:], targets)
        # Positions count real tokens only, so a left-padded row learns exactly what the unpadded text gives.
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        next_embeddings = None
        if isinstance(self.output_layer, OutputMemoryLayer):
            next_embeddings = input_embeddings(self.base_model)(input_ids[:, 1:])
        capture = None
        if self.bank is not None:
            scorers = [None if layer.scorer is None else layer.scores for layer in self.middle_layers]
            capture = BankCapture(scorers, pair_mask, differentiable, workspace=self._workspace)
        with (
            self.hooks.learning(LearnPass(pair_mask, next_embeddings, capture)) as learn_pass,
            torch.set_grad_enabled(differentiable),
            eval_mode(self.base_model),
            self.module_memories.passthrough(),  # every layer learns from the base model's own activations
            self._pass_mode(input_ids.device, differentiable or reader is not None),
        ):
            self.backbone(input_ids=input_ids, attention_mask=mask.long(), position_ids=positions, use_cache=False)
        # Every statistic is added after the pass, so an error inside it (or in the bank's checks) learns nothing.
        if capture is not None:
            with torch.set_grad_enabled(differentiable):
                step = capture.update(cast(MemoryBank, self.bank))  # a capture exists only with a bank
            self._workspace = capture.release()
            if step is not None:
                for middle in self.middle_layers:
                    middle.add_step_cross(step[middle.slot])
        rows = learn_pass.output_rows
        if rows is not None and isinstance(self.output_layer, ResidualOutputLayer):
            extra = self.hooks.extra_keys(rows[0])
            logits = None if reader is None else reader(rows[0], extra, targets, pair_mask)
            self.output_layer.learn(rows[0], targets, pair_mask, documents, extra, logits=logits,
                                    hold_out=reader is None)  # fmt: skip
        elif rows is not None:
            # Rows come only with an output layer; not the residual one, so an OutputMemoryLayer, whose values (the
            # next tokens' embeddings) the pass captured beside its keys.
            output = cast(OutputMemoryLayer, self.output_layer)
            output.memory.update(rows[0], cast(torch.Tensor, rows[1]), mask=pair_mask)
        if self._sink is not None:
            self._sink(input_ids, mask, pair_mask, documents)
        # One host sync for both counts.
        tokens, pairs = torch.stack([mask.sum(), pair_mask.sum()]).tolist()
        return LearnStats(tokens=tokens, pairs=pairs, batches=1, seconds=time.perf_counter() - started)

    def pass_precision(self, device: torch.device) -> str:
        """What learn() runs the decoder pass in on `device`: 'bfloat16' (autocast), 'int8' (the CPU's int8 products,
        faast/hf/int8_pass.py) or 'model' (the model's dtype). 'auto' with float32 weights: on a CPU the fastest of
        the three on the model's own linears, measured once per machine (faast/hf/pass_choice.py; FAAST_BACKEND=
        learn_pass=torch.<mode> pins it); on a GPU bfloat16 where it is native, else the model's dtype. An explicit
        'int8' the model cannot run (not on a CPU, weights not float32, or no nn.Linear of inputs at most the hidden
        size: GPT-2's blocks multiply through Conv1D) raises ValueError naming FaastConfig.learn_dtype."""
        weights = input_embeddings(self.base_model).weight
        if self.learn_dtype == "int8":
            if device.type != "cpu" or weights.dtype != torch.float32:
                raise ValueError(f"FaastConfig.learn_dtype: 'int8' runs the pass on a CPU with float32 weights only "
                                 f"(faast.ops.int8), got {weights.dtype} weights on {device}; expected 'auto', "
                                 f"'model' or 'bfloat16' there")  # fmt: skip
            if not self.int8_linears():
                raise ValueError(f"FaastConfig.learn_dtype: 'int8' runs the decoder's nn.Linear layers of inputs at "
                                 f"most {self._hidden_size()} wide in int8, and this model has none (GPT-2's blocks "
                                 f"use Conv1D); expected 'auto', 'model' or 'bfloat16'")  # fmt: skip
            return "int8"
        if self.learn_dtype != "auto":
            return self.learn_dtype
        if weights.dtype != torch.float32:
            return "model"
        if device.type != "cpu":
            return "bfloat16" if native_bf16(device) else "model"
        mode = learn_pass_mode(linear_shapes(self.backbone), self._hidden_size(), self.int8_linears(), device)
        return "model" if mode == "float32" else mode

    def _hidden_size(self) -> int:
        return input_embeddings(self.base_model).weight.shape[-1]

    def int8_linears(self) -> int:
        """How many of the backbone's nn.Linear layers an int8 pass takes (inputs at most the hidden size wide)."""
        if self._int8_count is None:
            widest = self._hidden_size()
            self._int8_count = sum(
                isinstance(m, nn.Linear) and m.in_features <= widest for m in self.backbone.modules()
            )
        return self._int8_count

    def autocasts(self, device: torch.device) -> bool:
        """Whether learn() runs the pass on `device` under bfloat16 autocast (`pass_precision` is 'bfloat16')."""
        return self.pass_precision(device) == "bfloat16"

    def precision(self) -> dict[str, object]:
        """What learn() computes in on the model's device, as learn_dtype and head_dtype resolve there ('auto' is
        measured on a CPU: this measures what is not cached yet): {'learn_pass': 'bfloat16' under autocast, 'int8'
        for the int8 pass, else the model's dtype; 'head_products': the residual output layer's head products dtype
        and 'head_pool_below' the probability below which its p·H pools a vocabulary column (0: exact; 'auto' until
        a learn() call on this CPU has timed it; both None without that layer); 'native_bf16': whether the device
        multiplies bfloat16 natively}. Result files record it beside the times it explains."""
        weights = input_embeddings(self.base_model).weight
        head: str | None = None
        pool: str | float | None = None
        if isinstance(self.output_layer, ResidualOutputLayer):
            layer = self.output_layer
            head_weight = layer.head.weight  # one read: a ScaledHead forms its product on each
            products = products_dtype(layer.head_dtype, weights, head_weight)
            head = str(products).split(".")[-1]
            pool = pool_threshold(layer.head_pool_below, products, weights, layer.policy)
            if pool is None:
                chosen = paths.current("head_pool", weights.device, pool_shape_class(head_weight, products))
                pool = "auto" if chosen is None else (0.0 if chosen == "exact" else layer.policy.pool_auto)
        learn_pass = self.pass_precision(weights.device)
        learn_pass = str(weights.dtype).split(".")[-1] if learn_pass == "model" else learn_pass
        return {"learn_pass": learn_pass, "head_products": head, "head_pool_below": pool,
                "native_bf16": native_bf16(weights.device)}  # fmt: skip

    def measure_paths(self, show: bool) -> None:
        """Make the CPU's measured choices for this model now, before its first batch (the first learn() on a machine
        times them: a few seconds), and when one was measured and `show`, say on stderr what it chose."""
        weights = input_embeddings(self.base_model).weight
        if weights.device.type != "cpu":
            return
        pending = self.learn_dtype == "auto" and weights.dtype == torch.float32 and paths.current(
            "learn_pass", weights.device, shape_class(linear_shapes(self.backbone)),
            {"int8_linears": self.int8_linears()}) is None  # fmt: skip
        layer = self.output_layer
        if isinstance(layer, ResidualOutputLayer) and layer.head_dtype == "auto":
            shape = head_shape_class(layer.head.weight, weights.dtype)
            pending = pending or paths.current("head_logits", weights.device, shape) is None
        started = time.perf_counter()
        chosen = self.precision()
        if pending and show:
            print(f"faast: measured this CPU's learning paths in {time.perf_counter() - started:.1f} s: pass "
                  f"{chosen['learn_pass']}, head logits {chosen['head_products']} (cached; python -m faast.hardware "
                  f"shows the times)", file=sys.stderr, flush=True)  # fmt: skip

    @contextlib.contextmanager
    def _call_buffers_kept(self) -> Iterator[None]:
        """What this call's batches share: the residual output layer's [chunk, V] head buffers (faast/hf/head.py)
        and an int8 pass's int8 weights (faast/hf/int8_pass.py)."""
        with self._int8.kept():
            if isinstance(self.output_layer, ResidualOutputLayer):
                with self.output_layer.head_buffers.kept():
                    yield
            else:
                yield

    def _pass_mode(self, device: torch.device, own_dtype: bool) -> contextlib.AbstractContextManager:
        """bfloat16 autocast or the int8 products for the pass where learn_dtype asks for them (`pass_precision`);
        neither with own_dtype (while training the readout, whose gradients keep the model's precision, or while a
        stream scores the pass). The captured states stay float32 either way: the residual stream and the norms'
        outputs are float32, only the matrix products inside the blocks round."""
        precision = "model" if own_dtype else self.pass_precision(device)
        if precision == "bfloat16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        if precision == "int8":
            return Int8Pass(self._int8, self._hidden_size())
        return contextlib.nullcontext()

    def learn_tensor(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
    ) -> LearnStats:
        """Learn one input_ids batch [B, T] (no gradient)."""
        try:
            with torch.no_grad():
                stats = self.learn_batch(input_ids, attention_mask, labels=labels)
            self._ends_on_text = False
            return stats
        finally:
            self._workspace = None  # the capture buffers live for one learn call

    def learn_stream(
        self, batches: Iterable[Batch], progress: bool | None, continues: bool = False, meter: Metered | None = None
    ) -> LearnStats:
        """Learn (input_ids, attention_mask, labels, documents) batches, consumed lazily, with a progress bar from the
        second batch on (progress None: when stderr is a terminal; faast/hf/progress.py). continues: the first text
        is the rest of the last text numbered before this call (one document to the step's tuning); the first batch
        must then hold texts (documents known). meter: the input's items as they are handed to `batches`, for the
        bar's time left."""
        if continues and self._documents == 0:
            raise ValueError("continues: no text was learned before this call, so there is none to continue")
        stats, show = LearnStats(), enabled(progress)
        self.measure_paths(show)
        bar = Bar(show, "faast learn")
        # Document numbers continue across learn() calls, so a later call's texts never share one with earlier ones,
        # except the first text of a call that continues the last one.
        first = self._documents - 1 if continues else self._documents
        try:
            with torch.no_grad(), self._call_buffers_kept():
                for ids, mask, batch_labels, documents in batches:
                    if continues and stats.batches == 0 and (documents is None or documents[0] != 0):
                        raise ValueError("continues: the first input must be a text or a token-id list of at least 2 "
                                         "tokens (a tensor's or a tokenised mapping's rows are of unknown "
                                         "documents)")  # fmt: skip
                    numbers: torch.Tensor | None = None
                    if documents is not None:  # host ints: numbering them costs no device sync
                        self._documents = first + documents[-1] + 1
                        numbers = torch.tensor(documents, dtype=torch.long, device=ids.device) + first
                    learned = self.learn_batch(ids, mask, labels=batch_labels, documents=numbers)
                    self._ends_on_text = documents is not None
                    stats += learned
                    bar.update(learned.tokens, None if meter is None else meter.fraction())
        finally:
            self._workspace = None
            bar.close()
        return stats
