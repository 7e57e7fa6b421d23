"""How the residual output layer chooses its step η, weight λ and key width at a solve (docs/design.md §6.3).

`StepChoice` tunes them on the held-out ends of the learned texts: the fit leaves those positions out (their statistics
subtract exactly), the head forms their base logits and the logits' change per unit step, `tuning` searches the step,
`diagnosis` says when the memory ends up off and `diagnosis.document_shrink` shrinks the step of long texts. The layer
(faast.hf.output.layer.ResidualOutputLayer) builds one per solve from what it holds then
(`ResidualOutputLayer.step_choice`): the statistics, the held-out tail, the head, its settings (`StepSettings`) and its
OutputPolicy. A StepChoice reads only what it was given and writes nothing back: `choose`
returns the tuning's record, which the layer keeps as `last_tuning`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...memory import FastWeights
from ..held_out import HeldOutTail
from ..targets import LMHead
from . import tuning
from .diagnosis import diagnose, document_shrink
from .head import HeadBuffers, change_logits, float_products, head_logits, head_weight, products_dtype
from .policy import OutputPolicy

_log = logging.getLogger("faast.hf")

# W = S⁺T·curvature⁻¹ [d_key, d] float64 for (S, T, count, curvature, key width): ResidualOutputLayer.newton.
Newton = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor]
# The held-out rows' W under document folds: (each row's fold [m] int64, fold -> W [d_key, d] float64).
FoldWeights = tuple[torch.Tensor, dict[int, torch.Tensor]]


def fixed_weight(space: str, weight: float | str) -> float | None:
    """λ when it is not tuned: 1 in logit space (the correction replaces the base logits), else the configured number
    `weight`; None for 'auto'."""
    if space == "logit":
        return 1.0
    return None if weight == "auto" else float(weight)


def min_fit(policy: OutputPolicy, hidden_size: int) -> int:
    """Fewest positions the step's tuning fit may have: policy.min_fit_tokens, and policy.fit_per_key_dim per dimension
    of h̃ (hidden_size)."""
    return max(policy.min_fit_tokens, policy.fit_per_key_dim * hidden_size)


@dataclass(frozen=True)
class StepSettings:
    """The layer's settings a step choice reads: `step` and `weight` ('auto' or fixed; ResidualOutput.step,
    .weight), `space` ('probability' or 'logit'), `default_weight` (λ when it cannot be tuned), `untuned_step` (η when
    it cannot be tuned, already scaled to the positions learned: ResidualOutputLayer.untuned_step) and `restored` (the
    step, weight and key width loaded with the statistics, each None when none was)."""

    step: float | str
    weight: float | str
    space: str
    default_weight: float
    untuned_step: float
    restored: tuple[float | None, float | None, int | None] = (None, None, None)


def change(keys: torch.Tensor, w: torch.Tensor | FoldWeights, rows: slice = slice(None)) -> torch.Tensor:
    """keys[rows] [n, d_key] times W: one W [d_key, d], or each row its fold's (`FoldWeights`); [n, d] float32."""
    if isinstance(w, torch.Tensor):
        return keys[rows] @ w.float()
    folds, weights = w[0][rows], w[1]
    out = keys.new_empty((folds.shape[0], next(iter(weights.values())).shape[-1]), dtype=torch.float32)
    part = keys[rows]
    for fold, wf in weights.items():
        mask = folds == fold
        out[mask] = part[mask].float() @ wf.float()
    return out


class StepChoice:
    """The step, weight and key width of a ResidualOutputLayer's statistics, chosen on its held-out tail.

    Args:
        memory: the layer's FastWeights (keys' Gram S [d_key, d_key], cross T [d_key, d], count; float64).
        held_out: its held-out tail (HeldOutTail).
        head: the model's LM head (weight [V, d], optional bias), read for the held-out rows' logits.
        head_dtype: ResidualOutput.head_dtype, the head products' dtype setting.
        head_buffers: the layer's HeadBuffers (the head's weight cast once per solve inside its `kept()`).
        hidden_size: d, the width of h̃ (the keys' leading columns).
        settings: the layer's `StepSettings`.
        policy: the layer's OutputPolicy.
        newton: the layer's Newton step (`Newton`: W for given statistics, curvature and key width).
    """

    def __init__(
        self,
        memory: FastWeights,
        held_out: HeldOutTail,
        head: LMHead,
        head_dtype: str,
        head_buffers: HeadBuffers,
        hidden_size: int,
        settings: StepSettings,
        policy: OutputPolicy,
        newton: Newton,
    ) -> None:
        self.memory, self.held_out, self.head = memory, held_out, head
        self.head_dtype, self.head_buffers, self.hidden_size = head_dtype, head_buffers, hidden_size
        self.settings, self.policy, self.newton = settings, policy, newton

    def tail_statistics(self) -> tuple:
        """The positions the step is tuned on now (HeldOutTail.split): (keys [m, d_key] float32, targets [m] and
        documents [m] of the sampled held-out positions; the S [d_key, d_key], T [d_key, d] float64 and count of every
        position the fit leaves out; how many are held out; how many are gaps before them)."""
        keys, ys, docs, out_k, out_v, held, gap = self.held_out.split(int(self.memory.count), self.min_fit())
        # float32 products of the kept (rounded) keys and gradients: their rounding already bounds the precision.
        k32 = out_k.float()
        count = torch.tensor(float(held + gap), dtype=torch.float64, device=out_k.device)
        return keys, ys, docs, (k32.T @ k32).double(), (k32.T @ out_v.float()).double(), count, held, gap

    def tail_logits(
        self,
        keys: torch.Tensor,
        ys: torch.Tensor,
        w: torch.Tensor | FoldWeights,
        base: tuple | None = None,
        rows: slice = slice(None),
        out: torch.Tensor | None = None,
    ) -> tuning.Logits:
        """(z0 [m, V] float32 and z1 [m, V] in `change_weight`'s dtype, the logits of the keys' h̃ and their change
        per unit step keys·w through the head without its bias; both at the targets ys [n], float32) for the keys
        [n, d_key] at `rows` (default all m = n). w: one W [d_key, d], or `FoldWeights` (each row read by its fold's
        W). base: `tail_base` of the same keys, reused. out: a [n, V] buffer of z1's dtype written at `rows` (two
        calls on complementary rows fill one)."""
        if base is None:
            base = self.tail_base(keys, ys)
        weight = self.change_weight()
        if out is None:
            out = torch.empty((keys.shape[0], base[0].shape[-1]), dtype=weight.dtype, device=keys.device)
        z1 = change_logits(self.head, change(keys, w, rows), out=out[rows], weight=weight)
        return base[0][rows], z1, base[1][rows], z1.gather(-1, ys[rows, None]).squeeze(-1).float()

    def change_weight(self) -> torch.Tensor:
        """The head's weight [V, d] in the dtype the step's tuning forms z1 in: the head products' (`head_dtype`;
        'auto' is the measured fastest on a CPU, bfloat16 where a GPU multiplies it natively: docs/design.md §6.3),
        float32 where they are int8 (only learning's logits are)."""
        weight = head_weight(self.head)
        products = float_products(products_dtype(self.head_dtype, weight, weight))
        return self.head_buffers.weight(weight, products)

    def tail_base(self, keys: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z0 [n, V] float32, its entries at the targets ys [n]): the base logits of the keys' h̃ [n, d_key]."""
        z0 = head_logits(self.head, keys[:, : self.hidden_size])
        return z0, z0.gather(-1, ys[:, None]).squeeze(-1)

    def min_fit(self) -> int:
        """Fewest positions the step's tuning fit may have (`min_fit`)."""
        return min_fit(self.policy, self.hidden_size)

    def row_folds(self, documents: torch.Tensor) -> torch.Tensor | None:
        """The fold [m] int64 of each held-out row's document [m] when the step is tuned by document folds
        (OutputPolicy.document_folds): None where the tail's rule applies instead (no folds kept, a fold that holds
        no learned position (fewer documents than folds), a row of an unknown document, or a fold that would leave
        fewer than `min_fit` positions to fit on)."""
        folds = self.held_out.folds
        if not folds:
            return None
        # With fewer documents than folds, a fold's fit holds as little as half the text, and reads the memory as
        # weaker than the whole fit is: on the domain suite two files turned off a memory that helps new files.
        if any(float(folds.sums(f)[2]) <= 0.0 for f in range(folds.folds)):
            return None
        rows = folds.fold_of(documents)
        if bool((rows < 0).any()):
            return None
        learned = float(self.memory.count)
        if any(learned - float(folds.sums(f)[2]) < self.min_fit() for f in rows.unique().tolist()):
            return None
        return rows

    def fitted_without(
        self,
        s_tail: torch.Tensor,
        t_tail: torch.Tensor,
        n_tail: torch.Tensor,
        row_folds: torch.Tensor | None,
        curvature: torch.Tensor,
        width: int,
    ) -> torch.Tensor | FoldWeights:
        """The W the held-out rows are read by, keys' `width` columns: fitted without the tail's statistics (S
        [d_key, d_key], T [d_key, d], count; float64) when row_folds is None, else one W per fold among row_folds
        [m], fitted without that fold (`FoldWeights`). Statistics subtract exactly. The curvature keeps every
        position: it depends on the model's predictions only, not on the tokens that followed."""
        memory, dt = self.memory, self.memory.gram.dtype
        if row_folds is None:
            return self.newton(memory.gram - s_tail.to(dt), memory.cross - t_tail.to(dt),
                               memory.count - n_tail.to(dt), curvature, width)  # fmt: skip
        weights = {}
        for fold in row_folds.unique().tolist():
            s_f, t_f, n_f = self.held_out.folds.sums(fold)
            weights[fold] = self.newton(memory.gram - s_f.to(dt), memory.cross - t_f.to(dt),
                                        memory.count - n_f.to(dt), curvature, width)  # fmt: skip
        return row_folds, weights

    def held_out_positions(self) -> int:
        """Positions the step is tuned on: the last round(f·n) of every learned document, f = min(held_out_share,
        tune_tokens / learned) (held_out.tail_plan); 0 when too little text was learned to fit on the rest, or
        after a load (the tail is learning state of this process)."""
        return self.held_out.held_positions(int(self.memory.count), self.min_fit())

    def widths(self, fitted: int) -> list[int]:
        """Key widths a fit on `fitted` positions may use: h̃ alone (d), and the full keys when they are wider and
        at least policy.fit_per_key_dim positions per key dimension are fitted."""
        d, full = self.hidden_size, self.memory.dim_key
        return [d, full] if full > d and fitted >= self.policy.fit_per_key_dim * full else [d]

    def choose(self, curvature: torch.Tensor) -> tuple[float, float, int, dict[str, object] | None]:
        """(η, λ, key width, the tuning's record) for the statistics given, the damped curvature [d, d] float64 of the
        layer's Newton step: fixed ones, tuned ones, or the saved/default ones when too little text was learned to
        tune them. The width is the full keys' where enough text was fitted to tune them and they give the lower
        held-out NLL; else h̃ alone (d). The record (ResidualOutputLayer.last_tuning) is None where step and weight
        are both fixed (nothing was chosen); its "warning" is the MemoryOffWarning's message or None."""
        policy, settings = self.policy, self.settings
        fixed_step = None if settings.step == "auto" else float(settings.step)
        fixed = fixed_weight(settings.space, settings.weight)
        held = self.held_out_positions()
        if fixed_step is not None and fixed is not None:
            fitted = int(self.memory.count) - held if held else int(self.memory.count)
            return fixed_step, fixed, self.widths(fitted)[-1], None
        if not held:
            restored_step, restored_weight, restored_width = settings.restored
            restored = restored_step is not None or restored_weight is not None
            step = fixed_step if fixed_step is not None else restored_step
            step = settings.untuned_step if step is None else step
            weight = fixed if fixed is not None else restored_weight
            weight = settings.default_weight if weight is None else weight
            width = self.hidden_size if restored_width is None else restored_width
            _log.info("faast: output layer: too little text to tune the step; using the %s step %s and weight %s",
                      "saved" if restored else "default", step, weight)  # fmt: skip
            record: dict[str, object] = {"step": step, "weight": weight, "tuned": False, "saved_step": restored,
                                         "key_width": width}  # fmt: skip
            return step, weight, width, record
        statistics = self.tail_statistics()
        row_folds = self.row_folds(statistics[2])
        if not (policy.document_folds_gate and row_folds is not None):
            return self.tune(curvature, fixed_step, fixed, statistics, row_folds)
        # The folds only gate: the memory stays off where no step helps text of documents the fit never saw, and
        # otherwise takes the tail's step (OutputPolicy.document_folds_gate). Both tunings read the same held-out
        # rows, so the gate's base logits serve the tail's when their rows come in the same order.
        bases: dict[bool, tuple] = {}
        gate = self.tune(curvature, fixed_step, fixed, statistics, row_folds, bases)
        if gate[0] <= 0.0 or gate[1] <= 0.0:
            _log.info("faast: output layer: read by document folds, no step helps unseen documents: the memory is off")
            gate[3]["folds_gate"] = "off"
            if gate[3].get("warning"):  # the warning's test was on fits without each text's fold: say so
                gate[3]["warning"] = (f"{gate[3]['warning']} (Read by fits without each held-out text's document "
                                      "fold, as new documents read: OutputPolicy.document_folds_gate. To read the "
                                      "learned texts themselves again, OutputPolicy(document_folds=0) judges by "
                                      "their own ends.)")  # fmt: skip
            return gate
        eta, lam, width, record = self.tune(curvature, fixed_step, fixed, statistics, None, bases)
        record["folds_gate"], record["folds_gate_step"] = "on", gate[0]
        return eta, lam, width, record

    def tune(
        self,
        curvature: torch.Tensor,
        fixed_step: float | None,
        fixed: float | None,
        statistics: tuple,
        row_folds: torch.Tensor | None,
        bases: dict[bool, tuple] | None = None,
    ) -> tuple[float, float, int, dict[str, object]]:
        """`choose` on the held-out rows of `tail_statistics`, each row read by W fitted without the tail (row_folds
        None) or without its document's fold (row_folds [m] int64, `row_folds`). bases: the base logits of an
        earlier call on the same statistics, by whether its rows were put in sample order (its z0 [m, V] and log
        base [m]); this call's are added. None: formed and dropped here."""
        policy, settings = self.policy, self.settings
        keys, ys, docs, s_tail, t_tail, n_tail, held, gap = statistics
        memory = self.memory
        if row_folds is None:
            fitted = int(memory.count) - held - gap
        else:  # each fold's fit leaves out its documents whole: no gap is needed
            gap = 0
            fitted = min(int(memory.count) - int(self.held_out.folds.sums(f)[2]) for f in row_folds.unique().tolist())
        widths = self.widths(fitted)
        # With two widths and many held-out rows, the width is chosen on a sample (its rows first), and only the chosen
        # width's change is formed for the rest: the [n, V] head products are most of the solve's time.
        sampled = keys.shape[0]
        ordered = len(widths) > 1 and keys.shape[0] >= policy.width_sample_min_rows
        if ordered:
            order, sampled = tuning.sample_first(keys.shape[0], keys.device, policy)
            keys, ys, docs = keys[order], ys[order], docs[order]
            row_folds = None if row_folds is None else row_folds[order]
        if bases is not None and ordered in bases:
            base, log_base = bases[ordered]
        else:  # the base logits are the same for every width
            base = self.tail_base(keys, ys)
            log_base = tuning.base_log_targets((base[0], None, base[1], None))
            if bases is not None:  # one kept at a time: each is [m, V]
                bases.clear()
                bases[ordered] = (base, log_base)
        sample_rows, results = slice(0, sampled), dict[int, tuple]()
        for width in widths:
            w = self.fitted_without(s_tail, t_tail, n_tail, row_folds, curvature, width)
            out = base[0].new_empty(base[0].shape, dtype=self.change_weight().dtype)  # z1 [n, V]: sample, then rest
            logits = self.tail_logits(keys, ys, w, base, sample_rows, out)
            start = max((r[1] for r in results.values()), default=0.0)  # the narrower keys' step
            tuned = tuning.tune_width(logits, log_base[sample_rows], fixed_step, fixed, start, len(widths) > 1,
                                      policy=policy)  # fmt: skip
            results[width] = (*tuned, logits, w, out)
        # The narrower keys win ties: a wider W fitted on the same text is the noisier one.
        width = min(results, key=lambda k: (results[k][0], k))
        _, eta, lam, trace, rows, logits, w, out = results[width]
        results = {k: v if k == width else v[:3] for k, v in results.items()}  # the other width's [n, V] z1 goes
        if sampled < keys.shape[0]:  # the chosen width on every held-out row, from the sample's step
            rest = self.tail_logits(keys, ys, w, base, slice(sampled, None), out)
            logits = (base[0], out, base[1], torch.cat([logits[3], rest[3]]))
            start = min(trace, key=lambda t: t[-1])[0]  # the sample's best step, before its gain test
            tuned = tuning.tune_width(logits, log_base, fixed_step, fixed, start, compare=False, sampled=True,
                                      policy=policy)  # fmt: skip
            _, eta, lam, trace, rows = tuned
        check_weight = lam if lam > 0 else (fixed if fixed is not None else settings.default_weight)
        candidate = min(trace, key=lambda t: t[-1])[0]  # the search's best step, before the gain test
        diagnosis = diagnose(logits, docs, eta, check_weight, candidate, rows, log_base, policy)
        documents = self.held_out.documents(int(memory.count), self.min_fit())
        shrink = 1.0
        if fixed_step is None and row_folds is None:  # a fold's fit never saw the held-out text: nothing to shrink
            shrink = document_shrink(fitted, documents, self.hidden_size, policy)
        tail_step, eta = eta, eta * shrink
        if shrink < 1.0:
            _log.info("faast: output layer: %.0f fitted positions per held-out text, so the tail's step %.3g is "
                      "shrunk ×%.2f", fitted / max(documents, 1), tail_step, shrink)  # fmt: skip
        record = {"step": eta, "weight": lam, "tuned": True, "held_out_tokens": held, "held_out_documents": documents,
                  "tail_step": tail_step, "document_shrink": shrink, "document_gap_tokens": gap,
                  "document_folds": 0 if row_folds is None else int(row_folds.unique().numel()), "folds_gate": None,
                  "fitted_tokens": fitted, "key_width": width, "held_out_nll": trace, **diagnosis,
                  "by_key_width": {k: {"held_out_nll": v[0], "step": v[1], "weight": v[2], "rows": sampled}
                                   for k, v in results.items() if len(results) > 1}}  # fmt: skip
        return eta, lam, width, record
