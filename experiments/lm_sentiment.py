"""Few-shot sentiment classification with a causal LM: FAAST against in-context learning (issue 6).

    python experiments/lm_sentiment.py                                   # embedded default, shipped reviews (offline)
    python experiments/lm_sentiment.py --model gpt2-xl --dataset sst2    # where the hub is reachable
    python experiments/lm_sentiment.py --model gpt2-xl --dataset imdb --shots 1,2,full

Protocol (docs/authors.md §2.11, without its mistakes): the prompt is `Review: <text>\\nSentiment:` and the prediction
is whichever label continuation (" positive" / " negative") the model finds more likely; with single-token labels
this compares the next-token logits, the paper's rule. Texts are cut to `--max-words` words (SST-2 100, IMDB 300).
- k-shot (k per label): for each query, k support examples per label are drawn (balanced, shuffled, seeded by the
  query's index, so FAAST and ICL see the same ones). FAAST resets its fast weights and learns them, each formatted
  as `Review: <text>\\nSentiment: <label>\\n`, then reads the query prompt alone. ICL puts them before the prompt.
- full: FAAST learns the whole support set (up to `--support-limit`) once, then answers every query; ICL does the
  same when the support set fits in the context, and is reported as not fitting otherwise.
- zero-shot: the prompt alone.
Every query is scored once (the query set is never repeated to reach a size), so the 95% Wilson interval is over
distinct queries.

Data: `--dataset sst2|imdb` (datasets library), or `--data-file` (JSONL with text, label, split = train|test), by
default experiments/data/reviews.jsonl written for this project.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, add_model_arguments, load_model, read_split_jsonl, table, write_results  # noqa: E402

DEFAULT_DATA = ROOT / "experiments" / "data" / "reviews.jsonl"
LABELS = ("negative", "positive")  # datasets' integer labels: 0 negative, 1 positive
# name -> (path, config, support split, query split, text field, label field, words kept)
PRESETS = {
    "sst2": ("glue", "sst2", "train", "validation", "sentence", "label", 100),
    "imdb": ("imdb", None, "train", "test", "text", "label", 300),
}


def _label(value: object) -> str:
    if isinstance(value, str) and value in LABELS:
        return value
    if isinstance(value, int | bool) and int(value) in (0, 1):
        return LABELS[int(value)]
    raise ValueError(f"label: expected one of {LABELS} or 0/1, got {value!r}")


def load_data(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """(support [(text, label)], queries [(text, label)], description)."""
    if args.dataset:
        from datasets import load_dataset

        path, config, support_split, query_split, text, label, words = PRESETS.get(
            args.dataset, (args.dataset, args.dataset_config, "train", "test", "text", "label", args.max_words or 100)
        )
        args.max_words = args.max_words or words
        data = load_dataset(path, config)
        support = [(r[text], _label(r[label])) for r in data[support_split]]
        queries = [(r[text], _label(r[label])) for r in data[query_split]]
        return support, queries, f"{args.dataset} {support_split} -> {query_split}"
    path = Path(args.data_file or DEFAULT_DATA)
    train, test = read_split_jsonl(path, ("text", "label"))
    support = [(str(r["text"]), _label(r["label"])) for r in train]
    queries = [(str(r["text"]), _label(r["label"])) for r in test]
    args.max_words = args.max_words or 100
    return support, queries, f"{path.name} train -> test"


def parse_shots(text: str) -> list[int | str]:
    out: list[int | str] = []
    for item in text.split(","):
        item = item.strip()
        if item == "full":
            out.append("full")
        elif item.isdigit() and int(item) >= 1:
            out.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"--shots: expected positive integers or 'full', got {item!r}")
    return out


class Prompts:
    """Token ids of prompts, demonstrations and labels under one tokenizer."""

    def __init__(self, tokenizer: object, max_words: int):
        self.tokenizer = tokenizer
        self.max_words = max_words
        self.labels = [tokenizer(" " + name, add_special_tokens=False)["input_ids"] for name in LABELS]
        if self.labels[0] == self.labels[1]:
            raise ValueError("tokenizer: the two labels tokenise identically")

    def _cut(self, text: str) -> str:
        return " ".join(text.split()[: self.max_words])

    def example(self, text: str, label: str) -> str:
        return f"Review: {self._cut(text)}\nSentiment: {label}\n"

    def prompt_ids(self, text: str, *, after_demos: bool = False) -> list[int]:
        """The query prompt; after demonstrations it gets no special tokens (those start the demonstrations)."""
        return self.tokenizer(f"Review: {self._cut(text)}\nSentiment:", add_special_tokens=not after_demos)[
            "input_ids"
        ]

    def demo_ids(self, demos: Sequence[tuple[str, str]]) -> list[int]:
        return self.tokenizer("".join(self.example(t, y) for t, y in demos))["input_ids"]

    def example_ids(self, text: str, label: str) -> list[int]:
        return self.tokenizer(self.example(text, label))["input_ids"]


def balanced_sample(support: Sequence[tuple[str, str]], k: int, rng: random.Random) -> list[tuple[str, str]]:
    """k examples per label, shuffled."""
    picked = []
    for name in LABELS:
        pool = [x for x in support if x[1] == name]
        if len(pool) < k:
            raise ValueError(f"--shots: {k} per label needs {k} support examples labelled {name!r}, found {len(pool)}")
        picked += rng.sample(pool, k)
    rng.shuffle(picked)
    return picked


def main(argv: list[str] | None = None) -> dict:
    import torch

    from faast.hf.evaluate import Prefix, continuation_log_probs, encode_prefix, wilson_interval

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--dataset", default=None, help=f"{sorted(PRESETS)} or a datasets name with text/label fields")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--data-file", default=None, help="JSONL with text, label, split (default: the shipped reviews)")
    p.add_argument("--shots", type=parse_shots, default=parse_shots("1,5,full"), help="per label; e.g. 1,5,full")
    p.add_argument("--methods", default="faast,icl", help="faast and/or icl (zero-shot always runs)")
    p.add_argument("--limit", type=int, default=None, help="queries scored (distinct, never repeated)")
    p.add_argument("--support-limit", type=int, default=5000)
    p.add_argument("--max-words", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16, help="support examples learned per batch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    if not methods <= {"faast", "icl"}:
        p.error(f"--methods: expected faast and/or icl, got {sorted(methods)}")

    model, tokenizer, description = load_model(args)
    support, queries, data = load_data(args)
    rng = random.Random(args.seed)
    rng.shuffle(support)
    rng.shuffle(queries)
    support, queries = support[: args.support_limit], queries[: args.limit]
    if not queries or not support:
        raise SystemExit(f"{data}: expected support and query examples, got {len(support)} and {len(queries)}")
    prompts = Prompts(tokenizer, args.max_words)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    print(f"{description}: {len(support)} support, {len(queries)} queries ({data})", flush=True)

    def predict(ids: list[int], prefix: Prefix | None = None) -> str:
        return LABELS[int(torch.argmax(continuation_log_probs(model, ids, prompts.labels, prefix=prefix)))]

    def icl_answer(i: int, q: tuple[str, str], draws: list) -> str:
        return predict(prompts.demo_ids(draws[i]) + prompts.prompt_ids(q[0], after_demos=True))

    def faast_answer(i: int, q: tuple[str, str], draws: list) -> str:
        model.reset_fast_weights()
        model.learn([prompts.example_ids(t, y) for t, y in draws[i]], batch_size=args.batch_size)
        return predict(prompts.prompt_ids(q[0]))

    def after_prefix(i: int, q: tuple[str, str], prefix: Prefix) -> str:  # noqa: ARG001
        return predict(prompts.prompt_ids(q[0], after_demos=True), prefix)

    rows, notes = [], []

    def score(method: str, shots: object, answers: list[str], seconds: float, learn_s: float = 0.0) -> None:
        correct = sum(a == q[1] for a, q in zip(answers, queries, strict=True))
        low, high = wilson_interval(correct, len(queries))
        rows.append({"method": method, "shots": shots, "accuracy": correct / len(queries), "ci95": [low, high],
                     "queries": len(queries), "seconds": seconds, "learn_s": learn_s,
                     "predicted_positive": sum(a == "positive" for a in answers)})  # fmt: skip
        print(f"  {method} {shots}: {correct}/{len(queries)} ({seconds:.1f} s)", flush=True)

    def fits(shots: object, lengths: list[int]) -> bool:
        """Whether every ICL prompt (with its longest label) fits in the context; a note says so when not."""
        longest = max(lengths) + max(map(len, prompts.labels))
        if context and longest > context:
            notes.append(f"ICL {shots}: not run; the longest prompt with its demonstrations takes {longest:,} tokens, "
                         f"more than the model's context of {context:,}")  # fmt: skip
            return False
        return True

    def timed(fn):  # noqa: ANN001, ANN202
        started = time.perf_counter()
        out = [fn(i, q) for i, q in enumerate(queries)]
        return out, time.perf_counter() - started

    with model.disable_faast():
        answers, seconds = timed(lambda i, q: predict(prompts.prompt_ids(q[0])))
    score("zero-shot", 0, answers, seconds)

    for shots in args.shots:
        if shots == "full":
            demos = support
            if "faast" in methods:
                model.reset_fast_weights()
                started = time.perf_counter()
                model.learn([prompts.example_ids(t, y) for t, y in demos], batch_size=args.batch_size)
                learn_s = time.perf_counter() - started
                answers, seconds = timed(lambda i, q: predict(prompts.prompt_ids(q[0])))
                score("FAAST", "full", answers, seconds, learn_s)
            if "icl" in methods:
                shared = prompts.demo_ids(demos)
                if fits("full", [len(shared) + len(prompts.prompt_ids(q[0], after_demos=True)) for q in queries]):
                    with model.disable_faast():
                        started = time.perf_counter()
                        cached = encode_prefix(model, shared)  # the same demonstrations before every query
                        learn_s = time.perf_counter() - started
                        answers, seconds = timed(partial(after_prefix, prefix=cached))
                    score("ICL", "full", answers, seconds, learn_s)
            continue
        draws = [
            balanced_sample(support, shots, random.Random(f"{args.seed}/{i}/{shots}")) for i in range(len(queries))
        ]
        if "faast" in methods:
            answers, seconds = timed(partial(faast_answer, draws=draws))
            score("FAAST", shots, answers, seconds)
        lengths = [
            len(prompts.demo_ids(d)) + len(prompts.prompt_ids(q[0], after_demos=True))
            for d, q in zip(draws, queries, strict=True)
        ]
        if "icl" in methods and fits(shots, lengths):
            with model.disable_faast():
                answers, seconds = timed(partial(icl_answer, draws=draws))
            score("ICL", shots, answers, seconds)
    model.reset_fast_weights()

    payload = {"model": description, "data": data, "support": len(support), "queries": len(queries),
               "max_words": args.max_words, "layers": model.faast_config.layers, "rows": rows, "notes": notes,
               "seed": args.seed, "torch_threads": torch.get_num_threads()}  # fmt: skip
    lines = [
        f"# Few-shot sentiment classification: {description}",
        "",
        f"{data}: {len(support)} support examples, {len(queries)} distinct queries; shots are per label. "
        "95% Wilson interval over the queries.",
        "",
        *table(
            ["method", "shots per label", "accuracy", "95% CI", "predicted positive", "time per query, ms"],
            [
                [
                    r["method"],
                    r["shots"],
                    f"{100 * r['accuracy']:.1f}%",
                    f"{100 * r['ci95'][0]:.1f}–{100 * r['ci95'][1]:.1f}%",
                    r["predicted_positive"],
                    f"{1000 * r['seconds'] / r['queries']:.0f}",
                ]
                for r in rows
            ],  # fmt: skip
        ),
        *[f"- {n}" for n in notes],
    ]
    write_results(args, "lm_sentiment", payload, lines)
    return payload


if __name__ == "__main__":
    main()
