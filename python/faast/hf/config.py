"""FaastConfig: where memory layers go and how they solve, recorded with every saved readout."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .._version import __version__

# The paper (appendix, "Impact of model size and number of layers"): a memory layer before every block for models
# below about 1B parameters, before every other block above.
PAPER_SMALL_MODEL_PARAMS = 1_000_000_000
# output_key_layers='auto' widens the residual output layer's keys with the input of block L // 7: an early block.
# On SmolLM2 (30 blocks) blocks 4 and 10 gave the same held-out perplexity within 0.5 points on three validation
# domains after 32K tokens (docs/design.md §6.3).
AUTO_KEY_BLOCK_DIVISOR = 7


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
    """Configuration of the memory layers added to a causal LM (docs/design.md §6).

    Attributes:
        num_layers: number of middle memory layers, placed before blocks int((i+1)·L/(n+1)) (the authors' rule).
            0 (the default): none, only the output layer, which needs no trained readout (middle layers read
            through a readout P that must be trained first, faast.hf.train). None: the paper's choice, every block
            below 1B parameters and every other block above.
        layers: explicit block indices instead (0 = before the first block); overrides num_layers.
        output_layer: add the output memory layer.
        output_target: what the output layer fits (docs/design.md §6.3).
            'residual' (the default): after the final norm, keys h̃ and values the gradient of the next token's
            log-likelihood with respect to h̃ (H[y] − pH, p the model's own prediction); W one Kronecker-factored
            Newton step, read as `output_space` says, with η (and λ) chosen on the held-out tail of the learned text.
            'embedding' (the paper's): before the final norm, values the next token's input embedding;
            h ← (1 - output_mix)·h + output_mix·h W. Configurations saved without this field load as 'embedding'.
        output_mix: the 'embedding' output layer's interpolation weight (0.9 in the paper).
        output_space: how the 'residual' layer's correction is read (docs/design.md §6.3).
            'probability' (the default): p = (1 − λ)·p_base + λ·softmax(z + η·(h̃W)Hᵀ), a mixture of the model's
            prediction and the corrected one (the model returns the log of the mixture as its logits).
            'logit': the logits of h̃ + η·h̃W (λ = 1; one head product when reading instead of two).
            Configurations saved without this field load as 'logit', the space they were measured in.
        output_step: the 'residual' layer's step η: 'auto' (tuned at each solve on the last output_tune_tokens learned
            positions) or a number >= 0.
        output_weight: the mixture weight λ in probability space: a number in [0, 1] (0.5: on three validation
            domains a fixed 0.5 with η tuned beat λ tuned with η on the held-out tail), or 'auto' (tuned with η).
        output_damping: the 'residual' layer's curvature damping δ (relative to the curvature's mean diagonal).
        output_alpha: the 'residual' layer's spectral filter exponent (its own; `alpha` is the middle layers').
        output_tune_tokens: learned positions held out to tune the step (0: no tuning, use output_default_step).
        output_default_step: η when the step cannot be tuned: too little text learned (fewer than about 5 positions per
            hidden dimension), and no step saved with loaded statistics. None: the space's own, chosen after 2K tokens
            on three validation domains (faast.hf.output.DEFAULT_STEP; docs/design.md §6.3).
        output_default_weight: λ when it cannot be tuned (probability space); None: faast.hf.output.DEFAULT_WEIGHT.
        output_key_layers: what else the 'residual' layer's keys hold besides h̃: block indices ℓ whose input hidden
            state (RMS-normalised, no learned scale) is concatenated to h̃, so the correction reads [h̃; x_ℓ]W with W of
            shape [d·(1 + len), d]. 'auto' (the default): one early block, ℓ = L // 7 (4 of SmolLM2's 30), chosen on
            three validation domains (docs/design.md §6.3), resolved by apply_faast into the saved list; [] keys h̃
            alone. The full keys are used only once the step can be tuned on enough text (FIT_PER_KEY_DIM positions
            per key dimension fitted) and their tuned correction predicts the held-out tail better than h̃ alone;
            else the h̃ block of the statistics is solved alone (with a fixed step and weight: whenever enough text
            is learned). Configurations saved without this field load as [] (h̃ alone), as they were measured.
        output_head_dtype: dtype of the 'residual' layer's LM-head products while learning (logits and p·H per
            position, float32 accumulation, statistics in float64): 'auto' is bfloat16 on CUDA and on CPUs with
            native bfloat16 (AVX512-BF16 or AMX), else float32; 'float32' or 'bfloat16' forces one.
        learn_dtype: the precision of the base model's forward pass inside learn() (statistics are accumulated in
            float32/float64 either way; reading is never affected). 'auto' (the default): bfloat16 autocast when the
            model's weights are float32 and the device multiplies bfloat16 natively (CUDA, or a CPU with AVX512-BF16
            or AMX), else the model's own dtype; 'model': always the model's own dtype; 'bfloat16': always autocast.
            Chosen on three validation domains (docs/design.md §6.4): on 2 AMD EPYC cores learning 32K tokens took
            0.77× the time, and held-out perplexity moved by at most 0.02%. Configurations saved without this field
            load as 'model'.
        alpha: spectral filter exponent (keep σ > N^-alpha·σmax), or 'auto' for the GCV-chosen rank.
        ridge: None for the truncated pseudo-inverse (the paper), a penalty μ, or 'auto' (GCV).
        scorer: weight values by the token scorer s = sigmoid(a·[k; v]) in middle layers.
        dropout: dropout on h·W before the readout while training it (inference folds M = W·P, no dropout).
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
    """

    num_layers: int | None = 0
    layers: list[int] | None = None
    output_layer: bool = True
    output_target: Literal["residual", "embedding"] = "residual"
    output_mix: float = 0.9
    output_space: Literal["probability", "logit"] = "probability"
    output_step: float | Literal["auto"] = "auto"
    output_weight: float | Literal["auto"] = 0.5
    output_damping: float = 1.0
    output_alpha: float = 1.0
    output_tune_tokens: int = 2048
    output_default_step: float | None = None
    output_default_weight: float | None = None
    output_key_layers: list[int] | Literal["auto"] = "auto"
    output_head_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    learn_dtype: Literal["auto", "model", "bfloat16"] = "auto"
    alpha: float | Literal["auto"] = 1.0
    ridge: float | Literal["auto"] | None = None
    scorer: bool = True
    dropout: float = 0.1
    compute_dtype: Literal["float64", "float32"] = "float64"
    target_modules: list[str] | str | None = None
    module_fit: Literal["residual", "replace"] = "residual"
    model_type: str | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    base_model: str | None = None
    faast_version: str = field(default=__version__)

    def __post_init__(self) -> None:
        if self.num_layers is not None and (
            isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 0
        ):
            raise ValueError(f"num_layers: expected None or an int >= 0, got {self.num_layers!r}")
        if self.layers is not None:
            if not isinstance(self.layers, list | tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers
            ):
                raise ValueError(f"layers: expected None or a list of block indices >= 0, got {self.layers!r}")
            if len(set(self.layers)) != len(self.layers):
                raise ValueError(f"layers: block indices must be distinct, got {self.layers!r}")
            self.layers = sorted(self.layers)
        if not 0.0 <= float(self.output_mix) <= 1.0:
            raise ValueError(f"output_mix: expected a number in [0, 1], got {self.output_mix!r}")
        if self.output_target not in ("residual", "embedding"):
            raise ValueError(f"output_target: expected 'residual' or 'embedding', got {self.output_target!r}")
        if self.output_step != "auto" and not (_is_number(self.output_step) and self.output_step >= 0):
            raise ValueError(f"output_step: expected 'auto' or a number >= 0, got {self.output_step!r}")
        if self.output_space not in ("probability", "logit"):
            raise ValueError(f"output_space: expected 'probability' or 'logit', got {self.output_space!r}")
        if self.output_weight != "auto" and not (_is_number(self.output_weight) and 0 <= self.output_weight <= 1):
            raise ValueError(f"output_weight: expected 'auto' or a number in [0, 1], got {self.output_weight!r}")
        weight = self.output_default_weight
        if weight is not None and not (_is_number(weight) and 0 <= weight <= 1):
            raise ValueError(f"output_default_weight: expected None or a number in [0, 1], got {weight!r}")
        for name, positive in (("output_damping", True), ("output_alpha", False), ("output_default_step", False)):
            value = getattr(self, name)
            if name == "output_default_step" and value is None:
                continue
            if not (_is_number(value) and (value > 0 if positive else value >= 0)):
                raise ValueError(f"{name}: expected a number {'> 0' if positive else '>= 0'}, got {value!r}")
        if self.output_head_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"output_head_dtype: expected 'auto', 'float32' or 'bfloat16', got {self.output_head_dtype!r}"
            )
        if self.learn_dtype not in ("auto", "model", "bfloat16"):
            raise ValueError(f"learn_dtype: expected 'auto', 'model' or 'bfloat16', got {self.learn_dtype!r}")
        keys = self.output_key_layers
        if keys != "auto":
            if not isinstance(keys, list | tuple) or not all(type(i) is int and i >= 0 for i in keys):
                raise ValueError(f"output_key_layers: expected 'auto' or a list of block indices >= 0, got {keys!r}")
            if len(set(keys)) != len(keys):
                raise ValueError(f"output_key_layers: block indices must be distinct, got {keys!r}")
            self.output_key_layers = list(keys)
        tune = self.output_tune_tokens
        if isinstance(tune, bool) or not isinstance(tune, int) or tune < 0:
            raise ValueError(f"output_tune_tokens: expected an int >= 0, got {self.output_tune_tokens!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout: expected a number in [0, 1), got {self.dropout!r}")
        if self.compute_dtype not in ("float64", "float32"):
            raise ValueError(f"compute_dtype: expected 'float64' or 'float32', got {self.compute_dtype!r}")
        if self.alpha != "auto" and not (isinstance(self.alpha, int | float) and self.alpha >= 0):
            raise ValueError(f"alpha: expected a number >= 0 or 'auto', got {self.alpha!r}")
        if (
            self.ridge is not None
            and self.ridge != "auto"
            and not (isinstance(self.ridge, int | float) and self.ridge >= 0)
        ):
            raise ValueError(f"ridge: expected None, a number >= 0 or 'auto', got {self.ridge!r}")
        self.target_modules = _check_target_modules(self.target_modules)
        if self.module_fit not in ("residual", "replace"):
            raise ValueError(f"module_fit: expected 'residual' or 'replace', got {self.module_fit!r}")

    def lm_layers_requested(self) -> bool:
        """Whether this configuration asks for memory layers of a causal LM (middle layers or the output layer)."""
        return self.output_layer or self.num_layers is None or self.num_layers > 0 or bool(self.layers)

    def block_indices(self, num_blocks: int, num_parameters: int) -> list[int]:
        """The blocks that get a memory layer before them, for a model with `num_blocks` blocks."""
        if self.layers is not None:
            bad = [i for i in self.layers if i >= num_blocks]
            if bad:
                raise ValueError(f"layers: indices {bad} are out of range for a model with {num_blocks} blocks")
            return list(self.layers)
        n = self.num_layers
        if n is None:
            n = num_blocks if num_parameters < PAPER_SMALL_MODEL_PARAMS else num_blocks // 2
        if n > num_blocks:
            raise ValueError(f"num_layers: {n} is more than the model's {num_blocks} blocks")
        return [int((i + 1) * num_blocks / (n + 1)) for i in range(n)]

    def output_key_blocks(self, num_blocks: int) -> list[int]:
        """The blocks whose input states widen the residual output layer's keys, for a model with `num_blocks`
        blocks: [] for the 'embedding' target or without an output layer."""
        keys = self.output_key_layers
        if not self.output_layer or self.output_target != "residual":
            if keys not in ("auto", []):
                raise ValueError(
                    f"output_key_layers: only the 'residual' output layer widens its keys, got {keys!r} with "
                    f"output_target={self.output_target!r}, output_layer={self.output_layer!r}"
                )
            return []
        if keys == "auto":
            return [num_blocks // AUTO_KEY_BLOCK_DIVISOR]
        bad = [i for i in keys if i >= num_blocks]
        if bad:
            raise ValueError(f"output_key_layers: indices {bad} are out of range for a model with {num_blocks} blocks")
        return list(keys)

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> FaastConfig:
        """Rebuild from to_dict(); unknown keys raise (a typo must not be silently ignored)."""
        if not isinstance(data, dict):
            raise TypeError(f"data: expected a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"FaastConfig: unknown fields {unknown}; known: {sorted(known)}")
        if "output_target" not in data:  # written before the residual output layer existed: the paper's layer
            data = {**data, "output_target": "embedding"}
        if "output_space" not in data:  # written before probability space existed: the residual layer read logits
            data = {**data, "output_space": "logit"}
        if "output_key_layers" not in data:  # written before wider keys existed: keys were h̃ alone
            data = {**data, "output_key_layers": []}
        if "learn_dtype" not in data:  # written before bfloat16 learning existed: learned in the model's dtype
            data = {**data, "learn_dtype": "model"}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> FaastConfig:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> Path:
        from ..persist import write_text_atomic

        return write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FaastConfig:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))
