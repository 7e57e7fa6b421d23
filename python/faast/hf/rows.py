"""Many named memories in one batch: row i of a forward pass reads memory memory_names[i] (docs/serving.md).

For each memory layer, the memories the batch names are solved (or taken from their caches) once per call, stacked
into one tensor [U + 1, d_key, d] (the last entry zeros: the base model's rows, "__base__") and gathered per row, so
every layer does one batched product (`bmm`) whatever the number of memories. Rows whose memory reads nothing (empty,
or "__base__") get the base model's output back exactly. A `generate` call that expands each row k times (beams,
num_return_sequences: transformers repeats rows with repeat_interleave) is followed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from .layers import MemoryLayer, OutputMemoryLayer
from .memory_store import BASE, StoredMemory
from .mixture import read_blocks
from .output import MIX_ROWS, READ_CHUNK, OutputState, ResidualOutputLayer
from .output.bias import with_token_bias

if TYPE_CHECKING:
    from ..memory import FastWeights


class RowMemories:
    """The memories of one call's rows.

    Args:
        names: one memory name per row ("__base__": the base model), already checked against the model's memories.
        state_of: name -> StoredMemory (the model's memory_state).
        output_layer: the model's output layer (it is swapped to unbound memories' states to solve them).
    """

    def __init__(
        self,
        names: list[str],
        state_of: Callable[[str], StoredMemory],
        output_layer: ResidualOutputLayer | OutputMemoryLayer | None,
    ) -> None:
        self.names = list(names)
        self.unique = [n for n in dict.fromkeys(self.names) if n != BASE]
        base = len(self.unique)
        self._index = torch.tensor([base if n == BASE else self.unique.index(n) for n in self.names])
        self._state_of = state_of
        self._output_layer = output_layer
        # Per layer, device and dtype: what every row reads (a tensor or a tuple of them, by the key's kind).
        self._cache: dict[tuple, Any] = {}

    def rows(self, batch: int, device: torch.device) -> torch.Tensor:
        """Per row of a batch of `batch` rows, the index of its memory [batch] int64 (U: the base model)."""
        n = len(self.names)
        if batch % n:
            raise ValueError(f"memory_names: {n} names for a batch of {batch} rows; give one name per row")
        index = self._index.to(device)
        return index if batch == n else index.repeat_interleave(batch // n)

    # ------------------------------------------------------------------ what each memory reads

    def _residual_layer(self) -> ResidualOutputLayer:
        """The output layer, for the reads that run only when it is the residual one (the model's hooks call them)."""
        return cast(ResidualOutputLayer, self._output_layer)

    def _output_solution(self, name: str, device: torch.device, dtype: torch.dtype) -> tuple:
        """(M [width, d] or None, λ, bias [d] or None, token bias [V] or None) of memory `name`'s residual output
        layer; an unbound memory's state is bound to the layer for the solve and keeps what it derived."""
        layer = self._residual_layer()
        output = cast(OutputState, self._state_of(name).output)  # a residual output layer's state
        solved = lambda: (*layer.solution(device, dtype), layer.folded_bias(device, dtype),  # noqa: E731
                          layer.folded_token_bias(device, dtype))  # fmt: skip
        # The state may be the layer's own (an identity check: the type checker sees no overlap of the two types).
        if cast(object, output) is layer.memory or output.memory is layer.memory:
            return solved()
        previous = layer.swap_state(output)
        try:
            return solved()
        finally:
            output.take_derived(layer.swap_state(previous))

    def _middle(self, layer: MemoryLayer, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        key = ("middle", layer.slot, device, dtype)
        if key not in self._cache:
            ms = [layer.folded(device, dtype, bank=self._state_of(n).bank) for n in self.unique]
            self._cache[key] = _stack(ms, (layer.bank.dim_key, layer.bank.dim_key), device)
        return self._cache[key]

    def _residual(self, device: torch.device, dtype: torch.dtype) -> tuple | None:
        """(M [U + 1, width, d] zero-padded to the widest, log-odds [U + 1], log(1 − λ) [U + 1], λ = 1 [U + 1],
        reads nothing [U + 1], bias [U + 1, 1, d] (zeros for none), token bias [U + 1, 1, V] or None when no memory
        has one (zeros for the others)) or None when no row reads anything."""
        key = ("residual", device, dtype)
        if key not in self._cache:
            layer = self._residual_layer()
            solutions = [self._output_solution(n, device, dtype) for n in self.unique]
            ms = [m for m, *_ in solutions]
            width = max([layer.hidden_size, *(m.shape[0] for m in ms if m is not None)])
            stacked = _stack(ms, (width, layer.hidden_size), device)
            lams = [lam if m is not None else 0.0 for m, lam, *_ in solutions] + [0.0]
            biases = _stack([None if b is None else b[None] for _, _, b, _ in solutions], (1, layer.hidden_size),
                            device)  # fmt: skip
            vocab = cast(torch.Tensor, layer.target_count.targets).shape[0]  # an Accumulator's [V] buffer
            tokens = _stack([None if t is None else t[None] for *_, t in solutions], (1, vocab), device)
            odds = [math.log(lam / (1.0 - lam)) if 0.0 < lam < 1.0 else 0.0 for lam in lams]
            rest = [math.log1p(-lam) if lam < 1.0 else 0.0 for lam in lams]
            flags = {"full": [lam >= 1.0 for lam in lams], "none": [m is None for m in ms] + [True]}
            self._cache[key] = None if stacked is None else (
                stacked, torch.tensor(odds, device=device), torch.tensor(rest, device=device),
                torch.tensor(flags["full"], device=device), torch.tensor(flags["none"], device=device),
                stacked.new_zeros((len(ms) + 1, 1, layer.hidden_size)) if biases is None else biases, tokens,
            )  # fmt: skip
        return self._cache[key]

    def needs_extra_keys(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether some row's output correction reads keys wider than h̃."""
        solved = self._residual(device, dtype)
        return solved is not None and solved[0].shape[1] > self._residual_layer().hidden_size

    # ------------------------------------------------------------------ reading

    def middle(self, layer: MemoryLayer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] -> hidden + hidden·M_row: each row through its memory's folded M (bmm)."""
        stacked = self._middle(layer, hidden.device, hidden.dtype)
        if stacked is None:
            return hidden
        m = stacked[self.rows(hidden.shape[0], hidden.device)]
        return hidden + torch.bmm(hidden.to(m.dtype), m).to(hidden.dtype)

    def embedding_output(self, layer: OutputMemoryLayer, hidden: torch.Tensor) -> torch.Tensor:
        """The paper's output layer per row: lerp(h, h·W_row, mix); rows reading nothing keep h exactly."""
        compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        key = ("embedding", hidden.device, compute)
        if key not in self._cache:
            # The paper's output layer keeps FastWeights as each memory's state.
            states = [cast("FastWeights | None", self._state_of(n).output) for n in self.unique]
            ws = [layer.weights(hidden.device, hidden.dtype, memory=state) for state in states]
            stacked = _stack(ws, (layer.memory.dim_key, layer.memory.dim_value), hidden.device)
            reads = torch.tensor([w is not None for w in ws] + [False], device=hidden.device)
            self._cache[key] = None if stacked is None else (stacked, reads)
        if self._cache[key] is None:
            return hidden
        stacked, reads = self._cache[key]
        index = self.rows(hidden.shape[0], hidden.device)
        h = hidden.to(stacked.dtype)
        out = torch.lerp(h, torch.bmm(h, stacked[index]), layer.mix).to(hidden.dtype)
        return torch.where(reads[index][:, None, None], out, hidden)

    def logit_output(
        self, layer: ResidualOutputLayer, hidden: torch.Tensor, extra: torch.Tensor | None
    ) -> torch.Tensor:
        """Logit space: hidden [B, T, d] -> hidden + key·M_row (rows reading nothing: hidden exactly)."""
        solved = self._residual(hidden.device, hidden.dtype)
        if solved is None:
            return hidden
        stacked = solved[0]
        keys = hidden if stacked.shape[1] == layer.hidden_size else layer.keys(hidden, extra)
        index = self.rows(hidden.shape[0], hidden.device)
        change = torch.bmm(keys.to(stacked.dtype), stacked[index])
        return hidden + (change + solved[5][index]).to(hidden.dtype)

    def logit_bias(self, layer: ResidualOutputLayer, logits: torch.Tensor) -> torch.Tensor | None:
        """Logit space: the head's output logits [B, T, V] plus each row's token bias (over the head's logit scale);
        None when no row's memory has one."""
        solved = self._residual(logits.device, logits.dtype)
        if solved is None or solved[6] is None:
            return None
        tokens = solved[6][self.rows(logits.shape[0], logits.device)]
        return with_token_bias(logits, tokens, float(getattr(layer.head, "scale", 1.0)), overwrite=False)

    def read_logits(
        self,
        layer: ResidualOutputLayer,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        extra: torch.Tensor | None,
        *,
        overwrite: bool = False,
    ) -> torch.Tensor:
        """Probability space, as ResidualOutputLayer.read_logits with each row's M and λ: hidden [B, T, d] and the
        head's logits [B, T, V] -> the log of each row's mixture; rows reading nothing keep their logits exactly.
        overwrite: `logits` is the caller's to reuse (mixture.read_blocks)."""
        solved = self._residual(hidden.device, hidden.dtype)
        if solved is None:
            return logits
        stacked, odds, rest, full, none, biases, tokens = solved
        index = self.rows(hidden.shape[0], hidden.device)
        if tokens is not None:  # each row's token bias, [B, 1, V] over the row's positions (zeros: none)
            logits = with_token_bias(logits, tokens[index], float(getattr(layer.head, "scale", 1.0)), overwrite)
        keys = hidden if stacked.shape[1] == layer.hidden_size else layer.keys(hidden, extra)
        # One batched product for every row's memory; then the head GEMM and the mixture in blocks, as the
        # single-memory read does.
        projected = torch.bmm(keys.to(stacked.dtype), stacked[index])  # [B, T, d]
        projected += biases[index]
        positions = logits.shape[1] if logits.dim() == 3 else 1
        per_row = lambda t: t[index].repeat_interleave(positions)  # noqa: E731 - a per-position gather
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        head_dtype = hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float16) else compute
        full_p, keep = per_row(full), per_row(none)
        head_weight = layer.head.weight  # [V, d]
        out = read_blocks(
            projected.reshape(-1, projected.shape[-1]), logits.reshape(-1, logits.shape[-1]),
            head_weight.to(head_dtype), compute=compute, scale=float(getattr(layer.head, "scale", 1.0)),
            log_odds=per_row(odds).to(compute)[:, None], log_rest=per_row(rest).to(compute)[:, None],
            full=full_p if bool(full_p.any()) else False, keep=keep if bool(keep.any()) else None,
            chunk=READ_CHUNK, block=READ_CHUNK if hidden.device.type == "cuda" else MIX_ROWS, overwrite=overwrite,
        )  # fmt: skip
        return out.reshape(logits.shape)


def _stack(ms: list[torch.Tensor | None], shape: tuple[int, int], device: torch.device) -> torch.Tensor | None:
    """[len(ms) + 1, *shape]: each M zero-padded to `shape` (None: zeros), then the base model's zeros; None when
    every M is None."""
    present = [m for m in ms if m is not None]
    if not present:
        return None
    out = torch.zeros((len(ms) + 1, *shape), dtype=present[0].dtype, device=device)
    for i, m in enumerate(ms):
        if m is not None:
            out[i, : m.shape[0], : m.shape[1]] = m
    return out
