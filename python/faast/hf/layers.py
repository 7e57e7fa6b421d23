"""The memory layers added to a causal LM: a middle layer (keys h_t, values h_{t+1} at one block's input, readout P,
token scorer) and the output layer (keys: last block's output, values: the next token's input embedding).

The middle layers of a FaastModel share one `MemoryBank` (faast/hf/bank.py: FastWeights(d, d, batch_shape=(L,))), so
learning a batch is one Gram accumulation and a solve one batched eigendecomposition for all of them; each layer's
`.memory` is a view of its slot. The output layer owns a `faast.FastWeights`. Learning only updates statistics; the
hidden states pass through unchanged (docs/design.md §6.4), so every layer learns from the base model's own activations
in one forward pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from .. import ops
from ..memory import FastWeights
from .bank import LayerMemory, MemoryBank
from .capture import next_token_pairs, scored_cross
from .config import EmbeddingOutput, FaastConfig, MiddleLayers


def _keep_dtype(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    # model.to(torch.bfloat16) must not turn the trained readout and scorer into bf16: they are fp32 master weights
    # (docs/authors.md H10: bf16 parameters round small AdamW updates away). Device moves still apply.
    def apply(t: torch.Tensor) -> torch.Tensor:
        moved = fn(t)
        return moved if moved.dtype == t.dtype else t.to(device=moved.device)

    return apply


def memory_options(config: FaastConfig) -> dict:
    """The FastWeights arguments a FaastConfig sets for every memory but the residual output layer's: the
    regulariser's alpha and ridge, and compute_dtype."""
    regulariser = config.regulariser
    return {
        "alpha": regulariser.alpha,
        "ridge": regulariser.ridge,
        "compute_dtype": getattr(torch, config.compute_dtype),
    }


def _memory(dim_key: int, dim_value: int, config: FaastConfig, device: torch.device | None) -> FastWeights:
    return FastWeights(dim_key, dim_value, **memory_options(config), device=device)


def memory_bank(
    hidden_size: int, num_layers: int, config: FaastConfig, device: torch.device | None = None
) -> MemoryBank:
    """The shared statistics of `num_layers` middle memory layers: MemoryBank(d, d, batch_shape=(num_layers,))."""
    return MemoryBank(hidden_size, hidden_size, batch_shape=(num_layers,), **memory_options(config), device=device)


def _solve_key(memory: FastWeights) -> tuple:
    # The statistics' versions and the filter settings: a user may retune memory.alpha after learning.
    return memory.solution_key


class MemoryLayer(nn.Module):
    """A middle memory layer before block `index`: h + P(dropout(h W)), folded to h + h (W P) at inference.

    Args:
        hidden_size: d, the width of the hidden states.
        config: the FaastConfig: its middle (MiddleLayers: scorer, dropout), regulariser and compute_dtype.
        index: the block it sits before.
        device: where its parameters (and its own bank) go.
        bank, slot: the MemoryBank shared by the model's middle layers and this layer's slot in it. Without a bank
            the layer owns a one-slot bank (a standalone layer, e.g. in tests).

    Attributes:
        memory: LayerMemory, the view of this layer's slot: FastWeights(d, d)-like statistics of keys h_t and
            score-weighted values s_t·h_{t+1}. Solve settings (alpha, ridge, ...) are the bank's, shared by all
            middle layers.
        readout: nn.Linear(d, d, bias=False), zero-initialised, trained once (P = readout.weight^T).
        scorer: nn.Linear(2d, 1, bias=False) or None; s = sigmoid(scorer([k; v])) with detached inputs.
    """

    def __init__(
        self,
        hidden_size: int,
        config: FaastConfig,
        index: int,
        device: torch.device | None = None,
        *,
        bank: MemoryBank | None = None,
        slot: int = 0,
    ):
        super().__init__()
        if not isinstance(config.middle, MiddleLayers):
            raise ValueError(f"config: a MemoryLayer needs config.middle = MiddleLayers(...), got {config.middle!r}")
        self.index = index
        if bank is None:
            self.own_bank = memory_bank(hidden_size, 1, config, device)  # registered: moves with the layer
            bank, slot = self.own_bank, 0
        elif not isinstance(bank, MemoryBank):
            raise TypeError(f"bank: expected a faast.hf.bank.MemoryBank or None, got {type(bank).__name__}")
        elif bank.dim_key != hidden_size or bank.dim_value != hidden_size:
            raise ValueError(
                f"bank: expected a MemoryBank of width hidden_size={hidden_size}, got {bank.dim_key}x{bank.dim_value}"
            )
        # A shared bank is registered once, by the model that owns it; a submodule here would repeat its statistics
        # in every layer's state_dict.
        self.__dict__["_bank"] = bank
        self.slot = bank.check_slot(slot)
        self.memory = LayerMemory(bank, self.slot)
        self.readout = nn.Linear(hidden_size, hidden_size, bias=False, device=device, dtype=torch.float32)
        nn.init.zeros_(self.readout.weight)
        self.scorer = (
            nn.Linear(2 * hidden_size, 1, bias=False, device=device, dtype=torch.float32)
            if config.middle.scorer
            else None
        )
        self.dropout = nn.Dropout(config.middle.dropout)
        # M = W·P per bank (a model's named memories each have their own bank; a mixed batch reads several).
        self._folded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._step_cross: torch.Tensor | None = None  # this step's differentiable T (readout training)
        self._train_weights: torch.Tensor | None = None  # differentiable W of the current training step

    @property
    def bank(self) -> MemoryBank:
        """The MemoryBank holding this layer's statistics (shared with the model's other middle layers)."""
        return self.__dict__["_bank"]

    def use_bank(self, bank: MemoryBank) -> None:
        """Read and learn `bank` from now on (FaastModel switching named memories; its slot stays this layer's)."""
        if not isinstance(bank, MemoryBank) or (bank.dim_key, bank.num_slots) != (self.bank.dim_key,
                                                                                 self.bank.num_slots):  # fmt: skip
            raise ValueError(f"bank: expected a MemoryBank like {self.bank!r}, got {bank!r}")
        self.__dict__["_bank"] = bank
        self.memory = LayerMemory(bank, self.slot)

    def extra_repr(self) -> str:
        return f"index={self.index}, slot={self.slot}"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MemoryLayer:
        self._folded.clear()
        return super()._apply(_keep_dtype(fn), recurse)

    def scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """s = sigmoid(a·[k; v]) [..., ] float32 from keys/values [..., d]; the inputs are detached."""
        assert self.scorer is not None, "this layer has no scorer (config.middle.scorer is off)"
        features = torch.cat([keys.detach(), values.detach()], dim=-1).to(self.scorer.weight.dtype)
        return torch.sigmoid(self.scorer(features)).squeeze(-1)

    def learn(self, hidden: torch.Tensor, pair_mask: torch.Tensor, *, differentiable: bool = False) -> None:
        """Add the pairs (h_t, h_{t+1}) of hidden [B, T, d] where pair_mask [B, T-1] (bool) is True, to this layer.

        differentiable: also keep this batch's T = K^T diag(s) V with the graph to the scorer (readout training).
        FaastModel.learn does not call this per layer: it captures every layer and updates the bank once.
        """
        keys, values = next_token_pairs(hidden, pair_mask)
        scores = None
        if self.scorer is not None:
            with torch.set_grad_enabled(differentiable):
                scores = self.scores(keys, values)
        self.memory.update(keys, values, None if scores is None else scores.detach(), mask=pair_mask)
        if differentiable and scores is not None:
            self.add_step_cross(scored_cross(keys, values, scores))

    def add_step_cross(self, step: torch.Tensor) -> None:
        """Add a batch's differentiable T [d, d] float64 to this training step's (see begin_training_step)."""
        self._step_cross = step if self._step_cross is None else self._step_cross + step

    def step_cross_delta(self) -> torch.Tensor | None:
        """T_step - T_step.detach(): zero valued, carries this step's gradient to the scorer (None without one)."""
        if self._step_cross is None:
            return None
        return self._step_cross - self._step_cross.detach()

    def begin_training_step(self) -> None:
        """Solve W = S_eps^+ T once for this step with T differentiable in the scorer (S_eps^+ constant).

        FaastModel.begin_training_step does this for all middle layers in one solve.
        """
        cross = self.memory.cross
        delta = self.step_cross_delta()
        if delta is not None:
            cross = cross + delta
        self.set_training_weights(self.memory.solve_for(cross).to(torch.float32))

    @property
    def training_weights(self) -> torch.Tensor | None:
        """The differentiable W [d, d] float32 this layer reads during a training step, else None."""
        return self._train_weights

    def set_training_weights(self, weights: torch.Tensor) -> None:
        """Read `weights` (W [d, d] float32, with the graph to the scorer) until end_training_step: the model's
        begin_training_step solves every middle layer in one call and hands each its slice."""
        self._train_weights = weights

    def end_training_step(self) -> None:
        """Drop the training step's differentiable T and W: the layer reads the folded fast weights again."""
        self._step_cross = None
        self._train_weights = None

    def folded(self, device: torch.device, dtype: torch.dtype, bank: MemoryBank | None = None) -> torch.Tensor | None:
        """M = W·P [d, d] in the activations' dtype for bf16/fp16 (one 16-bit GEMM: tensor cores on a GPU, where the
        float32 path measured 11x slower, lab/benchmarks/results/gpu_h100_run1.md), float64 for float64 inputs and
        float32 otherwise; None while this layer's memory is empty.

        Cached until the statistics or the readout change; recomputing it takes this layer's slice of the bank's
        solve (one solve for all layers) and one d×d GEMM. Whether the slot is empty is asked of the device once per
        change of the statistics for all layers together (MemoryBank.nonempty), not per layer and forward.
        bank: another named memory's bank of the same shape (default: the one this layer reads), cached per bank.
        """
        compute = dtype if dtype in (torch.float64, torch.bfloat16, torch.float16) else torch.float32
        bank = self.bank if bank is None else bank
        key = (*_solve_key(bank), self.readout.weight._version, id(self.readout.weight), device, compute)
        cached = self._folded.get(bank)
        if cached is None or cached[0] != key:
            m = None
            if bank.nonempty()[self.slot]:
                m = ops.fold_readout(bank.weights[self.slot], self.readout.weight.detach().mT, out_dtype=compute)
            cached = self._folded[bank] = (key, m)
        return cached[1]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] -> hidden + (hidden W) P, same shape and dtype."""
        if self._train_weights is not None:
            memory_out = self.dropout(hidden.to(torch.float32) @ self._train_weights)
            return hidden + self.readout(memory_out).to(hidden.dtype)
        m = self.folded(hidden.device, hidden.dtype)
        return hidden if m is None else ops.residual_project(hidden, m)


class OutputMemoryLayer(nn.Module):
    """The output memory layer after the last block: h <- (1 - mix)·h + mix·h W, no readout and no scorer.

    Keys are the last block's outputs, values the next token's input embedding; an empty memory passes h through.
    """

    def __init__(self, hidden_size: int, embedding_size: int, config: FaastConfig, device: torch.device | None = None):
        super().__init__()
        if not isinstance(config.output, EmbeddingOutput):
            raise ValueError(
                f"config: an OutputMemoryLayer needs config.output = EmbeddingOutput(...), got {config.output!r}"
            )
        self.mix = float(config.output.mix)
        self.memory = _memory(hidden_size, embedding_size, config, device)
        self._weights: tuple[tuple, torch.Tensor | None] | None = None

    def extra_repr(self) -> str:
        return f"mix={self.mix}"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> OutputMemoryLayer:
        self._weights = None
        return super()._apply(_keep_dtype(fn), recurse)

    def new_state(self) -> FastWeights:
        """An empty memory of this layer's shape: another named memory's state (FaastModel.learn(memory=...))."""
        return self.memory.empty_like()

    def swap_state(self, state: FastWeights) -> FastWeights:
        """Read and learn `state` (a memory from new_state) from now on; returns the one read before (no copy)."""
        if not isinstance(state, FastWeights) or state.config() != self.memory.config():
            raise ValueError(f"state: expected a FastWeights of configuration {self.memory.config()}")
        previous, self.memory, self._weights = self.memory, state, None
        return previous

    def learn(self, hidden: torch.Tensor, next_embeddings: torch.Tensor, pair_mask: torch.Tensor) -> None:
        """Add pairs (h_t, E[x_{t+1}]): hidden [B, T, d], next_embeddings [B, T-1, d_e], pair_mask [B, T-1]."""
        keys, values = next_token_pairs(hidden, pair_mask, next_embeddings)
        self.memory.update(keys, values, mask=pair_mask)

    def weights(
        self, device: torch.device, dtype: torch.dtype, memory: FastWeights | None = None
    ) -> torch.Tensor | None:
        """W [d, d_e] in float64 for float64 activations, else float32; None while empty. memory: another named
        memory of this layer's shape (default: the one it reads; that one's cast is cached here)."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        if memory is not None and memory is not self.memory:
            return memory.weights.to(device=device, dtype=compute) if bool(memory.count.gt(0).any()) else None
        key = (*_solve_key(self.memory), device, compute)
        if self._weights is None or self._weights[0] != key:
            w = self.memory.weights.to(compute) if bool(self.memory.count.gt(0).any()) else None
            self._weights = (key, w)
        return self._weights[1]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.weights(hidden.device, hidden.dtype)
        if w is None:
            return hidden
        h = hidden.to(w.dtype)
        return torch.lerp(h, h @ w, self.mix).to(hidden.dtype)
