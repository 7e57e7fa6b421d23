"""Which held-out tokens FAAST and LoRA gain on, and where LoRA at FAAST's time would stand a step earlier or later.

    python -m faast_lab.experiments.lm_token_gain --domains tkinter asyncio info \\
        --baselines-from lab/experiments/results/lm_domains_fair_peers_cpu.json

Per domain, as lab/experiments/lm_domains.py runs it (the same texts, 256-token learning windows, the curve's three
learn calls with a solve after each): the default FAAST learns the text, and its learn time as lm_domains counts it
(every learning pass and the last solve) is the budget.
LoRA (the benchmark's rank, LoRA-best's learning rate from --baselines-from, else --lora-lr; warmup over one epoch's
10%) then trains, and is scored after every step from --first-step to --last-step. The step at which the budget
runs out is LoRA at FAAST's time; the curve around it shows how much that comparison turns on where it stops.

Every scored position's negative log-likelihood is kept for the base model, FAAST and LoRA at FAAST's time, and
the gain (base NLL − method NLL, summed over a category, divided by all scored positions, so the categories add up
to the total) is split by what the target token is: how often it occurs in the learned text, whether it occurred
earlier in its scoring window, and whether it is whitespace only (`categories`).

--curve also scores FAAST after each curve point (2K, 8K, 32K tokens) and splits its gain there the same way: where
the curve rises, which tokens lose. --no-lora leaves LoRA out.

--lora-seeds trains LoRA once per seed (its initialisation and its window order), each scored at the same steps, so
that the verdict at FAAST's time can be read against LoRA's own run-to-run spread rather than one draw. The gain split
is the first seed's. FAAST has no seed: its learning and its step are deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from faast_lab.experiments._common import RESULTS, add_stream_arguments, run_default_domains
from faast_lab.experiments.domains import DOMAINS, EXTRA, VALIDATION

# Occurrences of the target token in the learned text: [low, high) per category.
COUNT_BUCKETS = ((0, 1), (1, 10), (10, 100), (100, math.inf))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", nargs="+", choices=(*DOMAINS, *EXTRA, *VALIDATION), default=["tkinter"])
    add_stream_arguments(p)
    p.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA's lr where --baselines-from has no LoRA-best")
    p.add_argument(
        "--baselines-from",
        type=Path,
        default=None,
        help="an lm_domains result JSON: LoRA-best's lr per domain (as lm_domains' LoRA at FAAST's time)",
    )
    p.add_argument("--curve", action="store_true", help="also score FAAST at every curve point (2K, 8K, 32K)")
    p.add_argument("--no-lora", action="store_true", help="FAAST alone (no LoRA rows)")
    p.add_argument("--lora-seeds", type=int, nargs="+", default=[0], help="LoRA's seeds (init and window order)")
    p.add_argument("--first-step", type=int, default=4)
    p.add_argument("--last-step", type=int, default=14)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_token_gain_cpu")
    args = p.parse_args(argv)
    if not 1 <= args.first_step <= args.last_step:
        p.error(f"--first-step, --last-step: expected 1 <= first <= last, got {args.first_step}, {args.last_step}")
    return args


def token_nll(model, windows: Sequence[Sequence[int]]):  # noqa: ANN001, ANN201 - torch.Tensor
    """Each scored position's negative log-likelihood, float64 [Σ (len(w) − 1)], windows in order: what
    faast.hf.evaluate.perplexity averages (its perplexity is exp of this mean)."""
    import torch

    out = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([list(w)])
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].double()
            out.append(-torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def categories(windows: Sequence[Sequence[int]], learned: Sequence[Sequence[int]], whitespace: set[int]) -> dict:
    """Boolean masks [Σ (len(w) − 1)] over the scored positions, by the target token (windows[i][t + 1]): its count
    in the learned texts (COUNT_BUCKETS), whether it occurs earlier in its own window (positions 0..t), and whether
    it is in `whitespace` (ids that decode to whitespace only)."""
    import torch

    counts = Counter(t for ids in learned for t in ids)
    targets, before = [], []
    for w in windows:
        seen: set[int] = set()
        for t in range(1, len(w)):
            seen.add(w[t - 1])
            targets.append(w[t])
            before.append(w[t] in seen)
    n = torch.tensor([counts[t] for t in targets], dtype=torch.float64)
    masks = {"all": torch.ones(len(targets), dtype=torch.bool)}
    for low, high in COUNT_BUCKETS:
        label = "unseen in the learned text" if high == 1 else f"learned {low}–{high - 1}×" if high < math.inf \
            else f"learned ≥ {low}×"  # fmt: skip
        masks[label] = (n >= low) & (n < high)
    masks["earlier in its window"] = torch.tensor(before, dtype=torch.bool)
    masks["not earlier in its window"] = ~masks["earlier in its window"]
    masks["whitespace only"] = torch.tensor([t in whitespace for t in targets], dtype=torch.bool)
    return masks


def gain_table(base, methods: dict, masks: dict) -> list[dict]:  # noqa: ANN001
    """Per category: share of positions, the base model's mean NLL there, and per method the gain in nats summed over
    the category and divided by all positions (so the categories of one partition add up to 'all')."""
    total = base.numel()
    rows = []
    for name, m in masks.items():
        row = {"category": name, "share": float(m.double().mean()), "base_nll": float(base[m].mean()) if m.any()
               else float("nan")}  # fmt: skip
        for method, nll in methods.items():
            row[method] = float((base - nll)[m].sum() / total)
        rows.append(row)
    return rows


def lora_lr(args: argparse.Namespace, domain: str) -> tuple[float, str]:
    """LoRA-best's lr for `domain` from --baselines-from (its row's tuned lr), else --lora-lr."""
    if args.baselines_from is not None:
        data = json.loads(args.baselines_from.read_text(encoding="utf-8"))
        for d in data["domains"]:
            if d["domain"] != domain:
                continue
            for r in d["rows"]:
                lr = (r.get("tuned") or {}).get("lr")
                if r["method"].startswith("LoRA-best (") and lr:
                    return float(lr), f"LoRA-best in {args.baselines_from.name}"
    return args.lora_lr, "--lora-lr"


def run_domain(name: str, base, tokenizer, args: argparse.Namespace) -> dict:  # noqa: ANN001
    import torch

    from faast.hf import FaastConfig, apply_faast
    from faast.hf.default import DEFAULT_READOUT
    from faast_lab.experiments.lm_domains import CURVE, Domain, curve_parts, points
    from faast_lab.experiments.lm_domains_peers import lora_rank

    torch.manual_seed(0)  # each domain as if run alone
    dargs = argparse.Namespace(**vars(args), parts_as_documents=False)  # lm_domains' protocol: a cut text continues
    domain = Domain(name, tokenizer, dargs)
    base_nll = token_nll(base, domain.windows)
    scored_ids = {t for w in domain.windows for t in w}
    whitespace = {t for t in scored_ids if tokenizer.decode([t]).strip() == ""}
    masks = categories(domain.windows, domain.learn, whitespace)
    model = apply_faast(base, FaastConfig())
    # The budget is lm_domains' learn time: every part's learning pass and the last solve. The solves at the earlier
    # curve points exist only to score them, and scoring is left out.
    budget, along = 0.0, []  # --curve: FAAST at each curve point
    try:
        amounts = points(domain.learned, CURVE)
        for amount, (part, continues) in zip(amounts, curve_parts(domain, amounts, dargs), strict=True):
            started = time.perf_counter()
            model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size, continues=continues)
            learned = time.perf_counter()
            model.solve()
            budget += learned - started + (time.perf_counter() - learned if amount == amounts[-1] else 0.0)
            if args.curve or amount == amounts[-1]:
                nll = token_nll(model, domain.windows)
                tuning = model.output_memory_layer.last_tuning or {}
                along.append({"tokens": amount, "ppl": math.exp(float(nll.mean())), "step": tuning.get("step"),
                              "tuned": bool(tuning.get("tuned")), "nll": nll})  # fmt: skip
    finally:
        model.remove_faast()
    faast_nll = along[-1]["nll"]
    row = {"domain": name, "scored": base_nll.numel(), "ppl_base": math.exp(float(base_nll.mean())),
           "ppl_faast": along[-1]["ppl"], "faast_step": along[-1]["step"], "budget_s": budget, "lora": None,
           "gains": gain_table(base_nll, {"faast": faast_nll}, masks)}  # fmt: skip
    if args.curve:
        row["curve"] = [{k: v for k, v in p.items() if k != "nll"} for p in along]
        row["curve_gains"] = gain_table(base_nll, {f"{p['tokens']}": p["nll"] for p in along}, masks)
    if args.no_lora:
        print(f"{name}: FAAST {row['ppl_faast']:.3f} in {budget:.1f} s", flush=True)
        return row
    lr, lr_from = lora_lr(args, name)
    # The benchmark's rank: LoRA's parameters match a linear projection at the shipped readout's middle layers.
    rank = lora_rank(base, FaastConfig.load(DEFAULT_READOUT / "faast_config.json").middle.layers)
    runs = [lora_run(base, domain, rank, lr, seed, budget, args) for seed in args.lora_seeds]
    first = runs[0]
    row["lora"] = {"rank": rank, "lr": lr, "lr_from": lr_from, "curve": first["curve"], "at_time": first["at_time"],
                   "seeds": [{k: v for k, v in run.items() if k != "kept"} for run in runs]}  # fmt: skip
    if len(runs) > 1:
        row["lora"]["over_seeds"] = seed_summary(row["lora"]["seeds"], row["ppl_faast"])
    kept, at_time, curve = first["kept"], first["at_time"], first["curve"]
    row["gains"] = gain_table(base_nll, {"faast": faast_nll, "lora": kept[at_time]}, masks)
    print(f"{name}: FAAST {row['ppl_faast']:.3f} in {budget:.1f} s; LoRA "
          + ", ".join(f"{c['steps']}: {c['ppl']:.3f}" for c in curve), flush=True)  # fmt: skip
    return row


def lora_run(base, domain, rank: int, lr: float, seed: int, budget: float, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """One LoRA, torch and its window order seeded with `seed`, trained as lm_domains' LoRA at FAAST's time trains it
    and scored after every step from --first-step to --last-step: {seed, curve: [{steps, seconds, ppl}], at_time: the
    last scored step whose training ended within `budget` seconds (at least the first), kept: {steps: NLL [n]}}."""
    import torch

    from faast_lab.experiments.lm_baselines import apply_lora, fit_causal_lm
    from faast_lab.experiments.lm_domains_peers import TIME_EPOCHS

    torch.manual_seed(seed)
    lora = apply_lora(base, rank)
    curve, kept, clock = [], {}, {"trained": 0.0, "since": time.perf_counter()}

    def on_step(n: int) -> bool:
        clock["trained"] += time.perf_counter() - clock["since"]  # the scoring below is not training time
        if n >= args.first_step:
            nll = token_nll(lora, domain.windows)
            curve.append({"steps": n, "seconds": clock["trained"], "ppl": math.exp(float(nll.mean()))})
            kept[n] = nll
        clock["since"] = time.perf_counter()
        return n >= args.last_step

    try:
        trainable = [p for p in lora.parameters() if p.requires_grad]
        fit_causal_lm(lora, trainable, domain.learn, window=args.train_window, batch_size=args.train_batch_size,
                      lr=lr, epochs=TIME_EPOCHS, warmup="epoch", on_step=on_step, seed=seed)  # fmt: skip
    finally:
        lora.unload()
    # LoRA at FAAST's time: the steps whose training ends within the budget (at least the first scored one).
    fits = [c["steps"] for c in curve if c["seconds"] <= budget] or [curve[0]["steps"]]
    print(f"  LoRA seed {seed}: " + ", ".join(f"{c['steps']}: {c['ppl']:.3f}" for c in curve), flush=True)
    return {"seed": seed, "curve": curve, "at_time": fits[-1], "kept": kept}


def seed_summary(seeds: list[dict], faast_ppl: float) -> dict:
    """LoRA over its seeds against FAAST's perplexity: per step count scored in every seed, the seeds' perplexities
    and their mean and sample standard deviation; at FAAST's time (each seed at its own `at_time`), the same, and in
    how many seeds FAAST is ahead (its perplexity strictly lower)."""

    def spread(values: list[float]) -> dict:
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        return {"ppl": values, "mean": mean, "sd": sd}

    by_steps = [{c["steps"]: c["ppl"] for c in s["curve"]} for s in seeds]
    common = sorted(set.intersection(*(set(b) for b in by_steps)))
    at_time = [b[s["at_time"]] for b, s in zip(by_steps, seeds, strict=True)]
    return {"steps": [{"steps": n, **spread([b[n] for b in by_steps])} for n in common],
            "at_time": {"steps": [s["at_time"] for s in seeds], **spread(at_time),
                        "faast_ahead": sum(faast_ppl < p for p in at_time)}}  # fmt: skip


def report(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        lo = r["lora"]
        lines += [f"## {r['domain']}: {r['scored']:,} scored positions", "",
                  f"zero-shot {r['ppl_base']:.3f}; FAAST {r['ppl_faast']:.3f} (step {r['faast_step']:.4g}) after "
                  f"{r['budget_s']:.1f} s of learning and solving."]  # fmt: skip
        if "curve" in r:
            lines += ["", "FAAST along the curve: gain in nats per scored position (base NLL − FAAST NLL, summed over"
                      " the category, over all positions; the categories count the target in all the learned text):",
                      "", "| target token | share | base NLL | "
                      + " | ".join(f"{p['tokens']:,} tokens (η {p['step']:.3g})" for p in r["curve"]) + " |",
                      "|---|---|---|" + "---|" * len(r["curve"])]  # fmt: skip
            for g in r["curve_gains"]:
                lines.append(f"| {g['category']} | {g['share']:.3f} | {g['base_nll']:.3f} | "
                             + " | ".join(f"{g[str(p['tokens'])]:+.4f}" for p in r["curve"]) + " |")  # fmt: skip
        if lo is None:
            lines.append("")
            continue
        lines += [
            "",
            f"LoRA r={lo['rank']}, lr {lo['lr']:g} ({lo['lr_from']}): {lo['at_time']} steps fit FAAST's time.",
            "",
            "| LoRA steps | training s | perplexity | against FAAST |",
            "|---|---|---|---|",
        ]
        for c in lo["curve"]:
            mark = " ← FAAST's time" if c["steps"] == lo["at_time"] else ""
            lines.append(f"| {c['steps']}{mark} | {c['seconds']:.1f} | {c['ppl']:.3f} | "
                         f"{'FAAST ahead' if r['ppl_faast'] < c['ppl'] else 'LoRA ahead'} |")  # fmt: skip
        over = lo.get("over_seeds")
        if over is not None:
            seeds = [s["seed"] for s in lo["seeds"]]
            t = over["at_time"]
            head = "| LoRA steps | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd | against FAAST |"
            lines += ["", f"LoRA over {len(seeds)} seeds (its initialisation and window order); FAAST "
                          f"{r['ppl_faast']:.3f}:", "", head,
                      "|---|" + "---|" * (len(seeds) + 2)]  # fmt: skip
            for c in over["steps"]:
                lines.append(f"| {c['steps']} | " + " | ".join(f"{p:.3f}" for p in c["ppl"])
                             + f" | {c['mean']:.3f} ± {c['sd']:.3f} | "
                             f"{'FAAST ahead' if r['ppl_faast'] < c['mean'] else 'LoRA ahead'} |")  # fmt: skip
            lines += ["", f"At FAAST's time (steps per seed: {', '.join(map(str, t['steps']))}): LoRA "
                          f"{t['mean']:.3f} ± {t['sd']:.3f} on the mean; FAAST ({r['ppl_faast']:.3f}) ahead in "
                          f"{t['faast_ahead']} of {len(seeds)} seeds."]  # fmt: skip
        lines += ["", f"Gain in nats per scored position (base NLL − method NLL, summed over the category, over all "
                      f"{r['scored']:,} positions), FAAST against LoRA at {lo['at_time']} steps:", "",
                  "| target token | share | base NLL | FAAST gain | LoRA gain | LoRA − FAAST |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for g in r["gains"]:
            lines.append(f"| {g['category']} | {g['share']:.3f} | {g['base_nll']:.3f} | {g['faast']:.4f} | "
                         f"{g['lora']:.4f} | {g['lora'] - g['faast']:+.4f} |")  # fmt: skip
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    return run_default_domains(args, run_domain, "Which held-out tokens gain, and LoRA around FAAST's time", report)


if __name__ == "__main__":
    main()
