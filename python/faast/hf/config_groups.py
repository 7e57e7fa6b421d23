"""The groups of a FaastConfig: the output layer (ResidualOutput or EmbeddingOutput), the middle layers
(MiddleLayers) and the spectral filter of their solves (Regulariser); docs/design.md §6.

Each group checks its own fields when built and names the offending one ("ResidualOutput.step: expected ...");
a keyword of another group, or of the other output variant, is refused with the place it belongs instead of
Python's bare "unexpected keyword argument".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NoReturn, TypeGuard, cast

from .output.policy import OutputPolicy


def is_real(value: object) -> TypeGuard[int | float]:
    """A finite int or float that is not a bool (True is an int to Python, never a number to a configuration)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_count(value: object) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def refuse(name: str, expected: str, value: object) -> NoReturn:
    """Raise ValueError naming the field `name`, what it takes and what it got."""
    raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _alternatives(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" or {items[-1]}"


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """`value` must be one of the strings `choices`."""
    if not (isinstance(value, str) and value in choices):
        refuse(name, _alternatives([repr(c) for c in choices]), value)


def check_real(name: str, value: object, *, low: float, high: float = math.inf, open_low: bool = False,
               open_high: bool = False, allow: tuple = ()) -> None:  # fmt: skip
    """`value` must be a finite number in the interval low..high (ends closed unless open_*), or one of `allow`
    (compared by identity for None, by equality for strings)."""
    if any(value is a if a is None else (isinstance(value, str) and value == a) for a in allow):
        return
    if not (
        is_real(value)
        and (value > low if open_low else value >= low)
        and (value < high if open_high else value <= high)
    ):
        if high == math.inf:
            interval = f"a number {'>' if open_low else '>='} {low:g}"
        else:
            interval = f"a number in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        refuse(name, _alternatives([*(repr(a) for a in allow), interval]), value)


def check_indices(name: str, value: object, *, allow: tuple = ()) -> list[int] | str:
    """A list (or tuple) of distinct block indices >= 0 (ints, not bools), returned as a list; or one of `allow`."""
    if isinstance(value, str) and value in allow:
        return value
    if not isinstance(value, list | tuple) or not all(is_count(i) and i >= 0 for i in value):
        refuse(name, _alternatives([*(repr(a) for a in allow), "a list of block indices >= 0"]), value)
    if len(set(value)) != len(value):
        raise ValueError(f"{name}: block indices must be distinct, got {value!r}")
    return list(value)


# Where every group field lives, for the errors that redirect a keyword given to the wrong group.
def _home(name: str) -> list[str]:
    return [g.__name__ for g in GROUPS if name in {f.name for f in dataclasses.fields(g)}]


class _Group:
    """Shared behaviour of the groups: a keyword of another group is refused with its home named."""

    # Every group is a dataclass: declared so the type checker lets dataclasses.fields read a _Group (no value here;
    # @dataclass sets it on each group).
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __new__(cls, *args: object, **kwargs: object) -> _Group:
        own = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in own:
                homes = _home(name)
                where = f"; it is a field of {' and '.join(homes)}" if homes else ""
                raise TypeError(
                    f"{cls.__name__}: {name} does not apply to {cls.__name__} (its fields: "
                    f"{', '.join(sorted(own))}){where}"
                )
        return super().__new__(cls)

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (lists copied)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: object) -> object:
    if isinstance(value, OutputPolicy):
        return value.to_dict()
    return list(value) if isinstance(value, list) else value


@dataclass
class ResidualOutput(_Group):
    """The residual output layer, faast's default (docs/design.md §6.3): after the final norm, keys h̃ and values
    the gradient of the next token's log-likelihood with respect to h̃ (H[y] − pH, p the model's own prediction);
    W one Kronecker-factored Newton step, read as `space` says, with η (and λ) chosen on the held-out tail of the
    learned text. It needs no trained readout.

    Attributes:
        space: how the correction is read. 'probability' (the default): p = (1 − λ)·p_base + λ·softmax(z +
            η·(h̃W)Hᵀ), a mixture of the model's prediction and the corrected one (the model returns the log of the
            mixture as its logits). 'logit': the logits of h̃ + η·h̃W (λ = 1; one head product when reading).
        step: η: 'auto' (tuned at each solve on the last `tune_tokens` learned positions) or a number >= 0.
        weight: the mixture weight λ in probability space: a number in [0, 1] (0.5: on three validation domains a
            fixed 0.5 with η tuned beat λ tuned with η on the held-out tail), or 'auto' (tuned with η).
        damping: the curvature damping δ (relative to the curvature's mean diagonal), > 0.
        alpha: this layer's spectral filter exponent (Regulariser.alpha is the middle layers' and module memories').
        tune_tokens: learned positions held out to tune the step (0: no tuning, use default_step).
        default_step: η when the step cannot be tuned: too little text learned (fewer than about 5 positions per
            hidden dimension), and no step saved with loaded statistics. None: the space's own, chosen after 2K
            tokens on three validation domains (OutputPolicy.default_step_probability / default_step_logit). Below
            OutputPolicy.default_step_per_dim (7) learned positions per hidden dimension it is scaled by the
            positions learned over that many.
        default_weight: λ when it cannot be tuned (probability space); None: OutputPolicy.default_weight.
        key_layers: what else the keys hold besides h̃: block indices ℓ whose input hidden state (RMS-normalised, no
            learned scale) is concatenated to h̃, so the correction reads [h̃; x_ℓ]W with W of shape
            [d·(1 + len), d]. 'auto' (the default): one early block, ℓ = L // 7 (4 of SmolLM2's 30), chosen on three
            validation domains, resolved by apply_faast into the saved list; [] keys h̃ alone. The full keys are used
            only once the step can be tuned on enough text and their tuned correction predicts the held-out tail
            better than h̃ alone; else the h̃ block of the statistics is solved alone.
        bias: β, the step of a bias added to every corrected position: β·curvature⁻¹·r̄, r̄ the mean learned
            gradient (the Newton step on it alone), with η·h̃W in both spaces; scaled like default_step below
            OutputPolicy.default_step_per_dim learned positions per hidden dimension. 0.5 was chosen on three
            validation domains with η as tuned (docs/design.md §6.3); 0 turns it off.
        token_bias: γ, the step of a bias added to the logits of every corrected position: γ·log((c_v + κ) /
            (P_v + κ)) for each token v, c_v how often v was a learned target and P_v the probability the model gave
            it summed over the learned positions (κ: OutputPolicy.token_prior): one iterative-scaling update of a
            per-token logit bias toward the learned text's token counts. Chosen on three validation domains with η
            as tuned (docs/design.md §6.3); 0 turns it off.
        head_dtype: dtype of the LM-head products while learning (logits and p·H per position, float32
            accumulation, statistics in float64) and of the logits' change the solve tunes the step on (the base
            logits stay float32): 'auto' is bfloat16 on CUDA and on CPUs with native bfloat16 (AVX512-BF16 or AMX),
            else 'int8' on a CPU with AVX2, else float32; 'float32', 'bfloat16' or 'int8' forces one. 'int8' forms only
            learning's logits in int8 (each row of h̃ and of the head on its own scale, h̃'s 32 largest columns of
            each block in float32, int32 sums): p·H and the tuning's logits stay float32 (docs/design.md §6.3).
        head_pool_below: p·H while learning pools the vocabulary columns whose probability stays below this in
            every position of a 1,024-position block onto their probability-weighted mean row of H (the gradients'
            sum stays exact): a number in [0, 1], 0 exact; 'auto' (the default) is 3e-4 (OutputPolicy.pool_auto)
            where the head products are float32 and, where timing finds it faster, on a CPU in either dtype; 0 for
            16-bit products on a GPU (docs/design.md §6.3).
        policy: the layer's tuned constants (faast.hf.OutputPolicy: the step rule's thresholds, the biases' priors,
            the held-out tail's shares, ...), saved with the configuration; OutputPolicy() (the default) is the
            shipped one. Experiments vary it by passing another (dataclasses.replace(OutputPolicy(), ...)).
    """

    kind: ClassVar[str] = "residual"

    space: Literal["probability", "logit"] = "probability"
    step: float | Literal["auto"] = "auto"
    weight: float | Literal["auto"] = 0.5
    damping: float = 1.0
    alpha: float = 1.0
    tune_tokens: int = 2048
    default_step: float | None = None
    default_weight: float | None = None
    key_layers: list[int] | Literal["auto"] = "auto"
    head_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"
    bias: float = 0.5
    token_bias: float = 0.3
    head_pool_below: float | Literal["auto"] = "auto"
    policy: OutputPolicy = field(default_factory=OutputPolicy)

    def __post_init__(self) -> None:
        check_choice("ResidualOutput.space", self.space, ("probability", "logit"))
        check_real("ResidualOutput.step", self.step, low=0, allow=("auto",))
        check_real("ResidualOutput.weight", self.weight, low=0, high=1, allow=("auto",))
        check_real("ResidualOutput.damping", self.damping, low=0, open_low=True)
        check_real("ResidualOutput.alpha", self.alpha, low=0)
        if not (is_count(self.tune_tokens) and self.tune_tokens >= 0):
            refuse("ResidualOutput.tune_tokens", "an int >= 0", self.tune_tokens)
        check_real("ResidualOutput.default_step", self.default_step, low=0, allow=(None,))
        check_real("ResidualOutput.default_weight", self.default_weight, low=0, high=1, allow=(None,))
        # allow=("auto",): the one string check_indices can give back.
        self.key_layers = cast(
            "list[int] | Literal['auto']",
            check_indices("ResidualOutput.key_layers", self.key_layers, allow=("auto",)),
        )
        check_choice("ResidualOutput.head_dtype", self.head_dtype, ("auto", "float32", "bfloat16", "int8"))
        check_real("ResidualOutput.bias", self.bias, low=0)
        check_real("ResidualOutput.token_bias", self.token_bias, low=0)
        check_real("ResidualOutput.head_pool_below", self.head_pool_below, low=0, high=1, allow=("auto",))
        if not isinstance(self.policy, OutputPolicy):
            refuse("ResidualOutput.policy", "an OutputPolicy", self.policy)


@dataclass
class EmbeddingOutput(_Group):
    """The paper's output layer: before the final norm, keys the last block's outputs and values the next token's
    input embedding; h ← (1 − mix)·h + mix·h W. No readout, no scorer.

    Attributes:
        mix: the interpolation weight, a number in [0, 1] (0.9 in the paper).
    """

    kind: ClassVar[str] = "embedding"

    mix: float = 0.9

    def __post_init__(self) -> None:
        check_real("EmbeddingOutput.mix", self.mix, low=0, high=1)


@dataclass
class MiddleLayers(_Group):
    """The paper's middle memory layers: keys h_t, values h_{t+1} at a block's input, read through a readout P (and a
    token scorer) that must be trained first (faast.hf.train), so they are an explicit opt-in.

    Attributes:
        num_layers: how many, placed before blocks int((i+1)·L/(n+1)) (the authors' rule), an int >= 1. None (the
            default): the paper's choice, every block below 1B parameters and every other block above.
        layers: explicit block indices instead (0 = before the first block), distinct, kept sorted; overrides
            num_layers. apply_faast records the blocks it chose here.
        scorer: weight values by the token scorer s = sigmoid(a·[k; v]).
        dropout: dropout on h·W before the readout while training it (inference folds M = W·P, no dropout), in
            [0, 1).
    """

    num_layers: int | None = None
    layers: list[int] | None = None
    scorer: bool = True
    dropout: float = 0.1

    def __post_init__(self) -> None:
        empty = "no middle layers: use FaastConfig(middle=None)"
        if self.num_layers is not None:
            if not is_count(self.num_layers) or self.num_layers < 0:
                refuse("MiddleLayers.num_layers", "None or an int >= 1", self.num_layers)
            if self.num_layers == 0:
                raise ValueError(f"MiddleLayers.num_layers: 0 means {empty}")
        if self.layers is not None:
            # Nothing allowed besides indices: check_indices gives back a list.
            self.layers = sorted(cast("list[int]", check_indices("MiddleLayers.layers", self.layers)))
            if not self.layers:
                raise ValueError(f"MiddleLayers.layers: [] means {empty}")
        if not isinstance(self.scorer, bool):
            refuse("MiddleLayers.scorer", "True or False", self.scorer)
        check_real("MiddleLayers.dropout", self.dropout, low=0, high=1, open_high=True)


@dataclass
class Regulariser(_Group):
    """The spectral filter of the middle layers' and the module memories' solves (FastWeights(alpha=, ridge=));
    the residual output layer has its own (ResidualOutput.alpha).

    Attributes:
        alpha: filter exponent (keep σ > N^-alpha·σmax), a number >= 0, or 'auto' for the GCV-chosen rank.
        ridge: None for the truncated pseudo-inverse (the paper), a penalty μ >= 0, or 'auto' (GCV). A ridge replaces
            the spectral cut, so it does not combine with alpha='auto'.
    """

    alpha: float | Literal["auto"] = 1.0
    ridge: float | Literal["auto"] | None = None

    def __post_init__(self) -> None:
        check_real("Regulariser.alpha", self.alpha, low=0, allow=("auto",))
        check_real("Regulariser.ridge", self.ridge, low=0, allow=(None, "auto"))
        # Refused here rather than when the first memory is built (FastWeights refuses it), so a saved configuration
        # can never hold it.
        if self.ridge is not None and self.alpha == "auto":
            raise ValueError(
                f"Regulariser.ridge: a ridge ({self.ridge!r}) replaces the spectral cut; it does not combine with "
                "alpha='auto'"
            )


GROUPS = (ResidualOutput, EmbeddingOutput, MiddleLayers, Regulariser)
# The output variants by the `kind` their to_dict() records.
OUTPUT_KINDS: dict[str, type[ResidualOutput] | type[EmbeddingOutput]] = {
    ResidualOutput.kind: ResidualOutput,
    EmbeddingOutput.kind: EmbeddingOutput,
}


def group_from_dict(where: str, cls: type[_Group], data: object) -> _Group:
    """`cls` rebuilt from its to_dict() found at `where` (e.g. 'middle'); a field it lacks raises naming it."""
    if not isinstance(data, dict):
        refuse(where, f"a dict of {cls.__name__} fields", data)
    own = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(own))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; {cls.__name__}'s fields: {own}")
    return cls(**data)


def output_from_dict(data: object) -> ResidualOutput | EmbeddingOutput | None:
    """The output layer from its to_dict() form: None, or a dict naming its `kind` with that variant's fields."""
    if data is None:
        return None
    if not isinstance(data, dict) or "kind" not in data:
        refuse("output", "None or a dict with a 'kind' ('residual' or 'embedding')", data)
    fields = dict(data)
    kind = fields.pop("kind")
    if not (isinstance(kind, str) and kind in OUTPUT_KINDS):
        refuse("output.kind", " or ".join(repr(k) for k in OUTPUT_KINDS), kind)
    cls = OUTPUT_KINDS[kind]
    own = [f.name for f in dataclasses.fields(cls)]
    for name in sorted(fields):
        if name not in own:
            raise ValueError(f"output.{name}: does not apply to kind={kind!r} (its fields: {', '.join(own)})")
    if "policy" in fields:  # saved as its dict; a configuration saved before the field takes the default
        fields["policy"] = OutputPolicy.from_dict(fields["policy"])
    return cls(**fields)
