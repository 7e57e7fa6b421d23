"""The peers' rows of lab/experiments/lm_domains.py: the kNN-LM (at the paper's settings, and tuned on FAAST's held-out
tail), LoRA (one epoch, LoRA-best tuned on the tail, and LoRA at FAAST's time) and the linear projection, each trained
or stored on a domain's learned text and scored on its held-out files (lab/experiments/lm_baselines)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Protocol

KNN_CURVE = (32768,)
# LoRA for FAAST's time: epochs are only an upper bound (the time budget stops it), high enough never to bind.
TIME_EPOCHS = 1000


class PeerDomain(Protocol):
    """What the peers read of lm_domains.Domain: its learned texts, held-out windows and rows."""

    learn: list[list[int]]
    windows: list[list[int]]
    learned: int
    curve: dict
    tuned: dict

    def add(self, method: str, result: object, learn_s: float, memory: int, **extra: object) -> None: ...

    def split(self, base: object, args: argparse.Namespace) -> object: ...

    def row(self, method: str) -> dict | None: ...


def run_knn(domain: PeerDomain, base, args: argparse.Namespace) -> None:  # noqa: ANN001
    from faast.hf.tokens import split_by_tokens
    from faast_lab.experiments.lm_baselines import KNNLM, KNNConfig

    knn = KNNLM(base, KNNConfig())
    amounts = sorted({p for p in KNN_CURVE if p < domain.learned} | {domain.learned})
    curve = domain.curve["knn"] = {"tokens": amounts, "ppl": [], "bytes": []}
    learn_s = 0.0
    for part in split_by_tokens(domain.learn, amounts):
        started = time.perf_counter()
        if part:
            knn.add(part, window=args.window, batch_size=args.batch_size)
        learn_s += time.perf_counter() - started
        result = knn.perplexity(domain.windows, batch_size=args.batch_size)
        curve["ppl"].append(result.ppl)
        curve["bytes"].append(knn.nbytes())
    domain.add(f"kNN-LM (k={knn.config.k}, λ={knn.config.lam})", result, learn_s, knn.nbytes())


def run_knn_tuned(domain: PeerDomain, base, args: argparse.Namespace) -> None:  # noqa: ANN001
    """The kNN-LM with λ and T chosen on FAAST's held-out tail (lm_baselines.tune_knn: the datastore of the fit
    prefixes), then the datastore of all the learned text with those, scored on the held-out files. Learn time is
    the final datastore's; the tuning's is tuning_s."""
    from faast_lab.experiments.lm_baselines import KNNLM, KNNConfig, tune_knn

    choice = tune_knn(base, domain.split(base, args), lams=args.knn_lams, temperatures=args.knn_temperatures,
                      k=args.knn_k, window=args.window, batch_size=args.batch_size)  # fmt: skip
    domain.tuned["knn_tuned"] = choice
    knn = KNNLM(base, KNNConfig(k=args.knn_k, lam=choice.lam, temperature=choice.temperature))
    started = time.perf_counter()
    knn.add(domain.learn, window=args.window, batch_size=args.batch_size)
    learn_s = time.perf_counter() - started
    result = knn.perplexity(domain.windows, batch_size=args.batch_size)
    domain.add(f"kNN-LM tuned (k={args.knn_k}, λ={choice.lam:g}, T={choice.temperature:g})", result, learn_s,
               knn.nbytes(), tuning_s=choice.tuning_s, **_tuned(choice))  # fmt: skip


def _tuned(choice: object) -> dict:
    """A tuning choice's fields for a row: the grid apart, the rest under "tuned" (tuning_s is its own column)."""
    fields = dataclasses.asdict(choice)
    grid = fields.pop("grid")
    fields.pop("tuning_s")
    return {"tuned": fields, "grid": grid}


def lora_rank(base, layers: list[int]) -> int:  # noqa: ANN001
    """The LoRA rank whose parameter count matches the linear projection's at `layers` (as the 1-epoch LoRA's)."""
    from faast_lab.experiments.lm_baselines import lora_rank_for

    return lora_rank_for(base, len(layers) * base.config.hidden_size**2)


def train_lora(domain: PeerDomain, base, rank: int, args: argparse.Namespace, **fit: object) -> tuple:  # noqa: ANN001
    """A fresh LoRA (torch seeded with 0, as lm_baselines.tune_lora seeds each of its runs) trained on all the learned
    text by fit_causal_lm(**fit) and scored on the held-out files: (FitStats, Perplexity, trainable parameters)."""
    import torch

    from faast.hf.evaluate import perplexity
    from faast_lab.experiments.lm_baselines import apply_lora, fit_causal_lm

    torch.manual_seed(0)
    lora = apply_lora(base, rank)
    try:
        trainable = [p for p in lora.parameters() if p.requires_grad]
        stats = fit_causal_lm(lora, trainable, domain.learn, window=args.train_window,
                              batch_size=args.train_batch_size, **fit)  # fmt: skip
        result = perplexity(lora, domain.windows, batch_size=args.batch_size)
    finally:
        lora.unload()
    return stats, result, trainable


def run_lora_best(domain: PeerDomain, base, layers: list[int], args: argparse.Namespace) -> None:  # noqa: ANN001
    """LoRA with its learning rate and epochs chosen on FAAST's held-out tail (lm_baselines.tune_lora: trained on
    the fit prefixes, scored after each epoch), then trained afresh on all the learned text with that lr for that
    many epochs, on the schedule the tuning scored (warmup over one epoch's 10%, then constant). Learn time is the
    final training's; the whole tuning's is tuning_s."""
    from faast_lab.experiments.lm_baselines import tune_lora

    rank = lora_rank(base, layers)
    choice = tune_lora(base, domain.split(base, args), lrs=args.lora_lrs, max_epochs=args.lora_max_epochs,
                       rank=rank, train_window=args.train_window, batch_size=args.train_batch_size,
                       window=args.window, score_batch_size=args.batch_size)  # fmt: skip
    domain.tuned["lora_best"] = choice
    stats, result, trainable = train_lora(domain, base, rank, args, lr=choice.lr, epochs=choice.epochs,
                                          warmup="epoch")  # fmt: skip
    epochs = f"{choice.epochs} epoch" + ("s" if choice.epochs != 1 else "")
    domain.add(f"LoRA-best (peft, r={rank}, lr={choice.lr:g}, {epochs}, tuned on the held-out tail)", result,
               stats.seconds, sum(p.numel() * p.element_size() for p in trainable),
               params=sum(p.numel() for p in trainable), steps=stats.steps, tuning_s=choice.tuning_s,
               **_tuned(choice))  # fmt: skip


def run_lora_time(domain: PeerDomain, base, layers: list[int], args: argparse.Namespace, faast_row: str) -> None:  # noqa: ANN001
    """LoRA trained on all the learned text for FAAST's time: as many steps as fit in the learn + solve time the
    default FAAST row measured in this run (fit_causal_lm's max_seconds; less than an epoch or several), with
    LoRA-best's lr when it ran in this domain, else the lr of a LoRA-best row imported from an earlier run of the same
    text (--baselines-from), else --lora-lr; warmup over one epoch's 10%, as LoRA-best's."""
    faast = domain.row(faast_row)
    if faast is None:
        raise RuntimeError(f"{domain.name}: LoRA at FAAST's time needs the default FAAST row, which did not run")
    choice = domain.tuned.get("lora_best")
    # LoRA-best's choice depends on the text and the tail, not on the machine: an earlier run's holds here.
    imported = next((r for r in domain.rows if r["method"].startswith("LoRA-best (") and "imported_from" in r
                     and (r.get("tuned") or {}).get("lr")), None)  # fmt: skip
    if choice is not None:
        lr, lr_from = choice.lr, "LoRA-best"
    elif imported is not None:
        lr, lr_from = imported["tuned"]["lr"], f"LoRA-best, imported from {imported['imported_from']['file']}"
    else:
        lr, lr_from = args.lora_lr, "--lora-lr"
    rank = lora_rank(base, layers)
    budget = faast["learn_s"]
    stats, result, trainable = train_lora(domain, base, rank, args, lr=lr, epochs=TIME_EPOCHS, warmup="epoch",
                                          max_seconds=budget)  # fmt: skip
    domain.add(f"LoRA at FAAST's time (peft, r={rank}, lr={lr:g}, {stats.steps} steps)", result, stats.seconds,
               sum(p.numel() * p.element_size() for p in trainable), params=sum(p.numel() for p in trainable),
               steps=stats.steps, epochs=stats.epochs, budget_s=budget,
               lr_from=lr_from)  # fmt: skip


def run_backprop(domain: PeerDomain, base, layers: list[int], method: str, args: argparse.Namespace) -> None:  # noqa: ANN001
    from faast.hf.evaluate import perplexity
    from faast_lab.experiments.lm_baselines import LinearProjection, apply_lora, fit_causal_lm, lora_rank_for

    fit = {"window": args.train_window, "batch_size": args.train_batch_size, "epochs": 1}
    params = len(layers) * base.config.hidden_size**2
    if method == "linear":
        projection = LinearProjection(base, layers)
        try:
            stats = fit_causal_lm(base, list(projection.parameters()), domain.learn, lr=args.linear_lr, **fit)
            result = perplexity(base, domain.windows, batch_size=args.batch_size)
        finally:
            projection.remove()
        domain.add(f"linear (backprop, {len(layers)} layers, 1 epoch)", result, stats.seconds, projection.nbytes(),
                   params=params)  # fmt: skip
        return
    import torch

    rank = lora_rank_for(base, params)
    lora = apply_lora(base, rank)
    autocast = torch.bfloat16 if method == "lora_bf16" else None
    try:
        trainable = [p for p in lora.parameters() if p.requires_grad]
        stats = fit_causal_lm(lora, trainable, domain.learn, lr=args.lora_lr, autocast=autocast, **fit)
        result = perplexity(lora, domain.windows, batch_size=args.batch_size)
    finally:
        lora.unload()
    nbytes = sum(p.numel() * p.element_size() for p in trainable)
    # A row name of its own before " (": the report's averages and goals key rows by it ("LoRA" is the float32 one).
    name = f"LoRA bf16 (peft, r={rank}, 1 epoch, bfloat16 autocast)" if autocast else f"LoRA (peft, r={rank}, 1 epoch)"
    domain.add(name, result, stats.seconds, nbytes,
               params=sum(p.numel() for p in trainable))  # fmt: skip
