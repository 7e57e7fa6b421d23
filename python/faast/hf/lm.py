"""What faast reads of a Hugging Face causal LM beyond nn.Module, as one Protocol for the type checker.

A transformers model is an nn.Module, and nn.Module types every attribute it does not declare as a tensor or a module;
`CausalLM` names the few parts faast uses (its config, its input and output embeddings, generate), and `as_lm` views
a module as one. Nothing here checks at run time: apply_faast refuses a model that lacks them (faast.hf.targets).
transformers is not imported.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn


class Embedding(Protocol):
    """An LM's input embeddings (an nn.Embedding or a subclass): weight [V, d] in the model's dtype."""

    weight: torch.Tensor
    num_embeddings: int
    embedding_dim: int

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class CausalLM(Protocol):
    """The parts of a transformers causal LM faast reads."""

    # A PretrainedConfig: its fields (hidden_size, model_type, max_position_embeddings, ...) differ per model type.
    config: Any

    def get_input_embeddings(self) -> Embedding: ...

    def get_output_embeddings(self) -> nn.Module | None: ...

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def as_lm(model: nn.Module) -> CausalLM:
    """`model` seen as a causal LM (no check: the callers hold a model apply_faast accepted as one)."""
    return cast(CausalLM, model)


def input_embeddings(model: nn.Module) -> Embedding:
    """model.get_input_embeddings() of a causal LM: its weight's device is where token ids go."""
    return as_lm(model).get_input_embeddings()
