"""The token bias's prior κ and step γ, read at the shipped W and step (docs/design.md §6.3, "A token bias").

    python -m faast_lab.experiments.lm_token_bias_probe                          # the validation domains: the choice
    python -m faast_lab.experiments.lm_token_bias_probe --domains tkinter info  # other domains, for information only

Each domain is learned as lab/experiments/lm_domains.py learns it (the default model, 256-token learning windows, the
curve's parts, a text cut at a curve point continued into the next), solved after every part, and its held-out files
read once through the model's own read (lm_step_probe.read_states). From the kept states the probe forms the base
logits z0 and the memory's change per unit step z1, and reads the held-out perplexity of the mixture
(1 − λ)·softmax(z0 + b) + λ·softmax(z0 + b + η·z1) at the tuned η and λ for the token bias
b = γ·log((c + κ)/(P + κ)) on a grid of κ and γ, and without it. The grid's point at the shipped κ and γ must equal
the model's own read (`rebuilt` against `read`).

The step is the one the layer tuned (without the token bias, as it tunes); only the bias changes. κ and γ are chosen
on the validation domains alone: the report's mean over them is the choice, other domains are listed apart.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from faast_lab.experiments._common import RESULTS, add_stream_arguments, run_default_domains
from faast_lab.experiments.domains import DOMAINS, EXTRA, VALIDATION, domain_texts

CURVE = (2048, 8192, 32768)
KAPPAS = (0.01, 0.03, 0.1, 0.3, 1.0)
GAMMAS = (0.1, 0.2, 0.3, 0.4, 0.5)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", nargs="+", choices=[*VALIDATION, *DOMAINS, *EXTRA], default=list(VALIDATION))
    p.add_argument("--curve", default=",".join(map(str, CURVE)))
    add_stream_arguments(p)  # the benchmark's learned and scored tokens and windows (LoRA's go unused here)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_token_bias_probe_cpu")
    return p.parse_args(argv)


def grid_key(kappa: float, gamma: float) -> str:
    return f"κ={kappa:g},γ={gamma:g}"


def bias_grid(z0, z1, ys, step: float, weight: float, counts, mass,  # noqa: ANN001
              kappas: tuple[float, ...] = KAPPAS, gammas: tuple[float, ...] = GAMMAS) -> dict[str, float]:  # fmt: skip
    """Held-out perplexity {grid_key(κ, γ): ppl, 'none': ppl without the bias} of the mixture
    (1 − λ)·softmax(z0 + b) + λ·softmax(z0 + b + η·z1), b = γ·log((c + κ)/(P + κ)).
    z0, z1 [n, V] float32 (the base logits, the change per unit step), ys [n] int64 targets, step η and weight λ as
    tuned, counts c [V] and mass P [V] (the layer's target_count and token_mass sums over the learned positions)."""
    from faast.hf.output import tuning
    from faast.hf.output.bias import token_log_ratio

    idx = ys[:, None]
    z1_target = z1.gather(-1, idx)[:, 0]

    def ppl(bias) -> float:  # noqa: ANN001
        z = z0 if bias is None else z0 + bias.to(z0.dtype)
        return math.exp(tuning.held_out_nll((z, z1, z.gather(-1, idx)[:, 0], z1_target), step, weight))

    out = {"none": ppl(None)}
    for kappa in kappas:
        ratio = token_log_ratio(counts, mass, prior=kappa)
        for gamma in gammas:
            out[grid_key(kappa, gamma)] = ppl(gamma * ratio) if gamma > 0 else out["none"]
    return out


def point(model, windows: list[list[int]]) -> dict:  # noqa: ANN001
    """One curve point: the tuned step and weight, the model's read, and `bias_grid` over the held-out files."""
    import torch

    from faast_lab.experiments.lm_step_probe import held_out_logits, read_states

    layer = model.output_memory_layer
    step, weight = layer.chosen_step(), layer.chosen_weight()
    states = read_states(model, windows)
    hidden, ys = states[0], states[2]
    z0 = hidden @ layer.head.weight.float().T
    base = math.exp(float((torch.logsumexp(z0, -1) - z0.gather(-1, ys[:, None])[:, 0]).double().mean()))
    row = {"step": step, "weight": weight, "ppl_read": states[3], "ppl_base": base,
           "positions": float(layer.memory.count), "grid": {}}  # fmt: skip
    z1 = held_out_logits(layer, states)[1]
    if z1 is not None:  # else the memory is off, and no bias is read
        row["grid"] = bias_grid(z0, z1, ys, step, weight, layer.target_count.targets, layer.token_mass.probability)
    return row


def mean_changes(rows: list[dict], domains: tuple[str, ...] | list[str], tokens: int) -> dict[str, float]:
    """{grid key: mean over `domains`' rows at `tokens` of ppl / ppl_base − 1} (keys every such row has)."""
    chosen = [r for r in rows if r["domain"] in domains and r["tokens"] == tokens and r["grid"]]
    if not chosen:
        return {}
    keys = [k for k in chosen[0]["grid"] if all(k in r["grid"] for r in chosen)]
    return {k: sum(r["grid"][k] / r["ppl_base"] - 1 for r in chosen) / len(chosen) for k in keys}


def report(rows: list[dict], shipped: str) -> list[str]:
    head = (
        f"Held-out perplexity change against the base model at the tuned step and weight, per (κ, γ); shipped:"
        f" {shipped}. `rebuilt` is the shipped point of the grid, which must equal the model's `read`."
    )
    lines = [head, ""]
    for tokens in sorted({r["tokens"] for r in rows}):
        for label, domains in (("validation (the choice)", VALIDATION),
                               ("other domains (information only)", [*DOMAINS, *EXTRA])):  # fmt: skip
            means = mean_changes(rows, domains, tokens)
            if not means:
                continue
            best = min((k for k in means if k != "none"), key=means.get)
            present = sorted({r["domain"] for r in rows if r["domain"] in domains and r["tokens"] == tokens})
            lines += [f"### {tokens:,} learned tokens, mean over {label}: {', '.join(present)}", "",
                      "| κ \\ γ | " + " | ".join(f"{g:g}" for g in GAMMAS) + " |",
                      "|---|" + "---|" * len(GAMMAS)]  # fmt: skip
            for kappa in KAPPAS:
                cells = []
                for gamma in GAMMAS:
                    key = grid_key(kappa, gamma)
                    cell = f"{100 * means[key]:+.2f}%" if key in means else "–"
                    cells.append(f"**{cell}**" if key == best else cell)
                lines.append(f"| {kappa:g} | " + " | ".join(cells) + " |")
            lines += ["", f"Without the bias: {100 * means['none']:+.2f}%. Best: {best}.", ""]
    lines += ["### Every point", "", "| domain | tokens | base | read | rebuilt | no bias | best (κ, γ) | best |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if not r["grid"]:
            lines.append(f"| {r['domain']} | {r['tokens']:,} | {r['ppl_base']:.3f} | {r['ppl_read']:.3f} | memory off"
                         " | – | – | – |")  # fmt: skip
            continue
        best = min((k for k in r["grid"] if k != "none"), key=r["grid"].get)
        lines.append(f"| {r['domain']} | {r['tokens']:,} | {r['ppl_base']:.3f} | {r['ppl_read']:.3f} | "
                     f"{r['grid'].get(shipped, float('nan')):.3f} | {r['grid']['none']:.3f} | {best} | "
                     f"{r['grid'][best]:.3f} |")  # fmt: skip
    return lines


def shipped_key() -> str:
    """The grid key of the shipped κ (OutputPolicy().token_prior) and γ (ResidualOutput().token_bias)."""
    from faast.hf import OutputPolicy, ResidualOutput

    return grid_key(OutputPolicy().token_prior, ResidualOutput().token_bias)


def run_domain(name: str, base, tokenizer, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """{domain, points: one `point` row per curve point}: the default learned as the benchmark learns it."""
    from faast.hf import FaastConfig, apply_faast
    from faast.hf.evaluate import token_windows
    from faast.hf.tokens import split_continuing, token_lists

    learn_texts, score_texts = domain_texts(name)
    learn = token_lists(learn_texts, tokenizer, args.learn_tokens)
    windows = [w for ids in token_lists(score_texts, tokenizer, args.score_tokens)
               for w in token_windows(ids, args.window)]  # fmt: skip
    learned = sum(map(len, learn))
    curve = [int(x) for x in args.curve.split(",")]
    amounts = sorted({p for p in curve if p < learned} | {learned})
    shipped, rows = shipped_key(), []
    model = apply_faast(base, FaastConfig())
    try:
        for amount, (part, continues) in zip(amounts, split_continuing(learn, amounts), strict=True):
            if part:
                model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size,
                            continues=continues)  # fmt: skip
                model.solve()
            row = {"domain": name, "tokens": amount, **point(model, windows)}
            rows.append(row)
            grid = row["grid"]
            print(f"{name:>15} {amount:>6}: read {row['ppl_read']:.3f} rebuilt {grid.get(shipped, math.nan):.3f}"
                  f" none {grid.get('none', math.nan):.3f} base {row['ppl_base']:.3f}", flush=True)  # fmt: skip
    finally:
        model.remove_faast()
    return {"domain": name, "points": rows}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    return run_default_domains(
        args,
        run_domain,
        "The token bias's prior and step at the shipped W and step",
        lambda domains: report([p for d in domains for p in d["points"]], shipped_key()),
    )


if __name__ == "__main__":
    main()
