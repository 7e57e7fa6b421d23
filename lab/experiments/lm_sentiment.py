"""Few-shot sentiment classification with a causal LM: FAAST against in-context learning (issue 6).

    python -m faast_lab.experiments.lm_sentiment                          # embedded default, shipped reviews (offline)
    python -m faast_lab.experiments.lm_sentiment --model gpt2-xl --dataset sst2    # where the hub is reachable
    python -m faast_lab.experiments.lm_sentiment --model gpt2-xl --dataset imdb --shots 1,2,full

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

Data: `--dataset sst2|imdb` (datasets library), or `--data-file` (JSONL with text, label, split = train|test, read
through the datasets library's json builder), by default lab/experiments/data/reviews.jsonl written for this project.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from faast_lab.experiments._common import (
    DATA,
    add_model_arguments,
    load_model,
    read_split_jsonl,
    start_record,
    table,
    write_results,
)

DEFAULT_DATA = DATA / "reviews.jsonl"
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    args.methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    if not args.methods <= {"faast", "icl"}:
        p.error(f"--methods: expected faast and/or icl, got {sorted(args.methods)}")
    return args


class Scoring:
    """Zero-shot, FAAST and ICL answers for every query, each method's row (accuracy, Wilson interval, time) and the
    notes on ICL settings that do not fit in the context."""

    def __init__(self, model, prompts: Prompts, support: list, queries: list, args: argparse.Namespace):  # noqa: ANN001
        self.model, self.prompts, self.support, self.queries, self.args = model, prompts, support, queries, args
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def predict(self, ids: list[int], prefix: object = None) -> str:
        import torch

        from faast.hf.evaluate import continuation_log_probs

        log_probs = continuation_log_probs(self.model, ids, self.prompts.labels, prefix=prefix)
        return LABELS[int(torch.argmax(log_probs))]

    def alone(self, i: int, q: tuple[str, str]) -> str:  # noqa: ARG002
        return self.predict(self.prompts.prompt_ids(q[0]))

    def icl_answer(self, i: int, q: tuple[str, str], draws: list) -> str:
        return self.predict(self.prompts.demo_ids(draws[i]) + self.prompts.prompt_ids(q[0], after_demos=True))

    def faast_answer(self, i: int, q: tuple[str, str], draws: list) -> str:
        self.model.reset_fast_weights()
        self.model.learn([self.prompts.example_ids(t, y) for t, y in draws[i]], batch_size=self.args.batch_size)
        return self.predict(self.prompts.prompt_ids(q[0]))

    def after_prefix(self, i: int, q: tuple[str, str], prefix: object) -> str:  # noqa: ARG002
        return self.predict(self.prompts.prompt_ids(q[0], after_demos=True), prefix)

    def timed(self, fn) -> tuple[list[str], float]:  # noqa: ANN001
        started = time.perf_counter()
        out = [fn(i, q) for i, q in enumerate(self.queries)]
        return out, time.perf_counter() - started

    def score(self, method: str, shots: object, answers: list[str], seconds: float, learn_s: float = 0.0) -> None:
        from faast.hf.evaluate import wilson_interval

        queries = self.queries
        correct = sum(a == q[1] for a, q in zip(answers, queries, strict=True))
        low, high = wilson_interval(correct, len(queries))
        self.rows.append({"method": method, "shots": shots, "accuracy": correct / len(queries), "ci95": [low, high],
                          "queries": len(queries), "seconds": seconds, "learn_s": learn_s,
                          "predicted_positive": sum(a == "positive" for a in answers)})  # fmt: skip
        print(f"  {method} {shots}: {correct}/{len(queries)} ({seconds:.1f} s)", flush=True)

    def fits(self, shots: object, lengths: list[int]) -> bool:
        """Whether every ICL prompt (with its longest label) fits in the context; a note says so when not."""
        longest = max(lengths) + max(map(len, self.prompts.labels))
        if self.context and longest > self.context:
            self.notes.append(f"ICL {shots}: not run; the longest prompt with its demonstrations takes {longest:,} "
                              f"tokens, more than the model's context of {self.context:,}")  # fmt: skip
            return False
        return True

    def zero_shot(self) -> None:
        with self.model.disable_faast():
            answers, seconds = self.timed(self.alone)
        self.score("zero-shot", 0, answers, seconds)

    def full(self, methods: set[str]) -> None:
        """FAAST learns the whole support set once; ICL puts it before every query (its KV cache computed once)."""
        from faast.hf.evaluate import encode_prefix

        model, prompts, demos = self.model, self.prompts, self.support
        if "faast" in methods:
            model.reset_fast_weights()
            started = time.perf_counter()
            model.learn([prompts.example_ids(t, y) for t, y in demos], batch_size=self.args.batch_size)
            learn_s = time.perf_counter() - started
            answers, seconds = self.timed(self.alone)
            self.score("FAAST", "full", answers, seconds, learn_s)
        if "icl" in methods:
            shared = prompts.demo_ids(demos)
            lengths = [len(shared) + len(prompts.prompt_ids(q[0], after_demos=True)) for q in self.queries]
            if self.fits("full", lengths):
                with model.disable_faast():
                    started = time.perf_counter()
                    cached = encode_prefix(model, shared)  # the same demonstrations before every query
                    learn_s = time.perf_counter() - started
                    answers, seconds = self.timed(partial(self.after_prefix, prefix=cached))
                self.score("ICL", "full", answers, seconds, learn_s)

    def k_shot(self, shots: int, methods: set[str]) -> None:
        """k examples per label drawn for each query (seeded by its index): FAAST learns them, ICL prepends them."""
        seed, queries = self.args.seed, self.queries
        draws = [
            balanced_sample(self.support, shots, random.Random(f"{seed}/{i}/{shots}")) for i in range(len(queries))
        ]
        if "faast" in methods:
            answers, seconds = self.timed(partial(self.faast_answer, draws=draws))
            self.score("FAAST", shots, answers, seconds)
        lengths = [
            len(self.prompts.demo_ids(d)) + len(self.prompts.prompt_ids(q[0], after_demos=True))
            for d, q in zip(draws, queries, strict=True)
        ]
        if "icl" in methods and self.fits(shots, lengths):
            with self.model.disable_faast():
                answers, seconds = self.timed(partial(self.icl_answer, draws=draws))
            self.score("ICL", shots, answers, seconds)


def report_lines(payload: dict) -> list[str]:
    """The Markdown below the title: the setting, the methods' table and the notes."""
    return [
        f"{payload['data']}: {payload['support']} support examples, {payload['queries']} distinct queries; shots are "
        "per label. 95% Wilson interval over the queries.",
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
                for r in payload["rows"]
            ],  # fmt: skip
        ),
        *[f"- {n}" for n in payload["notes"]],
    ]


def main(argv: list[str] | None = None) -> dict:
    import torch

    args = parse_args(argv)
    record = start_record()
    model, tokenizer, description = load_model(args)
    support, queries, data = load_data(args)
    rng = random.Random(args.seed)
    rng.shuffle(support)
    rng.shuffle(queries)
    support, queries = support[: args.support_limit], queries[: args.limit]
    if not queries or not support:
        raise SystemExit(f"{data}: expected support and query examples, got {len(support)} and {len(queries)}")
    print(f"{description}: {len(support)} support, {len(queries)} queries ({data})", flush=True)

    scoring = Scoring(model, Prompts(tokenizer, args.max_words), support, queries, args)
    scoring.zero_shot()
    for shots in args.shots:
        if shots == "full":
            scoring.full(args.methods)
        else:
            scoring.k_shot(shots, args.methods)
    model.reset_fast_weights()

    payload = {"model": description, "data": data, "support": len(support), "queries": len(queries),
               "max_words": args.max_words, "layers": [int(k) for k in model.memory_layers], "rows": scoring.rows,
               "notes": scoring.notes, "seed": args.seed, "torch_threads": torch.get_num_threads()}  # fmt: skip
    title = f"Few-shot sentiment classification: {description}"
    write_results(args, "lm_sentiment", record, payload, title, report_lines(payload))
    return payload


if __name__ == "__main__":
    main()
