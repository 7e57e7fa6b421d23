"""FaastConfig: where memory layers go and how they solve, recorded with every saved readout.

The settings are grouped by what they configure (faast.hf.config_groups): the output layer (`output`: a
ResidualOutput, an EmbeddingOutput or None), the middle layers (`middle`: MiddleLayers or None) and the spectral
filter of their solves (`regulariser`). Saved configurations carry `config_version`; version 1, the flat layout of
faast 0.1, is converted on load (faast.hf.config_legacy).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._version import __version__
from .config_groups import (
    OUTPUT_KINDS,
    EmbeddingOutput,
    MiddleLayers,
    Regulariser,
    ResidualOutput,
    check_choice,
    group_from_dict,
    is_count,
    output_from_dict,
    refuse,
)
from .config_legacy import FLAT_ONLY, flat_keyword_error, upgrade_v1
from .output.policy import OutputPolicy

# The layout FaastConfig.to_dict() writes. 1: the flat fields of faast 0.1 (config_legacy); 2: the groups.
CONFIG_VERSION = 2

# The paper (appendix, "Impact of model size and number of layers"): a memory layer before every block for models
# below about 1B parameters, before every other block above.
PAPER_SMALL_MODEL_PARAMS = 1_000_000_000


def _check_target_modules(value: object) -> list[str] | str | None:
    """None, a regular expression (str), or a list of distinct non-empty names (a tuple or set becomes a list)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"target_modules: {value!r} is not a valid regular expression ({err})") from None
        return value
    if isinstance(value, set | frozenset):
        value = sorted(value)
    if not isinstance(value, list | tuple) or not value or not all(isinstance(n, str) and n for n in value):
        raise ValueError(
            f"target_modules: expected None, a regular expression or a non-empty list of module names, got {value!r}"
        )
    if len(set(value)) != len(value):
        raise ValueError(f"target_modules: names must be distinct, got {value!r}")
    return list(value)


@dataclass
class FaastConfig:
    """Configuration of the memory layers added to a causal LM (docs/design.md §6), grouped by what each setting
    configures.

    Attributes:
        output: the output memory layer after the last block. ResidualOutput() (the default): the residual layer,
            which needs no trained readout; EmbeddingOutput(): the paper's; None: no output layer.
        middle: the middle memory layers, MiddleLayers(...), an explicit opt-in (they read through a readout that
            must be trained first, faast.hf.train); None (the default): none.
        regulariser: the spectral filter of the middle layers' and the module memories' solves, Regulariser().
        learn_dtype: the precision of the base model's forward pass inside learn() (statistics are accumulated in
            float32/float64 either way; reading is never affected). 'auto' (the default): bfloat16 autocast when the
            model's weights are float32 and the device multiplies bfloat16 natively (CUDA, or a CPU with AVX512-BF16
            or AMX); else, with float32 weights on a CPU with AVX2, the blocks' linears in int8 (faast/hf/int8_pass.py;
            the MLPs' down projections and the rest stay float32); else the model's own dtype. 'model': always the
            model's own dtype; 'bfloat16': always autocast; 'int8': always the int8 linears (a CPU with float32
            weights only, else learn() raises ValueError). Both were chosen on three validation domains
            (docs/design.md §6.4): on 2 AMD EPYC cores learning 32K tokens took 0.77× the time under autocast and
            held-out perplexity moved by at most 0.02%; the int8 linears' numbers are in docs/design.md §6.4.
        compute_dtype: 'float64' (default, exact) or 'float32' for the per-batch statistics GEMMs (summed in
            float64): faster on hardware with slow float64, see FastWeights(compute_dtype=).
        target_modules: put a memory on each module these name (docs/design.md §6.6), matched as PEFT matches its
            target_modules: a list of names (a module matches when its qualified name equals an entry or ends with
            "." + the entry) or a string, a regular expression that must match the whole qualified name. Keys are the
            module's input [..., d_in], values what its output [..., d_out] should have been; None: no module
            memories. On a model without an entry in faast.hf.targets (e.g. a BERT classifier) they are the only
            memories attached.
        module_fit: what a module memory fits. 'residual' (the default): the values are y - f(x), the targets minus
            the module's own output, and the module returns f(x) + x·W. 'replace': the values are the targets y and
            the module returns x·W. An empty memory returns f(x) either way.
        model_type, hidden_size, num_hidden_layers: filled in by apply_faast from the model; a saved readout only
            loads into a model of the same shape.
        base_model: free-form name of the base model the readout was trained on (informational).
        faast_version: the faast version that wrote the configuration.

    The flat keywords of configuration version 1 (num_layers=, output_step=, alpha=, ...) raise a TypeError that
    names each one's new place.
    """

    output: ResidualOutput | EmbeddingOutput | None = field(default_factory=ResidualOutput)
    middle: MiddleLayers | None = None
    regulariser: Regulariser = field(default_factory=Regulariser)
    learn_dtype: Literal["auto", "model", "bfloat16", "int8"] = "auto"
    compute_dtype: Literal["float64", "float32"] = "float64"
    target_modules: list[str] | str | None = None
    module_fit: Literal["residual", "replace"] = "residual"
    model_type: str | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    base_model: str | None = None
    faast_version: str = field(default=__version__)

    def __new__(cls, *args: object, **kwargs: object) -> FaastConfig:
        # Before the generated __init__ sees them: its bare "unexpected keyword argument" would not say where an
        # old flat setting went.
        error = flat_keyword_error(kwargs)
        if error is not None:
            raise error
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.output is not None and not isinstance(self.output, ResidualOutput | EmbeddingOutput):
            refuse("output", "a ResidualOutput, an EmbeddingOutput or None", self.output)
        if self.middle is not None and not isinstance(self.middle, MiddleLayers):
            refuse("middle", "a MiddleLayers or None", self.middle)
        if not isinstance(self.regulariser, Regulariser):
            refuse("regulariser", "a Regulariser", self.regulariser)
        check_choice("learn_dtype", self.learn_dtype, ("auto", "model", "bfloat16", "int8"))
        check_choice("compute_dtype", self.compute_dtype, ("float64", "float32"))
        self.target_modules = _check_target_modules(self.target_modules)
        check_choice("module_fit", self.module_fit, ("residual", "replace"))
        for name in ("model_type", "base_model"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                refuse(name, "None or a str", getattr(self, name))
        for name in ("hidden_size", "num_hidden_layers"):
            value = getattr(self, name)
            if value is not None and not (is_count(value) and value > 0):
                refuse(name, "None or an int > 0", value)
        if not isinstance(self.faast_version, str):
            refuse("faast_version", "a str", self.faast_version)

    def lm_layers_requested(self) -> bool:
        """Whether this configuration asks for memory layers of a causal LM (middle layers or the output layer)."""
        return self.output is not None or self.middle is not None

    def block_indices(self, num_blocks: int, num_parameters: int) -> list[int]:
        """The blocks that get a middle memory layer before them, for a model with `num_blocks` blocks and
        `num_parameters` parameters (the paper's rule for num_layers=None): [] without middle layers."""
        middle = self.middle
        if middle is None:
            return []
        if middle.layers is not None:
            bad = [i for i in middle.layers if i >= num_blocks]
            if bad:
                raise ValueError(
                    f"MiddleLayers.layers: indices {bad} are out of range for a model with {num_blocks} blocks"
                )
            return list(middle.layers)
        n = middle.num_layers
        if n is None:
            n = num_blocks if num_parameters < PAPER_SMALL_MODEL_PARAMS else num_blocks // 2
        if n > num_blocks:
            raise ValueError(f"MiddleLayers.num_layers: {n} is more than the model's {num_blocks} blocks")
        return [int((i + 1) * num_blocks / (n + 1)) for i in range(n)]

    def output_key_blocks(self, num_blocks: int) -> list[int]:
        """The blocks whose input states widen the residual output layer's keys, for a model with `num_blocks`
        blocks: [] for the embedding output layer or without an output layer. 'auto': block num_blocks //
        OutputPolicy.auto_key_block_divisor (of the layer's policy), an early block."""
        if not isinstance(self.output, ResidualOutput):
            return []
        keys = self.output.key_layers
        if keys == "auto":
            return [num_blocks // self.output.policy.auto_key_block_divisor]
        bad = [i for i in keys if i >= num_blocks]
        if bad:
            raise ValueError(
                f"ResidualOutput.key_layers: indices {bad} are out of range for a model with {num_blocks} blocks"
            )
        return list(keys)

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict:
        """The configuration as JSON-ready nested dicts: "output" (None or its fields with its "kind": 'residual' or
        'embedding'), "middle" (None or MiddleLayers' fields), "regulariser", then the top-level fields. Without
        the config_version (to_json and save add it)."""
        data: dict = {"output": None, "middle": None, "regulariser": self.regulariser.to_dict()}
        if self.output is not None:
            data["output"] = {"kind": self.output.kind, **self.output.to_dict()}
        if self.middle is not None:
            data["middle"] = self.middle.to_dict()
        for f in dataclasses.fields(self):
            if f.name not in data:
                value = getattr(self, f.name)
                data[f.name] = list(value) if isinstance(value, list) else value
        return data

    def to_json(self) -> str:
        """to_dict() as JSON, with "config_version": CONFIG_VERSION (what from_json reads it by)."""
        return json.dumps({"config_version": CONFIG_VERSION, **self.to_dict()}, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict, *, version: int = CONFIG_VERSION) -> FaastConfig:
        """Rebuild from to_dict() of configuration `version` (1: the flat layout of faast 0.1, converted with the
        defaults that version applied; 2: the groups, fields missing take today's defaults, so {} gives
        FaastConfig()). Unknown keys raise naming them (a typo must not be silently ignored); a "config_version"
        key, if present, must equal `version`."""
        if not isinstance(data, dict):
            raise TypeError(f"data: expected a dict, got {type(data).__name__}")
        if not is_count(version) or version < 1:
            refuse("version", f"a configuration version 1 to {CONFIG_VERSION}", version)
        if version > CONFIG_VERSION:
            raise ValueError(
                f"version: configuration version {version} was written by a newer faast (this one reads up to "
                f"{CONFIG_VERSION}); upgrade faast"
            )
        data = dict(data)
        if "config_version" in data and data.pop("config_version") != version:
            raise ValueError(f"data: holds a different config_version than version={version}: pass that version")
        if version == 1:
            data = upgrade_v1(data)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            hint = ""
            if set(unknown) & set(FLAT_ONLY):
                hint = (
                    " (flat fields of configuration version 1: pass version=1, or read the file with "
                    "FaastConfig.load / from_json, which take the version it records)"
                )
            raise ValueError(f"FaastConfig: unknown fields {unknown}; known: {sorted(known)}{hint}")
        groups: dict[str, Any] = {}
        if "output" in data:
            groups["output"] = output_from_dict(data.pop("output"))
        if "middle" in data:
            middle = data.pop("middle")
            groups["middle"] = None if middle is None else group_from_dict("middle", MiddleLayers, middle)
        if "regulariser" in data:
            groups["regulariser"] = group_from_dict("regulariser", Regulariser, data.pop("regulariser"))
        return cls(**groups, **data)

    @classmethod
    def from_json(cls, text: str, *, version: int | None = None) -> FaastConfig:
        """Parse to_json()'s text; `version` None: the "config_version" it records (absent: 1, the files written
        before versions were recorded)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"text: expected a JSON object, got {type(data).__name__}")
        if version is None:
            version = data.get("config_version", 1)
        return cls.from_dict(data, version=version)

    def save(self, path: str | Path) -> Path:
        """Write to_json() to `path` atomically; returns the path."""
        from ..persist import write_text_atomic

        return write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FaastConfig:
        """Read a file written by save() (any configuration version)."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


__all__ = [
    "CONFIG_VERSION",
    "OUTPUT_KINDS",
    "EmbeddingOutput",
    "FaastConfig",
    "MiddleLayers",
    "OutputPolicy",
    "Regulariser",
    "ResidualOutput",
]
