"""The Markdown report and plot of experiments/lm_domains.py: per-domain tables, averages, and the goals of the LM
adaptation work judged against the same run's baselines."""

from __future__ import annotations

from pathlib import Path

from _common import table

from faast.provenance import markdown


def default_label(payload: dict) -> str:
    """The row name of FAAST's default variant in this run."""
    return payload["variants"][payload["default_variant"]]


def _find(rows: list[dict], prefix: str) -> dict | None:
    return next((r for r in rows if r["method"].startswith(prefix)), None)


def averages(payload: dict) -> list[dict]:
    """Per method (by its name in the first domain): mean reduction, learn, score time and memory over the domains."""
    out = []
    for first in payload["domains"][0]["rows"]:
        key = first["method"].split(" (")[0] if not first["method"].startswith("FAAST") else first["method"]
        found = [_find(d["rows"], key) for d in payload["domains"]]
        if any(f is None for f in found):
            continue
        n = len(found)
        out.append({"method": first["method"], "reduction": sum(f["reduction"] for f in found) / n,
                    "learn_s": sum(f["learn_s"] for f in found) / n, "score_s": sum(f["score_s"] for f in found) / n,
                    "memory_bytes": max(f["memory_bytes"] for f in found)})  # fmt: skip
    return out


def goals(payload: dict, mean: list[dict]) -> list[list[str]]:
    """[goal, measured, met] rows."""
    by = {m["method"].split(" (")[0] if not m["method"].startswith("FAAST") else m["method"]: m for m in mean}
    label = default_label(payload)
    faast = by.get(label) or next((m for name, m in by.items() if name.startswith(label)), None)
    lora, knn = by.get("LoRA"), by.get("kNN-LM")
    rows = []
    if faast and lora:
        share = faast["reduction"] / lora["reduction"] if lora["reduction"] > 0 else float("nan")
        measured = f"{100 * share:.0f}% ({100 * faast['reduction']:.1f}% vs {100 * lora['reduction']:.1f}%)"
        rows.append(["≥ 60% of LoRA's mean perplexity reduction", measured, _yes(share >= 0.6)])
        ratio = faast["learn_s"] / lora["learn_s"]
        rows.append(["learn time ≤ ½ LoRA's", f"{ratio:.2f}× ({faast['learn_s']:.0f} s vs {lora['learn_s']:.0f} s)",
                     _yes(ratio <= 0.5)])  # fmt: skip
    if faast:
        measured = f"{100 * faast['reduction']:.1f}%"
        rows.append(["≥ 8% absolute mean reduction", measured, _yes(faast["reduction"] >= 0.08)])
    key = payload["default_variant"]
    curves = [d["curve"][key] for d in payload["domains"] if d["curve"].get(key)]
    if curves:
        falling = [all(b < a for a, b in zip(c["ppl"], c["ppl"][1:], strict=False)) for c in curves]
        rows.append(["perplexity falls at every step 2K → 32K", f"{sum(falling)} / {len(falling)} domains",
                     _yes(all(falling))])  # fmt: skip
        fixed = all(len(set(c["bytes"])) == 1 for c in curves)
        sizes = sorted({b for c in curves for b in c["bytes"]})
        rows.append(["fixed state size", f"{sizes[-1] / 2**20:.2f} MB at every point", _yes(fixed)])
    if faast and knn:
        rows.append(["stretch: the kNN-LM's mean reduction", f"{100 * faast['reduction']:.1f}% vs "
                     f"{100 * knn['reduction']:.1f}%", _yes(faast["reduction"] >= knn["reduction"])])  # fmt: skip
    return rows


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _method_table(rows: list[dict]) -> list[str]:
    return table(["method", "perplexity", "change", "learn s", "score s", "memory added"], [
        [r["method"] + (" †" if r.get("imported_from") else ""),
         f"{r['ppl']:.3f}", f"{-100 * r['reduction']:+.1f}%", f"{r['learn_s']:.1f}",
         f"{r['score_s']:.1f}", f"{r['memory_bytes'] / 2**20:,.2f} MB"] for r in rows])  # fmt: skip


def report(payload: dict) -> list[str]:
    mean = averages(payload)
    record = payload.get("provenance")
    imported = any(r.get("imported_from") for d in payload["domains"] for r in d["rows"])
    lines = [f"# Test-time learning on {len(payload['domains'])} local domains: {payload['model']}", "",
             *([markdown(record), ""] if record else []),
             "Change = perplexity change against zero-shot on the held-out files (negative is better). Every method"
             " learned the same tokens in the same process" + (
                 "; rows marked † were measured on the same text and model by an earlier run"
                 " (`imported_from` in the JSON: its file, git sha and date; --baselines-from)" if imported else "")
             + ". FAAST's learn time is its learning passes and its last solve; the solves at the earlier curve"
             " points, there only to score them, are listed with the curve (LoRA and the others learn once).", "",
             f"## Goals (averages over the domains; default: {default_label(payload)})", "",
             *table(["goal", "measured", "met"], goals(payload, mean)),
             "", "## Averages", "", *_method_table([{**m, "ppl": float("nan")} for m in mean]).__iter__()]  # fmt: skip
    lines = [x.replace("| nan |", "| – |") for x in lines]
    for d in payload["domains"]:
        lines += ["", f"## {d['domain']}: learned {d['learned_tokens']:,} tokens, scored {d['scored_tokens']:,}", "",
                  *_method_table(d["rows"])]  # fmt: skip
        for key, name in [*payload["variants"].items(), ("knn", "kNN-LM")]:
            c = d["curve"].get(key)
            if c:
                steps, weights, solves = c.get("step"), c.get("weight"), c.get("solve_s")
                lines += ["", f"{name} against tokens learned: " + ", ".join(
                    f"{t:,} → {p:.3f}" + (f" (η {steps[i]:.3g}" if steps and steps[i] is not None else "")
                    + (f", λ {weights[i]:.2f}" if weights and weights[i] is not None and weights[i] < 1 else "")
                    + (")" if steps and steps[i] is not None else "")
                    + (f" [solve {solves[i]:.1f} s]" if solves else "")
                    for i, (t, p) in enumerate(zip(c["tokens"], c["ppl"], strict=True)))]  # fmt: skip
    return lines


def plot(payload: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the curves are in the JSON)")
        return
    domains = payload["domains"]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.0), squeeze=False)
    for ax, d in zip(axes[0], domains, strict=True):
        zero = d["rows"][0]["ppl"]
        for key, label in [*payload["variants"].items(), ("knn", "kNN-LM")]:
            c = d["curve"].get(key)
            if c:
                ax.plot(c["tokens"], [p / zero for p in c["ppl"]], marker="o", label=label)
        for prefix in ("LoRA", "linear"):
            r = _find(d["rows"], prefix)
            if r:
                ax.axhline(r["ppl"] / zero, linestyle=":", color="C2" if prefix == "LoRA" else "C3", label=prefix)
        ax.axhline(1.0, color="gray", linestyle="--", label="zero-shot")
        ax.set_xscale("log", base=2)
        ax.set_title(d["domain"], fontsize=9)
        ax.set_xlabel("tokens learned")
    axes[0][0].set_ylabel("perplexity / zero-shot")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Rewrite the report of a saved run: python experiments/lm_domains_report.py RESULT.json [--default output]."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("result", type=Path)
    parser.add_argument("--default", choices=("full", "output"), default=None, help="the variant judged as default")
    args = parser.parse_args(argv)
    payload = json.loads(args.result.read_text(encoding="utf-8"))
    if args.default:
        payload["default_variant"] = args.default
    write_report(payload, args.result.with_suffix(""))


def write_report(payload: dict, stem: Path) -> None:
    from faast.persist import write_text_atomic

    lines = report(payload)
    write_text_atomic(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    plot(payload, stem.with_suffix(".png"))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
