"""The CPU paths on the default model, every figure from one run: tokens/s of the learning pass for each candidate and
for `auto`, next to the base model's float32 forward on the same windows, and the 32K solve for each solve candidate.

    python -m faast_lab.benchmarks.bench_cpu_paths                   # 4,096 tokens a round, 2 rounds; the solve at 32K
    python -m faast_lab.benchmarks.bench_cpu_paths --tokens 1024 --solve-tokens 4096 --rounds 1   # a quick look

The learning candidates pin learn_dtype and head_dtype (and the int8 kernel through FAAST_BACKEND); `auto` is the
default configuration, which measures the CPU paths first (into a scratch cache, so the measuring is part of this run
and its time is reported). Each round times every candidate in turn (interleaved, so load from elsewhere hits all
alike) over the same windows of the demo's domain (the stdlib's asyncio: 512-token windows, 4 a batch); a candidate
stops after the batch that takes it past --max-seconds, and its rate is from what it learned; the best round counts.
Then the default learns --solve-tokens tokens once and its solve is timed for each solve candidate: `auto` (what the
default runs: Cholesky where the cut is proven to cut nothing), float64 eigh, and the refined float32 eigh
(FAAST_BACKEND=eigh=...); the statistics are the same for all. Goals (issue "fast on the machine a user has"): auto
>= 0.95x the fastest candidate; the learning pass >= 0.8x the float32 forward on a CPU without native bfloat16; the
32K solve <= 5 s on 2 cores without native bfloat16.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from faast import hardware
from faast.hf import FaastConfig, ResidualOutput, apply_faast
from faast.hf.default import load_base_model
from faast.hf.demo import domain_files, tokens_of
from faast_lab.benchmarks import _harness as H

CANDIDATES = {
    "float32": ("model", "float32", None),
    "bfloat16": ("bfloat16", "bfloat16", None),
    "int8 (fbgemm)": ("int8", "int8", "int8_linear=torch.fbgemm"),
    "int8 (_int_mm)": ("int8", "int8", "int8_linear=torch.int_mm"),
    "auto": ("auto", "auto", None),
}
SOLVES = {"auto": None, "float64 eigh": "eigh=torch", "refined eigh": "eigh=torch.refined"}
WINDOW, BATCH = 512, 4


@contextlib.contextmanager
def _backend(value: str | None) -> Iterator[None]:
    saved = os.environ.get("FAAST_BACKEND")
    if value is None:
        os.environ.pop("FAAST_BACKEND", None)
    else:
        os.environ["FAAST_BACKEND"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("FAAST_BACKEND", None)
        else:
            os.environ["FAAST_BACKEND"] = saved


def _batches(ids: list[list[int]], tokens: int) -> list[torch.Tensor]:
    flat = [t for text in ids for t in text][:tokens]
    rows = [flat[i : i + WINDOW] for i in range(0, len(flat) - WINDOW + 1, WINDOW)]
    return [torch.tensor(rows[i : i + BATCH]) for i in range(0, len(rows), BATCH)]


def _learn_rate(model: object, batches: list[torch.Tensor], max_seconds: float) -> dict:
    tokens, seconds = 0, 0.0
    for batch in batches:
        stats = model.learn(batch, progress=False)
        tokens, seconds = tokens + stats.tokens, seconds + stats.seconds
        if seconds > max_seconds:
            break
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _forward_rate(base: torch.nn.Module, batches: list[torch.Tensor]) -> dict:
    start, tokens = time.perf_counter(), 0
    with torch.no_grad():
        for batch in batches:
            base(input_ids=batch)
            tokens += batch.numel()
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _config(learn: str, head: str) -> FaastConfig:
    return FaastConfig(output=ResidualOutput(head_dtype=head), learn_dtype=learn)


def run(args: argparse.Namespace) -> dict:
    base, tokenizer, _ = load_base_model("smollm2")
    learn_files, _ = domain_files("asyncio")
    ids = tokens_of(learn_files, tokenizer, max(args.tokens, args.solve_tokens))
    batches = _batches(ids, args.tokens)
    rounds: list[dict] = []
    precision: dict = {}
    started = time.perf_counter()
    model = apply_faast(base, _config("auto", "auto"))
    model.learn(batches[0][:1, :64], progress=False)  # auto measures the CPU paths here (into the scratch cache)
    measuring_s = time.perf_counter() - started
    precision["auto"] = model.learner.precision()
    base = model.remove_faast()
    for r in range(args.rounds):
        row = {"forward float32": _forward_rate(base, batches)}
        for name, (learn, head, backend) in CANDIDATES.items():
            if name not in args.candidates:
                continue
            with _backend(backend):
                model = apply_faast(base, _config(learn, head))
                row[name] = _learn_rate(model, batches, args.max_seconds)
                precision.setdefault(name, model.learner.precision())
                base = model.remove_faast()
            print(f"round {r + 1} {name:15} {row[name]['tokens_per_s']:8.1f} tokens/s", file=sys.stderr, flush=True)
        rounds.append(row)
    best = {name: max(rnd[name]["tokens_per_s"] for rnd in rounds) for name in rounds[0]}
    model = apply_faast(base, _config("auto", "auto"))
    solve_ids = [t for text in ids for t in text][: args.solve_tokens]
    learned = model.learn([solve_ids], max_length=WINDOW, batch_size=BATCH, progress=False)
    solves = {}
    for name, backend in SOLVES.items():
        with _backend(backend):
            model.output_memory_layer.restore_step(None)  # drops the cached solution: the same statistics again
            start = time.perf_counter()
            model.solve(progress=False)
            solves[name] = time.perf_counter() - start
        print(f"solve {name:15} {solves[name]:.2f} s", file=sys.stderr, flush=True)
    return {"rounds": rounds, "best_tokens_per_s": best, "precision": precision, "measuring_s": measuring_s,
            "solve_s": solves, "solve_learned_tokens": learned.tokens, "tokens": args.tokens,
            "machine": hardware.machine_key(), "cpu_flags": list(hardware.cpu_flags()),
            "native_bf16": hardware.cpu_has_bf16()}  # fmt: skip


def goals(result: dict) -> list[tuple[str, str, bool | None]]:
    best = result["best_tokens_per_s"]
    learners = {k: v for k, v in best.items() if k in CANDIDATES and k != "auto"} or {"auto": best["auto"]}
    fastest = max(learners, key=learners.__getitem__)
    auto_ratio = best["auto"] / learners[fastest]
    forward_ratio = best["auto"] / best["forward float32"]
    native = result["native_bf16"]
    solve = result["solve_s"]["auto"]
    return [
        ("auto >= 0.95x the fastest candidate", f"{auto_ratio:.2f}x ({fastest})", auto_ratio >= 0.95),
        ("learning pass >= 0.8x the float32 forward (no native bf16)", f"{forward_ratio:.2f}x",
         None if native else forward_ratio >= 0.8),
        ("32K solve <= 5 s (2 cores, no native bf16)", f"{solve:.1f} s at {result['solve_learned_tokens']:,} tokens",
         None if native or result["solve_learned_tokens"] < 32768 else solve <= 5.0),
    ]  # fmt: skip


def markdown(result: dict) -> list[str]:
    best = result["best_tokens_per_s"]
    forward = best["forward float32"]
    fastest = max(v for k, v in best.items() if k in CANDIDATES)
    lines = [
        f"Machine: {result['machine']}; native bfloat16: {result['native_bf16']}.",
        "",
        f"Learning pass, {result['tokens']:,} tokens a round, best of {len(result['rounds'])} "
        "(512-token windows, 4 a batch; asyncio):",
        "",
        "| path | what it computes in | tokens/s | × float32 forward | × fastest |",
        "|---|---|---|---|---|",
    ]
    for name, rate in best.items():
        p = result["precision"].get(name)
        what = "the base model, no memory" if p is None else (
            f"pass {p['learn_pass']}, head {p['head_products']}, pool {p['head_pool_below']}")  # fmt: skip
        lines.append(f"| {name} | {what} | {rate:,.1f} | {rate / forward:.2f} | {rate / fastest:.2f} |")
    lines += [
        "",
        f"auto's one-time measurement of the CPU paths: {result['measuring_s']:.1f} s.",
        "",
        f"Solve after learning {result['solve_learned_tokens']:,} tokens:",
        "",
        "| solve | seconds |",
        "|---|---|",
    ]
    lines += [f"| {name} | {s:.2f} |" for name, s in result["solve_s"].items()]
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'n/a' if ok is None else ('yes' if ok else 'no')} |" for g, m, ok in goals(result)]
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens each candidate learns per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=60.0, help="a candidate stops after the batch past this")
    p.add_argument("--solve-tokens", type=int, default=32768)
    p.add_argument("--candidates", default=",".join(CANDIDATES), help=f"a subset of {','.join(CANDIDATES)}")
    p.add_argument(
        "--out", type=Path, default=None, help="result stem (default: lab/benchmarks/results/cpu_paths_<cpu>)"
    )
    args = p.parse_args(argv)
    args.candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    if "auto" not in args.candidates or set(args.candidates) - set(CANDIDATES):
        p.error(f"--candidates: expected a subset of {list(CANDIDATES)} with auto, got {args.candidates}")
    record = H.start()
    with tempfile.TemporaryDirectory() as folder:
        os.environ["FAAST_AUTOTUNE_CACHE"] = str(Path(folder) / "autotune.json")
        result = run(args)
    stem = args.out or H.RESULTS / f"cpu_paths_{_machine_slug()}"
    body = markdown(result)
    H.write(stem, record, result, "The CPU paths on the default model", body)
    print("\n".join(body))
    return result


def _machine_slug() -> str:
    name = hardware.cpu_model().split("(")[0].strip().lower().replace(" ", "_")
    return f"{name}_{'_'.join(f for f in hardware.cpu_flags() if f.startswith(('avx512', 'amx')))[:40] or 'avx2'}"


if __name__ == "__main__":
    main()
