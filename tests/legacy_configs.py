"""Configurations as earlier faast releases wrote them (configuration version 1, flat fields, no config_version):
the data the compatibility tests load."""

from __future__ import annotations

# FaastConfig().to_dict() of the last release with flat fields: every one of its 28 fields present.
V1_DEFAULT = {
    "alpha": 1.0,
    "base_model": None,
    "compute_dtype": "float64",
    "dropout": 0.1,
    "faast_version": "0.1.0",
    "hidden_size": None,
    "layers": None,
    "learn_dtype": "auto",
    "model_type": None,
    "module_fit": "residual",
    "num_hidden_layers": None,
    "num_layers": 0,
    "output_alpha": 1.0,
    "output_damping": 1.0,
    "output_default_step": None,
    "output_default_weight": None,
    "output_head_dtype": "auto",
    "output_key_layers": "auto",
    "output_layer": True,
    "output_mix": 0.9,
    "output_space": "probability",
    "output_step": "auto",
    "output_target": "residual",
    "output_tune_tokens": 2048,
    "output_weight": 0.5,
    "ridge": None,
    "scorer": True,
    "target_modules": None,
}

# A configuration apply_faast recorded in that release: 2 middle layers (num_layers=2 resolved to blocks 1 and 2 of a
# 4-block model), a tuned-weight residual output layer with its keys resolved, module memories.
V1_APPLIED = {
    **V1_DEFAULT,
    "num_layers": 2,
    "layers": [1, 2],
    "scorer": False,
    "dropout": 0.2,
    "alpha": 0.5,
    "ridge": 0.01,
    "output_space": "logit",
    "output_step": 0.3,
    "output_weight": "auto",
    "output_damping": 0.5,
    "output_alpha": 0.8,
    "output_tune_tokens": 512,
    "output_default_step": 0.02,
    "output_default_weight": 0.4,
    "output_key_layers": [0],
    "output_head_dtype": "float32",
    "learn_dtype": "model",
    "compute_dtype": "float32",
    "target_modules": ["lm_head"],
    "module_fit": "replace",
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "base_model": "tiny",
}

# The oldest layout: the middle layers and the paper's output layer only (faast 0.1.0 before the residual output
# layer, probability space, wider keys and bfloat16 learning existed), as the shipped adapter's metadata holds it.
V1_OLDEST = {
    "alpha": 1.0,
    "base_model": "SmolLM2-135M-Instruct",
    "compute_dtype": "float64",
    "dropout": 0.1,
    "faast_version": "0.1.0",
    "hidden_size": 576,
    "layers": [4, 8, 12, 17, 21, 25],
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_layers": 6,
    "output_layer": True,
    "output_mix": 0.9,
    "ridge": None,
    "scorer": True,
}
