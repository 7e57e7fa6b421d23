"""Episodic few-shot evaluation and full-data evaluation, seeded and reproducible.

An episode draws `ways` classes, `shots` support examples per class and `queries` query examples per class
(distinct from the support examples when both come from one pool), fits a fresh classifier on the support set and
scores it on the queries. Episodes report the mean accuracy with a 95% interval 1.96·sd/√E (sd with E − 1); a
single full-data evaluation reports the Wilson score interval of the binomial accuracy. Queries are never repeated
to fill a quota: a class with too few examples is an error naming it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..intervals import Z95, wilson_interval


@dataclass
class Episode:
    """Indices into the support pool and the query pool; classes are the episode's class labels (pool codes)."""

    classes: torch.Tensor
    support: torch.Tensor
    query: torch.Tensor


def _codes(name: str, labels: object) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(labels))
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected a 1-D integer tensor of class codes, got {t.dtype} {list(t.shape)}")
    return t.to(torch.int64)


def sample_episode(
    labels: object,
    *,
    ways: int | None,
    shots: int,
    queries: int,
    generator: torch.Generator,
    query_labels: object = None,
) -> Episode:
    """One episode. `labels` [n] int codes of the support pool; `query_labels` of a separate query pool (e.g. a
    test split), or None to draw queries from the same pool, disjoint from the support examples. ways=None: all.

    This is faast's one few-shot sampler. queries=0 draws only the support set (class-balanced, `shots` distinct
    examples of each chosen class), for callers that score on a whole split instead of sampled queries.
    """
    support_codes = _codes("labels", labels)
    separate = query_labels is not None
    query_codes = _codes("query_labels", query_labels) if separate else support_codes
    available = support_codes.unique()
    if ways is None:
        ways = available.numel()
    if not 1 <= ways <= available.numel():
        raise ValueError(f"ways: expected 1..{available.numel()} (the classes present), got {ways}")
    if shots < 1 or queries < 0:
        raise ValueError(f"shots, queries: expected shots >= 1 and queries >= 0, got shots={shots}, queries={queries}")
    chosen = available[torch.randperm(available.numel(), generator=generator)[:ways]].sort().values
    support, query = [], []
    for c in chosen.tolist():
        members = (support_codes == c).nonzero().flatten()
        members = members[torch.randperm(members.numel(), generator=generator)]
        need = shots if separate else shots + queries
        if members.numel() < need:
            raise ValueError(
                f"labels: class {c} has {members.numel()} examples, an episode needs {need} "
                f"({shots} shots{'' if separate else f' + {queries} queries'}); queries are never repeated"
            )
        support.append(members[:shots])
        if separate:
            pool = (query_codes == c).nonzero().flatten()
            if pool.numel() < queries:
                raise ValueError(f"query_labels: class {c} has {pool.numel()} examples, an episode needs {queries}")
            query.append(pool[torch.randperm(pool.numel(), generator=generator)[:queries]])
        else:
            query.append(members[shots : shots + queries])
    return Episode(chosen, torch.cat(support), torch.cat(query))


def mean_ci(values: list[float] | np.ndarray) -> tuple[float, float]:
    """(mean, 95% half-width 1.96·sd/√E) of per-episode accuracies; half-width 0 for a single episode."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("values: expected at least one episode")
    if v.size == 1:
        return float(v[0]), 0.0
    return float(v.mean()), float(Z95 * v.std(ddof=1) / math.sqrt(v.size))


def wilson_ci(correct: int, total: int) -> tuple[float, float, float]:
    """(accuracy, low, high): the Wilson score 95% interval of a binomial proportion (faast.intervals)."""
    if total <= 0:
        raise ValueError(f"total: expected a positive number of queries, got {total}")
    return (correct / total, *wilson_interval(correct, total))


@dataclass
class EvalResult:
    accuracy: float
    ci95: float  # half-width (episodes) or max distance to the Wilson bounds (full)
    fit_seconds: float
    accuracies: list[float] = field(default_factory=list)


Factory = Callable[[torch.Tensor], object]  # episode's class codes -> an unfitted classifier


def evaluate_episodes(
    make: Factory,
    features: torch.Tensor,
    labels: object,
    *,
    ways: int | None,
    shots: int,
    queries: int,
    episodes: int,
    seed: int = 0,
    query_features: torch.Tensor | None = None,
    query_labels: object = None,
) -> EvalResult:
    """Mean query accuracy over `episodes` seeded episodes. `make(classes)` builds a fresh classifier for the
    episode's classes (so a prior can select their label embeddings); it is fitted on the support set with labels
    given as the pool's class codes."""
    if queries < 1 or episodes < 1:
        raise ValueError(f"queries and episodes: expected >= 1, got queries={queries}, episodes={episodes}")
    g = torch.Generator().manual_seed(seed)
    codes = _codes("labels", labels)
    q_codes = None if query_labels is None else _codes("query_labels", query_labels)
    q_features = features if query_features is None else query_features
    accuracies, fit_seconds = [], 0.0
    for _ in range(episodes):
        ep = sample_episode(codes, ways=ways, shots=shots, queries=queries, generator=g, query_labels=q_codes)
        clf = make(ep.classes)
        start = time.perf_counter()
        clf.fit(features[ep.support], codes[ep.support])
        fit_seconds += time.perf_counter() - start
        truth = (codes if q_codes is None else q_codes)[ep.query].numpy()
        accuracies.append(float(np.mean(clf.predict(q_features[ep.query]) == truth)))
    mean, half = mean_ci(accuracies)
    return EvalResult(mean, half, fit_seconds / episodes, accuracies)


def evaluate_full(
    make: Factory,
    features: torch.Tensor,
    labels: object,
    query_features: torch.Tensor,
    query_labels: object,
) -> EvalResult:
    """Fit on the whole support set, score every query once; Wilson 95% interval."""
    codes, q_codes = _codes("labels", labels), _codes("query_labels", query_labels)
    clf = make(codes.unique())
    start = time.perf_counter()
    clf.fit(features, codes)
    seconds = time.perf_counter() - start
    correct = int(np.sum(clf.predict(query_features) == q_codes.numpy()))
    p, low, high = wilson_ci(correct, q_codes.numel())
    return EvalResult(p, max(p - low, high - p), seconds, [p])
