"""Configuration version 1: the flat FaastConfig of faast 0.1 (28 fields, 13 of them output_*), converted to the
grouped layout of version 2 (faast.hf.config), and the errors that point an old keyword to its new place.

A version-1 file is read with the defaults that version had, including those it applied to fields missing from
files written before the fields existed; version 2 applies none of them, so a default changed later can never
change what an old file means.
"""

from __future__ import annotations

# Every field of the version-1 FaastConfig with the default it had in the last release that wrote version 1.
V1_DEFAULTS: dict[str, object] = {
    "num_layers": 0,
    "layers": None,
    "output_layer": True,
    "output_target": "residual",
    "output_mix": 0.9,
    "output_space": "probability",
    "output_step": "auto",
    "output_weight": 0.5,
    "output_damping": 1.0,
    "output_alpha": 1.0,
    "output_tune_tokens": 2048,
    "output_default_step": None,
    "output_default_weight": None,
    "output_key_layers": "auto",
    "output_head_dtype": "auto",
    "learn_dtype": "auto",
    "alpha": 1.0,
    "ridge": None,
    "scorer": True,
    "dropout": 0.1,
    "compute_dtype": "float64",
    "target_modules": None,
    "module_fit": "residual",
    "model_type": None,
    "hidden_size": None,
    "num_hidden_layers": None,
    "base_model": None,
    "faast_version": None,
}

# What a version-1 file missing a field meant: the behaviour of the release that wrote it, before the field existed.
V1_MISSING = {
    "output_target": "embedding",  # before the residual output layer existed: the paper's layer
    "output_space": "logit",  # before probability space existed: the residual layer read logits
    "output_key_layers": [],  # before wider keys existed: keys were h̃ alone
    "learn_dtype": "model",  # before bfloat16 learning existed: learned in the model's dtype
}

# Version-1 fields kept unchanged at the top level of version 2.
_TOP_LEVEL = ("learn_dtype", "compute_dtype", "target_modules", "module_fit", "model_type", "hidden_size",
              "num_hidden_layers", "base_model", "faast_version")  # fmt: skip
# The residual output layer's version-1 fields: output_<name> became ResidualOutput.<name>.
_RESIDUAL = ("space", "step", "weight", "damping", "alpha", "tune_tokens", "default_step", "default_weight",
             "key_layers", "head_dtype")  # fmt: skip


def _middle_v1(flat: dict) -> dict | None:
    layers, num_layers = flat["layers"], flat["num_layers"]
    if isinstance(layers, list | tuple) and not layers:  # what apply_faast recorded for no middle layers
        return None
    if layers is None and num_layers == 0:  # the version-1 default: none
        return None
    if layers is not None and num_layers == 0:
        # num_layers was ignored beside explicit layers; its default 0 would now read as "no middle layers".
        num_layers = None
    return {"num_layers": num_layers, "layers": layers, "scorer": flat["scorer"], "dropout": flat["dropout"]}


def _output_v1(flat: dict) -> dict | None:
    if flat["output_layer"] is False:
        return None
    if flat["output_target"] == "embedding":
        return {"kind": "embedding", "mix": flat["output_mix"]}
    if flat["output_target"] != "residual":
        raise ValueError(f"output_target: expected 'residual' or 'embedding', got {flat['output_target']!r}")
    return {"kind": "residual", **{name: flat[f"output_{name}"] for name in _RESIDUAL}}


def upgrade_v1(data: dict) -> dict:
    """A version-1 (flat) configuration dict as the version-2 dict FaastConfig.from_dict reads: fields missing
    take V1_MISSING, else V1_DEFAULTS; unknown fields raise naming them."""
    unknown = sorted(set(data) - set(V1_DEFAULTS))
    if unknown:
        raise ValueError(f"FaastConfig (config_version 1): unknown fields {unknown}; known: {sorted(V1_DEFAULTS)}")
    if "output_layer" in data and not isinstance(data["output_layer"], bool):
        raise ValueError(f"output_layer: expected True or False, got {data['output_layer']!r}")
    flat = {**V1_DEFAULTS, **V1_MISSING, **data}
    upgraded = {name: flat[name] for name in _TOP_LEVEL if flat[name] is not None or name in data}
    return {
        **upgraded,
        "output": _output_v1(flat),
        "middle": _middle_v1(flat),
        "regulariser": {"alpha": flat["alpha"], "ridge": flat["ridge"]},
    }


def _now(name: str, value: object) -> str:
    """Where the version-1 keyword `name` (given `value`) lives in the grouped FaastConfig."""
    if name in ("num_layers", "layers", "scorer", "dropout"):
        return f"FaastConfig(middle=MiddleLayers({name}={value!r}))"
    if name in ("alpha", "ridge"):
        return f"FaastConfig(regulariser=Regulariser({name}={value!r}))"
    if name == "output_layer":
        return "FaastConfig(output=None) for no output layer (the default is FaastConfig(output=ResidualOutput()))"
    if name == "output_target":
        return (
            "the output's class: FaastConfig(output=ResidualOutput(...)) or FaastConfig(output=EmbeddingOutput(...))"
        )
    if name == "output_mix":
        return f"FaastConfig(output=EmbeddingOutput(mix={value!r}))"
    return f"FaastConfig(output=ResidualOutput({name.removeprefix('output_')}={value!r}))"


# The version-1 keywords that no longer are FaastConfig fields.
FLAT_ONLY = tuple(name for name in V1_DEFAULTS if name not in _TOP_LEVEL)


def flat_keyword_error(kwargs: dict) -> TypeError | None:
    """The TypeError for FaastConfig(...) given version-1 keywords (naming each one's new place), or None."""
    old = [name for name in kwargs if name in FLAT_ONLY]
    if not old:
        return None
    lines = "; ".join(f"{name}: now {_now(name, kwargs[name])}" for name in old)
    return TypeError(f"FaastConfig: the flat settings of configuration version 1 are grouped now: {lines}")
