"""The tail's step with the held-out documents in folds (docs/design.md §6.3, docs/results.md "The held-out ends in two
folds").

The residual output layer tunes its step on the end of every learned text, scored by one W fitted without all of those
ends. Where the ends of several texts repeat one another (versions of a licence, shared boilerplate), that fit has lost
every copy, and the step it tunes is too small for later text that repeats the learned text. Here the documents that
hold out an end are dealt into OutputPolicy.folds folds by their content, and each document's held-out rows are scored
by a W fitted without its own fold's left-out positions only, so the fit keeps the other folds' ends. The layer takes
this step when it is at least OutputPolicy.fold_step_ratio times the one fit's: a step that much larger says the
texts' ends repeat one another. A memory the one fit leaves off (no significant gain on the ends) is turned on where
the folds find one. The numbers are the layer's policy's (`StepChoice.policy`).

Only whether the folds' step clears fold_step_ratio × the one fit's matters, so the folds' NLL is first read at that
threshold on a sample of the held-out rows: where it rises there, the folds' minimum lies below the threshold (the
search's own premise, one minimum on [0, max_step]) and neither the other rows' logits nor a search are computed.
Where it falls, the search runs on that sample from the threshold, and its best point starts the search on every row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from ...memory import FastWeights
from ..held_out import HeldOutTail
from ..targets import LMHead
from . import tuning
from .head import change_logits
from .policy import OutputPolicy


class FoldSource(Protocol):
    """What `fold_tuning` reads of the step choice that calls it (step.StepChoice): the statistics, the held-out
    tail, the head, the policy, the Newton step and the head's weight cast for the change."""

    @property
    def memory(self) -> FastWeights: ...
    @property
    def held_out(self) -> HeldOutTail: ...
    @property
    def head(self) -> LMHead: ...
    @property
    def policy(self) -> OutputPolicy: ...
    @property
    def newton(self) -> Callable[..., torch.Tensor]: ...
    def change_weight(self) -> torch.Tensor: ...


class FoldTuning(NamedTuple):
    """What the folds found: `step`, their searched step (None where no search ran); `check`, why: 'off'
    (OutputPolicy.fold_step_ratio is inf), 'fixed step or weight 0' (the layer tunes no mixture step), 'one document'
    (a single text holds out every row: its fold's fit is the one fit), 'above range' (fold_step_ratio × the one fit's
    step exceeds max_step), 'below ratio' (the sample's NLL rises at the threshold), 'searched'; `taken`, (η, the
    search's trace, the rows at η, the held-out logits) where the layer takes the step, else None."""

    step: float | None
    check: str
    taken: tuple | None = None


def fold_tuning(
    choice: FoldSource,
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
    spare: torch.Tensor | None = None,
) -> FoldTuning:
    """The folds' step (`FoldTuning`) for the sampled held-out keys [m, d_key], targets [m] and documents [m] of
    `choice.tail_statistics` (a step.StepChoice: the statistics, tail, head and Newton step it was given), their base
    logits (`tail_base`) and log-likelihoods (`base_log_targets`), at key width `width` and weight λ `weight`, against
    the one fit's step `start`; min_fit: `choice.min_fit()`. spare: a [m, V] buffer in the change's dtype
    (`choice.change_weight`) the choice no longer reads (the key width it did not choose), written with the folds'
    change instead of fresh pages. The folds, the ratio and the search's settings are `choice.policy`'s."""
    policy = choice.policy
    if policy.fold_step_ratio == float("inf"):
        return FoldTuning(None, "off")
    threshold = policy.fold_step_ratio * start
    if threshold > policy.max_step:
        return FoldTuning(None, "above range")
    memory = choice.memory
    documents, fold, stats = choice.held_out.fold_statistics(int(memory.count), min_fit, policy.folds)
    if documents.numel() < 2:
        return FoldTuning(None, "one document")
    ranked = torch.argsort(documents)
    row_fold = fold[ranked][torch.searchsorted(documents[ranked], docs)]
    dt = memory.gram.dtype
    fits = [choice.newton(memory.gram - s.to(dt), memory.cross - t.to(dt), memory.count - n, curvature, width)
            for s, t, n in stats]  # fmt: skip
    # Each row's change under its own fold's fit, [m, d]: the head is linear, so one product per row set follows.
    change = torch.empty((keys.shape[0], fits[0].shape[-1]), dtype=torch.float32, device=keys.device)
    for f, w in enumerate(fits):
        index = (row_fold == f).nonzero().squeeze(-1)
        change[index] = keys[index] @ w.float()
    head_weight = choice.change_weight()
    z1 = base[0].new_empty(base[0].shape, dtype=head_weight.dtype) if spare is None else spare
    target1 = torch.empty_like(base[1])
    m = keys.shape[0]
    stride = policy.search_sample_stride if m >= policy.search_sample_min_rows else 1
    # Row sets j::stride are strided views of z1 that the products write in place: no [r, V] copies or scatters,
    # whose fresh pages cost as much as the products (0.5 s per 400 MB in a 32K solve, 2 AMD EPYC cores).
    _fill(choice.head, head_weight, change, ys, z1, target1, 0, stride)
    if threshold > 0.0:  # from a memory the one fit left off (threshold 0), the search itself reads the slope at 0
        sample = (base[0][::stride], z1[::stride], base[1][::stride], target1[::stride])
        if tuning.derivatives(tuning.step_rows(sample, threshold), weight, log_base[::stride])[1] >= 0.0:
            return FoldTuning(None, "below ratio")
    for j in range(1, stride):
        _fill(choice.head, head_weight, change, ys, z1, target1, j, stride)
    logits = (base[0], z1, base[1], target1)
    # Sampled rows: the search runs on the check's sample from the threshold and its best point starts the one on every
    # row, which then ends in 1-3 passes over the [m, V] logits rather than the 4-6 it takes from the threshold
    eta, trace, rows = tuning.tune_step_rows(logits, weight, log_base, threshold, sampled=stride == 1, policy=policy)
    if eta > 0 and eta >= threshold:
        return FoldTuning(eta, "searched", (eta, trace, rows, logits))
    return FoldTuning(eta, "searched")


def _fill(
    head: LMHead,
    weight: torch.Tensor,
    change: torch.Tensor,
    ys: torch.Tensor,
    z1: torch.Tensor,
    target1: torch.Tensor,
    j: int,
    stride: int,
) -> None:
    """z1[j::stride] [r, V] (in the dtype of `weight`, the head's weight cast for the products), the logits' change
    per unit step for the rows' changes change[j::stride] [r, d], and target1[j::stride] float32, its entries at the
    targets ys."""
    rows = slice(j, None, stride)
    change_logits(head, change[rows], out=z1[rows], weight=weight)
    target1[rows] = z1[rows].gather(-1, ys[rows, None]).squeeze(-1)
