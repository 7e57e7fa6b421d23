"""One fast-weight bank for all middle memory layers of a FaastModel, and each layer's view of it.

The middle layers all learn d×d statistics from hidden states of the same width, so they are held as one
`FastWeights(d, d, batch_shape=(L,))`: a learning forward pass only captures every layer's keys, values and scores
(`BankCapture`), and one `update` after the backbone pass adds all of them (one Gram accumulation for L layers); one
solve eigendecomposes all L Gram matrices together (one batched eigh). The output memory layer keeps a FastWeights
of its own: its values are token embeddings, not hidden states.

Each `MemoryLayer.memory` is a `LayerMemory`, a view of one slot of the bank with the per-layer surface the layers
had when each owned a FastWeights (count, weights, solve_info, state_dict, update, reset, ...).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Literal

import torch

from ..memory import FastWeights
from ..ops import SolveInfo
from ..ops._validate import check_solve_options

if TYPE_CHECKING:
    from .layers import MemoryLayer

# The statistics FastWeights keeps per memory (num_dropped is a counter, handled beside them).
_STATISTICS = ("gram", "cross", "count", "target_sqnorm")
_STATE = (*_STATISTICS, "num_dropped")


class MemoryBank(FastWeights):
    """FastWeights(d, d, batch_shape=(L,)) whose slot i holds the statistics of middle memory layer i.

    It is a FastWeights in every respect (update, solve, merge, save, faast.distributed, faast.checkpoint); it adds
    what the layers need to share it: per-slot updates, discounts and resets, and which slots hold any rows, asked
    of the device once per change of the statistics rather than once per layer and forward pass.
    """

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - FastWeights' signature (load() uses it)
        super().__init__(*args, **kwargs)
        if len(self.batch_shape) != 1:
            raise ValueError(f"batch_shape: a MemoryBank holds one memory per layer, (L,); got {self.batch_shape}")
        self._nonempty: tuple[tuple, list[bool]] | None = None

    @property
    def num_slots(self) -> int:
        return self.batch_shape[0]

    def slot(self, index: int) -> LayerMemory:
        """The view of slot `index` (one middle layer's memory)."""
        return LayerMemory(self, index)

    def nonempty(self) -> list[bool]:
        """Per slot, whether it has learned any rows (count > 0); one host sync per change of the statistics."""
        key = self._state_key()
        if self._nonempty is None or self._nonempty[0] != key:
            self._nonempty = (key, self.count.gt(0).tolist())
        return self._nonempty[1]

    # ------------------------------------------------------------------ per-slot changes

    def _check_slot(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_slots:
            raise ValueError(f"slot: expected an int in [0, {self.num_slots}), got {index!r}")
        return index

    @torch.no_grad()
    def update_slot(
        self,
        index: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
    ) -> MemoryBank:
        """Learn rows into slot `index` only: keys [..., dk], values [..., dv], scores / mask [...] (see update).

        The rows are validated and summed by a one-slot FastWeights of the same configuration (same checks and
        errors as FastWeights.update, the bank untouched when it raises), then added to the slot after the slot's
        discount. Learning all slots at once (update with keys [L, ..., dk]) is the fast path; this one serves
        a single layer's `memory.update` and a standalone MemoryLayer.
        """
        index = self._check_slot(index)
        if self.mode != "exact":
            raise ValueError("update_slot: only defined for mode='exact'")
        part = FastWeights(
            self.dim_key, self.dim_value, weighted_least_squares=self.weighted_least_squares,
            compute_dtype=self.compute_dtype, drop_nonfinite=self.drop_nonfinite, device=self.device,
        )  # fmt: skip
        part.update(keys, values, scores, mask=mask)
        for name in _STATISTICS:
            mine = getattr(self, name)[index]
            if self.discount != 1.0:
                mine.mul_(self.discount)
            mine.add_(getattr(part, name))
        self.num_dropped[index].add_(part.num_dropped)
        self._changed()
        return self

    @torch.no_grad()
    def discount_slot(self, index: int, gamma: float) -> MemoryBank:
        """Multiply slot `index`'s S, T, N and GCV statistic by gamma in (0, 1] (apply_discount for one slot)."""
        index = self._check_slot(index)
        if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0 < gamma <= 1:
            raise ValueError(f"gamma: expected a number in (0, 1], got {gamma!r}")
        for name in _STATISTICS:
            getattr(self, name)[index].mul_(gamma)
        self._changed()
        return self

    @torch.no_grad()
    def reset_slot(self, index: int) -> MemoryBank:
        """Zero slot `index`'s statistics and counters (the other slots keep theirs)."""
        index = self._check_slot(index)
        for name in _STATE:
            getattr(self, name)[index].zero_()
        self._changed()
        return self

    @torch.no_grad()
    def load_slot(self, index: int, state: dict[str, torch.Tensor], *, source: object = "state") -> MemoryBank:
        """Copy one layer's statistics (LayerMemory.state_dict() names and shapes) into slot `index`."""
        index = self._check_slot(index)
        expected = dict(self.slot(index).state_dict())
        if set(state) != set(expected):
            raise ValueError(f"{source}: expected tensors {sorted(expected)}, found {sorted(state)}")
        for name, t in state.items():
            if not isinstance(t, torch.Tensor) or t.shape != expected[name].shape:
                raise ValueError(
                    f"{source}: tensor {name} has shape {list(getattr(t, 'shape', []))}, expected "
                    f"{list(expected[name].shape)}"
                )
        for name, t in state.items():
            getattr(self, name)[index].copy_(t)
        self._changed()
        return self


class LayerMemory:
    """One middle layer's memory: a view of slot `index` of the model's MemoryBank.

    Reads give this layer's part: `count` [], `gram` [dk, dk], `cross` [dk, dv], `target_sqnorm` [], `weights`
    [dk, dv] (all L slots are solved together and cached, so asking every layer costs one solve), `solve_info`
    (this slot's rank, cut, ridge, GCV), `state_dict()` (the tensors a per-layer FastWeights held, as views).
    Changes act on this slot only: `update`, `reset`, `apply_discount`, `load_state_dict`.

    The solve settings are the bank's and so are **shared by all middle layers**: setting `alpha`, `rtol`, `ridge`
    or `compute_dtype` through any layer's memory sets it for every middle layer (the output layer has its own
    FastWeights and is set separately). They are validated as the FastWeights constructor validates them.
    """

    __slots__ = ("_bank", "_index")

    def __init__(self, bank: MemoryBank, index: int) -> None:
        if not isinstance(bank, MemoryBank):
            raise TypeError(f"bank: expected a faast.hf.bank.MemoryBank, got {type(bank).__name__}")
        self._bank = bank
        self._index = bank._check_slot(index)

    def __repr__(self) -> str:
        return (
            f"LayerMemory(slot={self._index} of {self._bank.num_slots}, dim_key={self.dim_key}, "
            f"dim_value={self.dim_value}, alpha={self.alpha}, rtol={self.rtol}, ridge={self.ridge})"
        )

    @property
    def bank(self) -> MemoryBank:
        """The shared FastWeights(d, d, batch_shape=(L,)) this view reads."""
        return self._bank

    @property
    def index(self) -> int:
        """This layer's slot in the bank."""
        return self._index

    # ------------------------------------------------------------------ configuration (shared by all slots)

    @property
    def dim_key(self) -> int:
        return self._bank.dim_key

    @property
    def dim_value(self) -> int:
        return self._bank.dim_value

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """() : a layer's memory is a single memory, as the per-layer FastWeights was."""
        return ()

    @property
    def device(self) -> torch.device:
        return self._bank.device

    @property
    def dtype(self) -> torch.dtype:
        """dtype of `weights` (the statistics are float64)."""
        return self._bank.dtype

    @property
    def version(self) -> int:
        """The bank's version: it changes whenever any slot's statistics change."""
        return self._bank.version

    @property
    def discount(self) -> float:
        return self._bank.discount

    @property
    def alpha(self) -> float | Literal["auto"]:
        return self._bank.alpha

    @alpha.setter
    def alpha(self, value: float | Literal["auto"]) -> None:
        check_solve_options(value, self._bank.rtol, self._bank.ridge, target_sqnorm=True)
        self._bank.alpha = value

    @property
    def rtol(self) -> float | None:
        return self._bank.rtol

    @rtol.setter
    def rtol(self, value: float | None) -> None:
        check_solve_options(self._bank.alpha, value, self._bank.ridge, target_sqnorm=True)
        self._bank.rtol = value

    @property
    def ridge(self) -> float | Literal["auto"] | None:
        return self._bank.ridge

    @ridge.setter
    def ridge(self, value: float | Literal["auto"] | None) -> None:
        check_solve_options(self._bank.alpha, self._bank.rtol, value, target_sqnorm=True)
        self._bank.ridge = value

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._bank.compute_dtype

    @compute_dtype.setter
    def compute_dtype(self, value: torch.dtype) -> None:
        if value not in (torch.float32, torch.float64):
            raise TypeError(f"compute_dtype: expected torch.float32 or torch.float64, got {value!r}")
        self._bank.compute_dtype = value

    def config(self) -> dict:
        """The configuration of an equivalent per-layer FastWeights (the bank's, with batch_shape [])."""
        return {**self._bank.config(), "batch_shape": []}

    # ------------------------------------------------------------------ statistics (views of this slot)

    @property
    def gram(self) -> torch.Tensor:
        """S [dk, dk] float64 (a view: in-place edits change the bank)."""
        return self._bank.gram[self._index]

    @property
    def cross(self) -> torch.Tensor:
        """T [dk, dv] float64 (a view)."""
        return self._bank.cross[self._index]

    @property
    def count(self) -> torch.Tensor:
        """N [] float64: rows learned by this layer (a view)."""
        return self._bank.count[self._index]

    @property
    def target_sqnorm(self) -> torch.Tensor:
        return self._bank.target_sqnorm[self._index]

    @property
    def num_dropped(self) -> torch.Tensor:
        return self._bank.num_dropped[self._index]

    @property
    def prior(self) -> torch.Tensor | None:
        return None if self._bank.prior is None else self._bank.prior[self._index]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This slot's tensors under the names a per-layer FastWeights used (views, detached)."""
        state = {name: getattr(self._bank, name)[self._index].detach() for name in _STATE}
        if self._bank.prior is not None:
            state["prior"] = self._bank.prior[self._index].detach()
        return state

    def buffers(self) -> Iterator[torch.Tensor]:
        """This slot's tensors (views), as FastWeights.buffers() of a per-layer memory."""
        yield from self.state_dict().values()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> LayerMemory:
        """Copy a per-layer state (state_dict() names and shapes) into this slot."""
        self._bank.load_slot(self._index, state)
        return self

    # ------------------------------------------------------------------ solving and reading

    def solve(
        self,
        *,
        alpha: float | Literal["auto"] | None = None,
        rtol: float | None = None,
        ridge: float | Literal["auto"] | None = None,
    ) -> torch.Tensor:
        """W [dk, dv] of this layer; all slots are solved in one batched call and cached (FastWeights.solve)."""
        return self._bank.solve(alpha=alpha, rtol=rtol, ridge=ridge)[self._index]

    @property
    def weights(self) -> torch.Tensor:
        """W [dk, dv] in the bank's dtype (float32) with the configured filter."""
        return self._bank.weights[self._index]

    @property
    def solve_info(self) -> SolveInfo | None:
        """This slot's part of the bank's most recent solve (None before the first)."""
        info = self._bank.solve_info
        if info is None:
            return None
        return SolveInfo(*(None if f is None else f[self._index] for f in info))

    def solve_for(self, cross: torch.Tensor) -> torch.Tensor:
        """W = S_eps^+ T for this slot's S and another T [dk, dv], differentiable in `cross` (FastWeights.solve_for).

        Returns float64 [dk, dv]. The bank's eigendecomposition is shared; FaastModel.begin_training_step solves all
        slots in one call instead.
        """
        if not isinstance(cross, torch.Tensor):
            raise TypeError(f"cross: expected a tensor [dim_key, dim_value], got {type(cross).__name__}")
        if tuple(cross.shape) != (self.dim_key, self.dim_value):
            raise ValueError(
                f"cross: expected shape [dim_key, dim_value] = {[self.dim_key, self.dim_value]}, "
                f"got {list(cross.shape)}"
            )
        index = torch.tensor([self._index], device=self._bank.device)
        full = self._bank.cross.index_copy(0, index, cross.to(self._bank.cross).unsqueeze(0))
        return self._bank.solve_for(full)[self._index]

    def __call__(self, query: torch.Tensor) -> torch.Tensor:
        """query [..., dk] -> query @ W [..., dv] in the promoted dtype."""
        if not isinstance(query, torch.Tensor):
            raise TypeError(f"query: expected a tensor [..., dim_key={self.dim_key}], got {type(query).__name__}")
        if query.shape[-1:] != (self.dim_key,):
            raise ValueError(f"query: expected shape [..., dim_key={self.dim_key}], got {list(query.shape)}")
        weights = self.weights
        dtype = torch.promote_types(query.dtype, weights.dtype)
        return query.to(dtype) @ weights.to(dtype)

    # ------------------------------------------------------------------ learning (this slot only)

    def update(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
    ) -> LayerMemory:
        """Learn rows into this layer only: keys [..., dk], values [..., dv], scores / mask [...].

        Same semantics and errors as FastWeights.update on a per-layer memory. FaastModel.learn does not come here:
        it updates all layers of the bank in one call.
        """
        self._bank.update_slot(self._index, keys, values, scores, mask=mask)
        return self

    def apply_discount(self, gamma: float) -> LayerMemory:
        """Multiply this layer's S, T, N by gamma in (0, 1] (the other layers keep theirs)."""
        self._bank.discount_slot(self._index, gamma)
        return self

    def reset(self) -> LayerMemory:
        """Forget everything this layer learned (the other layers keep theirs)."""
        self._bank.reset_slot(self._index)
        return self


class BankCapture:
    """The rows of every middle layer in one learning forward pass, gathered for one bank update.

    The block hooks call `add` with each layer's block input; `keys`/`values` are written into buffers
    [L, B, T-1, d] (the hidden states' dtype) with non-pairs zeroed, and the scores [B, T-1] float32 are kept per
    slot. `update` then adds all layers with one `bank.update` (one Gram accumulation). A slot whose hook did not
    run learns nothing.

    Args:
        layers: the middle layers in slot order.
        pair_mask: [B, T-1] bool, True where tokens t and t+1 are both real.
        differentiable: keep the scores' graph to the scorers (readout training).
        workspace: buffers of a previous capture to reuse when their shape, dtype and device fit (a learning run
            allocates them once instead of once per batch); never reused when differentiable.
    """

    def __init__(
        self,
        layers: Sequence[MemoryLayer],
        pair_mask: torch.Tensor,
        differentiable: bool,
        workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.layers = list(layers)
        self.pair_mask = pair_mask
        self.differentiable = differentiable
        self.workspace = None if differentiable else workspace
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.scores: list[torch.Tensor | None] = [None] * len(self.layers)
        self.seen = [False] * len(self.layers)

    def _buffers(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            shape = (len(self.layers), hidden.shape[0], hidden.shape[1] - 1, hidden.shape[2])
            reuse = self.workspace
            if (
                reuse is not None
                and reuse[0].shape == shape
                and reuse[0].dtype == hidden.dtype
                and (reuse[0].device == hidden.device)
            ):
                self.keys, self.values = reuse
            else:
                self.keys = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
                self.values = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
        return self.keys, self.values

    def add(self, slot: int, hidden: torch.Tensor) -> None:
        """Capture layer `slot`'s pairs from its block input hidden [B, T, d]."""
        layer = self.layers[slot]
        keys, values = self._buffers(hidden)
        keep = self.pair_mask.unsqueeze(-1)
        zero = hidden.new_zeros(())
        # Non-pairs are zeroed (padding may hold anything, even NaN), so the scorer and the readout-training T see
        # finite rows; the bank update still masks them out of S, T and N.
        if hidden.dtype == keys.dtype:
            torch.where(keep, hidden[:, :-1], zero, out=keys[slot])
            torch.where(keep, hidden[:, 1:], zero, out=values[slot])
        else:  # a model whose blocks change dtype: the buffers keep the first layer's
            keys[slot].copy_(torch.where(keep, hidden[:, :-1], zero))
            values[slot].copy_(torch.where(keep, hidden[:, 1:], zero))
        if layer.scorer is not None:
            with torch.set_grad_enabled(self.differentiable):
                self.scores[slot] = layer.scores(keys[slot], values[slot])
        self.seen[slot] = True

    def update(self, bank: MemoryBank) -> torch.Tensor | None:
        """Add every captured layer to `bank` in one update. Returns the step's T [L, dk, dv] float64 with the graph
        to the scorers when differentiable (else None)."""
        if self.keys is None:  # no block hook ran (e.g. FAAST disabled mid-pass): nothing to learn
            return None
        keys, values = self.keys, self.values
        mask = self.pair_mask.unsqueeze(0).expand(len(self.layers), *self.pair_mask.shape)
        if not all(self.seen):
            missing = torch.tensor([not s for s in self.seen], device=mask.device)
            mask = mask & ~missing.view(-1, 1, 1)
            for slot, seen in enumerate(self.seen):
                if not seen:
                    keys[slot].zero_()
                    values[slot].zero_()
        scores = None
        if any(s is not None for s in self.scores):
            scores = torch.stack(
                [s if s is not None else keys.new_zeros(keys.shape[1:3], dtype=torch.float32) for s in self.scores]
            )
        bank.update(keys, values, None if scores is None else scores.detach(), mask=mask)
        if not (self.differentiable and scores is not None and scores.requires_grad):
            return None
        # T of this batch again, differentiable in the scores: K^T diag(s) V per layer over all rows (non-pairs are
        # zero rows and add nothing), so no boolean indexing and no host sync.
        flat = (len(self.layers), -1, keys.shape[-1])
        k = keys.reshape(flat).to(torch.float64)
        sv = scores.reshape(len(self.layers), -1, 1).to(torch.float64) * values.reshape(flat).to(torch.float64)
        return k.mT @ sv

    def release(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers, for the next capture to reuse (None when they must not be reused)."""
        if self.differentiable or self.keys is None:
            return None
        return self.keys, self.values
