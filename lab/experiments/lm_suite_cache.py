"""An exact cache beside FAAST, a capacity candidate of issue 74's item 4: the learned text's pairs (h̃_t, x_{t+1})
kept as they are and read as the kNN-LM reads its datastore, p = λ·p_cache + (1 − λ)·p_FAAST, where p_cache(y) ∝
Σ_{i ∈ kNN(h̃)} exp(−‖h̃ − k_i‖² / T)·[v_i = y] over the k nearest pairs. h̃ is the base model's final hidden state
(the LM head's input), both for the pairs and for the tokens scored, so the cache does not depend on what FAAST
learned; FAAST's log-probabilities come from the setting it is added to.

lm_suite runs it as settings: a setting's fields may hold "cache": {"lam", "temperature", "k"} beside its
ResidualOutput fields. The cache is read only when scoring, so a cached setting shares its learning pass and its
solve with the setting without the cache. The pairs are gathered once per domain, by a forward pass of the base model
over the learned text (`build`); at a curve point of N learned tokens the cache holds the pairs within the first N.
That pass is timed apart (build_s) and counted in the setting's learn time: a library build would take the pairs
from FAAST's own learning pass, which already computes h̃. Forward only, as FAAST: nothing is trained.

Experiment code, not part of the faast package; it uses only faast's public names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from faast.hf.evaluate import Perplexity
from faast_lab.experiments.lm_baselines import KNNLM, KNNConfig

CACHE = "cache"  # the key of a setting's cache fields (lm_suite --settings)


@dataclass(frozen=True)
class CacheSpec:
    """The cache's reading: λ (0 < λ < 1), temperature T > 0 and k >= 1 nearest pairs."""

    lam: float
    temperature: float
    k: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.lam, (int, float)) or not 0 < self.lam < 1:
            raise ValueError(f"cache lam: expected a number in (0, 1), got {self.lam!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ValueError(f"cache temperature: expected a number > 0, got {self.temperature!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"cache k: expected an int >= 1, got {self.k!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def split_cache(name: str, fields: Mapping) -> tuple[dict, CacheSpec | None]:
    """A setting's fields as (its ResidualOutput fields, its cache or None); a ValueError names the setting."""
    fields = dict(fields)
    raw = fields.pop(CACHE, None)
    if raw is None:
        return fields, None
    if not isinstance(raw, Mapping) or not {"lam", "temperature"} <= set(raw) or set(raw) - {"lam", "temperature",
                                                                                                "k"}:  # fmt: skip
        raise ValueError(f"--settings: setting {name!r}: 'cache' expects an object with lam and temperature (and "
                         f"optionally k), got {raw!r}")  # fmt: skip
    try:
        return fields, CacheSpec(**raw)
    except ValueError as err:
        raise ValueError(f"--settings: setting {name!r}: {err}") from err


def pairs_within(lengths: Sequence[int], tokens: int) -> int:
    """How many adjacent pairs of texts of `lengths` tokens lie within the stream's first `tokens` tokens."""
    pairs, left = 0, tokens
    for n in lengths:
        take = min(n, left)
        pairs += max(take - 1, 0)
        left -= take
    return pairs


@dataclass
class CacheStates:
    """One domain's cache, before any reading: the learned text's pairs in stream order (keys [N, d] float32,
    values [N] int64), the scored tokens' queries [M, d] float32 and targets [M] int64 in the order
    faast.hf.evaluate.token_log_probs keeps them, the texts' lengths, and the seconds the two base passes took."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    targets: torch.Tensor
    lengths: list[int]
    build_s: float
    query_s: float
    _found: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def pairs(self, tokens: int) -> int:
        """The pairs the cache holds after `tokens` learned tokens."""
        return pairs_within(self.lengths, tokens)

    def nbytes(self, pairs: int) -> int:
        """Bytes `pairs` pairs take (float32 keys and int64 next tokens)."""
        return pairs * (self.keys.shape[1] * self.keys.element_size() + 8)

    def neighbours(self, pairs: int, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(negative squared distances [M, k'] largest first, hits [M, k'] bool, seconds this call searched) over
        the first `pairs` pairs, k' = min(k, pairs); one search per (pairs, k), shared by every λ and T (a later
        call searches for 0 s)."""
        if pairs < 1:
            raise ValueError(f"pairs: expected at least one cached pair, got {pairs}")
        key = (pairs, k)
        if key in self._found:
            return (*self._found[key], 0.0)
        started = time.perf_counter()
        neg, hit = KNNLM.search(self.queries, self.targets, self.keys[:pairs], self.values[:pairs], k)
        self._found[key] = (neg, hit)
        return neg, hit, time.perf_counter() - started


@torch.no_grad()
def build(base: nn.Module, learn: Sequence[Sequence[int]], windows: Sequence[Sequence[int]], *, window: int,
          batch_size: int) -> CacheStates:  # fmt: skip
    """The cache's pairs over the learned texts (the base model's final hidden states, in windows of `window`
    tokens overlapping by one, as the kNN-LM's datastore) and the queries at the scored windows' targets (batches of
    `batch_size`, as faast.hf.evaluate.token_log_probs reads them). `base` must be the model without FAAST."""
    store = KNNLM(base, KNNConfig())
    started = time.perf_counter()
    store.add(learn, window=window, batch_size=batch_size)
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    queries, targets = [], []
    for start in range(0, len(windows), batch_size):
        q, _, t = store.scored_states(windows[start : start + batch_size])
        queries.append(q)
        targets.append(t)
    query_s = time.perf_counter() - started
    return CacheStates(keys=torch.cat(store.keys), values=torch.cat(store.values), queries=torch.cat(queries),
                       targets=torch.cat(targets), lengths=[len(x) for x in learn], build_s=build_s,
                       query_s=query_s)  # fmt: skip


@torch.no_grad()
def read(states: CacheStates, log_probs: torch.Tensor, targets: torch.Tensor, learned: int,
         spec: CacheSpec) -> tuple[Perplexity, dict]:  # fmt: skip
    """The perplexity of FAAST's `log_probs` [M] at `targets` [M] (faast.hf.evaluate.token_log_probs) mixed with
    the cache after `learned` tokens, and what the reading cost: {"pairs", "bytes", "search_s"} (search_s 0 where
    an earlier reading at this point searched already: one search serves every λ and T)."""
    if not torch.equal(targets, states.targets):
        raise ValueError("targets: the scored tokens differ from the cache's queries (another windowing or batching)")
    pairs = states.pairs(learned)
    neg, hit, search_s = states.neighbours(pairs, spec.k)
    mixed = KNNLM.mix(log_probs, neg, hit, spec.lam, spec.temperature)
    nll = -float(mixed.sum())
    if not math.isfinite(nll):
        raise ValueError(f"the cache's reading gave a non-finite nll ({nll}) at {learned} learned tokens")
    cost = {"pairs": pairs, "bytes": states.nbytes(pairs), "search_s": search_s}
    return Perplexity(nll=nll, tokens=int(targets.numel()), seconds=0.0), cost
