"""The baselines tuned as FAAST tunes its step: on the same held-out tail of the learned text, with a fixed grid.

FAAST's residual output layer holds out the tail that faast.hf.held_out.tail_plan picks (per document, its last
held_i positions, and the gap_i positions before them left out of the fit too), fits on the rest and chooses its step
by the held-out NLL. `tuning_split` cuts the learned documents by that same rule; `tune_lora` and `tune_knn` train or
store on the fit prefixes, score exactly the held-out positions after each setting, and return the setting with the
lowest held-out NLL together with the whole grid and the seconds all of it took (the tuning is a cost FAAST pays
inside its solve, so the experiments report it, apart from the final training).

Experiment code, not part of the faast package (faast_lab.experiments.lm_baselines).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from faast.hf import OutputPolicy
from faast.hf.held_out import tail_plan
from faast.hf.tokens import pad_rows

from .backprop import apply_lora, fit_causal_lm
from .knnlm import KNNLM, KNNConfig

DEFAULT_TEMPERATURES = (1.0, 3.0, 10.0, 30.0, 100.0)


def faast_min_fit(hidden_size: int, policy: OutputPolicy | None = None) -> int:
    """The fewest positions FAAST's step tuning fits on for a model of this hidden size (its key width): the
    residual output layer's rule under `policy` (None: the shipped OutputPolicy), 2304 for SmolLM2 (576)."""
    policy = OutputPolicy() if policy is None else policy
    return max(policy.min_fit_tokens, policy.fit_per_key_dim * int(hidden_size))


@dataclass
class TuningSplit:
    """The learned documents (token ids, stream order) and tail_plan's [(held_i, gap_i)] for each.

    Document i of L_i tokens has n_i = L_i − 1 positions; its last held_i positions are held out (their targets are
    tokens L_i − held_i .. L_i − 1) and the gap_i before them are left out of the fit, which sees the first
    L_i − held_i − gap_i tokens (the fit prefix)."""

    documents: list[list[int]]
    plan: list[tuple[int, int]]

    def fit_lengths(self) -> list[int]:
        """Tokens of each document's fit prefix."""
        return [len(ids) - held - gap for ids, (held, gap) in zip(self.documents, self.plan, strict=True)]

    def fit_texts(self) -> list[list[int]]:
        """The fit prefixes a baseline trains on or stores while tuning (those of >= 2 tokens: a pair at least)."""
        texts = [ids[:n] for ids, n in zip(self.documents, self.fit_lengths(), strict=True)]
        return [t for t in texts if len(t) >= 2]

    @property
    def held_tokens(self) -> int:
        """Held-out positions in all."""
        return sum(held for held, _ in self.plan)

    @property
    def fit_tokens(self) -> int:
        """Positions in the fit prefixes (what the fit learns)."""
        return sum(max(0, n - 1) for n in self.fit_lengths())

    def held_rows(self, window: int) -> list[tuple[list[int], int]]:
        """The rows that score the held-out positions, document by document: [(token ids, how many of its last
        tokens are targets)].

        A document's held-out targets are cut into consecutive runs of stride = window // 2; a run ending at token e
        is scored in the row ids[max(0, e − window) : e], so every row fits the model's `window` and every target
        sees all the document's tokens before it, or at least window − stride of them (as faast.hf.evaluate cuts its
        scored text into windows the model can take)."""
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window: expected an int >= 2, got {window!r}")
        stride = window // 2
        rows = []
        for ids, (held, _) in zip(self.documents, self.plan, strict=True):
            for start in range(len(ids) - held, len(ids), stride):
                end = min(start + stride, len(ids))
                rows.append((list(ids[max(0, end - window) : end]), end - start))
        return rows


def tuning_split(token_lists: Sequence[Sequence[int]], tune_tokens: int = 2048, min_fit: int = 2304) -> TuningSplit:
    """Hold out of `token_lists` (documents of token ids, stream order) what FAAST's step tuning holds out of them:
    faast.hf.held_out.tail_plan with counts n_i = len(ids) − 1 (0 for a document under 2 tokens), learned =
    Σ n_i. tune_tokens: ResidualOutput.tune_tokens; min_fit: `faast_min_fit(hidden_size)`."""
    documents = [list(ids) for ids in token_lists]
    counts = [max(0, len(ids) - 1) for ids in documents]
    plan = tail_plan(counts, sum(counts), tune_tokens, min_fit)
    if not any(held for held, _ in plan):
        raise ValueError(
            f"token_lists: {sum(counts)} learned positions in {len(documents)} documents hold out nothing to tune on"
            f" (tail_plan with tune_tokens={tune_tokens}, min_fit={min_fit})"
        )
    return TuningSplit(documents, [(int(h), int(g)) for h, g in plan])


@torch.no_grad()
def held_out_nll(model: nn.Module, split: TuningSplit, window: int, batch_size: int = 4) -> tuple[float, int]:
    """(summed NLL, count) of exactly the held-out positions of `split` under a causal LM (any module whose output
    has .logits [B, T, V]), each target given its context as `TuningSplit.held_rows` cuts it. Rows are right padded
    in batches of `batch_size`; labels are -100 on every context token, so only held-out targets count. Log-softmax
    in float32, the sum in float64."""
    rows = sorted(split.held_rows(window), key=lambda r: len(r[0]), reverse=True)  # alike lengths pad least
    device = model.get_input_embeddings().weight.device
    nll, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        ids, mask = pad_rows([r for r, _ in batch])
        labels = torch.full_like(ids, -100)
        for i, (row, scored) in enumerate(batch):
            labels[i, len(row) - scored : len(row)] = ids[i, len(row) - scored : len(row)]
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits[:, :-1]
        target = labels[:, 1:]
        valid = target != -100
        # Only the scored rows of the [B, T, V] logits go to float32: a SmolLM2 batch holds ~10^8 of them.
        logp = torch.log_softmax(logits[valid].float(), dim=-1).gather(-1, target[valid].unsqueeze(-1)).squeeze(-1)
        nll -= float(logp.double().sum())
        count += int(valid.sum())
    return nll, count


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


@dataclass
class LoraChoice:
    """tune_lora's result: the learning rate and epochs with the lowest mean held-out NLL (nll), the base model's
    (base_nll, no LoRA), every grid point [{"lr", "epochs", "nll"}], the seconds all the tuning took, the LoRA rank,
    and the held-out / fit positions."""

    lr: float
    epochs: int
    nll: float
    base_nll: float
    rank: int
    tuning_s: float
    held_tokens: int
    fit_tokens: int
    grid: list[dict] = field(default_factory=list)


def tune_lora(
    base: nn.Module,
    split: TuningSplit,
    *,
    lrs: Sequence[float] = (3e-4, 1e-3, 3e-3),
    max_epochs: int = 3,
    rank: int,
    train_window: int,
    batch_size: int,
    window: int = 1024,
    score_batch_size: int | None = None,
    seed: int = 0,
) -> LoraChoice:
    """LoRA (`apply_lora`, rank `rank`) trained on the split's fit prefixes for each learning rate, scored on the
    held-out positions (`held_out_nll`, rows of `window` tokens, `score_batch_size` of them at once; default
    `batch_size`) after each of up to max_epochs epochs; the (lr, epochs) of the lowest mean NLL is chosen.

    Each lr starts from the same fresh LoRA (torch seeded with `seed`; unloaded after) and trains with
    fit_causal_lm(warmup='epoch'): warmup over 10% of one epoch's steps, then constant, so its first E epochs are
    exactly a run of E epochs, and the final training with the chosen (lr, E) (same seed, same warmup rule) follows
    the schedule scored here. A diverged run (non-finite NLL) stops and never wins."""
    if not lrs or max_epochs < 1:
        raise ValueError(f"lrs, max_epochs: expected at least one lr and epoch, got {list(lrs)}, {max_epochs}")
    started = time.perf_counter()
    score_batch_size = score_batch_size or batch_size
    nll, count = held_out_nll(base, split, window, score_batch_size)
    base_nll = nll / count
    grid: list[dict] = []
    for lr in lrs:
        torch.manual_seed(seed)
        lora = apply_lora(base, rank)
        try:
            trainable = [p for p in lora.parameters() if p.requires_grad]

            def score(epoch: int, lr: float = lr, lora: nn.Module = lora) -> bool:
                nll, count = held_out_nll(lora, split, window, score_batch_size)
                grid.append({"lr": lr, "epochs": epoch, "nll": nll / count})
                return not math.isfinite(nll)

            fit_causal_lm(lora, trainable, split.fit_texts(), window=train_window, batch_size=batch_size, lr=lr,
                          epochs=max_epochs, seed=seed, warmup="epoch", on_epoch=score)  # fmt: skip
        finally:
            lora.unload()
    best = min(grid, key=lambda g: _finite_or_inf(g["nll"]))
    return LoraChoice(lr=best["lr"], epochs=best["epochs"], nll=best["nll"], base_nll=base_nll, rank=rank,
                      tuning_s=time.perf_counter() - started, held_tokens=split.held_tokens,
                      fit_tokens=split.fit_tokens, grid=grid)  # fmt: skip


@dataclass
class KnnChoice:
    """tune_knn's result: λ and T with the lowest mean held-out NLL (nll), the base model's (base_nll, λ = 0), k,
    every grid point [{"lam", "temperature", "nll"}], the seconds all the tuning took (datastore, search, grid), and
    the held-out positions and datastore size."""

    lam: float
    temperature: float
    k: int
    nll: float
    base_nll: float
    tuning_s: float
    held_tokens: int
    fit_tokens: int
    grid: list[dict] = field(default_factory=list)


def held_out_neighbours(
    knn: KNNLM, split: TuningSplit, window: int, batch_size: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every held-out position of `split` (rows as `TuningSplit.held_rows`): the LM's log-probability of the
    target [M] float32 and the datastore's k nearest neighbours (negative squared distances [M, k] float32, hits
    [M, k] bool; KNNLM.neighbours): all a grid over (λ, T) needs, computed once."""
    rows = split.held_rows(window)
    lms, targets, queries = [], [], []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        q, lm, t = knn.scored_states([r for r, _ in batch], [n for _, n in batch])
        queries.append(q)
        lms.append(lm)
        targets.append(t)
    neg, hit = knn.neighbours(torch.cat(queries), torch.cat(targets))
    return torch.cat(lms), neg, hit


def tune_knn(
    base: nn.Module,
    split: TuningSplit,
    *,
    lams: Sequence[float] = (0.05, 0.1, 0.25, 0.4, 0.6),
    temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
    k: int = 1024,
    window: int = 1024,
    batch_size: int = 4,
) -> KnnChoice:
    """The kNN-LM's (λ, T) by held-out NLL: the datastore holds the split's fit prefixes (windows of `window`
    tokens), the held-out positions' LM log-probabilities and k nearest neighbours are computed once
    (`held_out_neighbours`), and every (λ, T) of the grid mixes them (KNNLM.mix, as KNNLM.perplexity does)."""
    if not lams or not temperatures:
        raise ValueError(f"lams, temperatures: expected non-empty grids, got {list(lams)}, {list(temperatures)}")
    started = time.perf_counter()
    knn = KNNLM(base, KNNConfig(k=k))
    knn.add(split.fit_texts(), window=window, batch_size=batch_size)
    lm, neg, hit = held_out_neighbours(knn, split, window, batch_size)
    grid = [{"lam": lam, "temperature": t, "nll": float(-KNNLM.mix(lm, neg, hit, lam, t).double().mean())}
            for lam in lams for t in temperatures]  # fmt: skip
    best = min(grid, key=lambda g: _finite_or_inf(g["nll"]))
    return KnnChoice(lam=best["lam"], temperature=best["temperature"], k=min(k, knn.size), nll=best["nll"],
                     base_nll=float(-lm.double().mean()), tuning_s=time.perf_counter() - started,
                     held_tokens=int(lm.numel()), fit_tokens=knn.size, grid=grid)  # fmt: skip
