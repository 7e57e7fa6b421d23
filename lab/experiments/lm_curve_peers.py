"""Does more learned text help any learner? FAAST and LoRA at the curve's early points, each at its best for the
held-out files.

    python -m faast_lab.experiments.lm_curve_peers --domains info man
    python -m faast_lab.experiments.lm_curve_peers --domains info --cut "Node: Licenses" --no-lora --out NAME

The benchmark's curve (lab/experiments/lm_domains.py) asks that held-out perplexity fall from 2K to 8K to 32K learned
tokens. Where FAAST's rises, this asks whether the learned text itself is to blame. At each curve point up to
--upto, on the same stream the benchmark learns:
- FAAST's default learns the text as the benchmark does (256-token windows, one learn call and solve per part, a
  text cut at a point continued) and is read as it stands, at the best step for the held-out files, and at the best
  step and weight (lm_step_probe's oracles, rebuilt from one read);
- LoRA (the benchmark's rank) trains afresh on the same prefix at every learning rate of --lrs, and is scored on the
  held-out files after epochs 1, 2, 3, 4, 6, 8, ... up to `lora_epochs(tokens)`: as many as 3 epochs of the last
  point's text would take, so a short prefix is not held back by a short schedule. Its best cell is an oracle too:
  the held-out files choose.
If neither oracle improves from one point to the next, the text learned in between does not help these held-out
files, whatever the learner or its tuning.

--cut MARKER ends every learned text before MARKER's first occurrence (a counterfactual stream: e.g. the GNU info
domain without a manual's licence appendix); the rest of the stream moves up to fill the points.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path

from faast_lab.experiments._common import RESULTS, add_stream_arguments, run_default_domains, table
from faast_lab.experiments.domains import DOMAINS, EXTRA, VALIDATION

LORA_LRS = (3e-4, 1e-3, 3e-3)  # LoRA-best's grid (lm_baselines.tune_lora)
# What lm_step_probe.probe's row keeps of each point.
FAAST_FIELDS = ("ppl_base", "ppl_read", "tuned_step", "tuned_weight", "tuned", "oracle_step", "oracle_ppl",
                "joint_step", "joint_weight", "joint_ppl")  # fmt: skip
LORA_TOKENS_EPOCHS = 3  # LoRA trains on a prefix for as many tokens as this many epochs of the last point's text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", nargs="+", choices=(*DOMAINS, *EXTRA, *VALIDATION), default=["info", "man"])
    p.add_argument("--upto", type=int, default=8192, help="the last curve point (learned tokens) to measure")
    add_stream_arguments(p)
    p.add_argument("--lrs", type=lambda s: tuple(float(x) for x in s.split(",")), default=LORA_LRS)
    p.add_argument("--cut", default=None, help="end every learned text before this marker's first occurrence")
    p.add_argument("--no-lora", action="store_true", help="FAAST alone")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_curve_peers_cpu")
    args = p.parse_args(argv)
    if args.cut == "":
        p.error("--cut: expected a non-empty marker")
    if args.upto < 1:
        p.error(f"--upto: expected a positive token count, got {args.upto}")
    return args


def cut_texts(texts: Sequence[str], marker: str) -> tuple[list[str], int]:
    """Each text ended before `marker`'s first occurrence (texts without it kept whole; a text that would end empty
    dropped): (the texts, how many were cut)."""
    if not marker:
        raise ValueError("marker: expected a non-empty string")
    out, cut = [], 0
    for text in texts:
        at = text.find(marker)
        if at >= 0:
            cut += 1
            text = text[:at]
        if text.strip():
            out.append(text)
    return out, cut


def lora_epochs(tokens: int, last: int) -> list[int]:
    """The epochs LoRA is scored after on a `tokens`-token prefix: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... below
    E = max(LORA_TOKENS_EPOCHS, ceil(LORA_TOKENS_EPOCHS · last / tokens)), and E itself."""
    if not 1 <= tokens <= last:
        raise ValueError(f"tokens: expected 1 <= tokens <= last ({last}), got {tokens}")
    most = max(LORA_TOKENS_EPOCHS, math.ceil(LORA_TOKENS_EPOCHS * last / tokens))
    marks, e = [1, 2, 3, 4], 4
    while e < most:
        e = e + e // 2 if e % 3 else e + e // 3  # 4, 6, 8, 12, 16, 24, ...
        marks.append(e)
    return sorted({m for m in marks if m < most} | {most})


def best_cell(grid: dict[str, dict[int, float]]) -> tuple[float, int, float]:
    """(lr, epochs, perplexity) of the lowest perplexity in grid {lr: {epochs: perplexity}}; ties go to the first
    lr, then the fewest epochs."""
    cells = [(ppl, i, e, float(lr)) for i, (lr, row) in enumerate(grid.items()) for e, ppl in row.items()]
    if not cells:
        raise ValueError("grid: expected at least one scored cell")
    ppl, _, epochs, lr = min(cells)
    return lr, epochs, ppl


def domain_stream(name: str, tokenizer, args: argparse.Namespace) -> tuple:  # noqa: ANN001
    """(lm_domains' Domain for `name`, how many learned texts --cut cut): with --cut, the Domain's learned token
    lists are rebuilt from the cut texts."""
    from faast.hf.tokens import token_lists
    from faast_lab.experiments.domains import domain_texts
    from faast_lab.experiments.lm_domains import Domain

    domain = Domain(name, tokenizer, argparse.Namespace(**vars(args), parts_as_documents=False))
    cut = 0
    if args.cut is not None:
        texts, cut = cut_texts(domain_texts(name)[0], args.cut)
        domain.learn = token_lists(texts, tokenizer, args.learn_tokens)
        domain.learned = sum(len(x) for x in domain.learn)
    return domain, cut


def faast_points(domain, base, args: argparse.Namespace) -> list[dict]:  # noqa: ANN001
    """FAAST's default at each curve point up to --upto: lm_step_probe.probe's row (as read, best step, best step
    and weight for the held-out files)."""
    from faast.hf import FaastConfig, apply_faast
    from faast_lab.experiments.lm_domains import CURVE, curve_parts, points
    from faast_lab.experiments.lm_step_probe import probe

    amounts = points(domain.learned, CURVE)
    model = apply_faast(base, FaastConfig())
    rows = []
    try:
        parts = curve_parts(domain, amounts, argparse.Namespace(parts_as_documents=False))
        for amount, (part, continues) in zip(amounts, parts, strict=True):
            if amount > args.upto:
                break
            model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size, continues=continues)
            model.solve()
            row, _ = probe(model, domain.windows)
            rows.append({"tokens": amount, **{k: row[k] for k in FAAST_FIELDS}})
            print(f"  {domain.name} FAAST {amount:,}: read {row['ppl_read']:.3f} (η {row['tuned_step']:.4g}), "
                  f"best η {row['oracle_ppl']:.3f}, best η, λ {row['joint_ppl']:.3f}", flush=True)  # fmt: skip
    finally:
        model.remove_faast()
    return rows


def lora_point(domain, base, tokens: int, last: int, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """LoRA trained afresh on the first `tokens` learned tokens at each lr of --lrs, scored after lora_epochs."""
    import torch

    from faast.hf import FaastConfig
    from faast.hf.default import DEFAULT_READOUT
    from faast.hf.evaluate import perplexity
    from faast.hf.tokens import split_by_tokens
    from faast_lab.experiments.lm_baselines import apply_lora, fit_causal_lm
    from faast_lab.experiments.lm_domains_peers import lora_rank

    rank = lora_rank(base, FaastConfig.load(DEFAULT_READOUT / "faast_config.json").middle.layers)
    prefix = split_by_tokens(domain.learn, [tokens])[0]
    marks = lora_epochs(tokens, last)
    grid: dict[str, dict[int, float]] = {}
    for lr in args.lrs:
        torch.manual_seed(0)
        lora = apply_lora(base, rank)
        scores = grid[f"{lr:g}"] = {}

        def on_epoch(epoch: int, lora=lora, scores=scores) -> bool:  # noqa: ANN001
            if epoch in marks:
                scores[epoch] = perplexity(lora, domain.windows).ppl
            return epoch >= marks[-1]

        try:
            trainable = [p for p in lora.parameters() if p.requires_grad]
            fit_causal_lm(lora, trainable, prefix, window=args.train_window, batch_size=args.train_batch_size,
                          lr=lr, epochs=marks[-1], warmup="epoch", on_epoch=on_epoch)  # fmt: skip
        finally:
            lora.unload()
        print(f"  {domain.name} LoRA {tokens:,} lr {lr:g}: "
              + ", ".join(f"{e}: {p:.3f}" for e, p in scores.items()), flush=True)  # fmt: skip
    lr, epochs, ppl = best_cell(grid)
    return {"tokens": tokens, "rank": rank, "epochs_scored": marks, "grid": grid, "best_lr": lr,
            "best_epochs": epochs, "best_ppl": ppl}  # fmt: skip


def run_domain(name: str, base, tokenizer, args: argparse.Namespace) -> dict:  # noqa: ANN001
    import torch

    torch.manual_seed(0)  # each domain as if run alone
    started = time.perf_counter()
    domain, cut = domain_stream(name, tokenizer, args)
    faast = faast_points(domain, base, args)
    row = {"domain": name, "learned": domain.learned, "scored": domain.scored, "cut_texts": cut,
           "faast": faast, "lora": []}  # fmt: skip
    if not args.no_lora:
        last = faast[-1]["tokens"]
        row["lora"] = [lora_point(domain, base, p["tokens"], last, args) for p in faast]
    row["seconds"] = time.perf_counter() - started
    return row


def falls(values: Sequence[float]) -> str:
    return "yes" if all(b < a for a, b in zip(values, values[1:], strict=False)) else "no"


def report(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = ["Held-out perplexity at each curve point. Oracles are chosen on the held-out files themselves, so they "
             "bound what any tuning could reach: FAAST's best step (λ as shipped) and best step and weight on the W "
             "it fitted; LoRA's best learning rate and epoch count, trained afresh on each prefix. Falls: lower at "
             "every point than at the one before."]  # fmt: skip
    if args.cut is not None:
        lines += ["", f"Counterfactual stream: every learned text ends before {args.cut!r}."]
    for r in rows:
        points_ = [p["tokens"] for p in r["faast"]]
        lines += ["", f"## {r['domain']}: {r['learned']:,} learned tokens in the stream, {r['scored']:,} scored"
                  + (f"; {r['cut_texts']} texts cut" if args.cut is not None else ""), ""]  # fmt: skip
        body = [["zero-shot", *(f"{p['ppl_base']:.3f}" for p in r["faast"]), ""],
                ["FAAST, as read", *(f"{p['ppl_read']:.3f} (η {p['tuned_step']:.3g})" for p in r["faast"]),
                 falls([p["ppl_read"] for p in r["faast"]])],
                ["FAAST, best η", *(f"{p['oracle_ppl']:.3f} (η {p['oracle_step']:.3g})" for p in r["faast"]),
                 falls([p["oracle_ppl"] for p in r["faast"]])],
                ["FAAST, best η and λ",
                 *(f"{p['joint_ppl']:.3f} ({p['joint_step']:.3g}, {p['joint_weight']:.2f})" for p in r["faast"]),
                 falls([p["joint_ppl"] for p in r["faast"]])]]  # fmt: skip
        if r["lora"]:
            body.append(["LoRA, best lr and epochs",
                         *(f"{p['best_ppl']:.3f} ({p['best_lr']:g}, {p['best_epochs']})" for p in r["lora"]),
                         falls([p["best_ppl"] for p in r["lora"]])])  # fmt: skip
        lines += table(["", *(f"{t:,} tokens" for t in points_), "falls"], body)
        for p in r["lora"]:
            lines += ["", f"LoRA on the first {p['tokens']:,} tokens (r={p['rank']}), perplexity after each scored "
                      "epoch:", ""]  # fmt: skip
            lines += table(["lr", *(str(e) for e in p["epochs_scored"])],
                           [[lr, *(f"{g[e]:.3f}" if e in g else "–" for e in p["epochs_scored"])]
                            for lr, g in p["grid"].items()])  # fmt: skip
        lines.append(f"\n{r['seconds']:.0f} s for this domain.")
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    return run_default_domains(args, run_domain, "Does more learned text help any learner?",
                               lambda rows: report(rows, args))  # fmt: skip


if __name__ == "__main__":
    main()
