"""The tail's step with the held-out documents in folds (docs/design.md §6.3, docs/results.md "The held-out ends in two
folds").

The residual output layer tunes its step on the end of every learned text, scored by one W fitted without all of those
ends. Where the ends of several texts repeat one another (versions of a licence, shared boilerplate), that fit has lost
every copy, and the step it tunes is too small for later text that repeats the learned text. Here the documents that
hold out an end are dealt into FOLDS folds by their content, and each document's held-out rows are scored by a W fitted
without its own fold's left-out positions only, so the fit keeps the other folds' ends. The layer takes this step when
it is at least FOLD_STEP_RATIO times the one fit's: a step that much larger says the texts' ends repeat one another.
A memory the one fit leaves off (no significant gain on the ends) is turned on where the folds find one.
"""

from __future__ import annotations

import math

import torch

from . import output_tuning as tuning
from .head import change_logits

FOLDS = 2
# The two-fold step is taken where it is at least this many times the one fit's. On the validation domains' 12 tuned
# points (experiments/results/lm_step_rule_fit_folds_validation_cpu.md) the ratio was 2.08-2.24 at the two licence
# points, whose held-out files repeat the learned licences, and 1.00-1.38 elsewhere; any R from 1.41 to 2 gave -15.09%
# against -13.37% with the one fit. inf: off (the shipped rule until the benchmark checks it).
FOLD_STEP_RATIO = math.inf


def fold_tuning(
    layer,  # noqa: ANN001 - a ResidualOutputLayer
    keys: torch.Tensor,
    ys: torch.Tensor,
    docs: torch.Tensor,
    base: tuple[torch.Tensor, torch.Tensor],
    log_base: torch.Tensor,
    width: int,
    curvature: torch.Tensor,
    weight: float,
    start: float,
    min_fit: int,
) -> tuple[float, list, tuning.StepRows, tuning.Logits]:
    """The step tuned with the held-out rows in FOLDS folds: (η, the search's trace, the rows at η, the held-out
    logits), for the sampled held-out keys [m, d_key], targets [m] and documents [m] of `layer.tail_statistics`, their
    base logits (`tail_base`) and log-likelihoods (`base_log_targets`), at key width `width` and weight λ `weight`,
    the search starting from `start` (the one fit's step)."""
    memory = layer.memory
    documents, fold, stats = layer.held_out.fold_statistics(int(memory.count), min_fit, FOLDS)
    ranked = torch.argsort(documents)
    row_fold = fold[ranked][torch.searchsorted(documents[ranked], docs)]
    z1 = torch.empty_like(base[0])
    dt = memory.gram.dtype
    for f, (s, t, n) in enumerate(stats):
        rows = (row_fold == f).nonzero().squeeze(-1)
        if rows.numel():
            w = layer.newton(memory.gram - s.to(dt), memory.cross - t.to(dt), memory.count - n, curvature, width)
            z1[rows] = change_logits(layer.head, keys[rows] @ w.float())
    logits = (base[0], z1, base[1], z1.gather(-1, ys[:, None]).squeeze(-1))
    eta, trace, rows = tuning.tune_step_rows(logits, weight, log_base, start)
    return eta, trace, rows, logits
