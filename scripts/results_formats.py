"""The formatters of scripts/results_tables.py: one function per record kind, each turning the JSON records of a
section into Markdown lines (tables and a sentence or two of numbers), and the source line of a record."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


# ------------------------------------------------------------------------------------------------------- formatting
def num(x: float | None, digits: int = 3) -> str:
    """A number with thousands separators, or a dash for a missing one."""
    return "–" if x is None else f"{x:,.{digits}f}"


def pct(fraction: float | None, digits: int = 1) -> str:
    """A signed percentage with a true minus sign: -0.145 -> '−14.5%'."""
    if fraction is None:
        return "–"
    if abs(fraction) < 0.5 * 10 ** -(digits + 2):
        return f"{0:.{digits}f}%"
    return f"{fraction * 100:+.{digits}f}%".replace("-", "−")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def machine(p: dict) -> str:
    """The record's machine in words: CPU model and cores, native bfloat16, ISA flags, limits set, GPU."""
    bf16 = {True: "yes", False: "no", None: "not recorded"}[p.get("cpu_native_bf16")]
    flags = " ".join(p["cpu_flags"]) if p.get("cpu_flags") else "not recorded"
    words = f"{p.get('cpu_model')}, {p.get('physical_cores')} cores, native bfloat16 {bf16}, CPU flags {flags}"
    limits = {k: v for k, v in (p.get("environment") or {}).items() if not k.startswith("FAAST_AUTOTUNE")}
    if limits:
        words += ", " + " ".join(f"{k}={v}" for k, v in limits.items())
    if p.get("device") not in (None, "cpu"):
        words += f"; device {p['device']}"
    return words


def source(path: str, record: dict) -> str:
    """The small line under a table: the record, its machine, and the commit and date it ran at."""
    p = record.get("provenance") or {}
    sha = (p.get("git_sha") or "unknown")[:7]
    state = {True: ", dirty", False: "", None: ", tree state unknown"}[p.get("git_dirty")]
    link = f"[{Path(path).name}](../{path})"
    load = f", load {p['loadavg_at_start']} → {p['loadavg_at_end']}" if p.get("loadavg_at_start") is not None else ""
    return f"<sub>source: {link}; {machine(p)}{load}; git {sha}{state}, {str(p.get('date'))[:10]}</sub>"


# ------------------------------------------------------------------------------------- formatters, one per record kind
def fmt_demo(records: list[tuple[str, dict]]) -> list[str]:
    """One row per demo record (python -m faast.demo --json): perplexity before and after, speed, path, state."""
    rows = []
    for path, r in records:
        p, prec = r.get("provenance") or {}, r.get("precision") or {}
        path_words = f"{prec['learn_pass']} pass, {prec['head_products']} head" if prec else "not recorded"
        rows.append(
            [
                f"`{Path(path).stem}`",
                f"{p.get('cpu_model')} ×{p.get('physical_cores')}",
                path_words,
                f"{num(r['ppl_before'])} → {num(r['ppl_after'])} ({pct(-r['relative_reduction'])})",
                f"{num(r['learn_seconds'], 1)} ({num(r['learn_tokens_per_second'], 0)})",
                num(r["solve_seconds"], 1),
                num(r["state_bytes"] / 1e6, 1),
            ]
        )
    head = ["run", "CPU", "learning path", "held-out perplexity", "learn s (tokens/s)", "solve s", "state MB"]
    return table(head, rows)


def fmt_cpu_paths(records: list[tuple[str, dict]]) -> list[str]:
    """lab/benchmarks/bench_cpu_paths.py: each learning path's best rate against the float32 forward and the
    fastest."""
    (_, r), out = records[0], []
    best, forward = r["best_tokens_per_s"], r["best_tokens_per_s"].get("forward float32")
    fastest = max(v for k, v in best.items() if k != "forward float32")
    for name, rate in best.items():
        prec = r["precision"].get(name)
        what = f"pass {prec['learn_pass']}, head {prec['head_products']}" if prec else "the base model, no memory"
        out.append([name, what, num(rate, 1), num(rate / forward, 2), num(rate / fastest, 2)])
    lines = table(["path", "computes in", "tokens/s", "× float32 forward", "× fastest"], out)
    solves = ", ".join(f"{k} {num(v, 1)} s" for k, v in r["solve_s"].items())
    lines += [
        "",
        f"Learning pass: {r['tokens']:,} tokens a round, best of {len(r['rounds'])}. auto's one-time "
        f"measurement took {num(r['measuring_s'], 1)} s. Solve after {r['solve_learned_tokens']:,} tokens: "
        f"{solves}.",
    ]
    return lines


def _row(rows: list[dict], prefix: str) -> dict | None:
    return next((x for x in rows if x["method"].split(" (")[0] == prefix), None)


PEERS = {
    "LoRA, 1 epoch": "LoRA",
    "LoRA-best": "LoRA-best",
    "kNN-LM tuned": "kNN-LM tuned",
    "LoRA at FAAST's time": "LoRA at FAAST's time",
}


def _faast_rows(r: dict) -> list[str]:
    """The FAAST rows every domain has, the default first."""
    label, domains = r["variants"][r["default_variant"]], r["domains"]
    names = [x["method"] for x in domains[0]["rows"] if x["method"].startswith("FAAST")]
    names = [n for n in names if all(any(x["method"] == n for x in d["rows"]) for d in domains)]
    return sorted(names, key=lambda n: n != label)


def _short(r: dict, name: str) -> str:
    label = r["variants"][r["default_variant"]]
    return "FAAST" if name == label else "FAAST, " + name.removeprefix(label + ", ").removeprefix("FAAST: ")


def fmt_lm_domains(records: list[tuple[str, dict]]) -> list[str]:
    """Perplexity at the last curve point against every peer, then learn time and FAAST's curve."""
    (_, r), lines = records[0], []
    domains, names = r["domains"], _faast_rows(r)
    peers = {h: k for h, k in PEERS.items() if any(_row(d["rows"], k) for d in domains)}
    rows: list[list[str]] = []
    changes: dict[str, list[float | None]] = {c: [] for c in (*names, *peers)}
    for d in domains:
        by = {x["method"]: x for x in d["rows"]}
        cells = [d["domain"], num(_row_named(d, "zero-shot")["ppl"])]
        for n in names:
            cells.append(f"{num(by[n]['ppl'])} ({pct(-by[n]['reduction'])})")
            changes[n].append(by[n]["reduction"])
        for h, key in peers.items():
            peer = _row(d["rows"], key)
            steps = f", {peer['steps']} steps" if peer and key == "LoRA at FAAST's time" else ""
            cells.append(f"{num(peer['ppl'])} ({pct(-peer['reduction'])}{steps})" if peer else "–")
            changes[h].append(peer["reduction"] if peer else None)
        rows.append(cells)
    rows.append(
        [
            f"mean of {len(domains)}",
            "",
            *(pct(-sum(x or 0.0 for x in v) / len(v)) if None not in v else "–" for v in changes.values()),
        ]
    )
    lines += table(["domain", "zero-shot", *(_short(r, n) for n in names), *peers], rows) + [""]
    lines += _lm_times(r, names) + [""] + _lm_curve(r, names)
    runs = _other_runs(r)
    if runs:
        lines += ["", f"Domains measured by another process than the source line's (a resumed run): {runs}."]
    imported = sorted({x["imported_from"]["file"] for d in domains for x in d["rows"] if "imported_from" in x})
    if imported:
        lines += [
            "",
            "Rows imported from earlier runs on the same cores: " + ", ".join(f"`{f}`" for f in imported) + ".",
        ]
    return lines


def _other_runs(r: dict) -> str:
    """The domains whose `measured_by` (the process that measured them) differs from the record's provenance."""
    p, out = r.get("provenance") or {}, []
    for d in r["domains"]:
        m = d.get("measured_by") or {}
        if m and (m.get("git_sha"), m.get("cpu_model"), m.get("cpu_native_bf16")) != (
            p.get("git_sha"),
            p.get("cpu_model"),
            p.get("cpu_native_bf16"),
        ):
            bf16 = {True: "yes", False: "no", None: "not recorded"}[m.get("cpu_native_bf16")]
            out.append(
                f"{d['domain']} at git {str(m.get('git_sha'))[:7]}, {str(m.get('date'))[:10]}, "
                f"{m.get('cpu_model')}, native bfloat16 {bf16}"
            )
    return "; ".join(out)


def _lm_times(r: dict, names: list[str]) -> list[str]:
    """FAAST's learn + solve per row, as a multiple of the LoRA epoch where one is in the record, else of the first
    FAAST row's time."""
    domains = r["domains"]
    lora = [x for x in (_row(d["rows"], "LoRA") for d in domains) if x is not None]
    against = "LoRA epoch" if len(lora) == len(domains) else _short(r, names[0])
    base = (
        [x["learn_s"] for x in lora]
        if against == "LoRA epoch"
        else [_row_named(d, names[0])["learn_s"] for d in domains]
    )
    if against != "LoRA epoch" and len(names) == 1:
        return table(
            ["domain", "FAAST learn + solve s"], [[d["domain"], num(b, 1)] for d, b in zip(domains, base, strict=True)]
        )
    rows = []
    for d, b in zip(domains, base, strict=True):
        rows.append(
            [
                d["domain"],
                *(f"{num(_row_named(d, n)['learn_s'], 1)} ({_row_named(d, n)['learn_s'] / b:.2f}×)" for n in names),
                num(b, 1),
            ]
        )
    sums = [sum(_row_named(d, n)["learn_s"] for d in domains) for n in names]
    rows.append(["summed", *(f"{num(s, 1)} ({s / sum(base):.2f}×)" for s in sums), num(sum(base), 1)])
    head = [f"learn + solve s (× {against})", *(_short(r, n) for n in names), f"{against} s"]
    if against != "LoRA epoch":  # the last column repeats the first FAAST row's
        return table(head[:-1], [row[:-1] for row in rows])
    return table(head, rows)


def _row_named(d: dict, name: str) -> dict:
    return next(x for x in d["rows"] if x["method"] == name)


def _lm_curve(r: dict, names: list[str]) -> list[str]:
    """The first FAAST row's curve, and how far the other FAAST rows read from it at any curve point."""
    keys = {v: k for k, v in r["variants"].items()}
    first, others = keys[names[0]], [keys[n] for n in names[1:] if keys.get(n)]
    curves = [
        (d["domain"], d["curve"][first], [d["curve"][k] for k in others if k in d["curve"]]) for d in r["domains"]
    ]
    tokens = curves[0][1]["tokens"]
    rows = [[n, *(num(v) for v in c["ppl"]), num(max(c["solve_s"]), 1)] for n, c, _ in curves]
    lines = table([f"curve: {_short(r, names[0])}", *(f"{t:,} tokens" for t in tokens), "last solve s"], rows)
    gaps = [abs(a / b - 1) for _, c, more in curves for o in more for a, b in zip(o["ppl"], c["ppl"], strict=True)]
    if gaps:
        lines += ["", f"The other FAAST rows read within {100 * max(gaps):.3f}% of it at every curve point."]
    return lines


def fmt_lm_stream(records: list[tuple[str, dict]]) -> list[str]:
    """lab/experiments/lm_stream.py: prequential perplexity per stream and method, update time, FAAST's chunk
    latency."""
    lines = []
    for _, r in records:
        streams = list(r["streams"])
        by: dict[str, dict[str, dict]] = {}
        for x in (x for x in r["rows"] if x["stream"] in streams):
            by.setdefault(x["method"], {})[x["stream"]] = x
        rows = []
        for method, cells in by.items():
            red = [cells[s]["relative_reduction"] for s in streams if s in cells]
            row = [
                f"{num(cells[s]['ppl'])} ({pct(-cells[s]['relative_reduction'])})" if s in cells else "–"
                for s in streams
            ]
            rows.append([method, *row, pct(-sum(red) / len(red)), num(sum(c["update_s"] for c in cells.values()), 0)])
        lines += table(["method", *streams, "mean", "update s (total)"], rows)
        lat = r.get("faast_latency")
        if lat:
            lines += [
                "",
                f"FAAST's update per chunk: {num(lat['mean_s'], 2)} s on average, {num(lat['max_s'], 2)} s "
                f"at most; chunks of {r['chunk']:,} tokens, {r['limit']:,} tokens per stream.",
            ]
    return lines


def fmt_hf_overhead(records: list[tuple[str, dict]]) -> list[str]:
    """lab/benchmarks/bench_hf_overhead.py: the record's own overhead rows (learning and reading against the base)."""
    lines = []
    for _, r in records:
        for m in r.get("models", [r]):
            lines += [f"{m['model']}, batch {m['batch'][0]} × {m['batch'][1]} tokens:", ""]
            rows = [[*row[:-1], row[-1].replace("-", "−")] for row in m["overheads"]]
            lines += table(["measured", "against", "tokens/s", "its tokens/s", "change in time"], rows) + [""]
    return lines[:-1]


def fmt_serving(records: list[tuple[str, dict]]) -> list[str]:
    """lab/benchmarks/bench_serving.py: medians of every case, the ratios the goals use, switching and disk sizes."""
    (_, r), rows = records[0], []
    for name, s in r["median_s"].items():
        rows.append([name, num(s, 2)])
    lines = table(["case (8 rows × 256 tokens; generation 32 tokens)", "median s"], rows) + [""]
    ratios = [[k.replace("_", " "), num(v, 3)] for k, v in r["ratios"].items()]
    lines += table(["ratio", "value"], ratios) + [""]
    lines.append(
        f"`set_memory` once solved: {num(r['set_memory']['median_s'] * 1e3, 2)} ms (median of "
        f"{r['set_memory']['reps']}); one memory on disk {num(r['save_load']['memory_file_median_bytes'] / 1e6, 1)} "
        f"MB, one LoRA adapter {num(r['lora_adapter_bytes'] / 1e6, 1)} MB; reload bit-exact: "
        f"{r['save_load']['bit_exact']}."
    )
    return lines


def fmt_serve(records: list[tuple[str, dict]]) -> list[str]:
    """lab/benchmarks/bench_serve.py: per client count, requests/s and p50 / p95 latency with 8 memories and with the
    base model alone, and the p50 ratio the goal reads."""
    lines = []
    for _, r in records:
        rows = []
        for clients, modes in r["results"].items():
            for mode, m in modes.items():
                rows.append([clients, mode, num(m["requests_per_s"], 2), f"{m['p50_s'] * 1e3:,.0f} ms",
                             f"{m['p95_s'] * 1e3:,.0f} ms", str(m["errors"])])  # fmt: skip
        lines += table(["clients", "requests on", "requests/s", "p50 latency", "p95 latency", "errors"], rows) + [""]
        ratios = ", ".join(f"{c} client{'' if c == '1' else 's'} {num(v, 3)}" for c, v in r["p50_ratio"].items())
        lines.append(
            f"p50 latency with 8 memories / the base model alone: {ratios} (goal ≤ {r['goal']}: "
            f"{'met' if r['goal_met'] else 'not met'}); {r['requests_per_client']} requests per client of "
            f"{r['max_tokens']} tokens, {r['repeats']} rounds."
        )
    return lines


def fmt_learn(records: list[tuple[str, dict]]) -> list[str]:
    """lab/benchmarks/bench_learn.py: full learn and incremental re-solve against the authors' algorithm, and goals."""
    (_, r), rows = records[0], []
    for x in r["rows"]:
        median = {
            k: num(x[k]["median_s"]) for k in ("full_authors", "bare_pinv", "full_faast", "incr_authors", "incr_faast")
        }
        speedup = f"{x['speedup_full']:.1f}× ({x['speedup_vs_bare_pinv']:.1f}×)"
        incr = f"{median['incr_authors']} / {median['incr_faast']} ({x['speedup_incr']:.1f}×)"
        rows.append(
            [f"{x['N']:,}", x["d"], median["full_authors"], median["bare_pinv"], median["full_faast"], speedup, incr]
        )
    head = [
        "N",
        "d",
        "authors full learn s",
        "bare pinv s",
        "faast full learn s",
        "speedup (vs bare pinv)",
        "+512 rows & re-solve s: authors / faast",
    ]
    lines = table(head, rows) + [""]
    return lines + [f"Goal: {g['goal']}: {g['status']} ({g['detail']})." for g in r["goals"]]


def fmt_long_stream(records: list[tuple[str, dict]]) -> list[str]:
    """lab/benchmarks/bench_long_stream.py: relative errors of S and W and resident memory at each checkpoint."""
    (_, r), rows = records[0], []
    for x in r["result"]["reports"]:
        rows.append(
            [
                f"{x['rows']:,}",
                f"{x['rel_s_f64']:.1e}",
                f"{x['rel_w_f64']:.1e}",
                f"{x['rel_s_f32']:.1e}",
                f"{x['rel_w_f32']:.1e}",
                num(x["rss_mb"], 0),
                "yes" if x["count_exact"] else "no",
            ]
        )
    head = [
        "rows",
        "relS float64",
        "relW float64",
        "relS float32 compute",
        "relW float32 compute",
        "RSS MB",
        "count exact",
    ]
    return table(head, rows)


def fmt_classify(records: list[tuple[str, dict]]) -> list[str]:
    """bench_classify_text.py and bench_gcv_text.py: accuracy ± 95% per method and shot count, fit times."""
    (_, r), shots = records[0], list(records[0][1]["results"])
    methods = list(r["results"][shots[0]])
    rows = []
    for m in methods:
        cells = [f"{100 * r['results'][s][m]['accuracy']:.1f} ± {100 * r['results'][s][m]['ci95']:.1f}" for s in shots]
        fits = [r["results"][s][m]["fit_seconds"] for s in shots[-2:]]
        rows.append([m, *cells, " / ".join(f"{f * 1e3:.2f} ms" if f < 1 else f"{f:.2f} s" for f in fits)])
    return table(["method", *shots, f"fit time ({' / '.join(shots[-2:])})"], rows)


def fmt_rows(records: list[tuple[str, dict]], columns: dict[str, str]) -> list[str]:
    """A record's `rows` list, one column per key: ppl, sentiment and translation records."""

    def cell(x: dict, key: str) -> str:
        v: Any = x.get(key)
        if key == "accuracy":
            return pct(v).lstrip("+")
        if key == "relative_reduction":
            return pct(-v)
        if key == "ci95" and isinstance(v, list):
            return f"{100 * v[0]:.1f}–{100 * v[1]:.1f}%"
        if key == "memory_bytes":
            return num(v / 1e6, 1) if v else "–"
        if isinstance(v, float):
            return num(v, 1 if key.endswith("_s") or key == "seconds" else 3)
        return str(v)

    (_, r) = records[0]
    return table(list(columns.values()), [[cell(x, k) for k in columns] for x in r["rows"]])


def fmt_gpu_learn_stack(records: list[tuple[str, dict]]) -> list[str]:
    """lab/benchmarks/bench_learn_stack.py: learn → W of the layer stack per setting, and the solve per eigensolver."""
    (_, r), c = records[0], records[0][1]["config"]
    rows = [
        [k, num(v["update_s"]), num(v["solve_s"]), num(v["total_s"]), f"{r['authors_total_s'] / v['total_s']:.1f}×"]
        for k, v in r["end_to_end"].items()
    ]
    lines = table(["setting", "update s", "solve s", "learn → W s", "vs the authors"], rows) + [""]
    solves = [[k, num(v.get("eigh_s")), num(v["solve_s"])] for k, v in r["solve"].items()]
    lines += table([f"solve of the {c['layers']} × {c['d']} stack", "eigh s", "solve s"], solves) + [""]
    return lines + [
        f"{c['layers']} layers × d = {c['d']}, {c['tokens']:,} tokens; the authors' algorithm "
        f"{num(r['authors_total_s'], 2)} s ({r['note']})."
    ]


def fmt_lm_suite(records: list[tuple[str, dict]]) -> list[str]:
    """lab/experiments/lm_suite_report.py's merged record: each domain's change under the setting chosen on the other
    kinds (leave-one-kind-out) with its lowest curve point, one LoRA epoch's and LoRA's at FAAST's time, FAAST's time
    over LoRA's; per kind; the suite's median and worst, the goals, and every setting's change where several ran."""
    (_, r), lines = records[0], []
    loko, facts = r["loko"], r["domains"]

    def share(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.0f}%"

    def change(x: float | None) -> str:
        return "–" if x is None else pct(-x)

    def peer(domain: str, name: str) -> str:
        return change((facts[domain]["peers"].get(name) or {}).get("reduction"))

    def ratio(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}×"

    rows = [[c["domain"], c["kind"], c["setting"], change(c["reduction"]), change(facts[c["domain"]]["lowest_point"]),
             change(c["lora"]), share(c["share"]), peer(c["domain"], "LoRA at FAAST's time"),
             ratio(facts[c["domain"]]["time_ratio"])] for c in loko["choices"]]  # fmt: skip
    lines += table(["domain", "kind", "setting chosen on the other kinds", "change", "lowest curve point",
                    "1 LoRA epoch", "share", "LoRA at FAAST's time", "FAAST's time / LoRA's"], rows)  # fmt: skip
    kinds = [[k, str(len(v["domains"])), change(v["median"]), change(v["worst"]), share(v["share_median"])]
             for k, v in loko["kinds"].items()]  # fmt: skip
    lines += ["", *table(["kind", "domains", "median change", "worst change", "median share of LoRA's"], kinds), ""]
    g = r["goals"]
    lines.append(
        f"Suite of {len(loko['choices'])} domains: median change {change(loko['median'])}, worst "
        f"{change(loko['worst'])} ({loko['worst_domain']}); median share of one LoRA epoch's reduction "
        f"{share(loko['share_median'])} (goal ≥ {share(g['share_goal'])}), worst kind's "
        f"{share(loko['worst_kind_share'])} (goal ≥ {share(g['worst_kind_share_goal'])}); FAAST's learn + solve "
        f"time over one LoRA epoch's {ratio(g['time_ratio_worst'])} at worst (goal ≤ {ratio(g['time_ratio_goal'])});"
        f" lowest curve point {change(g['lowest_point'])} ({g['lowest_point_domain']}). Suite manifest "
        f"{r['suite']['manifest_sha256'][:12]}."
    )
    from faast_lab.experiments.lm_suite_report import (
        cache_lines,
        heuristic_lines,
        setting_lines,
        superseded_lines,
        tuned_peer_lines,
    )

    lines += cache_lines(r)  # the report's own lines
    lines += tuned_peer_lines(r)
    lines += superseded_lines(r)
    lines += setting_lines(r)
    if r.get("heuristics"):
        lines += ["", *heuristic_lines(r["heuristics"])]
    # A run writes each shard at its own date: runs differ by commit or machine.
    runs = {json.dumps({**x, "date": None}, sort_keys=True) for v in r.get("runs", {}).values() for x in v}
    if len(runs) > 1:
        lines.append(f"The shards were measured by {len(runs)} runs (commits or machines; each domain's in the "
                     "record's `runs`): compare times within a domain.")  # fmt: skip
    return lines


def fmt_lm_suite_timing(records: list[tuple[str, dict]]) -> list[str]:
    """lab/experiments/lm_suite_timing.py's shards, one per domain: FAAST's learn + solve over one LoRA epoch in
    each alternating round, as measured and scaled by the reference product's speed."""
    from faast_lab.experiments.lm_suite_timing import report_lines

    return report_lines([r for _, r in records])


# docs/results_sections.toml names a section's formatter by these keys (`kind`).
FORMATTERS: dict[str, Callable[..., list[str]]] = {
    "demo": fmt_demo,
    "cpu_paths": fmt_cpu_paths,
    "lm_domains": fmt_lm_domains,
    "lm_suite": fmt_lm_suite,
    "lm_suite_timing": fmt_lm_suite_timing,
    "lm_stream": fmt_lm_stream,
    "hf_overhead": fmt_hf_overhead,
    "serving": fmt_serving,
    "serve": fmt_serve,
    "learn": fmt_learn,
    "long_stream": fmt_long_stream,
    "classify": fmt_classify,
    "gpu_learn_stack": fmt_gpu_learn_stack,
    "rows": fmt_rows,
}
