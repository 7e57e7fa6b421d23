"""Translation after test-time learning: FAAST against in-context learning, sacrebleu BLEU (issue 6).

    python -m faast_lab.experiments.lm_translation                                    # embedded default, shipped pairs
    python -m faast_lab.experiments.lm_translation --model Qwen/Qwen2.5-3B-Instruct --dataset iwslt2017 --num-beams 5

Protocol (docs/authors.md §2.11, without its mistakes): with a chat template the system turn is "You are a helpful
assistant." and the user turn `Please translate <Src> text into <Tgt>.\\n\\n<Src>: <src>\\n<Tgt>:`; the reference is
the assistant turn when learning. Without a chat template the same text is a plain prompt and the reference follows it.
- 1-shot: for each query one support pair is drawn (seeded by the query's index, shared by FAAST and ICL). FAAST
  resets and learns that conversation, then translates the query alone; ICL puts it before the query as earlier turns.
- full: FAAST learns every support pair (up to `--support-limit`) once, then translates every query.
- zero-shot: the query alone.
Generation is greedy (`--num-beams 1`) or beam search, with the KV cache, at most `--max-new-tokens`, keeping the
first line. BLEU is sacrebleu's corpus BLEU over distinct queries, with a bootstrap 95% interval computed once per
method (not after every query).

Data: `--dataset iwslt2017` (datasets library, config iwslt2017-<src>-<tgt>, train -> test), or `--data-file` (JSONL
with one field per language code and split = train|test, read through the datasets library's json builder), by default
lab/experiments/data/parallel_en_de_fr.jsonl written for this project. `--pairs` lists the directions, e.g.
en-de,de-en,en-fr,fr-en.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
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

DEFAULT_DATA = DATA / "parallel_en_de_fr.jsonl"
LANGUAGES = {"en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "nl": "Dutch",
             "pt": "Portuguese", "ru": "Russian", "zh": "Chinese", "ja": "Japanese", "ko": "Korean"}  # fmt: skip
SYSTEM = "You are a helpful assistant."


def load_pairs(args: argparse.Namespace, src: str, tgt: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(support [(source, reference)], queries [(source, reference)]) for one direction."""
    if args.dataset:
        from datasets import load_dataset

        config = args.dataset_config or (f"iwslt2017-{src}-{tgt}" if args.dataset == "iwslt2017" else None)
        data = load_dataset(args.dataset, config)

        def rows(split: str) -> list[tuple[str, str]]:
            return [(r["translation"][src], r["translation"][tgt]) for r in data[split]]

        return rows(args.support_split), rows(args.query_split)
    path = Path(args.data_file or DEFAULT_DATA)
    train, test = read_split_jsonl(path, (src, tgt))
    support, queries = [(r[src], r[tgt]) for r in train], [(r[src], r[tgt]) for r in test]
    return support, queries


class Prompts:
    """Token ids of translation prompts under one tokenizer, with its chat template when it has one."""

    def __init__(self, tokenizer: object, src: str, tgt: str):
        self.tokenizer = tokenizer
        self.src, self.tgt = LANGUAGES.get(src, src), LANGUAGES.get(tgt, tgt)
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def _user(self, text: str) -> str:
        return f"Please translate {self.src} text into {self.tgt}.\n\n{self.src}: {text}\n{self.tgt}:"

    def _messages(self, demos: Sequence[tuple[str, str]], query: str | None, answer: str | None) -> list[dict]:
        messages = [{"role": "system", "content": SYSTEM}]
        for s, t in demos:
            messages += [{"role": "user", "content": self._user(s)}, {"role": "assistant", "content": t}]
        if query is not None:
            messages.append({"role": "user", "content": self._user(query)})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
        return messages

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"]

    def example_ids(self, source: str, reference: str) -> list[int]:
        """A conversation to learn: the prompt followed by its reference."""
        if self.chat:
            return self._ids(self.tokenizer.apply_chat_template(self._messages([], source, reference), tokenize=False))
        return self._ids(f"{self._user(source)} {reference}\n")

    def prompt_ids(self, source: str, demos: Sequence[tuple[str, str]] = ()) -> list[int]:
        """The query prompt, after the demonstrations (ICL) if any, ready for the model to write the translation."""
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                self._messages(demos, source, None), tokenize=False, add_generation_prompt=True
            )
            return self._ids(text)
        return self._ids("".join(f"{self._user(s)} {t}\n" for s, t in demos) + self._user(source))


def first_line_criteria(tokenizer: object, prompt_length: int):  # noqa: ANN201 - a StoppingCriteriaList
    """Stop a row once its continuation holds a line break (only the first line is kept)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class FirstLine(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:  # noqa: ANN003, ARG002
            done = [
                "\n" in tokenizer.decode(row[prompt_length:], skip_special_tokens=True).lstrip() for row in input_ids
            ]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([FirstLine()])


def translate(model, tokenizer, ids: list[int], args: argparse.Namespace) -> str:  # noqa: ANN001
    """Generate with the KV cache and keep the first line of the continuation."""
    import torch

    device = model.get_input_embeddings().weight.device
    batch = torch.as_tensor([ids], dtype=torch.long, device=device)
    room = int(getattr(model.config, "max_position_embeddings", 0) or 0) - len(ids)
    new = min(args.max_new_tokens, room) if room > 0 else args.max_new_tokens
    out = model.generate(
        input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=max(1, new), num_beams=args.num_beams,
        do_sample=False, use_cache=True, early_stopping=args.num_beams > 1, pad_token_id=tokenizer.pad_token_id,
        stopping_criteria=first_line_criteria(tokenizer, len(ids)),
    )  # fmt: skip
    text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    return text.strip().split("\n")[0].strip()


def bleu(hypotheses: list[str], references: list[str], bootstrap: int) -> dict:
    """sacrebleu corpus BLEU, with a bootstrap mean and 95% half-width (bootstrap > 0 and at least 2 queries)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    score = metric.corpus_score(hypotheses, [references])
    out = {"bleu": score.score, "signature": str(metric.get_signature())}
    if bootstrap and len(hypotheses) >= 2:
        boot = metric.corpus_score(hypotheses, [references], n_bootstrap=bootstrap)
        out["bootstrap_mean"], out["ci95_half_width"] = boot._mean, boot._ci  # sacrebleu's documented fields
    return out


def run_direction(model, tokenizer, args, src, tgt, shots, methods, rows) -> dict:  # noqa: ANN001, PLR0913
    """Zero-shot, FAAST and ICL for one direction; appends result rows and returns a few example outputs."""
    support, queries = load_pairs(args, src, tgt)
    rng = random.Random(args.seed)
    rng.shuffle(support)
    rng.shuffle(queries)
    support, queries = support[: args.support_limit], queries[: args.limit]
    if not support or not queries:
        raise SystemExit(f"{src}-{tgt}: expected support and query pairs, got {len(support)} and {len(queries)}")
    prompts = Prompts(tokenizer, src, tgt)
    references = [r for _, r in queries]
    print(f"{src}->{tgt}: {len(support)} support, {len(queries)} queries (chat template: {prompts.chat})", flush=True)
    samples = {}

    def run(method: str, shot: str, fn, learn_s: float = 0.0) -> None:  # noqa: ANN001
        started = time.perf_counter()
        hyps = [fn(i, q) for i, q in enumerate(queries)]
        seconds = time.perf_counter() - started
        rows.append({"pair": f"{src}-{tgt}", "method": method, "shots": shot, "queries": len(queries),
                     "seconds": seconds, "learn_s": learn_s, **bleu(hyps, references, args.bootstrap)})  # fmt: skip
        samples[f"{method} {shot}"] = hyps[:3]
        print(f"  {method} {shot}: BLEU {rows[-1]['bleu']:.2f} ({seconds:.1f} s)", flush=True)

    def alone(i: int, q: tuple[str, str]) -> str:
        return translate(model, tokenizer, prompts.prompt_ids(q[0]), args)

    draws = [random.Random(f"{args.seed}/{i}").choice(support) for i in range(len(queries))]

    def one_shot(i: int, q: tuple[str, str]) -> str:
        model.reset_fast_weights()
        model.learn([prompts.example_ids(*draws[i])])
        return alone(i, q)

    def in_context(i: int, q: tuple[str, str]) -> str:
        return translate(model, tokenizer, prompts.prompt_ids(q[0], [draws[i]]), args)

    with model.disable_faast():
        run("zero-shot", "0", alone)
    if "1" in shots and "faast" in methods:
        run("FAAST", "1", one_shot)
    if "1" in shots and "icl" in methods:
        with model.disable_faast():
            run("ICL", "1", in_context)
    if "full" in shots and "faast" in methods:
        model.reset_fast_weights()
        started = time.perf_counter()
        model.learn([prompts.example_ids(s, t) for s, t in support], batch_size=args.batch_size)
        run("FAAST", "full", alone, time.perf_counter() - started)
    model.reset_fast_weights()
    return {"sources": [q for q, _ in queries[:3]], "references": references[:3], **samples}


def main(argv: list[str] | None = None) -> dict:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--dataset", default=None, help="e.g. iwslt2017 (fields translation[<lang>])")
    p.add_argument("--dataset-config", default=None, help="default for iwslt2017: iwslt2017-<src>-<tgt>")
    p.add_argument("--support-split", default="train")
    p.add_argument("--query-split", default="test")
    p.add_argument("--data-file", default=None, help="JSONL with a field per language and split (default: shipped)")
    p.add_argument("--pairs", default="en-de,de-en,en-fr,fr-en")
    p.add_argument("--shots", default="1,full", help="1 and/or full")
    p.add_argument("--methods", default="faast,icl", help="faast and/or icl (zero-shot always runs)")
    p.add_argument("--limit", type=int, default=40, help="queries per direction (distinct, never repeated)")
    p.add_argument("--support-limit", type=int, default=5000)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="support conversations learned per batch")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    pairs = [tuple(x.strip().split("-")) for x in args.pairs.split(",") if x.strip()]
    if not pairs or any(len(x) != 2 for x in pairs):
        p.error(f"--pairs: expected directions like en-de,de-en, got {args.pairs!r}")
    shots = [s.strip() for s in args.shots.split(",") if s.strip()]
    methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    if not set(shots) <= {"1", "full"} or not methods <= {"faast", "icl"}:
        p.error("--shots: expected 1 and/or full; --methods: faast and/or icl")

    record = start_record()
    model, tokenizer, description = load_model(args)
    rows, examples = [], {}
    for src, tgt in pairs:
        examples[f"{src}-{tgt}"] = run_direction(model, tokenizer, args, src, tgt, shots, methods, rows)

    payload = {"model": description, "data": args.dataset or Path(args.data_file or DEFAULT_DATA).name,
               "num_beams": args.num_beams, "layers": [int(k) for k in model.memory_layers], "rows": rows,
               "examples": examples,
               "seed": args.seed, "torch_threads": torch.get_num_threads()}  # fmt: skip
    lines = [
        f"{payload['data']}; {'greedy' if args.num_beams == 1 else f'beam {args.num_beams}'} decoding with the KV "
        "cache; sacrebleu corpus BLEU over distinct queries (95% bootstrap half-width).",
        "",
        *table(
            ["direction", "method", "shots", "BLEU", "± 95%", "queries", "time per query, s"],
            [
                [
                    r["pair"],
                    r["method"],
                    r["shots"],
                    f"{r['bleu']:.2f}",
                    f"{r['ci95_half_width']:.2f}" if "ci95_half_width" in r else "—",
                    r["queries"],
                    f"{r['seconds'] / r['queries']:.2f}",
                ]
                for r in rows
            ],  # fmt: skip
        ),
    ]
    write_results(args, "lm_translation", record, payload, f"Translation after learning: {description}", lines)
    return payload


if __name__ == "__main__":
    main()
