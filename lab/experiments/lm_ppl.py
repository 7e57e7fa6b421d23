"""Perplexity after test-time learning, with its baselines measured in the same run (issue 6, the PPL experiment).

    python -m faast_lab.experiments.lm_ppl                                  # embedded default on local text (offline)
    python -m faast_lab.experiments.lm_ppl --model gpt2-xl --dataset wikitext --dataset-config wikitext-103-raw-v1

Protocol (docs/authors.md §2.10, without its mistakes): each method learns from the learn split (train) and is scored
on non-overlapping `--window`-token windows of the score split (test); every predicted token is scored once, padding
never, and every method scores the same tokens. Methods:
- zero-shot: the frozen model;
- FAAST: learning = forward passes into the fast weights (statistics only, fixed size);
- kNN-LM: a datastore of final hidden states -> next tokens, k nearest neighbours, p = λ p_kNN + (1 - λ) p_LM;
- linear: h + h·A at FAAST's layers, A trained by backprop on the learn split (lab/experiments/lm_baselines);
- LoRA (peft): q/v projections of every block, rank matched to the linear projection's parameter count;
- ICL: the last learned tokens that fit in the context before each window (its cost: the prefix's KV cache).
For each: learn time, inference time (the scoring pass) and the memory it adds, measured here. FAAST and the kNN-LM
are also scored after each of `--curve-points` growing amounts of learned text (the PPL-vs-tokens plot).

Local data (default): the Python source of one stdlib package (`--stdlib-package`), split by file as in the demo; or
`--text-files` (learn) with `--score-files`. Local files are read through the datasets library
(`load_dataset("text", data_files=..., sample_by="document")`: one row per file). `--limit` caps the learned tokens
(quick runs).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from faast_lab.experiments._common import (
    add_model_arguments,
    load_local,
    load_model,
    start_record,
    table,
    write_results,
)

METHODS = ("zero-shot", "faast", "knn", "linear", "lora", "icl")


def load_data(args: argparse.Namespace, tokenizer: object) -> tuple[list[list[int]], list[list[int]], str]:
    """(learn token lists, score token lists, description)."""
    from faast.hf.tokens import token_lists

    if args.dataset:
        from faast.hf.corpus import read_dataset

        learn = joined(read_dataset(args.dataset, config=args.dataset_config, split=args.learn_split))
        score = joined(read_dataset(args.dataset, config=args.dataset_config, split=args.score_split))
        name = f"{args.dataset}/{args.dataset_config} {args.learn_split} -> {args.score_split}"
    elif args.text_files:
        from faast.hf.corpus import read_text_files

        if not args.score_files:
            raise SystemExit("--text-files needs --score-files (held-out text of the same domain)")
        learn = (t for _, t in read_text_files(args.text_files))
        score = (t for _, t in read_text_files(args.score_files))
        name = "local files"
    else:
        from faast.hf.demo import domain_files

        learn_files, score_files = domain_files(args.stdlib_package)
        learn = file_texts(learn_files)
        score = file_texts(score_files)
        name = f"stdlib '{args.stdlib_package}' source, learn files -> held-out files"
    return token_lists(learn, tokenizer, args.limit), token_lists(score, tokenizer, args.score_limit), name


def file_texts(files: Sequence[Path]) -> Iterator[str]:
    """Each file's whole text, in order, read lazily through the datasets library's text builder (one row per file)."""
    return (row["text"] for row in load_local("text", files, sample_by="document"))


def joined(rows: Iterable[tuple[str, str]], chunk_chars: int = 1 << 20) -> Iterator[str]:
    """A dataset's rows (WikiText: one paragraph or heading each) joined by blank lines into ~1 MB texts, so windows
    span rows as in the usual WikiText protocol; a pair is split only between two such texts (one per ~250K tokens)."""
    buffer, size = [], 0
    for _, text in rows:
        buffer.append(text)
        size += len(text)
        if size >= chunk_chars:
            yield "\n\n".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield "\n\n".join(buffer)


def curve_points(total: int, count: int) -> list[int]:
    """`count` learned-token amounts doubling up to `total` (the last is the whole learn split)."""
    if count <= 1:
        return [total]
    return sorted({max(1, total >> k) for k in range(count)})


def baseline_layers(model) -> list[int]:  # noqa: ANN001 - a FaastModel
    """Blocks of the linear projection (and LoRA's parameter budget): FAAST's middle layers, or, for the default
    configuration without any, the placement of the shipped readout's rule with 6 layers (fewer on small models)."""
    from faast.hf import FaastConfig, MiddleLayers

    if model.memory_layers:
        return [int(k) for k in model.memory_layers]
    blocks = model.faast_config.num_hidden_layers
    return FaastConfig(middle=MiddleLayers(num_layers=min(6, blocks))).block_indices(blocks, 0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--dataset", default=None)
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--learn-split", default="train")
    p.add_argument("--score-split", default="test")
    p.add_argument("--text-files", nargs="+", default=None)
    p.add_argument("--score-files", nargs="+", default=None)
    p.add_argument("--stdlib-package", default="asyncio")
    p.add_argument("--limit", type=int, default=16384, help="tokens learned")
    p.add_argument("--score-limit", type=int, default=4096, help="tokens scored")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--curve-points", type=int, default=5, help="learned amounts FAAST and kNN-LM are scored at")
    p.add_argument("--knn-k", type=int, default=1024)
    p.add_argument("--knn-lambda", type=float, default=0.25)
    p.add_argument("--knn-temperature", type=float, default=1.0)
    p.add_argument("--train-window", type=int, default=256, help="window of the backprop baselines' training")
    p.add_argument("--train-batch-size", type=int, default=4)
    p.add_argument("--train-epochs", type=int, default=1)
    p.add_argument("--linear-lr", type=float, default=1e-4)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--icl-tokens", type=int, default=None, help="context tokens (default: what fits)")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; expected a subset of {list(METHODS)}")
    return args


def add_row(rows: list[dict], method: str, result, learn_s: float, memory: int, **extra: object) -> None:  # noqa: ANN001
    """Append one method's row (perplexity, learn and scoring seconds, bytes it adds) and print it."""
    rows.append({"method": method, "ppl": result.ppl, "learn_s": learn_s, "infer_s": result.seconds,
                 "memory_bytes": memory, **extra})  # fmt: skip
    print(f"  {method}: ppl {result.ppl:.3f} (learn {learn_s:.1f} s, score {result.seconds:.1f} s)", flush=True)


def run_faast(model, parts: list, windows: list, args: argparse.Namespace, rows: list, curve: dict) -> None:  # noqa: ANN001
    """FAAST learns the parts one after another, scored after each (the curve); the last point is the row. Its learn
    time is every learning pass and the last solve (with the step tuning); the solves at the earlier curve points,
    there only to score them, are recorded apart (curve["faast_solve_s"]), so no solve is counted as scoring."""
    from faast.hf.evaluate import perplexity

    learn_s, solves = 0.0, []
    for part, continues in parts:  # a part that begins with the rest of a cut text continues it (one document)
        started = time.perf_counter()
        if part:
            model.learn(part, max_length=args.window, batch_size=args.batch_size, continues=continues)
        learned = time.perf_counter()
        if part:
            model.solve()
        learn_s += learned - started
        solves.append(time.perf_counter() - learned)
        result = perplexity(model, windows, batch_size=args.batch_size)
        curve["faast"].append(result.ppl)
        curve["faast_bytes"].append(model.fast_weight_bytes())
        curve["faast_infer_s"].append(result.seconds)
    curve["faast_solve_s"] = solves
    add_row(rows, "FAAST", result, learn_s + solves[-1], model.fast_weight_bytes(), curve_solve_s=sum(solves[:-1]))
    model.reset_fast_weights()


def run_knn(model, parts: list, windows: list, args: argparse.Namespace, rows: list, curve: dict) -> None:  # noqa: ANN001
    """The kNN-LM's datastore grows by the same parts, scored after each; the last point is the row."""
    from faast_lab.experiments.lm_baselines import KNNLM, KNNConfig

    knn = KNNLM(model, KNNConfig(k=args.knn_k, lam=args.knn_lambda, temperature=args.knn_temperature))
    learn_s = 0.0
    with model.disable_faast():
        for part, _ in parts:
            started = time.perf_counter()
            if part:
                knn.add(part, window=args.window, batch_size=args.batch_size)
            learn_s += time.perf_counter() - started
            result = knn.perplexity(windows, batch_size=args.batch_size)
            curve["knn"].append(result.ppl)
            curve["knn_bytes"].append(knn.nbytes())
            curve["knn_infer_s"].append(result.seconds)
    add_row(rows, f"kNN-LM (k={knn.config.k}, λ={knn.config.lam})", result, learn_s, knn.nbytes())


def run_linear(model, learn: list, windows: list, layers: list[int], args: argparse.Namespace, rows: list) -> None:  # noqa: ANN001
    """h + h·A at `layers`, A trained by backprop on the learn split, then removed."""
    from faast.hf.evaluate import perplexity
    from faast_lab.experiments.lm_baselines import LinearProjection, fit_causal_lm

    base = model.base_model
    with model.disable_faast():
        projection = LinearProjection(base, layers)
        stats = fit_causal_lm(base, list(projection.parameters()), learn, lr=args.linear_lr, **training(args))
        result = perplexity(base, windows, batch_size=args.batch_size)
        projection.remove()
    method = f"linear projection (backprop, {len(projection.layers)} layers)"
    add_row(rows, method, result, stats.seconds, projection.nbytes(), params=linear_params(model, layers),
            train_loss=[stats.first_loss, stats.last_loss])  # fmt: skip


def run_lora(model, learn: list, windows: list, layers: list[int], args: argparse.Namespace, rows: list) -> None:  # noqa: ANN001
    """LoRA on q/v of every block, its rank matched to the linear projection's parameter count, then unloaded."""
    from faast.hf.evaluate import perplexity
    from faast_lab.experiments.lm_baselines import apply_lora, fit_causal_lm, lora_rank_for

    base = model.base_model
    rank = lora_rank_for(base, linear_params(model, layers))
    with model.disable_faast():
        lora = apply_lora(base, rank)
        trainable = [p for p in lora.parameters() if p.requires_grad]
        stats = fit_causal_lm(lora, trainable, learn, lr=args.lora_lr, **training(args))
        result = perplexity(lora, windows, batch_size=args.batch_size)
        lora.unload()
    n, nbytes = sum(p.numel() for p in trainable), sum(p.numel() * p.element_size() for p in trainable)
    add_row(rows, f"LoRA (peft, r={rank})", result, stats.seconds, nbytes, params=n,
            train_loss=[stats.first_loss, stats.last_loss])  # fmt: skip


def run_icl(model, learn: list, windows: list, args: argparse.Namespace, rows: list, notes: list) -> None:  # noqa: ANN001
    """The last learned tokens that fit before each window, in the context; a note when none fit."""
    from faast.hf.evaluate import perplexity
    from faast_lab.experiments.lm_baselines import kv_cache_bytes

    base = model.base_model
    room = int(getattr(base.config, "max_position_embeddings", 0) or 0) - args.window
    stream = [t for ids in learn for t in ids]
    size = min(args.icl_tokens if args.icl_tokens is not None else room, room, len(stream))
    if size < 1:
        context = room + args.window
        notes.append(f"ICL: no room for context before a {args.window}-token window (model context {context})")
        return
    with model.disable_faast():
        result = perplexity(model, windows, batch_size=1, context=stream[-size:])
    add_row(rows, f"ICL ({size:,} tokens in context)", result, 0.0, kv_cache_bytes(base, size), context_tokens=size)


def training(args: argparse.Namespace) -> dict:
    """The backprop baselines' training settings."""
    return {"window": args.train_window, "batch_size": args.train_batch_size, "epochs": args.train_epochs}


def linear_params(model, layers: list[int]) -> int:  # noqa: ANN001 - a FaastModel
    """The linear projection's parameter count (d x d per layer), LoRA's budget too."""
    return len(layers) * model.base_model.config.hidden_size**2


def report_lines(payload: dict) -> list[str]:
    """The Markdown below the title: the methods' table, then the curve's table when there is one."""
    rows, curve = payload["rows"], payload["curve"]
    lines = [
        f"{payload['data']}; learned {payload['learn_tokens']:,} tokens, scored {payload['scored_tokens']:,} tokens "
        f"in {payload['window']}-token windows.",
        "",
        *table(
            ["method", "perplexity", "reduction vs zero-shot", "learn time, s", "inference time, s", "memory added"],
            [
                [
                    r["method"],
                    f"{r['ppl']:.3f}",
                    f"{100 * r['relative_reduction']:+.1f}%",
                    f"{r['learn_s']:.1f}",
                    f"{r['infer_s']:.1f}",
                    f"{r['memory_bytes'] / 2**20:,.1f} MB",
                ]
                for r in rows
            ],  # fmt: skip
        ),
    ]
    if curve["faast"] or curve["knn"]:
        lines += ["", "Perplexity, memory and scoring time against tokens learned:", ""]
        methods = [(m, name) for m, name in (("faast", "FAAST"), ("knn", "kNN-LM")) if curve[m]]
        header = ["tokens learned"] + [
            f"{name} {what}" for _, name in methods for what in ("ppl", "memory", "score s")
        ]
        body = [
            [f"{t:,}"]
            + [
                cell
                for m, _ in methods
                for cell in (
                    f"{curve[m][i]:.3f}",
                    f"{curve[m + '_bytes'][i] / 2**20:,.1f} MB",
                    f"{curve[m + '_infer_s'][i]:.1f}",
                )
            ]  # fmt: skip
            for i, t in enumerate(curve["tokens"])
        ]
        lines += table(header, body)
        if curve.get("faast_solve_s"):
            pairs = zip(curve["tokens"], curve["faast_solve_s"], strict=True)
            solves = ", ".join(f"{t:,} → {s:.1f} s" for t, s in pairs)
            lines += ["", f"FAAST's solve at each point (the last is in its learn time): {solves}."]
    lines += [f"- {n}" for n in payload["notes"]]
    return lines


def main(argv: list[str] | None = None) -> dict:
    import torch

    from faast.hf.evaluate import perplexity, token_windows
    from faast.hf.tokens import split_continuing

    args = parse_args(argv)
    record = start_record()
    model, tokenizer, description = load_model(args)
    learn, score, data = load_data(args, tokenizer)
    windows = [w for ids in score for w in token_windows(ids, args.window)]
    n_learn = sum(len(x) for x in learn)
    print(f"{description}: learn {n_learn:,} tokens, score {sum(len(w) - 1 for w in windows):,} ({data})", flush=True)

    rows, notes = [], []
    with model.disable_faast():
        zero = perplexity(model, windows, batch_size=args.batch_size)
    add_row(rows, "zero-shot", zero, 0.0, 0)

    # FAAST and the kNN-LM learn the same stream in growing parts, scored after each: the curve, whose last point is
    # the whole learn split (the table's rows).
    points = curve_points(n_learn, args.curve_points)
    parts = split_continuing(learn, points)
    curve = {"tokens": points, "faast": [], "knn": [], "faast_bytes": [], "knn_bytes": [], "faast_infer_s": [],
             "knn_infer_s": []}  # fmt: skip
    if "faast" in args.methods:
        run_faast(model, parts, windows, args, rows, curve)
    if "knn" in args.methods:
        run_knn(model, parts, windows, args, rows, curve)
    layers = baseline_layers(model)
    if "linear" in args.methods:
        run_linear(model, learn, windows, layers, args, rows)
    if "lora" in args.methods:
        run_lora(model, learn, windows, layers, args, rows)
    if "icl" in args.methods:
        run_icl(model, learn, windows, args, rows, notes)

    for r in rows:
        r["relative_reduction"] = 1 - r["ppl"] / zero.ppl
    payload = {"model": description, "data": data, "learn_tokens": n_learn, "scored_tokens": zero.tokens,
               "window": args.window, "layers": [int(k) for k in model.memory_layers], "baseline_layers": layers,
               "rows": rows, "curve": curve,
               "zero_shot_ppl": zero.ppl, "notes": notes, "training": training(args),
               "torch_threads": torch.get_num_threads()}  # fmt: skip
    title = f"Perplexity after learning: {description}"
    folder = write_results(args, "lm_ppl", record, payload, title, report_lines(payload))
    plot_curve(payload, folder / f"{args.out or 'lm_ppl_' + args.model.replace('/', '_')}.png")
    return payload


def plot_curve(payload: dict, path: Path) -> None:
    """PPL against tokens learned (FAAST, kNN-LM, zero-shot line); skipped with a note when matplotlib is missing."""
    curve = payload["curve"]
    if not (curve["faast"] or curve["knn"]):
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the curve is in the JSON)")
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for key, label in (("faast", "FAAST"), ("knn", "kNN-LM")):
        if curve[key]:
            ax.plot(curve["tokens"], curve[key], marker="o", label=label)
    ax.axhline(payload["zero_shot_ppl"], color="gray", linestyle="--", label="zero-shot")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens learned")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(payload["model"].split(" (")[0], fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
