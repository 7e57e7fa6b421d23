"""How far the default's tuned step is from the best step for the held-out files, at every curve point.

    python experiments/lm_step_probe.py --domains email multiprocessing licenses tkinter info

For each domain the default model (FaastConfig(), as experiments/lm_domains.py runs it: the benchmark's 256-token
learning windows) learns the curve's amounts of text and solves. Its held-out files are then read once, with the
memory's own read path, and the final-norm states and the wider keys it reads are kept. From them the base logits z0
and the memory's logit change per unit step z1 (keys·W·Hᵀ, W = M/η) are formed, so the held-out perplexity of the
mixture (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1) costs no model pass for any η and λ.

Reported per point: the perplexity the model read (the check that the reconstruction is the read path), the tuned
step and what the tuning saw (how many documents the held-out tail came from, how many positions were fitted), the
held-out perplexity at multiples of the tuned step, and the oracle: η (λ held at the shipped weight) and (η, λ) both
chosen on the held-out files themselves. The oracle is not a method: it is the headroom of any step rule, and the
ratio oracle η / tuned η says in which direction and by how much the tail misleads (docs/design.md §6.3).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, ROOT  # noqa: E402
from domains import DOMAINS, EXTRA, VALIDATION, domain_texts  # noqa: E402

from faast import provenance  # noqa: E402

CURVE = (2048, 8192, 32768)
FACTORS = (0.25, 0.5, 0.71, 1.0, 1.41, 2.0)  # the report's columns
# the held-out perplexity is kept at the tuned step times 2^(k/4), k = -8..8 (any rule's step can be read off it),
# and the oracle step refined by GOLDEN golden-section steps on log η between the best point's neighbours
CURVE_STEPS = tuple(2 ** (k / 4) for k in range(-8, 9))
GOLDEN = 8
# --pairs: at the points where the step is not tuned (the default step and weight apply), the held-out perplexity on
# this grid of (η, λ): which default pair suits text the step cannot be tuned on
PAIR_STEPS = (0.02, 0.03, 0.045, 0.06, 0.09, 0.12)
PAIR_WEIGHTS = (0.1, 0.2, 0.3, 0.5)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    every = [*VALIDATION, *DOMAINS, *EXTRA]
    p.add_argument("--domains", nargs="+", choices=every, default=every)
    p.add_argument("--curve", default=",".join(map(str, CURVE)))
    p.add_argument("--learn-tokens", type=int, default=32768)
    p.add_argument("--score-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=1024, help="scoring window (tokens)")
    p.add_argument("--learn-window", type=int, default=256)
    p.add_argument("--learn-batch-size", type=int, default=8)
    p.add_argument("--pairs", action="store_true", help="at untuned points, the grid PAIR_STEPS × PAIR_WEIGHTS")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_step_probe_cpu")
    return p.parse_args(argv)


def read_states(model, windows: list[list[int]]):  # noqa: ANN001, ANN201
    """One pass over the held-out windows (one at a time) through the model's own read: (hidden [n, d] float32, extra
    [n, e] float32 or None, targets [n] int64, the model's perplexity) over every predicted position."""
    import torch

    layer = model.output_memory_layer
    kept: list[tuple] = []
    read = layer.read_logits

    def spy(hidden, logits, extra=None, *, overwrite=False):  # noqa: ANN001, ANN202
        h = hidden.detach().reshape(-1, hidden.shape[-1]).float().clone()
        e = None if extra is None else extra.detach().reshape(-1, extra.shape[-1]).float().clone()
        kept.append((h, e))
        return read(hidden, logits, extra, overwrite=overwrite)

    device = model.get_input_embeddings().weight.device
    hidden, extra, targets, nll = [], [], [], 0.0
    layer.read_logits = spy
    try:
        with torch.no_grad():
            for w in windows:
                ids = torch.tensor([w], device=device)
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                y = ids[0, 1:]
                nll -= float(torch.log_softmax(logits, -1).gather(-1, y[:, None]).sum())
                h, e = kept.pop()
                hidden.append(h[:-1])
                extra.append(None if e is None else e[:-1])
                targets.append(y.cpu())
    finally:
        del layer.read_logits
    n = sum(len(t) for t in targets)
    wide = extra[0] is not None
    return torch.cat(hidden), (torch.cat(extra) if wide else None), torch.cat(targets), math.exp(nll / n)


def probe(model, windows: list[list[int]], pairs: bool = False) -> dict:  # noqa: ANN001
    import torch

    from faast.hf import output_tuning as tuning

    layer = model.output_memory_layer
    last = dict(layer.last_tuning or {})
    eta, lam = layer.chosen_step(), layer.chosen_weight()
    started = time.perf_counter()
    hidden, extra, ys, ppl_read = read_states(model, windows)
    head = layer.head.weight.float()
    if float(getattr(layer.head, "scale", 1.0)) != 1.0:
        raise SystemExit("the probe forms logits as h·Hᵀ: a head with a logit scale is not supported")
    m, _ = layer.solution(head.device, torch.float32)
    row = {"tuned_step": eta, "tuned_weight": lam, "ppl_read": ppl_read,
           **{k: last.get(k) for k in ("tuned", "held_out_tokens", "held_out_documents", "document_gap_tokens",
                                       "fitted_tokens", "key_width")}}  # fmt: skip
    z0 = hidden @ head.T
    idx = ys[:, None]
    base = float((torch.logsumexp(z0, -1) - z0.gather(-1, idx)[:, 0]).double().mean())
    row["ppl_base"] = math.exp(base)
    if m is None:  # the memory is off: its direction is the h̃-only solve at the default step's width
        row.update(
            ppl_reconstructed=math.exp(base),
            grid={},
            curve=[],
            oracle_step=None,
            oracle_ppl=None,
            joint_step=None,
            joint_weight=None,
            joint_ppl=None,
        )
        row["probe_s"] = time.perf_counter() - started
        return row
    keys = hidden if m.shape[0] == layer.hidden_size else layer.keys(hidden, extra)
    z1 = (keys @ (m / eta)) @ head.T
    logits = (z0, z1, z0.gather(-1, idx)[:, 0], z1.gather(-1, idx)[:, 0])
    del keys
    ppl = lambda e, w: math.exp(tuning.held_out_nll(logits, e, w))  # noqa: E731
    row["ppl_reconstructed"] = ppl(eta, lam)
    row["curve"] = [(f * eta, ppl(f * eta, lam)) for f in CURVE_STEPS]
    row["grid"] = {f"{f:g}": ppl(f * eta, lam) for f in FACTORS}
    # the oracle step at the shipped weight: golden section on log η between the best curve point's neighbours
    k = min(range(len(CURVE_STEPS)), key=lambda i: row["curve"][i][1])
    lo = math.log(eta * CURVE_STEPS[k] / 2**0.25) if k > 0 else math.log(eta / 64)
    hi = math.log(eta * CURVE_STEPS[k] * 2**0.25) if k < len(CURVE_STEPS) - 1 else math.log(eta * 64)
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = ppl(math.exp(a), lam), ppl(math.exp(b), lam)
    for _ in range(GOLDEN):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = ppl(math.exp(a), lam)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = ppl(math.exp(b), lam)
    best = math.exp(a if fa < fb else b)
    row["oracle_step"], row["oracle_ppl"] = best, min(fa, fb)
    # the oracle step and weight together: the layer's own search (tune_mixture), run on the held-out files
    _, _, trace = tuning.tune_mixture(logits)
    joint = min(trace, key=lambda t: t[2])  # the best point, whether or not it passes the significance test
    row["joint_step"], row["joint_weight"], row["joint_ppl"] = joint[0], joint[1], math.exp(joint[2])
    if pairs and not last.get("tuned"):
        row["pairs"] = [(e, w, ppl(e, w)) for e in PAIR_STEPS for w in PAIR_WEIGHTS]
    row["probe_s"] = time.perf_counter() - started
    return row


def gap_steps(layer) -> dict:  # noqa: ANN001
    """The step (and key width) the layer tunes with the fit leaving out GAP_MULTIPLE × the held-out rows of each
    document before them, for GAP_MULTIPLE 0, 1 and 2 (the shipped 2); the layer is left as shipped."""
    from faast.hf import output_tuning as tuning

    shipped, out = tuning.GAP_MULTIPLE, {}
    try:
        for gap in (0, 1, 2):
            tuning.GAP_MULTIPLE = gap
            layer.restore_step(None)
            out[str(gap)] = {"step": layer.chosen_step(), "key_width": layer.chosen_key_width(),
                             "fitted_tokens": (layer.last_tuning or {}).get("fitted_tokens")}  # fmt: skip
    finally:
        tuning.GAP_MULTIPLE = shipped
        layer.restore_step(None)
        layer.chosen_step()
    return out


def summary(rows: list[dict]) -> list[str]:
    """Per domain: the perplexity change against the base model at each point as read, with the oracle step and with
    the oracle step and weight; and whether each falls at every point."""
    out = [
        "",
        "## Against the base model (perplexity change), by domain",
        "",
        "Each cell: as read (tuned) / oracle η / oracle η and λ, at each point in order.",
        "",
        "| domain | points | as read | oracle η | oracle η, λ | falls: read, η, η+λ |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["domain"] for r in rows):
        mine = [r for r in rows if r["domain"] == name]
        cols = []
        for key in ("ppl_read", "oracle_ppl", "joint_ppl"):
            values = [r[key] if r[key] is not None else r["ppl_read"] for r in mine]
            change = [f"{100 * (v / r['ppl_base'] - 1):+.1f}%" for v, r in zip(values, mine, strict=True)]
            cols.append((values, change))
        falls = ["yes" if all(b < a for a, b in zip(v, v[1:], strict=False)) else "no" for v, _ in cols]
        tokens = ", ".join(f"{r['tokens']:,}" for r in mine)
        out.append(f"| {name} | {tokens} | "
                   + " | ".join(", ".join(c) for _, c in cols) + f" | {', '.join(falls)} |")  # fmt: skip
    return out


def pair_table(rows: list[dict]) -> list[str]:
    """The (η, λ) grid at untuned points: perplexity change against the base model per domain, and the mean over
    the validation domains, the benchmark's five and the extra two."""
    out = []
    for tokens in sorted({r["tokens"] for r in rows if r.get("pairs")}):
        mine = {r["domain"]: r for r in rows if r["tokens"] == tokens and r.get("pairs")}
        groups = [(g, [n for n in group if n in mine]) for g, group in
                  (("validation", VALIDATION), ("benchmark", DOMAINS), ("extra", EXTRA))]  # fmt: skip
        groups = [(g, names) for g, names in groups if names]
        out += ["", f"## Untuned ({tokens:,} tokens learned): held-out perplexity change by default step and weight",
                "", "| η | λ | " + " | ".join(mine) + " | " + " | ".join(f"mean, {g}" for g, _ in groups) + " |",
                "|---|---|" + "---|" * (len(mine) + len(groups))]  # fmt: skip
        for i, (eta, lam, _) in enumerate(next(iter(mine.values()))["pairs"]):
            change = {n: 100 * (r["pairs"][i][2] / r["ppl_base"] - 1) for n, r in mine.items()}
            means = [sum(change[n] for n in names) / len(names) for _, names in groups]
            out.append(f"| {eta:g} | {lam:g} | " + " | ".join(f"{change[n]:+.1f}%" for n in mine) + " | "
                       + " | ".join(f"{m:+.2f}%" for m in means) + " |")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    import torch

    from faast.hf import FaastConfig, apply_faast
    from faast.hf.default import load_base_model
    from faast.hf.evaluate import token_windows
    from faast.hf.tokens import split_by_tokens, token_lists

    args = parse_args(argv)
    record = provenance.start(ROOT)
    torch.manual_seed(0)
    base, tokenizer, description = load_base_model("smollm2")
    curve = [int(x) for x in args.curve.split(",")]
    rows: list[dict] = []
    for name in args.domains:
        learn_texts, score_texts = domain_texts(name)
        learn = token_lists(learn_texts, tokenizer, args.learn_tokens)
        windows = [w for ids in token_lists(score_texts, tokenizer, args.score_tokens)
                   for w in token_windows(ids, args.window)]  # fmt: skip
        learned = sum(map(len, learn))
        amounts = sorted({p for p in curve if p < learned} | {learned})
        model = apply_faast(base, FaastConfig())
        try:
            done = 0
            for amount, part in zip(amounts, split_by_tokens(learn, amounts), strict=True):
                if part:
                    model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size)
                    model.solve()
                done = amount
                row = {"domain": name, "tokens": done, "documents": len(learn), **probe(model, windows, args.pairs)}
                row["gap_steps"] = gap_steps(model.output_memory_layer)
                rows.append(row)
                grid = " ".join(f"{k}:{v:.3f}" for k, v in row["grid"].items())
                print(f"{name:>15} {done:>6}: η {row['tuned_step']:.4g} read {row['ppl_read']:.3f} (rebuilt "
                      f"{row['ppl_reconstructed']:.3f}) base {row['ppl_base']:.3f} | {grid} | oracle η "
                      f"{row['oracle_step'] or 0:.4g} → {row['oracle_ppl'] or 0:.3f} | joint η "
                      f"{row['joint_step'] or 0:.4g} λ {row['joint_weight'] or 0:.3f} → {row['joint_ppl'] or 0:.3f}"
                      f" | tail docs "
                      f"{row['held_out_documents']} fitted {row['fitted_tokens']} | gaps "
                      f"{ {k: round(v['step'], 4) for k, v in row['gap_steps'].items()} }", flush=True)  # fmt: skip
        finally:
            model.remove_faast()
    lines = ["Perplexity on the held-out files. `read`: the model's own read; `rebuilt`: the probe's reconstruction at"
             " the same step and weight (they must agree). Columns ×f: the tuned step times f, λ at the shipped"
             " weight. Oracle: the step chosen on the held-out files themselves (λ fixed); ratio = oracle step /"
             " tuned step. Tail docs: how many learned documents the tuning's held-out rows came from.", "",
             "| domain | tokens | base | tuned η | read | rebuilt | " + " | ".join(f"×{f:g}" for f in FACTORS)
             + " | oracle η | oracle | ratio | joint η, λ | joint | tail docs | fitted |",
             "|---|---|---|---|---|---|" + "---|" * len(FACTORS) + "---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        grid = " | ".join(f"{r['grid'][f'{f:g}']:.3f}" if r["grid"] else "–" for f in FACTORS)
        ratio = f"{r['oracle_step'] / r['tuned_step']:.2f}" if r["oracle_step"] else "–"
        oracle = f"{r['oracle_step']:.4g} | {r['oracle_ppl']:.3f}" if r["oracle_step"] else "– | –"
        joint = (f"{r['joint_step']:.4g}, {r['joint_weight']:.2f} | {r['joint_ppl']:.3f}" if r["joint_ppl"]
                 else "– | –")  # fmt: skip
        lines.append(f"| {r['domain']} | {r['tokens']:,} | {r['ppl_base']:.3f} | {r['tuned_step']:.4g} | "
                     f"{r['ppl_read']:.3f} | {r['ppl_reconstructed']:.3f} | {grid} | {oracle} | {ratio} | {joint} | "
                     f"{r['held_out_documents']} | {r['fitted_tokens']} |")  # fmt: skip
    lines += summary(rows)
    if args.pairs:
        lines += pair_table(rows)
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "settings": settings, "rows": rows}
    provenance.write(args.results_dir / args.out, record, payload,
                     "The tuned step against the best step for the held-out files", lines)  # fmt: skip
    return payload


if __name__ == "__main__":
    main()
