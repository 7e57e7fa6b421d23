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

A tuned cache ("cache": {"tune": true, "k"}) chooses its λ and T at each curve point as FAAST chooses its step, on
the held-out tail of the learned text (`tune`): each tail position is read against the pairs of the other learned
documents (a held-out file has no pairs of its own in the cache), mixed with FAAST's log-probabilities of the tail
from the same solve, over a grid that holds λ = 0 (no cache). Where no tail is held out, it is off.

Experiment code, not part of the faast package; it uses only faast's public names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from faast.hf.evaluate import Perplexity, token_log_probs
from faast_lab.experiments.lm_baselines import KNNLM, KNNConfig, TuningSplit, tuning_split

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


LAMS = (0.05, 0.1, 0.2, 0.3, 0.45)  # the fixed settings' grid (suite_cache.json), and the tuned cache's
TEMPERATURES = (3.0, 10.0, 30.0, 100.0)


@dataclass(frozen=True)
class TunedCacheSpec:
    """A cache whose λ and T are chosen at each curve point on the learned text's held-out tail, as FAAST's step is
    (`tune`): the grid is (λ = 0, no cache) and every (λ, T) of `lams` × `temperatures`; k nearest pairs."""

    k: int = 1024
    lams: tuple[float, ...] = LAMS
    temperatures: tuple[float, ...] = TEMPERATURES

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"cache k: expected an int >= 1, got {self.k!r}")
        for lam in self.lams:  # each one checked as a fixed cache checks it
            CacheSpec(lam, 1.0)
        for t in self.temperatures:
            CacheSpec(0.5, t)
        if not self.lams or not self.temperatures:
            raise ValueError(
                f"cache lams, temperatures: expected non-empty grids, got {self.lams}, {self.temperatures}"
            )

    def to_dict(self) -> dict:
        return {"tune": True, "k": self.k, "lams": list(self.lams), "temperatures": list(self.temperatures)}


def split_cache(name: str, fields: Mapping) -> tuple[dict, CacheSpec | TunedCacheSpec | None]:
    """A setting's fields as (its ResidualOutput fields, its cache or None): {"lam", "temperature", "k"} a fixed
    cache, {"tune": true, "k", "lams", "temperatures"} a tuned one. A ValueError names the setting."""
    fields = dict(fields)
    raw = fields.pop(CACHE, None)
    if raw is None:
        return fields, None
    if isinstance(raw, Mapping) and raw.get("tune") is True:
        extra = set(raw) - {"tune", "k", "lams", "temperatures"}
        if extra:
            raise ValueError(f"--settings: setting {name!r}: a tuned 'cache' takes k, lams and temperatures, got "
                             f"{sorted(extra)}")  # fmt: skip
        grids = {g: tuple(float(x) for x in raw[g]) for g in ("lams", "temperatures") if g in raw}
        try:
            return fields, TunedCacheSpec(k=raw.get("k", 1024), **grids)
        except ValueError as err:
            raise ValueError(f"--settings: setting {name!r}: {err}") from err
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
    tails: dict[int, Tail | None] = field(default_factory=dict)  # a tuned cache's tail at each curve point
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


@dataclass
class Tail:
    """The held-out tail of a stream's first tokens, as FAAST's step tuning holds it out (lm_baselines.tuning_split):
    its rows [(token ids, how many of its last tokens are scored)] (TuningSplit.held_rows) and, at the scored
    positions in row order, the base model's final hidden states [m, d] float32, the targets [m] int64 and each
    position's document [m] int64 (its index among the learned texts); seconds: the base pass over the rows."""

    rows: list[tuple[list[int], int]]
    queries: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor
    seconds: float


def truncated(texts: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """The stream's first `tokens` tokens, text by text (the last one cut)."""
    out, left = [], tokens
    for ids in texts:
        if left <= 0:
            break
        out.append(list(ids[:left]))
        left -= len(out[-1])
    return out


def tail_of(store: KNNLM, texts: Sequence[Sequence[int]], *, window: int, batch_size: int, tune_tokens: int,
            min_fit: int) -> Tail | None:  # fmt: skip
    """`Tail` of `texts` (tune_tokens and min_fit as FAAST's: lm_baselines.tuning_split); None where the text is too
    short to hold a tail out (FAAST's step is untuned there, and a tuned cache is off)."""
    try:
        split = tuning_split(texts, tune_tokens, min_fit)
    except ValueError:
        return None
    started = time.perf_counter()
    rows, documents = [], []
    for i, (ids, plan) in enumerate(zip(split.documents, split.plan, strict=True)):
        mine = TuningSplit([ids], [plan]).held_rows(window)
        rows += mine
        documents += [i] * sum(n for _, n in mine)
    queries, targets = [], []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        q, _, t = store.scored_states([r for r, _ in batch], [n for _, n in batch])
        queries.append(q)
        targets.append(t)
    seconds = time.perf_counter() - started
    return Tail(rows=rows, queries=torch.cat(queries), targets=torch.cat(targets),
                documents=torch.tensor(documents, dtype=torch.int64), seconds=seconds)  # fmt: skip


@torch.no_grad()
def build(base: nn.Module, learn: Sequence[Sequence[int]], windows: Sequence[Sequence[int]], *, window: int,
          batch_size: int, tails_at: Sequence[int] = (), tune_tokens: int = 0,
          min_fit: int = 0) -> CacheStates:  # fmt: skip
    """The cache's pairs over the learned texts (the base model's final hidden states, in windows of `window`
    tokens overlapping by one, as the kNN-LM's datastore) and the queries at the scored windows' targets (batches of
    `batch_size`, as faast.hf.evaluate.token_log_probs reads them). `base` must be the model without FAAST. For a
    tuned cache, the held-out tail of the first N learned tokens for each N of `tails_at` (`tail_of`)."""
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
    tails = {n: tail_of(store, truncated(learn, n), window=window, batch_size=batch_size, tune_tokens=tune_tokens,
                        min_fit=min_fit) for n in tails_at}  # fmt: skip
    return CacheStates(keys=torch.cat(store.keys), values=torch.cat(store.values), queries=torch.cat(queries),
                       targets=torch.cat(targets), lengths=[len(x) for x in learn], build_s=build_s,
                       query_s=query_s, tails=tails)  # fmt: skip


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


def pair_documents(lengths: Sequence[int], tokens: int) -> torch.Tensor:
    """The document (index among the texts) of each pair within the stream's first `tokens` tokens [P] int64, in
    stream order (`pairs_within`)."""
    out, left = [], tokens
    for i, n in enumerate(lengths):
        take = min(n, left)
        out += [i] * max(take - 1, 0)
        left -= take
    return torch.tensor(out, dtype=torch.int64)


FAR = -1e30  # a neighbour's negative squared distance where there is none: zero weight beside any real one


def search_apart(queries: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, key_documents: torch.Tensor, k: int,
                 query_chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KNNLM.search, each query [M, d] (of document `documents` [M]) among the keys [N, d] of other documents only
    (`key_documents` [N]): a held-out file is read with no pair of its own in the cache, and so is the tail. Where a
    query has fewer than k such keys, the missing neighbours are FAR and miss."""
    k = min(k, keys.shape[0])
    key_sq = keys.square().sum(-1)
    negs, hits = [], []
    for start in range(0, queries.shape[0], query_chunk):
        q = queries[start : start + query_chunk].float()
        dist = q.square().sum(-1, keepdim=True) - 2 * q @ keys.mT + key_sq
        dist.masked_fill_(documents[start : start + q.shape[0], None] == key_documents[None, :], math.inf)
        neg, index = torch.topk(-dist, k, dim=-1)
        real = torch.isfinite(neg)
        negs.append(neg.masked_fill(~real, FAR))
        hits.append((values[index] == targets[start : start + q.shape[0]].unsqueeze(-1)) & real)
    return torch.cat(negs), torch.cat(hits)


def tune(states: CacheStates, tail: Tail, faast_log_probs: torch.Tensor, learned: int,
         spec: TunedCacheSpec) -> tuple[CacheSpec | None, dict]:  # fmt: skip
    """λ and T by FAAST's mean NLL mixed with the cache on `tail` (faast_log_probs [m]: FAAST's log-probabilities of
    the tail's targets, `faast_tail_log_probs`), the cache holding the pairs within the first `learned` tokens of
    the tail's own document's others (`search_apart`). The grid: λ = 0 (no cache: None, chosen on ties), then
    spec.lams × spec.temperatures. ({"grid": [{"lam", "temperature", "nll"}], "tail_positions"} beside it.)"""
    pairs = states.pairs(learned)
    neg, hit = search_apart(tail.queries, tail.targets, tail.documents, states.keys[:pairs], states.values[:pairs],
                            pair_documents(states.lengths, learned), spec.k)  # fmt: skip
    grid = [{"lam": 0.0, "temperature": None, "nll": float(-faast_log_probs.double().mean())}]
    for lam in spec.lams:
        for t in spec.temperatures:
            nll = float(-KNNLM.mix(faast_log_probs, neg, hit, lam, t).double().mean())
            grid.append({"lam": lam, "temperature": t, "nll": nll})
    best = min(grid, key=lambda g: g["nll"] if math.isfinite(g["nll"]) else math.inf)
    chosen = None if best["lam"] == 0.0 else CacheSpec(best["lam"], best["temperature"], spec.k)
    return chosen, {"grid": grid, "tail_positions": int(tail.targets.numel())}


def faast_tail_log_probs(model: nn.Module, tail: Tail, batch_size: int) -> torch.Tensor:
    """The model's log-probabilities [m] float32 of the tail's scored targets, in `Tail` order (each row's last
    scored tokens of faast.hf.evaluate.token_log_probs' scores)."""
    rows = [r for r, _ in tail.rows]
    kept = token_log_probs(model, rows, batch_size=batch_size, progress=False)
    picked, offset = [], 0
    for row, n in tail.rows:
        offset += len(row) - 1  # each row's scores: all its tokens after the first
        picked.append(torch.arange(offset - n, offset))
    index = torch.cat(picked)
    if not torch.equal(kept.targets[index], tail.targets):
        raise ValueError("tail: the model's scored targets differ from the tail's (another windowing)")
    return kept.log_probs[index]


def read_at(states: CacheStates, spec: CacheSpec | TunedCacheSpec, learned: int, faast: Perplexity,
            per_token: tuple) -> tuple[Perplexity, dict]:  # fmt: skip
    """A cached setting's perplexity after `learned` tokens and its cost ({"pairs", "bytes", "search_s"}; a tuned
    cache adds its choice "lam", "temperature" (0 and None: off) and "tune_s"). faast: FAAST's Perplexity;
    per_token: (FAAST's log-probabilities [M], targets [M], and for a tuned cache (its tail log-probabilities [m],
    the seconds they took) or None). A tuned cache with no tail, or whose tail chose λ = 0, reads as FAAST."""
    log_probs, targets, tail_scores = per_token
    if isinstance(spec, CacheSpec):
        return read(states, log_probs, targets, learned, spec)
    pairs = states.pairs(learned)
    tail = states.tails.get(learned)
    chosen, tune_s = None, 0.0
    if tail is not None and pairs > 0:  # no tail (too little text): off, as FAAST's step is untuned there
        started = time.perf_counter()
        chosen, _ = tune(states, tail, tail_scores[0], learned, spec)
        tune_s = time.perf_counter() - started + tail.seconds + tail_scores[1]
    if chosen is None:
        result = Perplexity(nll=faast.nll, tokens=faast.tokens, seconds=0.0)
        cost = {"pairs": pairs, "bytes": states.nbytes(pairs), "search_s": 0.0}
    else:
        result, cost = read(states, log_probs, targets, learned, chosen)
    lam, temperature = (0.0, None) if chosen is None else (chosen.lam, chosen.temperature)
    return result, {**cost, "lam": lam, "temperature": temperature, "tune_s": tune_s}
