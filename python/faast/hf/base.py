"""What every faast model shares about the frozen model it wraps: the delegating wrapper, freezing, eval mode while
learning, and the name of the configuration file both model kinds save."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

# FaastModel and FaastModuleModel save their FaastConfig under this name; faast.hf.from_pretrained reads it for both.
CONFIG_NAME = "faast_config.json"
# Base models FAAST is applied to, until remove_faast: apply_faast refuses them, since a second set of hooks would
# stack on the first.
WRAPPED_BASE_MODELS: weakref.WeakSet = weakref.WeakSet()


class BaseModelDelegate(nn.Module):
    """An nn.Module wrapping `self.base_model`: unknown attributes, forward and generate go to the base model."""

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
        return self.base_model.generate(*args, **kwargs)


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
