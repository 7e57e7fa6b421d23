"""What faast.hf.persistence reads of the model it saves and loads, as a Protocol.

persistence.py types its model by these members rather than by FaastModel because faast.hf.model imports it:
importing FaastModel back, even under TYPE_CHECKING, would close an import circle (tests/test_structure.py). This
module imports nothing of faast.hf.model; mypy checks that FaastModel satisfies SavedModel wherever model.py passes
itself to persistence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import nn

    from ..accumulator import Accumulator
    from ..memory import FastWeights
    from .bank import MemoryBank
    from .config import FaastConfig
    from .modules import ModuleMemories


class SavedModel(Protocol):
    """The members of a FaastModel that its adapter folder and fast-weights file are written from and read into
    (read-only here: persistence changes what they hold, never which object they are)."""

    @property
    def faast_config(self) -> FaastConfig:
        """The configuration as built (saved as faast_config.json and in the adapter's metadata)."""

    @property
    def base_model(self) -> nn.Module:
        """The wrapped causal LM: its vocabulary size is part of what a saved model needs of the base."""

    @property
    def memory_layers(self) -> nn.ModuleDict:
        """Block index (str) -> MemoryLayer: each one's `.readout` and `.scorer` are the adapter's tensors."""

    @property
    def memory_bank(self) -> MemoryBank | None:
        """The middle layers' statistics, one slot per entry of memory_layers (None without middle layers)."""

    @property
    def output_memory_layer(self) -> nn.Module | None:
        """The output memory layer (a ResidualOutputLayer has settings saved beside its statistics), or None."""

    @property
    def module_memories(self) -> ModuleMemories:
        """The memories on FaastConfig.target_modules (empty when none are configured)."""

    def learned_state(self) -> list[tuple[str, FastWeights | Accumulator]]:
        """Every piece of learned state by name, in file order (FaastModel.learned_state)."""
