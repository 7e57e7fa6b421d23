"""Per-model-type attachment table: which modules of a Hugging Face causal LM the memory layers wrap.

Supporting a new architecture is one entry here (PEFT's approach): no modeling code is copied. A memory layer is a
forward pre-hook on a block (it rewrites the block's input hidden states) and the output layer is a pre-hook on the
final norm (it rewrites the last block's output before the norm).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Target:
    backbone: str  # the decoder without the LM head: learning runs only this
    blocks: str  # nn.ModuleList of transformer blocks
    final_norm: str  # the norm after the last block


TARGETS: dict[str, Target] = {
    "gpt2": Target(backbone="transformer", blocks="transformer.h", final_norm="transformer.ln_f"),
    "llama": Target(backbone="model", blocks="model.layers", final_norm="model.norm"),
    "qwen2": Target(backbone="model", blocks="model.layers", final_norm="model.norm"),
}


def target_for(model: nn.Module) -> Target:
    """The table entry for `model.config.model_type`; a clear error naming the supported types otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in TARGETS:
        raise ValueError(
            f"model: faast.hf supports model types {sorted(TARGETS)}, got {model_type!r} "
            f"({type(model).__name__}); add an entry to faast.hf.targets.TARGETS to support it"
        )
    return TARGETS[model_type]


def get_submodule(model: nn.Module, path: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"model: expected the {what} at '{path}' for model type {model.config.model_type!r}, but "
            f"{type(model).__name__} has none (pass the *ForCausalLM model)"
        ) from None
