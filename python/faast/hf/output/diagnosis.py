"""Why a tuned step is what it is: the residual output layer's diagnosis of its held-out tail (docs/design.md §6.3),
the warning it gives when the memory ends up off or far below what one of its texts would take alone, and how far the
tail's step is shrunk when its documents each have much fitted text of their own."""

from __future__ import annotations

import math
from typing import cast

import torch

from .policy import DEFAULT_POLICY, OutputPolicy
from .tuning import Logits, StepRows, base_log_targets, log_mixture, log_targets, step_rows


def document_shrink(fitted: int, documents: int, hidden_size: int, policy: OutputPolicy = DEFAULT_POLICY) -> float:
    """The factor (0, 1] on the tail's tuned step when `fitted` positions were fitted and the held-out rows come from
    `documents` documents: min(1, (P·hidden_size / L)^power), L = fitted / documents, P and power the policy's
    document_positions_per_dim and document_shrink_power. Where each held-out document has much fitted text of its
    own (one long file), the tail rewards what is particular to that text, and its step overshoots on other files
    (docs/design.md §6.3)."""
    per_document = fitted / max(documents, 1)
    threshold = policy.document_positions_per_dim * hidden_size
    if per_document <= threshold:
        return 1.0
    return (threshold / per_document) ** policy.document_shrink_power


class MemoryOffWarning(UserWarning):
    """A solve left the residual output memory off (step or weight 0) although it had text to tune on, or at a step
    much smaller than some of its texts would get alone: the reason is in the message and in last_tuning."""


def diagnose(
    logits: Logits,
    documents: torch.Tensor,
    eta: float,
    lam: float,
    candidate: float,
    rows: StepRows | None = None,
    log_base: torch.Tensor | None = None,
    policy: OutputPolicy = DEFAULT_POLICY,
) -> dict:
    """Why a tuned (η, λ) is what it is, from the held-out logits (`Logits`, m rows) and each row's document [m]:

    - off: η or λ is 0; held_out_gain / held_out_gain_se: the mean gain in log-likelihood per held-out position,
      and its standard error, at (η, λ) or, when off, at `candidate` (the best step the search found);
    - parts: for every document with policy.part_min_positions or more rows, the step it alone would take, estimated
      by one Newton step on its rows' mean NLL from η (their gradient and curvature in η at weight λ), and, where
      that step is over policy.part_step_ratio times η, whether its rows gain there significantly over η
      (`confirmed`: one pass over those rows; None where not checked);
    - warning: a message when the memory is off, or when a confirmed part's step is over policy.part_step_ratio
      times η (else None).

    rows, log_base: what `tune_step_rows` and `base_log_targets` computed (rows at η or at `candidate`), reused.
    """
    if log_base is None:
        log_base = base_log_targets(logits)
    off = eta <= 0.0 or lam <= 0.0
    at = candidate if off else eta
    if rows is None or rows.eta != at:
        rows = step_rows(logits, at)
    gain = log_mixture(log_base, rows.log_memory, lam) - log_base if at > 0 else log_base * 0
    mean, se = float(gain.mean()), float(gain.std()) / math.sqrt(max(gain.numel(), 1))
    if rows.eta != eta:  # the parts' derivatives are taken where the memory is: at η
        rows = step_rows(logits, eta)
    log_mix = log_mixture(log_base, rows.log_memory, lam)
    share = (rows.log_memory - log_mix).exp() * lam
    gap, spread = rows.gap, rows.spread
    grad, curv = -share * gap, share * spread + (share * share - share) * gap * gap
    parts = []
    ids, counts = torch.unique(documents, return_counts=True)
    if ids.numel() > 1:
        for doc, n in zip(ids.tolist(), counts.tolist(), strict=True):
            if n < policy.part_min_positions:
                continue
            part = documents == doc
            g, c = float(grad[part].mean()), float(curv[part].mean())
            if c > 0:
                step = min(policy.max_step, max(0.0, eta - g / c))
            else:  # not convex here: only the direction is known
                step = policy.max_step if g < 0 else 0.0
            # A step far from η is a one-step extrapolation: it counts only if the part's rows really gain there,
            # significantly, over what they read at η (one pass over those rows alone).
            confirmed = None
            if step > policy.part_step_ratio * eta:
                part_logits = cast(Logits, tuple(v[part] for v in logits))  # the same 4 tensors, this part's rows
                there = log_mixture(log_base[part], log_targets(*part_logits, step), lam)
                better = there - log_mix[part]
                confirmed = float(better.mean()) > policy.min_gain_se * float(better.std()) / math.sqrt(n)
            parts.append({"document": doc, "positions": n, "step": step, "confirmed": confirmed})
    n, docs = int(documents.numel()), int(ids.numel())
    warning = None
    if off:
        found = ("the loss rose with any step" if at <= 0 else
                 f"best step {at:.3g}: mean gain {mean:+.4f} ± {se:.4f} nats per position, needs over "
                 f"{policy.min_gain_se:g} standard errors")  # fmt: skip
        wanting = [p for p in parts if p["step"] > 0 and p["confirmed"]]
        alone = ""
        if wanting:
            top = max(wanting, key=lambda p: p["step"])
            alone = (f" {len(wanting)} of its {len(parts)} largest held-out texts would take a step alone (document "
                     f"{top['document']}: about {top['step']:.3g}): learn them into a memory of their own "
                     f"(learn(memory=...)).")  # fmt: skip
        warning = (f"faast: the residual output memory is off: no step raised the likelihood of its held-out text "
                   f"significantly ({n} positions from {docs} document(s); {found}), so the model reads as the base "
                   f"model.{alone} Learn more text like what it will read, or set ResidualOutput(step=...) to force "
                   f"a step.")  # fmt: skip
    else:
        larger = [p for p in parts if p["step"] > policy.part_step_ratio * eta and p["confirmed"]]
        if larger:
            top = max(larger, key=lambda p: p["step"])
            warning = (f"faast: the residual output memory's step {eta:.3g} is much smaller than {len(larger)} of "
                       f"its {len(parts)} largest held-out texts would take alone (document {top['document']}: "
                       f"about {top['step']:.3g}): its texts disagree on how far to step, and the step serves them "
                       f"all. Learn them into separate memories (learn(memory=...)) to give each its "
                       f"own.")  # fmt: skip
    return {"off": off, "held_out_gain": mean, "held_out_gain_se": se, "parts": parts, "warning": warning}
