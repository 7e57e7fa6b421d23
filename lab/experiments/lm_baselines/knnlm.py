"""kNN-LM (Khandelwal et al., 2020), the memory baseline of the LM experiments: a datastore of the LM head's inputs
h_t mapped to the next tokens x_{t+1}; at inference p = λ·p_kNN + (1 − λ)·p_LM with
p_kNN(y) ∝ Σ_{i ∈ kNN(h)} exp(−‖h − k_i‖² / T)·[v_i = y]. The authors' FAAST code has no such baseline.

Unlike FAAST it stores every key: memory grows as N·d, and each predicted token searches the whole datastore.
Experiment code, not part of the faast package (faast_lab.experiments.lm_baselines).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from faast.hf.evaluate import Perplexity
from faast.hf.tokens import overlapping_windows, pad_rows


@dataclass
class KNNConfig:
    """k neighbours, interpolation λ and temperature T (the paper's k = 1024, λ = 0.25, T = 1)."""

    k: int = 1024
    lam: float = 0.25
    temperature: float = 1.0
    query_chunk: int = 256  # queries searched at once (bounds the N x chunk distance matrix)


class KNNLM:
    """A datastore over a causal LM's final hidden states (the input of its LM head)."""

    def __init__(self, model: nn.Module, config: KNNConfig | None = None):
        self.model = model
        self.config = config or KNNConfig()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._head = model.get_output_embeddings()

    @property
    def size(self) -> int:
        return sum(v.numel() for v in self.values)

    def nbytes(self) -> int:
        """Bytes held by the datastore (keys float32 + int64 next-token ids)."""
        return sum(k.numel() * k.element_size() for k in self.keys) + sum(v.numel() * 8 for v in self.values)

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [B, T, d], logits [B, T, V]) from one forward pass, via a hook on the LM head."""
        seen = {}
        handle = self._head.register_forward_pre_hook(lambda m, args: seen.__setitem__("h", args[0]))
        try:
            logits = self.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
        finally:
            handle.remove()
        return seen["h"], logits

    @torch.no_grad()
    def add(self, token_ids: Sequence[Sequence[int]], *, window: int = 1024, batch_size: int = 4) -> int:
        """Store (h_t, x_{t+1}) for every adjacent pair of every text (windows overlap by one token). Returns pairs."""
        windows = [w for ids in token_ids for w in overlapping_windows(ids, window)]
        added = 0
        device = self._head.weight.device
        for start in range(0, len(windows), batch_size):
            ids, mask = pad_rows(windows[start : start + batch_size])
            ids, mask = ids.to(device), mask.to(device)
            hidden, _ = self._hidden(ids, mask)
            pair = mask[:, :-1] & mask[:, 1:]
            self.keys.append(hidden[:, :-1][pair].float())
            self.values.append(ids[:, 1:][pair])
            added += int(pair.sum())
        return added

    def add_states(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Store pairs whose states are already computed: keys [M, d] (final hidden states, kept as float32),
        values [M] int64 (each state's next token). What a stream's datastore grows by after scoring a window with
        the same forward pass (lm_baselines.stream). Returns M."""
        if keys.ndim != 2 or values.shape != keys.shape[:1]:
            raise ValueError(f"keys, values: expected [M, d] and [M], got {list(keys.shape)} and {list(values.shape)}")
        self.keys.append(keys.detach().float())
        self.values.append(values.detach().long())
        return int(values.numel())

    def neighbours(self, queries: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k nearest keys of each query [M, d]: (their negative squared L2 distances [M, k] float32, largest
        first; whether each one's next token is the query's target [M, k] bool), k = min(config.k, datastore size).
        Independent of λ and T, so a grid over them reuses one search (lm_baselines.tuning.tune_knn)."""
        if not self.values:
            raise ValueError("the datastore is empty: call add() first")
        return self.search(queries, targets, torch.cat(self.keys), torch.cat(self.values), self.config.k,
                           self.config.query_chunk)  # fmt: skip

    @staticmethod
    def search(queries: torch.Tensor, targets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k: int,
               query_chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`neighbours` over given keys [N, d] float32 and values [N] int64 (no datastore needed)."""
        k = min(k, keys.shape[0])
        key_sq = keys.square().sum(-1)
        negs, hits = [], []
        for start in range(0, queries.shape[0], query_chunk):
            q = queries[start : start + query_chunk].float()
            dist = q.square().sum(-1, keepdim=True) - 2 * q @ keys.mT + key_sq  # squared L2, [m, N]
            neg, index = torch.topk(-dist, k, dim=-1)
            negs.append(neg)
            hits.append(values[index] == targets[start : start + q.shape[0]].unsqueeze(-1))
        return torch.cat(negs), torch.cat(hits)

    @staticmethod
    def log_probs_from(neg: torch.Tensor, hit: torch.Tensor, temperature: float) -> torch.Tensor:
        """log p_kNN(target) [M] from `neighbours`' negative distances [M, k] and hits [M, k] at temperature T
        (−inf where no neighbour has the target)."""
        logw = torch.log_softmax(neg / temperature, dim=-1)
        return torch.logsumexp(logw.masked_fill(~hit, -math.inf), dim=-1)

    @staticmethod
    def mix(lm_log_probs: torch.Tensor, neg: torch.Tensor, hit: torch.Tensor, lam: float,
            temperature: float) -> torch.Tensor:  # fmt: skip
        """log(λ·p_kNN + (1 − λ)·p_LM) at the targets [M]: lm_log_probs [M] the LM's log-probabilities of the
        targets, neg and hit [M, k] from `neighbours`. λ = 0 is the LM exactly."""
        if lam <= 0:
            return lm_log_probs
        knn = KNNLM.log_probs_from(neg, hit, temperature)
        return torch.logaddexp(lm_log_probs + math.log1p(-lam), knn + math.log(lam))

    def knn_log_probs(self, queries: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p_kNN(target) [M] for queries [M, d] (−inf where no neighbour has the target)."""
        neg, hit = self.neighbours(queries, targets)
        return self.log_probs_from(neg, hit, self.config.temperature)

    @torch.no_grad()
    def scored_states(
        self, rows: Sequence[Sequence[int]], scored: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batch of rows (right padded): (final hidden states [M, d], the LM's log-probabilities of the targets
        [M] float32, the targets [M] int64) at the scored positions, in row order. scored[r]: how many of row r's
        last tokens are scored as targets (None: every token after the first, as perplexity windows are)."""
        device = self._head.weight.device
        ids, mask = pad_rows(rows)
        ids, mask = ids.to(device), mask.to(device)
        hidden, logits = self._hidden(ids, mask)
        valid = mask[:, :-1] & mask[:, 1:]
        if scored is not None:
            for r, (row, n) in enumerate(zip(rows, scored, strict=True)):
                if not 0 <= n < len(row):
                    raise ValueError(f"scored: row {r} has {len(row)} tokens, so 0 to {len(row) - 1} targets; got {n}")
                valid[r, : len(row) - 1 - n] = False  # targets are tokens 1 .. len - 1: keep the last n
        target = ids[:, 1:][valid]
        lm = torch.log_softmax(logits[:, :-1][valid].float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        return hidden[:, :-1][valid].float(), lm, target

    @torch.no_grad()
    def perplexity(
        self, windows: Sequence[Sequence[int]], *, batch_size: int = 4, scored: Sequence[int] | None = None
    ) -> Perplexity:
        """Held-out perplexity of the interpolated model over the windows, scored as faast.hf.evaluate.perplexity
        (scored: per window, how many of its last tokens are scored; None: all but the first)."""
        if not self.values:
            raise ValueError("the datastore is empty: call add() first")
        nll, tokens = 0.0, 0
        started = time.perf_counter()
        for start in range(0, len(windows), batch_size):
            part = None if scored is None else scored[start : start + batch_size]
            queries, lm, target = self.scored_states(windows[start : start + batch_size], part)
            neg, hit = self.neighbours(queries, target)
            nll -= float(self.mix(lm, neg, hit, self.config.lam, self.config.temperature).sum())
            tokens += int(target.numel())
        return Perplexity(nll=nll, tokens=tokens, seconds=time.perf_counter() - started)
