"""Perplexity after test-time learning, with its baselines measured in the same run (issue 6, the PPL experiment).

    python experiments/lm_ppl.py                                  # embedded default on local text (offline)
    python experiments/lm_ppl.py --model gpt2-xl --dataset wikitext --dataset-config wikitext-103-raw-v1

Protocol (reference.md §2.10, without its mistakes): the model learns from the learn split (train) and is scored on
non-overlapping `--window`-token windows of the score split (test); every predicted token is scored once, padding
never. Methods: zero-shot (the frozen model), FAAST (learn = forward passes into the fast weights), kNN-LM (a
datastore of final hidden states -> next tokens, k nearest neighbours, p = λ p_kNN + (1 - λ) p_LM). For each: learn
time, inference time (the scoring pass) and the memory it adds, measured here. Not yet in this script (issue 6): the
backprop linear projection, LoRA and in-context-learning baselines.

Local data (default): the Python source of one stdlib package (`--stdlib-package`), split by file as in the demo; or
`--text-files` (learn) with `--score-files`. `--limit` caps the learned tokens (quick runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

RESULTS = ROOT / "experiments" / "results"


def load_data(args: argparse.Namespace, tokenizer: object) -> tuple[list[list[int]], list[list[int]], str]:
    """(learn token lists, score token lists, description)."""
    from faast.hf._tokens import token_lists

    if args.dataset:
        from faast.hf.corpus import read_dataset

        learn = (t for _, t in read_dataset(args.dataset, config=args.dataset_config, split=args.learn_split))
        score = (t for _, t in read_dataset(args.dataset, config=args.dataset_config, split=args.score_split))
        name = f"{args.dataset}/{args.dataset_config} {args.learn_split} -> {args.score_split}"
    elif args.text_files:
        from faast.hf.corpus import read_text_files

        if not args.score_files:
            raise SystemExit("--text-files needs --score-files (held-out text of the same domain)")
        learn = (t for _, t in read_text_files(args.text_files))
        score = (t for _, t in read_text_files(args.score_files))
        name = "local files"
    else:
        from faast.demo import domain_files

        learn_files, score_files = domain_files(args.stdlib_package)
        learn = (f.read_text(encoding="utf-8") for f in learn_files)
        score = (f.read_text(encoding="utf-8") for f in score_files)
        name = f"stdlib '{args.stdlib_package}' source, learn files -> held-out files"
    return token_lists(learn, tokenizer, args.limit), token_lists(score, tokenizer, args.score_limit), name


def main(argv: list[str] | None = None) -> dict:
    from faast.hf import FaastConfig, apply_faast, from_pretrained
    from faast.hf.default import DEFAULT_READOUT, load_base_model
    from faast.hf.evaluate import perplexity, token_windows
    from faast.hf.knnlm import KNNLM, KNNConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a transformers id/path")
    p.add_argument("--readout", default=None, help="a trained adapter folder (default: the shipped one for smollm2)")
    p.add_argument("--dataset", default=None)
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--learn-split", default="train")
    p.add_argument("--score-split", default="test")
    p.add_argument("--text-files", nargs="+", default=None)
    p.add_argument("--score-files", nargs="+", default=None)
    p.add_argument("--stdlib-package", default="asyncio")
    p.add_argument("--limit", type=int, default=32768, help="tokens learned")
    p.add_argument("--score-limit", type=int, default=8192, help="tokens scored")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--knn-k", type=int, default=1024)
    p.add_argument("--knn-lambda", type=float, default=0.25)
    p.add_argument("--knn-temperature", type=float, default=1.0)
    p.add_argument("--out", default=None, help="result file stem (default: lm_ppl_<model>)")
    p.add_argument("--results-dir", default=str(RESULTS))
    args = p.parse_args(argv)

    base, tokenizer, description = load_base_model(args.model)
    readout = args.readout or (DEFAULT_READOUT if args.model == "smollm2" else None)
    model = from_pretrained(base, readout) if readout else apply_faast(base, FaastConfig())
    learn, score, data = load_data(args, tokenizer)
    windows = [w for ids in score for w in token_windows(ids, args.window)]
    n_learn = sum(len(x) for x in learn)
    print(f"{description}: learn {n_learn:,} tokens, score {sum(len(w) - 1 for w in windows):,} ({data})", flush=True)

    rows = []
    with model.disable_faast():
        zero = perplexity(model, windows, batch_size=args.batch_size)
    rows.append({"method": "zero-shot", "ppl": zero.ppl, "learn_s": 0.0, "infer_s": zero.seconds, "memory_bytes": 0})

    started = time.perf_counter()
    model.learn(learn, max_length=args.window, batch_size=args.batch_size)
    learn_s = time.perf_counter() - started
    faast = perplexity(model, windows, batch_size=args.batch_size)
    rows.append({"method": "FAAST", "ppl": faast.ppl, "learn_s": learn_s, "infer_s": faast.seconds,
                 "memory_bytes": model.fast_weight_bytes()})  # fmt: skip
    model.reset_fast_weights()

    with model.disable_faast():
        knn = KNNLM(model, KNNConfig(k=args.knn_k, lam=args.knn_lambda, temperature=args.knn_temperature))
        started = time.perf_counter()
        knn.add(learn, window=args.window, batch_size=args.batch_size)
        knn_learn_s = time.perf_counter() - started
        knn_ppl = knn.perplexity(windows, batch_size=args.batch_size)
    rows.append({"method": f"kNN-LM (k={knn.config.k}, λ={knn.config.lam})", "ppl": knn_ppl.ppl,
                 "learn_s": knn_learn_s, "infer_s": knn_ppl.seconds, "memory_bytes": knn.nbytes()})  # fmt: skip

    for r in rows:
        r["relative_reduction"] = 1 - r["ppl"] / zero.ppl
    payload = {"model": description, "data": data, "learn_tokens": n_learn, "scored_tokens": zero.tokens,
               "window": args.window, "layers": model.faast_config.layers, "rows": rows,
               "torch_threads": torch.get_num_threads()}  # fmt: skip
    stem = args.out or f"lm_ppl_{args.model.replace('/', '_')}"
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    lines = [
        f"# Perplexity after learning: {description}",
        "",
        f"{data}; learned {n_learn:,} tokens, scored {zero.tokens:,} tokens in {args.window}-token windows.",
        "",
        "| method | perplexity | reduction vs zero-shot | learn time, s | inference time, s | memory added |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["method"], f"{r['ppl']:.3f}", f"{100 * r['relative_reduction']:+.1f}%", f"{r['learn_s']:.1f}",
                 f"{r['infer_s']:.1f}", f"{r['memory_bytes'] / 2**20:,.1f} MB"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return payload


if __name__ == "__main__":
    main()
