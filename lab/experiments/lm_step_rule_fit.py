"""The document shrink's threshold and power, refitted on step-probe results: no model pass.

    python -m faast_lab.experiments.lm_step_rule_fit \
        lab/experiments/results/lm_step_probe_continues_validation_cpu.json \
        lab/experiments/results/lm_step_probe_longest1_continues_cpu.json --out lm_step_rule_fit_continues_cpu

The residual output layer multiplies the step its held-out tail tunes by min(1, (P / L)^a), L the fitted positions per
held-out text (faast.hf.output.diagnosis.document_shrink: P = 2·d, a = 0.5 today). Each tuned point of a step-probe
file (lab/experiments/lm_step_probe.py) keeps the held-out files' perplexity along a grid of steps (`curve`, the tuned
step times 2^(k/4), k = -8..8, λ at the shipped weight, W alone). From it this script reads, for every rule (P, a) of
a grid, the perplexity at the step that rule would have taken: the tail's step is the probe's tuned step divided by
the shrink the layer applied (P = 6·d, a = 0.5 when the probes ran: PROBED_THRESHOLD, PROBED_POWER; from the fitted
positions and held-out texts the probe recorded; `--tail-steps` for files written before the shrink existed, whose
tuned step is the tail's). Between grid points the log-perplexity is interpolated linearly in log η; a step off the
grid takes the nearest end and is counted.

Reported: each rule's mean perplexity change against the base model over the tuned points, per point for the shipped
rule, no shrink and the best rule, and the oracle (the step chosen on the held-out files) as the headroom; and, with
each point left out in turn, the best rule on the rest and its margin over the shipped one (how much of a margin
rests on one point). Rules are
to be chosen on validation domains only (docs/design.md §6.3).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from faast import provenance
from faast_lab.experiments._common import RESULTS, ROOT

HIDDEN = 576  # SmolLM2-135M's hidden size d, the probe's model
# The long-text shrink the probe files' layer applied, (PROBED_THRESHOLD / L)^PROBED_POWER: OutputPolicy's
# document_positions_per_dim was 6 and document_shrink_power 0.5 when they ran.
PROBED_THRESHOLD, PROBED_POWER = 6 * HIDDEN, 0.5
THRESHOLDS = (2000, 2500, 3000, 3456, 4000, 5000, 6000, 8000, 12000)  # P, fitted positions per held-out text
POWERS = (0.25, 0.5, 0.75, 1.0, 1.5)
# --folds probe files: a point takes the two-fold step (lm_step_probe.fold_steps) where it is at least R times the
# shipped one-fit step, for R in FOLD_RATIOS (1: always the two folds; inf: never, the shipped rule)
FOLD_RATIOS = (1.0, 1.2, 1.41, 1.6, 2.0, math.inf)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="step-probe JSON files whose tuned step is the shipped one")
    p.add_argument("--tail-steps", nargs="*", type=Path, default=[], help="probe files from before the shrink")
    p.add_argument(
        "--domains",
        nargs="*",
        default=["email", "multiprocessing", "licenses"],
        help="only these domains' points (default: the validation domains)",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_step_rule_fit_cpu")
    return p.parse_args(argv)


def shrink(fitted: int, documents: int, threshold: float, power: float) -> float:
    """min(1, (threshold / L)^power), L = fitted / documents: the document shrink with threshold P in positions."""
    per_document = fitted / max(documents, 1)
    return 1.0 if per_document <= threshold else (threshold / per_document) ** power


def ppl_at(curve: list[list[float]], eta: float) -> tuple[float, bool]:
    """(the perplexity at step eta read off the probe's curve [(η, ppl)] with log ppl linear in log η, whether eta
    lies within the curve's steps)."""
    steps = [math.log(c[0]) for c in curve]
    logs = [math.log(c[1]) for c in curve]
    x = math.log(eta)
    if x <= steps[0]:
        return curve[0][1], x >= steps[0] - 1e-9
    if x >= steps[-1]:
        return curve[-1][1], x <= steps[-1] + 1e-9
    k = next(i for i in range(1, len(steps)) if steps[i] >= x)
    t = (x - steps[k - 1]) / (steps[k] - steps[k - 1])
    return math.exp(logs[k - 1] + t * (logs[k] - logs[k - 1])), True


def points(files: list[Path], tail_files: list[Path], domains: list[str]) -> list[dict]:
    """The tuned points of the given probe files (of `domains`; all when empty): domain, tokens, source file,
    fitted, documents, the tail's step, base and oracle perplexity, and the curve."""
    out = []
    for path, shipped in [(f, True) for f in files] + [(f, False) for f in tail_files]:
        payload = json.loads(path.read_text(encoding="utf-8"))
        for row in payload["rows"]:
            if not row.get("tuned") or not row.get("curve") or (domains and row["domain"] not in domains):
                continue
            fitted, docs = int(row["fitted_tokens"]), int(row["held_out_documents"])
            applied = shrink(fitted, docs, PROBED_THRESHOLD, PROBED_POWER) if shipped else 1.0
            out.append({"file": path.name, "git": payload["provenance"].get("git_sha"), "domain": row["domain"],
                        "tokens": row["tokens"], "fitted": fitted, "documents": docs,
                        "tail_step": row["tuned_step"] / applied, "base": row["ppl_base"],
                        "oracle_step": row["oracle_step"], "oracle": row["oracle_ppl"],
                        "key_width": row.get("key_width"), "gap_steps": row.get("gap_steps"),
                        "fold_steps": row.get("fold_steps"),
                        "curve": row["curve"]})  # fmt: skip
    return out


def evaluate(pts: list[dict], threshold: float, power: float) -> dict:
    """Each point's step and perplexity change under the rule (threshold, power); mean change and off-grid count."""
    changes, steps, off = [], [], 0
    for p in pts:
        eta = p["tail_step"] * shrink(p["fitted"], p["documents"], threshold, power)
        ppl, inside = ppl_at(p["curve"], eta)
        off += not inside
        changes.append(ppl / p["base"] - 1)
        steps.append(eta)
    return {"threshold": threshold, "power": power, "mean": sum(changes) / len(changes), "changes": changes,
            "steps": steps, "off_grid": off}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    record = provenance.start(ROOT)
    pts = points(args.files, args.tail_steps, args.domains)
    if not pts:
        raise SystemExit("files: no tuned point with a curve in the given probe files")
    rules = [evaluate(pts, t, a) for t in THRESHOLDS for a in POWERS]
    none = evaluate(pts, math.inf, 1.0)
    shipped = evaluate(pts, PROBED_THRESHOLD, PROBED_POWER)
    best = min(rules, key=lambda r: (r["mean"], -r["threshold"]))
    oracle = sum(p["oracle"] / p["base"] - 1 for p in pts) / len(pts)
    lines = [f"{len(pts)} tuned points from {', '.join(f.name for f in [*args.files, *args.tail_steps])}. Perplexity "
             "change against the base model at the step each rule takes (W alone, λ at the shipped weight), read "
             "off the probe's curves.", "",
             f"- no shrink: {none['mean']:+.3%}; shipped (P = {PROBED_THRESHOLD}, a = {PROBED_POWER}): "
             f"{shipped['mean']:+.3%}; best "
             f"of the grid: P = {best['threshold']}, a = {best['power']}: {best['mean']:+.3%}; oracle step: "
             f"{oracle:+.3%}",
             f"- steps off the probe's grid (read at its end): shipped {shipped['off_grid']}, best {best['off_grid']}",
             "", "## Every rule: mean change", "",
             "| P \\ a | " + " | ".join(f"{a:g}" for a in POWERS) + " |", "|---|" + "---|" * len(POWERS)]  # fmt: skip
    for t in THRESHOLDS:
        cells = [r for r in rules if r["threshold"] == t]
        lines.append(f"| {t} | " + " | ".join(f"{r['mean']:+.3%}" for r in cells) + " |")
    # How much of the best rule's margin over the shipped one rests on a single point: the grid refitted without it.
    robust = []
    for i in range(len(pts)):
        rest = pts[:i] + pts[i + 1 :]
        fitted = min(
            (evaluate(rest, t, a) for t in THRESHOLDS for a in POWERS), key=lambda r: (r["mean"], -r["threshold"])
        )
        margin = fitted["mean"] - evaluate(rest, PROBED_THRESHOLD, PROBED_POWER)["mean"]
        robust.append({"left_out": i, "threshold": fitted["threshold"], "power": fitted["power"], "margin": margin})
    lines += ["", "## Leaving one point out", "",
              "The grid's best rule on the other points, and its mean change minus the shipped rule's there.", "",
              "| left out | best P, a | margin |", "|---|---|---|"]  # fmt: skip
    for r in robust:
        p = pts[r["left_out"]]
        lines.append(f"| {p['file'].removeprefix('lm_step_probe_').removesuffix('.json')} {p['domain']} "
                     f"{p['tokens']:,} | {r['threshold']}, {r['power']:g} | {r['margin']:+.3%} |")  # fmt: skip
    # The gap the tuning fit leaves before each held-out end (gap_multiple 0, 1, 2), where the probe recorded the step
    # each gap tunes (its shrink applied) and every gap kept the curve's key width.
    gaps = {}
    for p in pts:
        steps = p.get("gap_steps") or {}
        if steps and all(v["key_width"] == p["key_width"] for v in steps.values()):
            gaps[len(gaps)] = {g: ppl_at(p["curve"], v["step"])[0] / p["base"] - 1 for g, v in steps.items()}
    if gaps:
        names = sorted({g for v in gaps.values() for g in v})
        means = {g: sum(v[g] for v in gaps.values()) / len(gaps) for g in names}
        lines += ["", "## The tuning fit's gap", "",
                  f"{len(gaps)} points where every gap kept the key width: mean change "
                  + ", ".join(f"gap {g}: {means[g]:+.3%}" for g in names) + "."]  # fmt: skip
    # Where the held-out documents' ends are scored by fits that keep the other fold's ends (--folds probe files).
    folded = [p for p in pts if p.get("fold_steps")]
    folds = {}
    for ratio in FOLD_RATIOS if folded else ():
        changes = []
        for p in folded:
            one, two = p["fold_steps"]["1"]["step"], p["fold_steps"]["2"]["step"]
            changes.append(ppl_at(p["curve"], two if two >= ratio * one else one)[0] / p["base"] - 1)
        folds[str(ratio)] = {"mean": sum(changes) / len(changes), "changes": changes}
    if folds:
        lines += ["", "## Two folds where their step is at least R times the one fit's", "",
                  f"{len(folded)} points with the probe's fold steps. R = inf is the shipped rule.", "",
                  "| point | ratio | " + " | ".join(f"R = {r:g}" for r in FOLD_RATIOS) + " |",
                  "|---|---|" + "---|" * len(FOLD_RATIOS)]  # fmt: skip
        for i, p in enumerate(folded):
            ratio = p["fold_steps"]["2"]["step"] / p["fold_steps"]["1"]["step"]
            cells = " | ".join(f"{folds[str(r)]['changes'][i]:+.2%}" for r in FOLD_RATIOS)
            lines.append(f"| {p['domain']} {p['tokens']:,} | {ratio:.2f} | {cells} |")
        lines.append("| mean | | " + " | ".join(f"{folds[str(r)]['mean']:+.3%}" for r in FOLD_RATIOS) + " |")
    lines += ["", "## By point", "",
              "| file | domain | tokens | fitted / text | tail η | shipped η → change | best rule η → change | "
              "no shrink | oracle η → change |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, p in enumerate(pts):
        lines.append(f"| {p['file'].removeprefix('lm_step_probe_').removesuffix('.json')} | {p['domain']} | "
                     f"{p['tokens']:,} | {p['fitted'] / max(p['documents'], 1):,.0f} | {p['tail_step']:.4g} | "
                     f"{shipped['steps'][i]:.4g} → {shipped['changes'][i]:+.2%} | {best['steps'][i]:.4g} → "
                     f"{best['changes'][i]:+.2%} | {none['changes'][i]:+.2%} | {p['oracle_step']:.4g} → "
                     f"{p['oracle'] / p['base'] - 1:+.2%} |")  # fmt: skip
    settings = {"files": [str(f) for f in args.files], "tail_steps": [str(f) for f in args.tail_steps],
                "domains": args.domains}  # fmt: skip
    kept = [{k: v for k, v in p.items() if k != "curve"} for p in pts]
    payload = {"points": kept, "no_shrink": none, "shipped": shipped, "best": best, "rules": rules,
               "oracle_mean": oracle, "leave_one_out": robust, "gaps": gaps, "folds": folds,
               "settings": settings}  # fmt: skip
    provenance.write(args.results_dir / args.out, record, payload, "The document shrink refitted on probe curves",
                     lines)  # fmt: skip
    print("\n".join(lines))
    return payload


if __name__ == "__main__":
    main()
