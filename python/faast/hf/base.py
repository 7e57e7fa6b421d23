"""What every faast model shares about the frozen model it wraps: the delegating wrapper, the API both model kinds
implement (FaastModelBase), freezing, eval mode while learning, and the names of the configuration and memories
files both save."""

from __future__ import annotations

import abc
import contextlib
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from .lm import as_lm

if TYPE_CHECKING:
    import torch

    from ..memory import FastWeights

# FaastModel and FaastModuleModel save their FaastConfig under this name; faast.hf.from_pretrained reads it for both.
CONFIG_NAME = "faast_config.json"
# What a model learned, in folders written before named memories (format 1) and by FaastModuleModel: one file.
MEMORIES_NAME = "faast_memories.safetensors"
# Base models FAAST is applied to, until remove_faast: apply_faast refuses them, since a second set of hooks would
# stack on the first.
WRAPPED_BASE_MODELS: weakref.WeakSet = weakref.WeakSet()


class BaseModelDelegate(nn.Module):
    """An nn.Module wrapping a base model (`self.base_model`, registered as its submodule): unknown attributes,
    forward and generate go to the base model."""

    def __init__(self, base_model: nn.Module) -> None:
        super().__init__()
        self.base_model = base_model

    def __getattr__(self, name: str) -> Any:  # any attribute of the base model
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self._modules["base_model"], name)

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the base model's signature
        return self.base_model(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):  # noqa: ANN002, ANN003, ANN206 - transformers' signature
        """Refused here (FaastModel overrides it): the delegation would reach the base model's from_pretrained, which
        loads a bare base model. faast.hf.from_pretrained(base_model, directory) loads a saved faast model."""
        raise NotImplementedError(
            f"{cls.__name__}.from_pretrained would load the base model alone: use "
            "faast.hf.from_pretrained(base_model, directory)"
        )

    def push_to_hub(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - transformers' signature
        """Refused: the base model's push_to_hub (reached through the delegation) would upload it without what faast
        learned. Save with save_pretrained(folder) and upload that folder."""
        raise NotImplementedError(
            "push_to_hub would upload the base model without faast's state: write it with "
            "save_pretrained(folder) and upload that folder"
        )

    def save_model(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - transformers' Trainer-style name
        """Refused for the same reason as push_to_hub: use save_pretrained."""
        raise NotImplementedError("save_model would save the base model without faast's state: use save_pretrained")

    def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the base model's signature
        return as_lm(self.base_model).generate(*args, **kwargs)


class FaastModelBase(BaseModelDelegate, abc.ABC):
    """The API FaastModel (a causal LM) and FaastModuleModel (any other model) share, declared once so that the two
    cannot drift: each subclass implements every method below and accepts at least these parameters, with these
    defaults (tests/test_hf_modules.py checks the signatures). Why there are two classes: docs/design.md §6.6.

    `learn` and `solve` are not part of it: an LM learns texts (strings, token ids, datasets) into named memories and
    its solve tunes the output layer's step, while a module model learns a batch's labels into its target modules."""

    @abc.abstractmethod
    def learn_modules(
        self, *args: object, targets: torch.Tensor | Mapping[str, torch.Tensor],
        mask: torch.Tensor | Mapping[str, torch.Tensor] | None = None, **model_inputs: object,
    ) -> int:  # fmt: skip
        """Run the base model on model_inputs and learn each target module from its captured inputs; the rows."""

    @abc.abstractmethod
    def learn_module(
        self, inputs: torch.Tensor, *, targets: torch.Tensor, name: str | None = None, mask: torch.Tensor | None = None
    ) -> int:
        """Learn one target module from its inputs [..., d_in] and targets [..., d_out] (or class ids); the rows."""

    @abc.abstractmethod
    def fast_weights(self) -> list[FastWeights]:
        """Every FastWeights this model learns into."""

    @abc.abstractmethod
    def reset_fast_weights(self) -> FaastModelBase:
        """Forget everything learned; returns self."""

    @abc.abstractmethod
    def disable_faast(self) -> contextlib.AbstractContextManager[None]:
        """A context inside which the model computes exactly what the base model does."""

    @abc.abstractmethod
    def remove_faast(self) -> nn.Module:
        """Detach faast for good and return the base model."""

    @abc.abstractmethod
    def save_fast_weights(self, path: str | Path) -> Path:
        """Write what was learned to one file, atomically; it loads back bit for bit."""

    @abc.abstractmethod
    def load_fast_weights(self, path: str | Path) -> FaastModelBase:
        """Load a file written by save_fast_weights; returns self."""

    @abc.abstractmethod
    def save_pretrained(self, directory: str | Path, *, memories: bool = True) -> Path:
        """Write the configuration and, with memories=True, what was learned; faast.hf.from_pretrained reads it."""

    @abc.abstractmethod
    def load_adapter(self, directory: str | Path) -> FaastModelBase:
        """Load a folder written by save_pretrained into this model; returns self."""


def freeze(model: nn.Module) -> None:
    """Turn off gradients of every parameter of `model`: faast never trains the base model."""
    for p in model.parameters():
        p.requires_grad_(False)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Inside, `model` is in eval mode (restored after): memories learn from the frozen model's deterministic
    activations, so no dropout, even while a readout is being trained."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
