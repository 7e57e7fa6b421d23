"""The Markdown report and plot of lab/experiments/lm_domains.py: per-domain tables, averages, and the goals of the LM
adaptation work judged against the same run's baselines."""

from __future__ import annotations

from pathlib import Path

from faast.provenance import markdown
from faast_lab.experiments._common import measured_by_words, several_runs, table
from faast_lab.experiments.domains import DOMAINS, EXTRA

# "Never hurts": FAAST's perplexity at most this multiple of zero-shot's, on every domain and at every curve point.
NEVER_HURTS = 1.003
# FAAST's last solve (with its step tuning) at most this many seconds.
LAST_SOLVE_S = 5.0
NOT_RUN = "not run"
# Row names (before " (") of the peers the goals compare against.
LORA, LORA_BEST, LORA_TIME, KNN = "LoRA", "LoRA-best", "LoRA at FAAST's time", "kNN-LM"
# The float32 row of a result whose variants map lacks it (lm_domains.py's VARIANTS["fp32learn"] names it now).
FP32_LEARN = "FAAST: residual output only, float32 learning pass"
# The float32 pass with the head's logits in int8 (lm_domains.py's VARIANTS["int8learn"]).
INT8_LEARN = "FAAST: residual output only, float32 learning pass, int8 head logits"
# The decoder's linears and the head's logits in int8 (lm_domains.py's VARIANTS["int8pass"]).
INT8_PASS = "FAAST: residual output only, int8 learning pass and head logits"


def default_label(payload: dict) -> str:
    """The row name of FAAST's default variant in this run."""
    return payload["variants"][payload["default_variant"]]


def method_key(method: str) -> str:
    """A row's name across domains: FAAST rows by their whole name, the others by the part before " (" (their
    settings, e.g. LoRA's rank or the tuned λ, may differ per domain)."""
    return method if method.startswith("FAAST") else method.split(" (")[0]


def _find(rows: list[dict], key: str) -> dict | None:
    """The first row whose `method_key` is exactly `key` ("LoRA" does not find "LoRA-best")."""
    return next((r for r in rows if method_key(r["method"]) == key), None)


def averages(payload: dict, names: tuple[str, ...] | None = None) -> list[dict]:
    """Per method (by its name in the first domain) found in every domain of `names` (None: all the run's): mean
    reduction, learn, tuning and score time and the largest memory over those domains ([] when none ran)."""
    domains = [d for d in payload["domains"] if names is None or d["domain"] in names]
    if not domains:
        return []
    out = []
    for first in domains[0]["rows"]:
        key = method_key(first["method"])
        found = [_find(d["rows"], key) for d in domains]
        if any(f is None for f in found):
            continue
        n = len(found)
        tuning = [f.get("tuning_s") for f in found]
        # A tuned row's settings differ per domain: the mean row names none of them.
        name = first["method"] if len({f["method"] for f in found}) == 1 else f"{key} (settings per domain)"
        out.append({"method": name, "reduction": sum(f["reduction"] for f in found) / n,
                    "learn_s": sum(f["learn_s"] for f in found) / n, "score_s": sum(f["score_s"] for f in found) / n,
                    "tuning_s": sum(tuning) / n if None not in tuning else None,
                    "memory_bytes": max(f["memory_bytes"] for f in found)})  # fmt: skip
    return out


def _not_run(goal: str, missing: str) -> list[str]:
    return [goal, f"{NOT_RUN}: no {missing}", NOT_RUN]


def _per_domain(payload: dict, *keys: str) -> tuple[list[tuple[dict, list[dict]]], list[str]]:
    """([(domain, [its row of each key])] for the domains that have them all, [names of those that do not])."""
    have, missing = [], []
    for d in payload["domains"]:
        rows = [next((r for r in d["rows"] if r["method"] == k), None) or _find(d["rows"], k) for k in keys]
        if None in rows:
            missing.append(d["domain"])
        else:
            have.append((d, rows))
    return have, missing


def _cpus(payload: dict) -> dict[str, str] | None:
    """{domain: the CPU that measured it} when the domains were measured by more than one run (a resumed run),
    else None: then seconds from different domains do not add up, and time goals compare within each domain."""
    if not several_runs(payload["domains"]):
        return None
    words = {True: "native bfloat16", False: "no native bfloat16"}
    return {d["domain"]: f"{by.get('cpu_model', '?')}, {words.get(by.get('cpu_native_bf16'), 'bfloat16 unknown')}"
            for d in payload["domains"] for by in [d.get("measured_by") or {}]}  # fmt: skip


def _half_time_row(goal: str, row: dict | None, lora: dict | None, what: str, payload: dict | None = None) -> list:
    """A goal row met when `row`'s mean learn time is at most half the 1-epoch LoRA's; "not run" (naming `what`)
    when either is missing. With domains measured on different CPUs, the mean of the per-domain ratios (each
    domain's two rows come from one run), with the largest named."""
    if not (row and lora):
        return _not_run(goal, f"{what} in every domain")
    cpus = _cpus(payload) if payload else None
    if cpus is None:
        ratio = row["learn_s"] / lora["learn_s"]
        return [goal, f"{ratio:.2f}× ({row['learn_s']:.0f} s vs {lora['learn_s']:.0f} s)", _yes(ratio <= 0.5)]
    have, _ = _per_domain(payload, method_key(row["method"]), method_key(lora["method"]))
    ratios = [(r["learn_s"] / base["learn_s"], d["domain"]) for d, (r, base) in have]
    ratio = sum(x for x, _ in ratios) / len(ratios)
    worst = max(ratios)
    return [goal, f"{ratio:.2f}× (mean of the per-domain ratios: the domains ran on different CPUs; largest "
                  f"{worst[0]:.2f}×, {worst[1]} on {cpus[worst[1]]})", _yes(ratio <= 0.5)]  # fmt: skip


def _worst_row(goal: str, entries: list[tuple], limit: float, missing: list[str], what: str, describe) -> list:  # noqa: ANN001
    """A goal row met when the largest first value of `entries` [(value, ...)] is at most `limit` and no domain is
    `missing`; `describe` words the largest entry; "not run" (naming `what`) without entries."""
    if not entries:
        return _not_run(goal, what)
    worst = max(entries, key=lambda x: x[0])
    return [goal, describe(worst) + _missing_note(missing), _yes(worst[0] <= limit and not missing)]


def _ran_as(payload: dict, key: str, head: str = "float32", learn_pass: str = "float32") -> bool:
    """Whether the row `key` ran its learning pass in `learn_pass` and its head products in `head` (its recorded
    `precision`) in every domain: the default does on a CPU without native bfloat16 (learn_dtype='auto')."""
    rows = [_find(d["rows"], key) for d in payload["domains"]]
    precisions = [(r or {}).get("precision") or {} for r in rows]
    return bool(rows) and all(p.get("learn_pass") == learn_pass and p.get("head_products") == head
                              for p in precisions)  # fmt: skip


def _missing_note(missing: list[str]) -> str:
    return f"; {NOT_RUN} on {', '.join(missing)}" if missing else ""


def goals(payload: dict, mean: list[dict]) -> list[list[str]]:
    """[goal, measured, met] rows, every goal always listed: one whose rows or curves are missing says "not run" and
    is not met. `mean`: `averages` over all the run's domains."""
    by = {method_key(m["method"]): m for m in mean}
    label = default_label(payload)
    # A default row named with more after its label (older runs), never another variant's row (e.g. the float32 one).
    others = set(payload["variants"].values()) - {label}
    faast = by.get(label) or next((m for n, m in by.items() if n.startswith(label) and n not in others), None)
    lora, lora_best, knn = by.get(LORA), by.get(LORA_BEST), by.get(KNN)
    fp32 = by.get(payload["variants"].get("fp32learn", FP32_LEARN))
    default_is_fp32 = fp32 is None and faast is not None and _ran_as(payload, method_key(faast["method"]))
    if default_is_fp32:  # on a CPU without native bfloat16 the default runs what the float32 row would
        fp32 = faast
    int8 = by.get(payload["variants"].get("int8learn", INT8_LEARN))
    default_is_int8 = int8 is None and faast is not None and _ran_as(payload, method_key(faast["method"]), "int8")
    if default_is_int8:  # ... or, with AVX2 before 'auto' took the int8 pass, what the int8-head row would
        int8 = faast
    int8_pass = by.get(payload["variants"].get("int8pass", INT8_PASS))
    default_is_int8_pass = (
        int8_pass is None and faast is not None and _ran_as(payload, method_key(faast["method"]), "int8", "int8")
    )
    if default_is_int8_pass:  # ... or, with AVX2 now, what the int8-pass row would
        int8_pass = faast
    key = payload["default_variant"]
    rows = []

    goal = "≥ 60% of LoRA's mean perplexity reduction"
    if faast and lora:
        rows.append([goal, *_share(faast["reduction"], lora["reduction"], 0.6)])
    else:
        rows.append(_not_run(goal, "FAAST default or 1-epoch LoRA rows in every domain"))
    rows.append(_half_time_row("learn time ≤ ½ LoRA's", faast, lora, "FAAST default or 1-epoch LoRA rows", payload))
    goal = "≥ 8% absolute mean reduction"
    if faast:
        rows.append([goal, f"{100 * faast['reduction']:.1f}%", _yes(faast["reduction"] >= 0.08)])
    else:
        rows.append(_not_run(goal, "FAAST default row in every domain"))

    # (a) every domain: the default beats LoRA trained for FAAST's own learn + solve time.
    goal = "beats LoRA at FAAST's time on every domain"
    have, missing = _per_domain(payload, label, LORA_TIME)
    if have:
        wins = [f["ppl"] < t["ppl"] for _, (f, t) in have]
        d, (f, t) = max(have, key=lambda x: x[1][0]["ppl"] / x[1][1]["ppl"])
        measured = (f"{sum(wins)} / {len(payload['domains'])} domains (closest: {d['domain']}, {f['ppl']:.3f} vs"
                    f" {t['ppl']:.3f})" + _missing_note(missing))  # fmt: skip
        rows.append([goal, measured, _yes(all(wins) and not missing)])
    else:
        rows.append(_not_run(goal, "LoRA at FAAST's time rows" if payload["domains"] else "domains"))
    # (b) the mean reduction against LoRA tuned on the same held-out tail.
    for goal, least in (("≥ 90% of LoRA-best's mean reduction", 0.9), ("stretch: ≥ 100% of LoRA-best's mean"
                                                                         " reduction", 1.0)):  # fmt: skip
        if faast and lora_best:
            rows.append([goal, *_share(faast["reduction"], lora_best["reduction"], least)])
        else:
            rows.append(_not_run(goal, "FAAST default or LoRA-best rows in every domain"))
    # (c) never hurts: at every curve point of every domain.
    goal = f"never hurts: perplexity ≤ zero-shot × {NEVER_HURTS} at every point"
    points, missing = [], []
    for d in payload["domains"]:
        zero, curve, row = _find(d["rows"], "zero-shot"), d["curve"].get(key), _find(d["rows"], label)
        if zero is None or not curve or row is None:
            missing.append(d["domain"])
            continue
        points += [(p / zero["ppl"], d["domain"], t) for t, p in zip(curve["tokens"], curve["ppl"], strict=True)]
        points.append((row["ppl"] / zero["ppl"], d["domain"], d["learned_tokens"]))
    rows.append(_worst_row(goal, points, NEVER_HURTS, missing, "FAAST default curves",
                           lambda w: f"worst {100 * (w[0] - 1):+.2f}% ({w[1]}, {w[2]:,} tokens)"))  # fmt: skip
    # (d) the curve falls at every step, on every domain.
    goal = "perplexity falls at every step 2K → 32K"
    curves = [d["curve"][key] for d in payload["domains"] if d["curve"].get(key)]
    missing = [d["domain"] for d in payload["domains"] if not d["curve"].get(key)]
    if curves:
        falling = [all(b < a for a, b in zip(c["ppl"], c["ppl"][1:], strict=False)) for c in curves]
        rows.append([goal, f"{sum(falling)} / {len(payload['domains'])} domains" + _missing_note(missing),
                     _yes(all(falling) and not missing)])  # fmt: skip
        fixed = all(len(set(c["bytes"])) == 1 for c in curves)
        sizes = sorted({b for c in curves for b in c["bytes"]})
        rows.append(["fixed state size", f"{sizes[-1] / 2**20:.2f} MB at every point", _yes(fixed)])
    else:
        rows += [_not_run(goal, "FAAST default curves"), _not_run("fixed state size", "FAAST default curves")]
    # (e) the float32 learning pass (learn + solve) against one epoch of LoRA.
    rows.append(_half_time_row("float32-learn learn time ≤ ½ the 1-epoch LoRA's", fp32, lora,
                               "float32-learn or 1-epoch LoRA rows", payload))  # fmt: skip
    if default_is_fp32 and rows[-1][2] != "not run":
        rows[-1][1] += "; the default row, which learned in float32 in every domain"
    rows.append(_half_time_row("float32 pass, int8 head logits: learn time ≤ ½ the 1-epoch LoRA's", int8, lora,
                               "int8-head or 1-epoch LoRA rows", payload))  # fmt: skip
    if default_is_int8 and rows[-1][2] != "not run":
        rows[-1][1] += "; the default row, which learned in float32 with int8 head logits in every domain"
    rows.append(_half_time_row("int8 pass and head logits: learn time ≤ ½ the 1-epoch LoRA's", int8_pass, lora,
                               "int8-pass or 1-epoch LoRA rows", payload))  # fmt: skip
    if default_is_int8_pass and rows[-1][2] != "not run":
        rows[-1][1] += "; the default row, which learned with the int8 pass and head logits in every domain"
    # (f) the last solve, with its step tuning, on every domain.
    goal = f"last solve ≤ {LAST_SOLVE_S:g} s"
    solves = [(d["curve"][key]["solve_s"][-1], d["domain"]) for d in payload["domains"]
              if (d["curve"].get(key) or {}).get("solve_s")]  # fmt: skip
    missing = [d["domain"] for d in payload["domains"] if not (d["curve"].get(key) or {}).get("solve_s")]
    cpus = _cpus(payload)
    where = (lambda name: f"{name}, on {cpus[name]}") if cpus else str  # noqa: E731 - seconds differ by CPU
    rows.append(_worst_row(goal, solves, LAST_SOLVE_S, missing, "FAAST default solve times",
                           lambda w: f"max {w[0]:.2f} s ({where(w[1])})"))  # fmt: skip
    goal = "stretch: the kNN-LM's mean reduction"
    if faast and knn:
        rows.append([goal, f"{100 * faast['reduction']:.1f}% vs {100 * knn['reduction']:.1f}%",
                     _yes(faast["reduction"] >= knn["reduction"])])  # fmt: skip
    else:
        rows.append(_not_run(goal, "FAAST default or kNN-LM rows in every domain"))
    return rows


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _share(mine: float, peer: float, least: float) -> tuple[str, str]:
    """(measured, met) for "mine reaches at least `least` of peer's mean reduction". Where the peer gains nothing on
    average (its reduction ≤ 0) no share exists; the goal is then met when mine ≥ least·peer, which any gain does."""
    pair = f"{100 * mine:.1f}% vs {100 * peer:.1f}%"
    measured = f"{100 * mine / peer:.0f}% ({pair})" if peer > 0 else f"no share: the peer gains nothing ({pair})"
    return measured, _yes(mine >= least * peer)


def _method_table(rows: list[dict]) -> list[str]:
    return table(["method", "perplexity", "change", "learn s", "tuning s", "score s", "memory added"], [
        [r["method"] + (" †" if r.get("imported_from") else ""),
         f"{r['ppl']:.3f}", f"{-100 * r['reduction']:+.1f}%", f"{r['learn_s']:.1f}",
         f"{r['tuning_s']:.1f}" if r.get("tuning_s") is not None else "–",
         f"{r['score_s']:.1f}", f"{r['memory_bytes'] / 2**20:,.2f} MB"] for r in rows])  # fmt: skip


def _averages_sections(payload: dict, mean: list[dict]) -> list[str]:
    """The averages over all the run's domains, then over its benchmark domains and over its extra ones apart (each
    group when the run has some of it and other domains too)."""
    names = [d["domain"] for d in payload["domains"]]
    rows = [{**m, "ppl": float("nan")} for m in mean]
    lines = [f"## Averages over all {len(names)} domains", ""]
    cpus = _cpus(payload)
    if cpus:
        machines = "; ".join(f"{', '.join(n for n, c in cpus.items() if c == cpu)} on {cpu}"
                             for cpu in dict.fromkeys(cpus.values()))  # fmt: skip
        lines += [f"The domains were measured on different CPUs ({machines}): the mean seconds mix them; compare"
                  " times within a domain.", ""]  # fmt: skip
    lines += _method_table(rows)
    for title, group in (("the benchmark domains", DOMAINS), ("the extra domains (chosen after the settings)", EXTRA)):
        chosen = tuple(n for n in names if n in group)
        if chosen and len(chosen) < len(names):
            rows = [{**m, "ppl": float("nan")} for m in averages(payload, chosen)]
            lines += ["", f"## Averages over {title}: {', '.join(chosen)}", "", *_method_table(rows)]
    return lines


def _measured_line(domain: dict, payload: dict) -> list[str]:
    """Names the run and CPU of a domain when the domains were not all measured by one run (a resumed run)."""
    if not several_runs(payload["domains"]) or not domain.get("measured_by"):
        return []
    words = measured_by_words(domain["measured_by"])
    return [f"Measured by {words}; its times compare with this domain's rows only.", ""]


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
             " points, there only to score them, are listed with the curve (LoRA and the others learn once). The"
             " tuned peers (LoRA-best, kNN-LM tuned) choose their settings on the held-out tail FAAST tunes its step"
             " on; their tuning is in its own column, their learn time is the final training's.", "",
             f"## Goals (averages over the domains; default: {default_label(payload)})", "",
             *table(["goal", "measured", "met"], goals(payload, mean)),
             "", *_averages_sections(payload, mean)]  # fmt: skip
    lines = [x.replace("| nan |", "| – |") for x in lines]
    for d in payload["domains"]:
        lines += ["", f"## {d['domain']}: learned {d['learned_tokens']:,} tokens, scored {d['scored_tokens']:,}", "",
                  *_measured_line(d, payload), *_method_table(d["rows"])]  # fmt: skip
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
        for prefix, color in ((LORA, "C2"), ("linear", "C3"), (LORA_BEST, "C4")):
            r = _find(d["rows"], prefix)
            if r:
                ax.axhline(r["ppl"] / zero, linestyle=":", color=color, label=prefix)
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
    """Rewrite the report of a saved run:
    python -m faast_lab.experiments.lm_domains_report RESULT.json [--default output]."""
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
