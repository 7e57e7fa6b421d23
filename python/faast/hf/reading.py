"""Learn while reading: a memory that improves as a long text streams through (docs/language_models.md, "Learn while
reading").

A text longer than the context window is read in order, in chunks of C tokens. Each chunk is scored with the memory
learned from everything before it, then learned: the scoring pass is the learning pass (the head's logits it scores
with are the ones the residual output layer learns from), so learning a chunk costs its statistics, the step's tuning
and one solve, never another forward pass. The state stays fixed-size (the layer's d_key² + d_key·d + d² sums and a
V-vector), and generation after reading uses it.

The step is tuned prequentially: after chunk t is scored with W_{t−1} (fitted on chunks < t), the step and weight
that would have scored it best are chosen on STREAM_TUNE_ROWS of its positions (W_{t−1} never saw them), and chunk
t + 1 is read with them and W_t. Nothing is ever tuned on the chunk being scored. Until the first tuning the memory is
off (step 0). The keys widen to the full keys (ResidualOutput.key_layers) once OutputPolicy.fit_per_key_dim positions
per key dimension are learned, as the layer's own solve allows; the step's search reads the layer's policy too.

Windows: chunk t predicts tokens [max(1, tC), (t + 1)C) of the stream from the window ids[max(0, tC − 1):(t + 1)C],
so every pair is predicted once and each window holds one token of the previous chunk (`chunk_windows`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from .layers import OutputMemoryLayer
from .learning import Learner
from .lm import input_embeddings
from .memory_store import DEFAULT, check_name
from .named_memories import NamedMemories
from .output import ResidualOutputLayer, tuning
from .output.head import change_logits, head_logits
from .progress import Bar, enabled

__all__ = ["STREAM_TUNE_ROWS", "ReadReport", "StreamReader", "chunk_windows", "read_stream"]

# Positions of each chunk the step is tuned on (evenly spaced): each pass of the search reads [rows, V] logits, and 512
# keep the tuning near 0.1 s a pass on 2 CPU cores (V = 49,152) while holding the step's noise to that of 512 tokens.
STREAM_TUNE_ROWS = 512


def chunk_windows(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The input windows (start, end) of a stream of n_tokens read in chunks of `chunk`: window t is
    ids[max(0, t·chunk − 1):min((t + 1)·chunk, n_tokens)] and predicts tokens [max(1, t·chunk), (t + 1)·chunk), so
    chunk 0 predicts chunk − 1 tokens, every later full chunk `chunk`, and no pair is lost or predicted twice."""
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 0:
        raise ValueError(f"n_tokens: expected an int >= 0, got {n_tokens!r}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 2:
        raise ValueError(f"chunk: expected an int >= 2 (tokens per chunk), got {chunk!r}")
    return [(max(0, t * chunk - 1), min((t + 1) * chunk, n_tokens)) for t in range(math.ceil(n_tokens / chunk))
            if min((t + 1) * chunk, n_tokens) - max(1, t * chunk) > 0]  # fmt: skip


@dataclass
class ReadReport:
    """What reading a stream measured, per chunk (index t in stream order).

    chunk: C. tokens: the tokens chunk t predicted. nll: their mean negative log-likelihood (nats) under the memory
    learned from chunks < t. chunk_nll: each chunk's per-token NLL [tokens[t]] float64 (token_nll: joined). read_s:
    seconds scoring chunk t (the forward pass and the memory's read); update_s: seconds learning it (the step's tuning,
    the statistics and the solve; apart in tune_s, statistics_s and solve_s). steps, weights, key_widths: the η, λ
    and key width chunk t was read with (η = 0: the memory was off). step, weight, key_width: what the memory reads
    with after the stream (tuned on the last chunk).
    """

    chunk: int
    tokens: list[int] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    chunk_nll: list[torch.Tensor] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    tune_s: list[float] = field(default_factory=list)
    statistics_s: list[float] = field(default_factory=list)
    solve_s: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    key_widths: list[int] = field(default_factory=list)
    step: float = 0.0
    weight: float = 0.0
    key_width: int = 0

    @property
    def token_nll(self) -> torch.Tensor:
        """[N − 1] float64 on the CPU: every predicted token's NLL in stream order (chunk_nll joined)."""
        return torch.cat(self.chunk_nll) if self.chunk_nll else torch.zeros(0, dtype=torch.float64)

    def perplexity(self, skip_first: bool = True) -> float:
        """exp of the token-weighted mean NLL over the chunks (after the first, which no memory could help, when
        skip_first); nan when there is none."""
        start = self.tokens[0] if skip_first and self.tokens else 0
        rest = self.token_nll[start:]
        return math.exp(float(rest.mean())) if rest.numel() else float("nan")


def _context_window(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _stream_ids(stream: object, tokenizer: object | None, vocab: int, device: torch.device) -> torch.Tensor:
    """The stream's token ids [N] int64 on `device`, from a text (with tokenizer), a 1-D integer tensor ([1, N]
    accepted) or a list of ints; anything else raises naming what was expected."""
    if isinstance(stream, str):
        if tokenizer is None:
            raise ValueError("tokenizer: required to read a text stream")
        tokenize = cast("Callable[..., Any]", tokenizer)  # a transformers tokenizer, or any callable like one
        ids = torch.as_tensor(tokenize(stream, add_special_tokens=False)["input_ids"], dtype=torch.long)
    elif isinstance(stream, torch.Tensor):
        if stream.dtype.is_floating_point or stream.dtype.is_complex or stream.dtype == torch.bool:
            raise TypeError(f"stream: expected integer token ids, got a {stream.dtype} tensor")
        if stream.dim() == 2 and stream.shape[0] == 1:
            stream = stream[0]
        if stream.dim() != 1:
            raise ValueError(f"stream: expected token ids of shape [N] (or [1, N]), got {list(stream.shape)}")
        ids = stream.long()
    elif isinstance(stream, (list, tuple)):
        bad = next((x for x in stream if not isinstance(x, int) or isinstance(x, bool)), None)
        if bad is not None:
            raise TypeError(f"stream: expected a list of int token ids, got an item of type {type(bad).__name__}")
        ids = torch.as_tensor(list(stream), dtype=torch.long)
    else:
        raise TypeError(f"stream: expected a text, a 1-D tensor or a list of token ids, got {type(stream).__name__}")
    if ids.numel() < 2:
        raise ValueError(f"stream: nothing to read: {ids.numel()} token(s), at least 2 are needed to predict one")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"stream: token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
    return ids.to(device)


def _base_log_targets(z0: torch.Tensor, target0: torch.Tensor) -> torch.Tensor:
    """log softmax(z0) at the targets [n] float64 (tuning.base_log_targets reads only z0 and the target entries)."""
    return tuning.base_log_targets((z0, None, target0, None))


class _Reading:
    """The state of one read: the unit-step correction W of what was learned so far, the step and weight it is read
    with, and the report. Owned by StreamReader.read."""

    def __init__(self, layer: ResidualOutputLayer, report: ReadReport) -> None:
        self.layer, self.report = layer, report
        self.fixed_step = None if layer.step == "auto" else float(layer.step)
        if layer.space == "logit":
            self.fixed_weight: float | None = 1.0
        else:
            self.fixed_weight = None if layer.weight == "auto" else float(layer.weight)
        self.w: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None  # the layer's mean-gradient bias, read with the memory as it is
        self.tokens: torch.Tensor | None = None  # and its token bias [V] (float32)
        self.eta, self.lam, self.width = 0.0, self.fixed_weight or 0.0, layer.hidden_size
        if float(layer.memory.count) > 0:  # what was learned before the stream, read as the model reads it now
            self.eta, self.lam = layer.chosen_step() or 0.0, layer.chosen_weight() or 0.0
            self.width = layer.chosen_key_width() or layer.hidden_size
            self.solve()
        elif self.fixed_step is not None:
            self.eta = self.fixed_step
        self.timer = self.tuned = 0.0

    def solve(self) -> None:
        """W of the statistics learned so far at the key width their count allows."""
        layer, memory = self.layer, self.layer.memory
        full = memory.dim_key
        if full > layer.hidden_size and float(memory.count) >= layer.policy.fit_per_key_dim * full:
            self.width = full
        curvature = layer.damped_curvature()
        self.w = layer.newton(memory.gram, memory.cross, memory.count, curvature, self.width)
        self.bias = layer.mean_gradient_bias(curvature)[0]
        tokens = layer.token_logit_bias()[0]
        self.tokens = None if tokens is None else tokens.float()

    def read(self, hidden: torch.Tensor, extra: torch.Tensor | None, targets: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Learner reader: score the window (hidden [1, T, d], extra keys, targets [1, T-1], mask) with the memory
        learned before it, tune the step on it, and return its base logits [1, T-1, V] for the layer to learn."""
        layer, report = self.layer, self.report
        started = time.perf_counter()
        forward_s, self.timer = started - self.timer, started
        h = hidden[0, :-1]
        ys = targets[0]
        z0 = head_logits(layer.head, h)
        target0 = z0.gather(-1, ys[:, None]).squeeze(-1)
        log_base = _base_log_targets(z0, target0)
        logits, nll = None, -log_base
        if self.w is not None:
            keys = layer.keys(hidden, extra)[0, :-1, : self.width]
            z1 = change_logits(layer.head, keys @ self.w[: self.width].to(keys.dtype))
            # the memory's component reads z0 + b·Hᵀ + η·z1 (the bias at its fixed step, with any η > 0)
            zm = z0 if self.bias is None else z0 + change_logits(layer.head, self.bias[None].to(keys.dtype))
            logits = (zm, z1, zm.gather(-1, ys[:, None]).squeeze(-1), z1.gather(-1, ys[:, None]).squeeze(-1))
            if self.eta > 0 and self.lam > 0:
                nll = -self.log_read(logits, z0, ys, log_base)
        nll = nll[mask[0]]
        report.tokens.append(int(nll.numel()))
        report.nll.append(float(nll.mean()))
        report.chunk_nll.append(nll.cpu())
        report.steps.append(self.eta)
        report.weights.append(self.lam)
        report.key_widths.append(self.width)
        scored = time.perf_counter()
        report.read_s.append(forward_s + scored - started)
        if logits is not None:
            self.tune(logits, log_base, mask[0])
        self.timer = scored  # update time runs from here: the tuning, then the layer's statistics and the solve
        self.tuned = time.perf_counter()
        report.tune_s.append(self.tuned - scored)
        return z0[None]

    def log_read(
        self, logits: tuning.Logits, z0: torch.Tensor, ys: torch.Tensor, log_base: torch.Tensor
    ) -> torch.Tensor:
        """The log-probability [n] of the targets ys as the model reads them with this memory: the mixture of the
        base and the memory's component at η and λ, both with the token bias where the layer has one (as
        ResidualOutputLayer.read_logits adds it). The step's tuning reads them without it, as the layer's does."""
        if self.tokens is None:
            return tuning.log_mixture(log_base, tuning.log_targets(*logits, self.eta), self.lam)
        tokens = self.tokens.to(z0.dtype)
        at = lambda z: z.gather(-1, ys[:, None]).squeeze(-1)  # noqa: E731 - the entries at the targets
        biased_base, biased_memory = z0 + tokens, logits[0] + tokens
        log_memory = tuning.log_targets(biased_memory, logits[1], at(biased_memory), logits[3], self.eta)
        return tuning.log_mixture(_base_log_targets(biased_base, at(biased_base)), log_memory, self.lam)

    def tune(self, logits: tuning.Logits, log_base: torch.Tensor, mask: torch.Tensor) -> None:
        """Choose the step (and weight, when 'auto') that would have read this chunk best with W_{t−1}, on
        STREAM_TUNE_ROWS evenly spaced positions of it."""
        if self.fixed_step is not None and self.fixed_weight is not None:
            return
        rows = mask.nonzero().squeeze(-1)
        if rows.numel() > STREAM_TUNE_ROWS:
            rows = rows[torch.linspace(0, rows.numel() - 1, STREAM_TUNE_ROWS, device=rows.device).round().long()]
        sample = cast(tuning.Logits, tuple(part[rows] for part in logits))
        base, policy = log_base[rows], self.layer.policy
        if self.fixed_weight is None and self.fixed_step is None:
            self.eta, self.lam, _ = tuning.tune_mixture(sample, log_base=base, policy=policy)
        elif self.fixed_weight is None and self.fixed_step is not None:
            self.lam = tuning.best_weight(base, tuning.log_targets(*sample, self.fixed_step), policy)
        elif self.fixed_weight is not None:  # the weight fixed, the step 'auto'
            start = self.eta if self.eta > 0 else self.layer.default_step
            self.eta, _, _ = tuning.tune_step_rows(sample, self.fixed_weight, base, start, policy=policy)


class StreamReader:
    """A FaastModel's reading of long streams: FaastModel.read_stream (which says what it does) delegates here.

    Args:
        base_model: the wrapped model: its context window, and its input embeddings' device (where ids go).
        output_layer: the model's output layer (reading needs the residual one) or None.
        middle_layers: the number of the model's middle layers (reading needs none).
        learner: the model's Learner: each chunk's scoring pass is its learning pass.
        memories: the model's NamedMemories: the stream is read into one of them.
    """

    def __init__(
        self,
        base_model: nn.Module,
        output_layer: ResidualOutputLayer | OutputMemoryLayer | None,
        middle_layers: int,
        learner: Learner,
        memories: NamedMemories,
    ) -> None:
        self.base_model, self.output_layer, self.middle_layers = base_model, output_layer, middle_layers
        self.learner, self.memories = learner, memories

    def read(
        self,
        stream: str | torch.Tensor | Sequence[int],
        *,
        tokenizer: object | None = None,
        chunk: int = 1024,
        memory: str = DEFAULT,
        on_chunk: Callable[[int, ReadReport], None] | None = None,
        progress: bool | None = None,
    ) -> ReadReport:
        """FaastModel.read_stream: read `stream` in chunks of `chunk` tokens into memory `memory`."""
        layer = self.output_layer
        if not isinstance(layer, ResidualOutputLayer) or self.middle_layers:
            raise ValueError(
                "model: read_stream needs the residual output layer alone (FaastConfig(output=ResidualOutput(), "
                f"middle=None)), got output={type(layer).__name__} and {self.middle_layers} middle layer(s)"
            )
        name = check_name(memory)
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 2:
            raise ValueError(f"chunk: expected an int >= 2 (tokens per chunk), got {chunk!r}")
        context = _context_window(self.base_model)
        if context is not None and chunk + 1 > context:
            raise ValueError(f"chunk: {chunk} + 1 tokens (a chunk and one token of the one before) exceed the "
                             f"model's context window of {context}; use chunk <= {context - 1}")  # fmt: skip
        if on_chunk is not None and not callable(on_chunk):
            raise TypeError(f"on_chunk: expected a callable or None, got {type(on_chunk).__name__}")
        device = input_embeddings(self.base_model).weight.device
        ids = _stream_ids(stream, tokenizer, int(layer.head.weight.shape[0]), device)
        report = ReadReport(chunk=chunk)
        bar = Bar(enabled(progress), "faast read")
        memories = self.memories
        try:
            with memories.into(name), memories.learning_recorded(), torch.no_grad(), layer.head_buffers.kept():
                state = _Reading(layer, report)
                layer.discard_held_out()
                for t, (start, end) in enumerate(chunk_windows(int(ids.numel()), chunk)):
                    state.timer = time.perf_counter()
                    self.learner.learn_batch(ids[None, start:end], None, reader=state.read)
                    learned = time.perf_counter()
                    state.solve()
                    solved = time.perf_counter()
                    report.statistics_s.append(learned - state.tuned)
                    report.solve_s.append(solved - learned)
                    report.update_s.append(solved - state.timer)
                    bar.update(end - start - 1, (end - 1) / max(1, ids.numel() - 1))
                    if on_chunk is not None:
                        on_chunk(t, report)
                # The model reads what the stream would read next: the last W (its statistics) with the last step.
                layer.restore_step(state.eta, state.lam, state.width)
                report.step, report.weight, report.key_width = state.eta, state.lam, state.width
        finally:
            bar.close()
        return report


def read_stream(model: object, stream: str | torch.Tensor | Sequence[int], **options: Any) -> ReadReport:
    """`model.read_stream(stream, **options)` for a FaastModel `model` (FaastModel.read_stream)."""
    reader = getattr(model, "stream_reader", None)
    if not isinstance(reader, StreamReader):
        raise TypeError(f"model: expected a FaastModel (apply_faast(...)), got {type(model).__name__}")
    return reader.read(stream, **options)
