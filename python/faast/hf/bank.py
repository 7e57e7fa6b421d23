"""One fast-weight bank for all middle memory layers of a FaastModel, and each layer's view of it.

The middle layers all learn d×d statistics from hidden states of the same width, so they are held as one
`FastWeights(d, d, batch_shape=(L,))`: a learning forward pass only captures every layer's keys, values and scores
(faast.hf.capture.BankCapture), and one `update` after the backbone pass adds all of them (one Gram accumulation
for L layers); one solve eigendecomposes all L Gram matrices together (one batched eigh). The output memory layer
keeps a FastWeights of its own: its keys and values are not the middle layers' hidden states.

Each `MemoryLayer.memory` is a `LayerMemory`, a view of one slot of the bank with the per-layer surface the layers
had when each owned a FastWeights (count, weights, solve_info, state_dict, update, reset, ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch

from ..memory import FastWeights
from ..ops import SolveInfo
from ..ops._validate import check_solve_options

# The statistics FastWeights keeps per memory (num_dropped is a counter, handled beside them).
_STATISTICS = ("gram", "cross", "count", "target_sqnorm")
_STATE = (*_STATISTICS, "num_dropped")


class MemoryBank(FastWeights):
    """FastWeights(d, d, batch_shape=(L,)) whose slot i holds the statistics of middle memory layer i.

    It is a FastWeights in every respect (update, solve, merge, save, faast.distributed, faast.checkpoint); it adds
    what the layers need to share it: per-slot updates, discounts and resets, and which slots hold any rows, asked
    of the device once per change of the statistics rather than once per layer and forward pass.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # FastWeights' signature (load() uses it)
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
        key = self.state_key
        if self._nonempty is None or self._nonempty[0] != key:
            self._nonempty = (key, self.count.gt(0).tolist())
        return self._nonempty[1]

    # ------------------------------------------------------------------ per-slot changes

    def check_slot(self, index: int) -> int:
        """`index` when it is a slot of this bank (an int in [0, num_slots)); else ValueError."""
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
        index = self.check_slot(index)
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
        self.mark_changed()
        return self

    @torch.no_grad()
    def discount_slot(self, index: int, gamma: float) -> MemoryBank:
        """Multiply slot `index`'s S, T, N and GCV statistic by gamma in (0, 1] (apply_discount for one slot)."""
        index = self.check_slot(index)
        if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0 < gamma <= 1:
            raise ValueError(f"gamma: expected a number in (0, 1], got {gamma!r}")
        for name in _STATISTICS:
            getattr(self, name)[index].mul_(gamma)
        self.mark_changed()
        return self

    @torch.no_grad()
    def reset_slot(self, index: int) -> MemoryBank:
        """Zero slot `index`'s statistics and counters (the other slots keep theirs)."""
        index = self.check_slot(index)
        for name in _STATE:
            getattr(self, name)[index].zero_()
        self.mark_changed()
        return self

    @torch.no_grad()
    def load_slot(self, index: int, state: dict[str, torch.Tensor], *, source: object = "state") -> MemoryBank:
        """Copy one layer's statistics (LayerMemory.state_dict() names and shapes) into slot `index`."""
        index = self.check_slot(index)
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
        self.mark_changed()
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
        self._index = bank.check_slot(index)

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
        return info.map_tensors(lambda f: f[self._index])

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
