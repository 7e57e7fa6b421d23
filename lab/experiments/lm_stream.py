"""Learn while reading (issue 35): a long token stream read in chunks, each chunk scored with what was learned from
the chunks before it (prequentially), then learned; FAAST against the streaming baselines, token for token.

    bash scripts/experiment.sh lm_stream                                   # five streams, 32K tokens, 1024 a chunk
    bash scripts/experiment.sh lm_stream --streams stdlib --limit 3072 --validation-limit 2048 --out smoke

Streams (each read in natural order: sorted files, concatenated with blank lines, tokenised once, the first --limit
tokens): `stdlib` (the stdlib package asyncio), `perl` (Perl modules), `man` (section 1 manual pages), `licences`
(Debian copyright files), `longfile` (the single file tkinter/__init__.py); or --text-files, read in the given order
as one stream. The file lists are lab/experiments/domains.py's; unreadable, empty and duplicate files are skipped.

Methods, every one scoring the windows of faast.hf.reading.chunk_windows (lab/experiments/lm_baselines/stream.py):
zero-shot; faast (read_stream: learns each chunk from its scoring pass, tunes itself on text already read); dynamic
evaluation (Krause et al., 2018) of LoRA adapters (rank --lora-rank) or of the last --blocks blocks and the final
norm; the neural cache (Grave et al., 2017); the kNN-LM whose datastore grows chunk by chunk. The baselines' settings
are chosen on the validation streams (`email`: the stdlib package; `licenses`: /usr/share/common-licenses), never in
the table, by prequential perplexity averaged over them (--settings: a JSON of chosen settings, or an earlier result,
skips the search). The cache and kNN grids reuse one base forward pass per window. --resume keeps the streams the
result already holds with every method, with its settings, and runs the rest; each stream records the run and CPU
that measured it (`measured_by`), and the report names them when they differ.

Perplexity is prequential: exp of the mean NLL of every token predicted in the chunks after the first. Results
(--results-dir/--out): JSON (rows per stream and method, per-chunk NLL and times, the grids and the choices),
Markdown (tables, FAAST's update latency, the issue's goals judged) and a plot of the running perplexity.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import math
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

from faast_lab.experiments._common import (
    ROOT,
    add_model_arguments,
    load_model,
    measured_by,
    measured_by_words,
    several_runs,
    start_record,
    table,
    write_results,
)

METHODS = ("zero-shot", "faast", "dynamic-eval-lora", "dynamic-eval-blocks", "cache", "knn")
ALIASES = {"dynamic-eval": ("dynamic-eval-lora", "dynamic-eval-blocks")}
TUNED = ("dynamic-eval-lora", "dynamic-eval-blocks", "cache", "knn")
DYNAMIC = ("dynamic-eval-lora", "dynamic-eval-blocks")
STREAMS = ("stdlib", "perl", "man", "licences", "longfile")
VALIDATION = ("email", "licenses")
TEXT_FILES = "text-files"
# Tokens tokenised beyond --limit before the cut, so the first --limit tokens do not depend on where reading stopped.
MARGIN = 64
FAAST_CHUNK_KEYS = ("steps", "weights", "key_widths", "tune_s", "statistics_s", "solve_s")  # kept per chunk
NEVER_WORSE = 1.003  # goal 4: FAAST's perplexity at most this multiple of zero-shot's on every stream
LATENCY_S = 1.0  # goal 3: FAAST's update at most this many seconds per chunk
FLAT = 1.25  # goal 3: mean(last quarter) / mean(first quarter) of FAAST's update seconds at most this


def stream_files(name: str) -> list[Path]:
    """The files of a named stream (STREAMS or VALIDATION), in reading order."""
    from faast_lab.experiments.domains import FILES

    if name == "longfile":
        return [Path(sysconfig.get_paths()["stdlib"]) / "tkinter" / "__init__.py"]
    source = {"stdlib": "asyncio", "licences": "copyright"}.get(name, name)
    if source not in FILES:
        raise ValueError(f"stream: expected one of {(*STREAMS, *VALIDATION)}, got {name!r}")
    return FILES[source]()


def expand(patterns: Sequence[str]) -> list[Path]:
    """--text-files: each argument a file or a glob (its matches sorted), in the order given."""
    out = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(Path(m).is_file() for m in matches):
            raise SystemExit(f"--text-files: {pattern!r} names no file")
        out += [Path(m) for m in matches]
    return out


def stream_ids(paths: Sequence[Path], tokenizer: object, limit: int) -> tuple[list[int], int]:
    """(the first `limit` token ids of the files' texts joined by blank lines, files read). Files are read only until
    the text holds limit + MARGIN tokens (a long list such as the copyright files is not read whole); the joined
    text is tokenised in one call, again with more text when too short."""
    texts, chars, wanted = [], 0, 8 * (limit + MARGIN)
    from faast_lab.experiments.domains import unique_texts

    source = iter(unique_texts(paths))
    exhausted = False
    while True:
        while chars < wanted and not exhausted:
            text = next(source, None)
            if text is None:
                exhausted = True
            else:
                texts.append(text)
                chars += len(text) + 2
        ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"] if texts else []
        if len(ids) >= limit + MARGIN or exhausted:
            return list(ids[:limit]), len(texts)
        wanted *= 2


def numbers(text: str, kind: type = float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--text-files", nargs="+", default=None, help="one stream of these files (globs allowed), in order")
    p.add_argument("--streams", default=",".join(STREAMS), help=f"comma list of {','.join(STREAMS)}")
    p.add_argument("--limit", type=int, default=32768, help="tokens read per stream")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk")
    p.add_argument("--methods", default="zero-shot,faast,dynamic-eval,cache,knn",
                   help=f"comma list of {','.join(METHODS)} ('dynamic-eval': both forms)")  # fmt: skip
    p.add_argument("--validation-streams", default=",".join(VALIDATION), help="comma list the settings are chosen on")
    p.add_argument("--validation-limit", type=int, default=8192, help="tokens read per validation stream")
    p.add_argument("--settings", type=Path, default=None, help="JSON of chosen settings (or an earlier result)")
    p.add_argument("--resume", action="store_true",
                   help="keep the streams the result JSON already holds with every method (and its settings), run"
                        " the rest")  # fmt: skip
    p.add_argument("--faast-bias", type=float, default=None,
                   help="FAAST's ResidualOutput.bias (default: the configuration's)")  # fmt: skip
    p.add_argument("--lora-rank", type=int, default=8, help="dynamic evaluation's LoRA rank (fixed)")
    p.add_argument("--blocks", type=int, default=2, help="blocks dynamic evaluation trains (plus the final norm)")
    p.add_argument("--lora-lrs", default="1e-4,3e-4,1e-3,3e-3")
    p.add_argument("--block-lrs", default="1e-5,3e-5,1e-4,3e-4")
    p.add_argument("--dynamic-steps", default="1,2", help="gradient steps per chunk grid")
    p.add_argument("--cache-thetas", default="1,3,10,30,100", help="neural cache's cosine scale θ grid")
    p.add_argument("--cache-lams", default="0.02,0.05,0.1,0.2,0.3")
    p.add_argument("--knn-ks", default="16,64,256,1024")
    p.add_argument("--knn-temperatures", default="1,10,100,1000", help="on squared L2 distances of raw states")
    p.add_argument("--knn-lams", default="0.02,0.05,0.1,0.25")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS) - set(ALIASES))
    if unknown:
        p.error(f"--methods: unknown {unknown}; expected a subset of {[*METHODS, *ALIASES]}")
    chosen = {x for m in methods for x in ALIASES.get(m, (m,))} | {"zero-shot"}  # the reference is always run
    args.methods = [m for m in METHODS if m in chosen]
    if args.text_files:
        args.streams = [TEXT_FILES]
    else:
        args.streams = [s.strip() for s in args.streams.split(",") if s.strip()]
        if not args.streams or set(args.streams) - set(STREAMS):
            p.error(f"--streams: expected a comma list of {list(STREAMS)}, got {args.streams}")
    args.validation_streams = [s.strip() for s in args.validation_streams.split(",") if s.strip()]
    if set(args.validation_streams) - set(VALIDATION):
        p.error(f"--validation-streams: expected a comma list of {list(VALIDATION)}, got {args.validation_streams}")
    if args.chunk < 2 or args.limit < args.chunk + 1 or args.validation_limit < args.chunk + 1:
        p.error("--chunk >= 2 and --limit, --validation-limit > --chunk: at least two chunks, the first not scored")
    try:
        args.grids = {
            "dynamic-eval-lora": {"lr": numbers(args.lora_lrs), "steps": numbers(args.dynamic_steps, int)},
            "dynamic-eval-blocks": {"lr": numbers(args.block_lrs), "steps": numbers(args.dynamic_steps, int)},
            "cache": {"theta": numbers(args.cache_thetas), "lam": numbers(args.cache_lams)},
            "knn": {"k": numbers(args.knn_ks, int), "temperature": numbers(args.knn_temperatures),
                    "lam": numbers(args.knn_lams)},
        }  # fmt: skip
    except ValueError as err:
        p.error(f"a grid: expected comma-separated numbers ({err})")
    if any(not values for grid in args.grids.values() for values in grid.values()):
        p.error("every grid needs at least one value")
    return args


def build(method: str, model, setting: dict, args: argparse.Namespace):  # noqa: ANN001, ANN201 - a StreamMethod
    """The baseline `method` with its setting (lm_baselines.stream)."""
    from faast_lab.experiments.lm_baselines import stream

    if method == "zero-shot":
        return stream.ZeroShot(model)
    if method == "dynamic-eval-lora":
        rank = int(setting.get("rank", args.lora_rank))
        return stream.DynamicEvalLora(model, setting["lr"], int(setting["steps"]), rank=rank)
    if method == "dynamic-eval-blocks":
        blocks = int(setting.get("blocks", args.blocks))
        return stream.DynamicEvalBlocks(model, setting["lr"], int(setting["steps"]), blocks=blocks)
    if method == "cache":
        return stream.NeuralCache(model, setting["theta"], setting["lam"])
    if method == "knn":
        return stream.KnnStream(model, int(setting["k"]), setting["temperature"], setting["lam"])
    raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


def run_method(method: str, model, ids: list[int], setting: dict, args: argparse.Namespace,  # noqa: ANN001
               learn_last: bool = True) -> dict:  # fmt: skip
    """One method over one stream: lm_baselines.stream's record (run_faast's for faast); the model is given back
    as it was (the method closed, faast's fast weights reset)."""
    from faast_lab.experiments.lm_baselines import stream

    if method == "faast":
        return stream.run_faast(model, ids, args.chunk)
    baseline = build(method, model, setting, args)
    try:
        return stream.run_stream(baseline, ids, args.chunk, learn_last=learn_last)
    finally:
        baseline.close()


def grid_points(grid: dict) -> list[dict]:
    """Every combination of a grid's values, as settings."""
    points = [{}]
    for name, values in grid.items():
        points = [{**p, name: v} for p in points for v in values]
    return points


def load_settings(path: Path | None) -> dict:
    """Chosen settings by method from --settings: a JSON object of them, or an earlier result (its
    "chosen_settings")."""
    if path is None:
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    data = data.get("chosen_settings", data)
    unknown = sorted(set(data) - set(TUNED))
    if unknown:
        raise SystemExit(f"--settings {path}: expected settings of {list(TUNED)}, got {unknown}")
    return data


def validate(model, tokenizer, args: argparse.Namespace, fixed: dict) -> tuple[dict, dict]:  # noqa: ANN001
    """(chosen settings by method, the search's record): each tuned method run in this run and not in `fixed` gets
    the grid point with the lowest prequential perplexity averaged over the validation streams (the cache and kNN
    grids from one base forward per window: lm_baselines.stream.cache_grid / knn_grid)."""
    import torch

    from faast_lab.experiments.lm_baselines import stream

    todo = [m for m in TUNED if m in args.methods and m not in fixed]
    chosen = {m: fixed[m] for m in TUNED if m in args.methods and m in fixed}
    record = {"streams": {}, "grids": {m: args.grids[m] for m in todo}, "points": {m: [] for m in todo}}
    if not todo:
        return chosen, record
    scores = {m: {} for m in todo}  # method -> point key -> {stream: ppl}
    for name in args.validation_streams:
        ids, files = stream_ids(stream_files(name), tokenizer, args.validation_limit)
        if len(ids) < args.chunk + 1:
            raise SystemExit(f"validation stream {name!r}: {len(ids)} tokens, fewer than two chunks of {args.chunk}")
        began = time.perf_counter()
        states = stream.stream_states(model, ids, args.chunk)
        zero = stream.prequential_ppl(-torch.cat(states.lm).cpu(), states.tokens)
        record["streams"][name] = {"tokens": len(ids), "files": files, "zero_shot_ppl": zero}
        print(f"validation {name}: {len(ids):,} tokens from {files} files, zero-shot ppl {zero:.3f}", flush=True)
        if "cache" in todo:
            g = args.grids["cache"]
            for key, nll in stream.cache_grid(states, g["theta"], g["lam"]).items():
                scores["cache"].setdefault(key, {})[name] = stream.prequential_ppl(nll, states.tokens)
        if "knn" in todo:
            g = args.grids["knn"]
            for key, nll in stream.knn_grid(states, g["k"], g["temperature"], g["lam"]).items():
                scores["knn"].setdefault(key, {})[name] = stream.prequential_ppl(nll, states.tokens)
        for method in [m for m in todo if m in DYNAMIC]:
            for point in grid_points(args.grids[method]):
                result = run_method(method, model, ids, point, args, learn_last=False)
                scores[method].setdefault(tuple(point.values()), {})[name] = result["ppl"]
                print(f"  {method} {point}: ppl {result['ppl']:.3f}", flush=True)
        print(f"  validation {name} took {time.perf_counter() - began:.1f} s", flush=True)
    for method in todo:
        names = list(args.grids[method])
        for key, ppl in scores[method].items():
            mean = sum(ppl.values()) / len(ppl)
            record["points"][method].append({"setting": dict(zip(names, key, strict=True)), "ppl": ppl,
                                             "mean_ppl": mean})  # fmt: skip
        best = min(record["points"][method], key=lambda p: p["mean_ppl"])
        # A choice at the end of a grid axis may have stopped short of a better value: the report says so.
        edge = [k for k, v in args.grids[method].items() if len(v) > 1 and best["setting"][k] in (min(v), max(v))]
        chosen[method] = {**best["setting"], "validation_ppl": best["mean_ppl"], "at_grid_edge": edge}
        print(f"  {method}: chose {best['setting']} (validation ppl {best['mean_ppl']:.3f})", flush=True)
    return chosen, record


def latency(update_s: Sequence[float]) -> dict:
    """FAAST's update seconds per chunk: max and mean over all chunks; over the chunks after the first (whose update
    has no step to tune yet), the least-squares slope against the chunk index (s per chunk) and mean(last quarter) /
    mean(first quarter)."""
    rest = list(update_s[1:])
    out = {"max_s": max(update_s), "mean_s": sum(update_s) / len(update_s), "slope_s_per_chunk": 0.0, "ratio": 1.0}
    if len(rest) >= 2:
        xs = range(1, len(rest) + 1)
        mx, my = sum(xs) / len(rest), sum(rest) / len(rest)
        out["slope_s_per_chunk"] = sum((x - mx) * (y - my) for x, y in zip(xs, rest, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        q = max(1, len(rest) // 4)
        out["ratio"] = (sum(rest[-q:]) / q) / max(sum(rest[:q]) / q, 1e-12)
    return out


def row(stream_name: str, result: dict, zero_ppl: float) -> dict:
    """The table row of one method on one stream."""
    out = {"stream": stream_name, "method": result["method"], "ppl": result["ppl"],
           "relative_reduction": (zero_ppl - result["ppl"]) / zero_ppl, "update_s": sum(result["update_s"]),
           "read_s": sum(result["read_s"]), "total_s": result["total_s"], "tokens": sum(result["tokens"]),
           "chunks": len(result["tokens"]), "settings": result["settings"]}  # fmt: skip
    if result["method"] == "faast":
        lat = latency(result["update_s"])
        out.update(update_max_s=lat["max_s"], update_mean_s=lat["mean_s"], update_per_chunk_s=result["update_s"],
                   update_slope_s_per_chunk=lat["slope_s_per_chunk"],
                   update_ratio_last_first=lat["ratio"])  # fmt: skip
    return out


def mean_rows(rows: list[dict], methods: Sequence[str]) -> list[dict]:
    """Per method over the streams: mean relative reduction, summed times and tokens, perplexity's geometric mean;
    for faast also the largest update and the mean update over every chunk."""
    out = []
    for method in methods:
        found = [r for r in rows if r["method"] == method]
        if not found:
            continue
        n = len(found)
        mean = {"stream": "mean", "method": method, "ppl": math.exp(sum(math.log(r["ppl"]) for r in found) / n),
                "relative_reduction": sum(r["relative_reduction"] for r in found) / n,
                "update_s": sum(r["update_s"] for r in found), "read_s": sum(r["read_s"] for r in found),
                "total_s": sum(r["total_s"] for r in found), "tokens": sum(r["tokens"] for r in found),
                "streams": n}  # fmt: skip
        if method == "faast":
            chunks = [s for r in found for s in r["update_per_chunk_s"]]
            mean.update(update_max_s=max(chunks), update_mean_s=sum(chunks) / len(chunks))
        out.append(mean)
    return out


def goals(payload: dict) -> list[tuple[str, str, str]]:
    """The issue's goals as (goal, 'met' | 'NOT met' | 'not run', the numbers)."""
    means = {r["method"]: r for r in payload["rows"] if r["stream"] == "mean"}
    faast = means.get("faast")
    out = []
    g1 = "(1) FAAST's mean reduction ≥ the best dynamic-eval form's, with ≤ ¼ of its total update time"
    forms = [means[m] for m in DYNAMIC if m in means]
    if faast is None or not forms:
        out.append((g1, "not run", "needs faast and a dynamic-eval form"))
    else:
        best = max(forms, key=lambda r: r["relative_reduction"])
        ok = faast["relative_reduction"] >= best["relative_reduction"] and faast["update_s"] <= best["update_s"] / 4
        out.append((g1, "met" if ok else "NOT met", f"faast {100 * faast['relative_reduction']:+.2f}% in "
                    f"{faast['update_s']:.2f} s; {best['method']} {100 * best['relative_reduction']:+.2f}% in "
                    f"{best['update_s']:.2f} s (¼: {best['update_s'] / 4:.2f} s)"))  # fmt: skip
    g2 = "(2) FAAST's mean reduction > the neural cache's and > the kNN-LM's"
    peers = [means[m] for m in ("cache", "knn") if m in means]
    if faast is None or not peers:
        out.append((g2, "not run", "needs faast and the cache or the kNN-LM"))
    else:
        ok = all(faast["relative_reduction"] > p["relative_reduction"] for p in peers)
        missing = "" if len(peers) == 2 else " (only these ran)"
        numbers_ = "; ".join(f"{r['method']} {100 * r['relative_reduction']:+.2f}%" for r in (faast, *peers))
        out.append((g2, "met" if ok else "NOT met", numbers_ + missing))
    g3 = (f"(3) FAAST's update ≤ {LATENCY_S:g} s per chunk (max over chunks and streams) and flat in position "
          f"(mean last quarter / first quarter ≤ {FLAT}, chunk 0 excluded)")  # fmt: skip
    lat = payload.get("faast_latency")
    if faast is None or lat is None:
        out.append((g3, "not run", "needs faast"))
    else:
        ok = lat["max_s"] <= LATENCY_S and lat["ratio"] <= FLAT
        out.append((g3, "met" if ok else "NOT met", f"max {lat['max_s']:.3f} s, mean {lat['mean_s']:.3f} s; over "
                    f"the streams' mean per chunk: slope {1000 * lat['slope_s_per_chunk']:+.2f} ms/chunk, ratio "
                    f"{lat['ratio']:.2f}"))  # fmt: skip
    g4 = f"(4) FAAST not worse than zero-shot by more than {100 * (NEVER_WORSE - 1):.1f}% on any stream"
    if faast is None:
        out.append((g4, "not run", "needs faast"))
    else:
        zero = {r["stream"]: r["ppl"] for r in payload["rows"] if r["method"] == "zero-shot"}
        ratios = {r["stream"]: r["ppl"] / zero[r["stream"]] for r in payload["rows"]
                  if r["method"] == "faast" and r["stream"] != "mean"}  # fmt: skip
        worst = max(ratios, key=ratios.get)
        ok = ratios[worst] <= NEVER_WORSE
        out.append((g4, "met" if ok else "NOT met", f"worst: {worst}, ppl × {ratios[worst]:.4f} of zero-shot's"))
    return out


def report_lines(payload: dict) -> list[str]:
    """The Markdown below the title and the provenance block."""
    methods = [m for m in METHODS if any(r["method"] == m for r in payload["rows"])]
    streams = list(payload["streams"])
    by = {(r["stream"], r["method"]): r for r in payload["rows"]}
    lines = [f"{payload['model']}; streams read in chunks of {payload['chunk']} tokens, up to {payload['limit']:,} "
             "tokens each. Perplexity is prequential: every token of the chunks after the first, scored before its "
             "chunk is learned. Reduction: (ppl zero-shot − ppl) / ppl zero-shot, positive = better; the mean row "
             "averages it over the streams (its perplexity is the geometric mean).", ""]  # fmt: skip
    if several_runs(payload["streams"].values()):  # a resumed run: times compare within a stream only
        lines += ["Streams measured by different runs (--resume); times compare within a stream only:", ""]
        lines += [f"- {name}: {measured_by_words(v.get('measured_by'))}" for name, v in payload["streams"].items()]
        lines.append("")
    head = ["stream", "tokens scored", *methods]
    body = []
    for s in [*streams, "mean"]:
        cells = []
        for m in methods:
            r = by.get((s, m))
            red = "" if r is None or m == "zero-shot" else f" ({100 * r['relative_reduction']:+.2f}%)"
            cells.append("—" if r is None else f"{r['ppl']:.3f}{red}")
        tokens = by.get((s, "zero-shot"), {}).get("tokens", "")
        body.append([s, f"{tokens:,}" if tokens != "" else "", *cells])
    lines += ["Perplexity (reduction vs zero-shot):", "", *table(head, body), ""]
    body = [[s, *(("—" if (s, m) not in by else f"{by[s, m]['update_s']:.2f} / {by[s, m]['total_s']:.2f}")
                  for m in methods)] for s in [*streams, "mean"]]  # fmt: skip
    lines += ["Seconds: update (learning, scoring excluded) / total (scoring + update); the mean row sums them:", "",
              *table(["stream", *methods], body), ""]  # fmt: skip
    body = [[s, *(("—" if (s, m) not in by else f"{by[s, m]['update_s'] / by[s, m]['chunks']:.3f} / "
                   f"{by[s, m]['read_s'] / by[s, m]['chunks']:.3f}") for m in methods)] for s in streams]  # fmt: skip
    lines += ["Seconds per chunk: update / scoring:", "", *table(["stream", *methods], body), ""]
    faast = [r for r in payload["rows"] if r["method"] == "faast" and r["stream"] != "mean"]
    if faast:
        body = [[r["stream"], f"{r['update_max_s']:.3f}", f"{r['update_mean_s']:.3f}",
                 f"{1000 * r['update_slope_s_per_chunk']:+.2f}", f"{r['update_ratio_last_first']:.2f}"]
                for r in faast]  # fmt: skip
        lat = payload["faast_latency"]
        body.append(["mean per chunk", f"{lat['max_s']:.3f}", f"{lat['mean_s']:.3f}",
                     f"{1000 * lat['slope_s_per_chunk']:+.2f}", f"{lat['ratio']:.2f}"])  # fmt: skip
        lines += ["FAAST's update latency (slope and ratio over the chunks after the first; the last row: the "
                  "streams' mean update at each chunk index):", "",
                  *table(["stream", "max s", "mean s", "slope ms/chunk", "last ¼ / first ¼"], body), ""]  # fmt: skip
        parts = ("tune_s", "statistics_s", "solve_s")
        faast_chunks = {name: payload["chunks"].get(name, {}).get("faast", {}) for name in streams}
        split = [[name, *(f"{sum(c[k][1:]) / max(len(c[k]) - 1, 1):.3f}" for k in parts)]
                 for name, c in faast_chunks.items() if "solve_s" in c]  # fmt: skip
        if split:
            lines += ["FAAST's update, its parts (mean seconds per chunk after the first):", "",
                      *table(["stream", "tune s", "statistics s", "solve s"], split), ""]  # fmt: skip
    lines += ["Settings (chosen on the validation streams by mean prequential perplexity, or given by --settings):",
              ""]  # fmt: skip
    for m, s in payload["chosen_settings"].items():
        shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()
                          if k not in ("validation_ppl", "at_grid_edge"))  # fmt: skip
        if "validation_ppl" in s:
            shown += f" (validation ppl {s['validation_ppl']:.3f})"
        if s.get("at_grid_edge"):
            shown += f"; at the end of its grid in {', '.join(s['at_grid_edge'])}"
        lines.append(f"- {m}: {shown}")
    val = payload["validation"]["streams"]
    if val:
        shown = (f"{n} ({v['tokens']:,} tokens, zero-shot ppl {v['zero_shot_ppl']:.3f})" for n, v in val.items())
        lines.append("- validation streams: " + ", ".join(shown))
    lines += [f"- dynamic evaluation: AdamW (no weight decay), state kept across chunks, gradients clipped to norm "
              f"1; LoRA rank {payload['lora_rank']} (fixed) on q/v of every block; blocks: the last "
              f"{payload['blocks']} and the final norm", "- neural cache: unit-normalised states, θ scales cosines;"
              " kNN-LM: squared L2 distances of raw states", "", "Goals:", ""]  # fmt: skip
    lines += [f"- {goal}: **{status}** — {detail}" for goal, status, detail in payload["goals"]]
    return lines


def plot(payload: dict, path: Path) -> None:
    """Running perplexity (every token from the second chunk to this one) against token position, one line per
    method, one panel per stream; skipped with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the per-chunk NLL is in the JSON)")
        return
    streams = payload["chunks"]
    cols = min(3, len(streams))
    rows = math.ceil(len(streams) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, methods) in zip(axes.flat, streams.items(), strict=False):
        for method, c in methods.items():
            xs, ys, nll, n, pos = [], [], 0.0, 0, c["tokens"][0]
            for mean, count in zip(c["nll"][1:], c["tokens"][1:], strict=True):
                nll, n, pos = nll + mean * count, n + count, pos + count
                xs.append(pos)
                ys.append(math.exp(nll / n))
            style = {"color": "black", "linestyle": "--", "zorder": 3} if method == "zero-shot" else {}
            ax.plot(xs, ys, marker=".", label=method, **style)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("token position")
        ax.set_ylabel("running perplexity")
    for ax in list(axes.flat)[len(streams) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    import torch

    args = parse_args(argv)
    record = start_record()
    torch.manual_seed(0)
    model, tokenizer, description = load_model(args)
    if args.faast_bias is not None:
        if not (math.isfinite(args.faast_bias) and args.faast_bias >= 0):
            raise SystemExit(f"--faast-bias: expected a finite number >= 0, got {args.faast_bias}")
        model.output_memory_layer.bias = args.faast_bias
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context and args.chunk + 1 > context:
        raise SystemExit(f"--chunk: {args.chunk} + 1 tokens exceed the model's context of {context}")
    stem = args.out or f"lm_stream_{args.model.replace('/', '_')}"
    earlier = resumed(Path(args.results_dir) / f"{stem}.json", args) if args.resume else None
    fixed = earlier["chosen_settings"] if earlier else load_settings(args.settings)
    chosen, search = validate(model, tokenizer, args, fixed)
    payload = {"model": description, "chunk": args.chunk, "limit": args.limit, "methods": args.methods,
               "lora_rank": args.lora_rank, "blocks": args.blocks,
               "settings": {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()},
               "chosen_settings": chosen, "validation": earlier["validation"] if earlier else search, "streams": {},
               "rows": [], "chunks": {}, "goals": [], "faast_latency": None}  # fmt: skip
    if earlier:
        if earlier.get("model") != description:
            raise SystemExit(f"--resume: the earlier result measured {earlier.get('model')!r}, not {description!r}")
        payload["earlier_runs"] = [*earlier.get("earlier_runs", []), earlier.get("provenance")]
        keep(payload, earlier, args)
    for name in [s for s in args.streams if s not in payload["streams"]]:
        paths = expand(args.text_files) if name == TEXT_FILES else stream_files(name)
        ids, files = stream_ids(paths, tokenizer, args.limit)
        if len(ids) < args.chunk + 1:
            raise SystemExit(f"stream {name!r}: {len(ids)} tokens, fewer than two chunks of {args.chunk}")
        payload["streams"][name] = {"tokens": len(ids), "files": files, "measured_by": measured_by(record)}
        print(f"{name}: {len(ids):,} tokens from {files} files, {math.ceil(len(ids) / args.chunk)} chunks", flush=True)
        chunks, zero = payload["chunks"].setdefault(name, {}), None
        for method in args.methods:
            result = run_method(method, model, ids, chosen.get(method, {}), args)
            if method == "zero-shot":  # first in METHODS: every other row's reference
                zero = result["ppl"]
            r = row(name, result, zero)
            payload["rows"].append(r)
            chunks[method] = {k: result[k] for k in ("tokens", "nll", "update_s", "read_s", *(
                FAAST_CHUNK_KEYS if method == "faast" else ()))}  # fmt: skip
            n = len(result["tokens"])
            print(f"  {name} {method}: ppl {r['ppl']:.3f} ({100 * r['relative_reduction']:+.2f}%), update "
                  f"{r['update_s'] / n:.3f} s/chunk (max {max(result['update_s']):.3f}), scoring "
                  f"{r['read_s'] / n:.3f} s/chunk, total {r['total_s']:.1f} s", flush=True)  # fmt: skip
        finish(payload, args)
        with contextlib.redirect_stdout(io.StringIO()):  # a cut run keeps what it measured; the report prints once
            write_results(args, "lm_stream", record, payload, title(payload), report_lines(payload))
    folder = write_results(args, "lm_stream", record, payload, title(payload), report_lines(payload))
    plot(payload, folder / f"{stem}.png")
    return payload


def resumed(path: Path, args: argparse.Namespace) -> dict | None:
    """--resume: the earlier result at `path` (None when there is none), after checking that it measured what this
    run measures: the same chunk, limit, methods, LoRA rank and blocks (main checks the model); its chosen settings
    are this run's."""
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text(encoding="utf-8"))
    for key in ("chunk", "limit", "methods", "lora_rank", "blocks"):
        if earlier.get(key) != getattr(args, key):
            raise SystemExit(f"--resume: {path} was run with {key}={earlier.get(key)!r}, this run asks for "
                             f"{getattr(args, key)!r}; use another --out")  # fmt: skip
    if args.settings is not None:
        raise SystemExit("--resume takes its settings from the earlier result; drop --settings")
    return earlier


def keep(payload: dict, earlier: dict, args: argparse.Namespace) -> None:
    """Copies into `payload` each stream of `earlier` that this run asks for and that holds a row of every method;
    a stream cut short is run again whole (every method of a stream in one run)."""
    record = earlier.get("provenance") or {}
    for name, info in earlier["streams"].items():
        rows = [r for r in earlier["rows"] if r["stream"] == name]
        if name not in args.streams or {r["method"] for r in rows} != set(args.methods):
            continue
        payload["streams"][name] = {"measured_by": measured_by(record), **info}
        payload["rows"] += rows
        payload["chunks"][name] = earlier["chunks"][name]
        print(f"{name}: kept from {payload['streams'][name]['measured_by'].get('date')} (--resume)", flush=True)


def finish(payload: dict, args: argparse.Namespace) -> None:
    """The mean rows (after the streams' rows, replacing earlier ones), FAAST's latency over the streams' mean update
    per chunk index, and the goals."""
    order = [n for n in args.streams if n in payload["streams"]]  # kept streams come first; the table keeps --streams
    payload["streams"] = {n: payload["streams"][n] for n in order}
    payload["chunks"] = {n: payload["chunks"][n] for n in order if n in payload["chunks"]}
    rows = sorted((r for r in payload["rows"] if r["stream"] != "mean"), key=lambda r: order.index(r["stream"]))
    payload["rows"] = rows + mean_rows(rows, args.methods)
    runs = [c["faast"]["update_s"] for c in payload["chunks"].values() if "faast" in c]
    if runs:
        length = min(len(u) for u in runs)
        pooled = [sum(u[i] for u in runs) / len(runs) for i in range(length)]
        payload["faast_latency"] = {**latency(pooled), "max_s": max(max(u) for u in runs),
                                    "mean_s": sum(map(sum, runs)) / sum(map(len, runs))}  # fmt: skip
    payload["goals"] = goals(payload)


def title(payload: dict) -> str:
    return f"Learn while reading: {payload['model']}, chunks of {payload['chunk']} tokens"


if __name__ == "__main__":
    main()
