"""The residual output layer's tuned constants in one place: `OutputPolicy` (docs/design.md §6.3).

Every number the layer's step rule, biases, held-out tail, diagnosis and head pooling were tuned to lives in one
frozen dataclass. A layer is given one through `ResidualOutput.policy` (default `OutputPolicy()`, the shipped
choices), which is saved with the configuration and loads back with it; a configuration saved before the field
existed loads with the default. To try another value, pass a policy:

    policy = dataclasses.replace(OutputPolicy(), document_shrink_power=0.0)
    config = FaastConfig(output=ResidualOutput(policy=policy))

(or, on a layer already learned, `layer.policy = policy`: the next solve uses it). The functions of tuning,
diagnosis, bias, held_out and head take a `policy` argument whose default is `DEFAULT_POLICY`; the layer always
passes its own, and gives it to the StepChoice it builds per solve (step.py).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import NoReturn

# Fields of earlier versions whose mechanism the layer no longer has (CHANGELOG.md, "Removed"; docs/design.md §6.3): a
# configuration saved with them loads, with a warning that names them, since nothing would read them.
REMOVED_FIELDS = {
    "folds": "the held-out ends scored in folds",
    "fold_step_ratio": "the held-out ends scored in folds",
    "token_bias_full": "the token bias's ramp below 32,768 learned positions",
}


def _refuse(name: str, expected: str, value: object) -> NoReturn:
    raise ValueError(f"OutputPolicy.{name}: expected {expected}, got {value!r}")


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_real(name: str, value: object, low: float, high: float = math.inf, *, open_low: bool = False,
                open_high: bool = False) -> None:  # fmt: skip
    inside = False
    if isinstance(value, int | float) and _is_real(value):
        above = value > low if open_low else value >= low
        inside = above and (value < high if open_high else value <= high)
    if not inside:
        if high == math.inf:
            _refuse(name, f"a finite number {'>' if open_low else '>='} {low:g}", value)
        _refuse(name, f"a number in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}", value)


@dataclass(frozen=True)
class OutputPolicy:
    """The tuned constants of the residual output layer (docs/design.md §6.3 says how each was chosen). Frozen and
    hashable: a layer's cached solution is keyed by it."""

    # ---------------------------------------------------------------- the untuned step and weight

    default_step_probability: float = 0.03
    """η in probability space when it cannot be tuned (too little text learned, nothing saved) and
    ResidualOutput.default_step is None. Chosen on the validation domains after 2K tokens at weight 0.5 (docs/design.md
    §6.3, lab/experiments/results/lm_output_variants_probability.md)."""

    default_step_logit: float = 0.015
    """The same in logit space (docs/design.md §6.3)."""

    default_weight: float = 0.5
    """λ when ResidualOutput.weight is 'auto' and cannot be tuned, and ResidualOutput.default_weight is None
    (docs/design.md §6.3)."""

    default_step_per_dim: float = 7.0
    """Below this many learned positions per hidden dimension (4,032 for d = 576) the untuned step and the bias step
    are scaled by the positions over that many: a W fitted on fewer holds more noise. Chosen on the domain suite at
    2K learned tokens: 7 kept every domain within zero-shot + 0.3%, where 3.5 left Debian copyright files 4.1% above
    it; 14 lost more median, and tuning the step from 2 positions per dimension made four of nine domains worse than
    zero-shot (docs/design.md §6.3, docs/results.md "The untuned step at 2K tokens")."""

    # ---------------------------------------------------------------- the token bias (bias.py)

    token_prior: float = 0.3
    """κ, the pseudo-count added to both the learned count and the model's summed probability of every token in the
    token bias log((c + κ)/(P + κ)). Chosen on the validation domains with γ (docs/design.md §6.3)."""

    # ---------------------------------------------------------------- the held-out tail (held_out)

    held_out_share: float = 0.2
    """The step is tuned on at most this share of the learned positions (and at most ResidualOutput.tune_tokens),
    drawn from the end of every learned text in proportion to its length (docs/design.md §6.3)."""

    min_held_out: int = 128
    """The step is tuned only when at least this many positions are held out."""

    min_fit_tokens: int = 256
    """... and at least this many remain to fit on."""

    fit_per_key_dim: int = 4
    """... and at least this many per key dimension: a d×d map fitted on fewer is mostly noise, and a tail cut from
    the same text cannot tell (2,304 positions for d = 576). The full keys [h̃; x̂_ℓ] are used only when this many per
    dimension of the full width are fitted (docs/design.md §6.3)."""

    gap_multiple: int = 2
    """The fit that tunes the step also leaves out up to this many times each text's held-out positions just before
    them: nearby text shares names and phrasing. Chosen on the validation domains (0, 1×, 2×, 3×, the whole document;
    docs/design.md §6.3, lab/experiments/results/lm_output_variants_validation.md)."""

    document_folds: int = 4
    """0: each held-out row is scored by W fitted without the held-out tail and the gap before it (gap_multiple), and
    the tuned step is shrunk for long texts (document_positions_per_dim). F ≥ 2: the learned documents are dealt into
    F folds in turn and the layer keeps each fold's key statistics while learning (F·(d_key² + d_key·d) float64:
    faast/hf/document_folds.py), so that a held-out row can be scored by W fitted without every document of its fold:
    text the fit never saw. Read while learning. What the folds decide is document_folds_gate's. Where fewer
    documents than folds were learned, or a fold would leave fewer than the fit's minimum to fit on, the tail's rule
    alone. 4: the count the gate was measured with on the domain suite, the only one tried (docs/design.md §6.3)."""

    document_folds_gate: bool = True
    """With document_folds F ≥ 2 (inert without): True, the folds only gate the memory: it is off where, read by the
    folds, no step helps text of documents the fit never saw (the step the folds tune is 0), and otherwise the step is
    the tail's, tuned by the tail's rule; a second tuning per solve. False: the step itself is tuned on the folds (no
    gap and no long-text shrink), which lowered the suite's median by 1.8 points. On the domain suite the gate keeps
    new files at zero-shot where no learned file helps another (markdown-a-l: +11.6% worse than zero-shot without
    it) and reads as the tail's rule elsewhere (docs/design.md §6.3). What it judges is new documents: where the text
    to read continues the learned documents themselves and they share nothing with one another, document_folds=0
    (the tail's rule) keeps the memory on for them."""

    tune_sample: int = 2048
    """With more held-out positions than this, the held-out NLL is read on this many spread evenly over them (the fit
    still leaves out all of them): bounds the [n, V] logits. A longer span was not better (docs/design.md §6.3)."""

    # ---------------------------------------------------------------- the step's search (tuning.py)

    max_step: float = 4.0
    """η is searched on [0, max_step]."""

    step_iterations: int = 12
    """At most this many passes of the step's Newton search over the held-out logits."""

    step_tol: float = 1e-2
    """The search stops once the next point would move η by less than this, relative: the NLL is quadratic at its
    minimum, so a 1% error in η costs about 1e-4 of the gain (docs/design.md §6.3)."""

    search_sample_stride: int = 4
    """With search_sample_min_rows held-out rows or more, the search first runs on every search_sample_stride-th row
    and its best point starts the search on all rows: 3-4.25 passes over SmolLM2's held-out logits instead of 7-8,
    the same step within 0.7% (docs/design.md §6.3, lab/experiments/results/lm_step_search_cpu.md)."""

    search_sample_min_rows: int = 1024
    """See search_sample_stride."""

    width_sample_min_rows: int = 1024
    """With two key widths to compare on at least this many held-out rows, the width is chosen on the search's row
    sample and only the chosen width's change is formed for every row (docs/design.md §6.3,
    lab/experiments/results/lm_key_width_sample_cpu.md)."""

    min_grid_step: float = 1 / 256
    """weight='auto': η is searched on a geometric grid (factor 2) from min_grid_step to max_step, then refined by
    golden section (docs/design.md §6.3)."""

    golden_iterations: int = 8
    """Golden-section steps on log η around the grid's best point (weight='auto')."""

    weight_iterations: int = 40
    """Bisections of the NLL's derivative in λ for each η (weight='auto'; the NLL is convex in λ)."""

    min_gain_se: float = 2.0
    """A mixture is used only when its mean held-out gain per position exceeds this many standard errors: a sharp
    correction mixed in with a small λ lowers the held-out NLL of random text by chance; without this test some new
    random text read over 1% worse than under the base model (docs/design.md §6.3,
    tests/test_hf_removed_heuristics.py)."""

    # ---------------------------------------------------------------- the step's diagnosis (diagnosis.py)

    part_min_positions: int = 128
    """A held-out text takes part in the diagnosis of a tuned step when at least this many of its positions are in
    the tuning sample."""

    part_step_ratio: float = 4.0
    """A text's own step is "much larger" beyond this many times the chosen one: the layer then warns
    (MemoryOffWarning; docs/design.md §6.3)."""

    document_positions_per_dim: float = 2
    """The tail's step is multiplied by min(1, (document_positions_per_dim·d / L)^document_shrink_power), L the
    positions fitted per held-out text and d the hidden size: a tail cut from one long file rewards what is particular
    to it. 2 against 6 was chosen by leave-one-kind-out on the domain suite (6 let one learned 8K file go unshrunk, and
    the memory read above zero-shot there); the value 2 was proposed by a probe on two domains
    (docs/language_models.md, "How the default was chosen"; docs/results.md "The long-document shrink's
    threshold"). 1, which read best in that probe, lost to 2 on the suite (worse at 32K on 22 of 25 domains; no kind
    chose it). The power was chosen on the validation domains (docs/design.md §6.3)."""

    document_shrink_power: float = 0.5
    """See document_positions_per_dim."""

    # ---------------------------------------------------------------- the head's products (head) and the keys (config)

    pool_auto: float = 3e-4
    """ResidualOutput.head_pool_below='auto': p·H pools the vocabulary columns whose probability stays below this in
    every position of a block (on a GPU with float32 products, or on a CPU where timing finds it faster). On the
    validation domains held-out perplexity moved by at most 0.012% with float32 products (1e-3: 0.023%, 1e-2: 0.25%)
    and 0.023% with bfloat16 ones; the gradients erred by 0.3-0.4%, and the float32 head products took 0.78-0.87× their
    time (docs/design.md §6.3, lab/experiments/results/lm_head_pool_cpu.md)."""

    pool_dense_share: float = 0.6
    """A block whose probabilities keep more than this share of the vocabulary above the pooling threshold forms p·H
    in full: past it the gathers cost more than the columns they save (docs/design.md §6.3). 1: pool however few
    columns fall below the threshold."""

    auto_key_block_divisor: int = 7
    """ResidualOutput.key_layers='auto' widens the keys with the input of block L // auto_key_block_divisor (4 of
    SmolLM2's 30): blocks 4 and 10 tied on the validation domains, so the earlier. The widening pays on the domain
    suite (median +1.4 points at 32K against h̃ alone); the block itself was not chosen there (docs/design.md §6.3)."""

    def __post_init__(self) -> None:
        for name, low in (("min_held_out", 1), ("min_fit_tokens", 0), ("fit_per_key_dim", 0),
                          ("gap_multiple", 0), ("tune_sample", 1), ("step_iterations", 1), ("search_sample_stride", 1),
                          ("search_sample_min_rows", 0), ("width_sample_min_rows", 0), ("golden_iterations", 0),
                          ("weight_iterations", 0), ("part_min_positions", 1),
                          ("auto_key_block_divisor", 1)):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                _refuse(name, f"an int >= {low}", value)
        if not (isinstance(self.document_folds, int) and not isinstance(self.document_folds, bool)
                and (self.document_folds == 0 or self.document_folds >= 2)):  # fmt: skip
            _refuse("document_folds", "0 (off) or an int >= 2", self.document_folds)
        if not isinstance(self.document_folds_gate, bool):
            _refuse("document_folds_gate", "a bool", self.document_folds_gate)
        for name in ("default_step_probability", "default_step_logit", "token_prior", "min_gain_se",
                     "document_positions_per_dim", "document_shrink_power"):  # fmt: skip
            _check_real(name, getattr(self, name), 0)
        for name in ("default_step_per_dim", "max_step", "step_tol", "part_step_ratio"):
            _check_real(name, getattr(self, name), 0, open_low=True)
        _check_real("default_weight", self.default_weight, 0, 1)
        _check_real("held_out_share", self.held_out_share, 0, 1, open_low=True, open_high=True)
        _check_real("min_grid_step", self.min_grid_step, 0, self.max_step, open_low=True)
        _check_real("pool_auto", self.pool_auto, 0, 1)
        _check_real("pool_dense_share", self.pool_dense_share, 0, 1)

    def default_step(self, space: str) -> float:
        """The untuned η of `space` ('probability' or 'logit')."""
        return self.default_step_probability if space == "probability" else self.default_step_logit

    def to_dict(self) -> dict:
        """Every field by name, JSON-ready."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> OutputPolicy:
        """Rebuild from to_dict(); fields missing take today's defaults, fields of a removed mechanism
        (`REMOVED_FIELDS`) are left out with a warning naming them, other unknown ones raise naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"ResidualOutput.policy: expected a dict of OutputPolicy fields, got {data!r}")
        gone = sorted(set(data) & set(REMOVED_FIELDS))
        if gone:
            what = sorted({REMOVED_FIELDS[name] for name in gone})
            warnings.warn(f"ResidualOutput.policy: {gone} belong to a mechanism faast no longer has ({'; '.join(what)}"
                          f"); the layer solves without them (CHANGELOG.md)", UserWarning, stacklevel=2)  # fmt: skip
            data = {name: value for name, value in data.items() if name not in REMOVED_FIELDS}
        own = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(own))
        if unknown:
            raise ValueError(f"ResidualOutput.policy: unknown fields {unknown}; OutputPolicy's fields: {own}")
        return cls(**data)


DEFAULT_POLICY = OutputPolicy()
"""The shipped policy: the default of every `policy` argument."""
