"""faast and PEFT: why faast is not a PEFT method (`get_peft_model(model, FaastConfig)`), and how the two compose.

PEFT's public registration is `peft.utils.register_peft_method(*, name: str, config_cls, model_cls,
prefix: Optional[str] = None, is_mixed_compatible=False) -> None` (peft 0.21, peft/utils/peft_types.py). It raises
`ValueError("Unknown PEFT type FAAST, please add an entry to peft.utils.peft_types.PeftType.")` unless
`name.upper()` is already a member of `peft.utils.PeftType`, a closed `enum.Enum` (members cannot be added to an
Enum after its class is created). Every later lookup (`PeftModel.__init__`, `get_peft_model_state_dict`,
`PeftConfig.from_peft_type`) goes through the dicts `peft.mapping.PEFT_TYPE_TO_{CONFIG,TUNER,PREFIX}_MAPPING` keyed by
that enum. So a third-party method can only be registered by editing PEFT's enum or by writing into those
module-level dicts directly, which are PEFT internals; faast does neither (docs/design.md §6.6).

What works with public API on both sides: faast's memories hook modules of the model PEFT wraps, LoRA layers
included (a LoRA-wrapped nn.Linear keeps in_features / out_features), so `apply_faast_to_peft` puts them on the model
inside a PeftModel and both adaptations act in the same forward pass.
"""

from __future__ import annotations

from torch import nn

from .config import FaastConfig


def peft_accepts_method(name: str = "faast") -> bool:
    """Whether the installed peft's register_peft_method would accept a method called `name` (it must already be a
    member of peft.utils.PeftType); False when peft is not installed."""
    try:
        from peft.utils import PeftType
    except ImportError:
        return False
    return name.upper() in PeftType.__members__


def apply_faast_to_peft(peft_model: nn.Module, config: FaastConfig) -> nn.Module:
    """Attach faast to the transformers model inside a PeftModel (e.g. one with LoRA adapters).

    The memories hook that model's modules in place, so calling `peft_model` (or the returned faast model) runs the
    adapters and the memories together; a target module PEFT wrapped (lora.Linear) is hooked as the wrapper, so a
    residual memory fits what the adapted model still gets wrong. apply_faast freezes every parameter, adapters
    included: train the adapters first, then learn with faast.

    Returns what apply_faast returns for the inner model: a FaastModel (a causal LM) or a FaastModuleModel.
    """
    from .model import apply_faast

    get_base = getattr(peft_model, "get_base_model", None)
    if get_base is None:
        raise TypeError(f"peft_model: expected a peft.PeftModel, got {type(peft_model).__name__}")
    return apply_faast(get_base(), config)
