"""FAAST's learn + solve time over one LoRA epoch's, timed again and again on the same domain (issue 74's time goal).

    python -m faast_lab.experiments.lm_suite_timing --domains multiprocessing idlelib --repeats 3 \
        --out lab/experiments/results/lm_suite_timing_cpu
    python -m faast_lab.experiments.lm_suite_timing --report lab/experiments/results/lm_suite_timing_cpu

The suite (lm_suite) times each domain's FAAST pass and its LoRA epoch once, minutes apart, and a virtual machine's
speed drifts within a run: one domain's ratio says little on its own. Here each repetition times both on the same
tokens, in alternating order (FAAST first, then LoRA first), and a short reference product (REFERENCE_ROWS: a float32
product of a learning batch's rows) is timed just before and just after each, so the report can give each ratio as
measured and with each phase's time scaled by the speed the reference saw during it. No text is scored: the suite's
shards hold the perplexities of the same passes.

Per domain: the suite's learned tokens (lm_suite: --learn-tokens of the manifest's learned files); FAAST with the
shipped default on the float32 path (FaastConfig(learn_dtype='model'), head_dtype='float32'), learned in one call and
solved once; one LoRA epoch as lm_suite's peer (lm_domains_peers: the rank matched to the shipped readout's layers,
--train-window, --train-batch-size, --lora-lr). With --base, each round also times the frozen base model's forward
over the learning pass's windows and batches, logits included: what any forward-only pass costs at least, and what
LoRA's epoch runs before its backward. The report then gives FAAST's pass over it, and it over LoRA's epoch. One
record per domain (a shard), resumable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from faast_lab.experiments import suite
from faast_lab.experiments._common import ModelLoader
from faast_lab.experiments.lm_suite import write_shards

# The reference: a learning batch's rows (ROWS × d) by a d × 4d matrix in float32, repeated REPEATS times: the
# machine's speed at that moment, in GFLOP/s. It is short (under a second), so it reads the moment, not the phase.
REFERENCE_ROWS, REFERENCE_REPEATS = 2048, 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", nargs="+", default=None, help="suite domains (default: all of the manifest)")
    p.add_argument("--repeats", type=int, default=3, help="timings of each side per domain")
    p.add_argument("--warmup", type=int, default=0, help="untimed FAAST learn + solve runs before a domain's rounds")
    p.add_argument("--base", action="store_true", help="also time the base model's forward over the same windows")
    p.add_argument("--out", type=Path, help="the folder of the shard records (<domain>.json)")
    p.add_argument("--report", type=Path, help="print the report of this folder's shards instead of running")
    p.add_argument("--learn-tokens", type=int, default=32768)
    p.add_argument("--learn-window", type=int, default=256)
    p.add_argument("--learn-batch-size", type=int, default=8)
    p.add_argument("--train-window", type=int, default=256)
    p.add_argument("--train-batch-size", type=int, default=4)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--manifest", type=Path, default=suite.MANIFEST)
    args = p.parse_args(argv)
    if (args.out is None) == (args.report is None):
        p.error("expected one of --out (run) and --report (print the report)")
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats, --warmup: expected at least 1 and 0, got {args.repeats} and {args.warmup}")
    return args


def reference_gflops(hidden: int) -> float:
    """The machine's speed now: GFLOP/s of REFERENCE_REPEATS float32 products [REFERENCE_ROWS, d] @ [d, 4d]."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(REFERENCE_ROWS, hidden, generator=gen)
    b = torch.randn(hidden, 4 * hidden, generator=gen)
    a @ b  # the first call allocates
    started = time.perf_counter()
    for _ in range(REFERENCE_REPEATS):
        a @ b
    seconds = time.perf_counter() - started
    return 2 * REFERENCE_ROWS * hidden * 4 * hidden * REFERENCE_REPEATS / seconds / 1e9


def time_faast(base: object, learn: list[list[int]], args: argparse.Namespace) -> dict:
    """The shipped default on the float32 path: one learn() call over every text, one solve."""
    from faast.hf import FaastConfig, ResidualOutput, apply_faast

    model = apply_faast(base, FaastConfig(learn_dtype="model", output=ResidualOutput(head_dtype="float32")))
    try:
        started = time.perf_counter()
        model.learn(learn, max_length=args.learn_window, batch_size=args.learn_batch_size, progress=False)
        pass_s = time.perf_counter() - started
        started = time.perf_counter()
        model.solve(progress=False)
        solve_s = time.perf_counter() - started
    finally:
        model.remove_faast()
    return {"pass_s": pass_s, "solve_s": solve_s, "seconds": pass_s + solve_s}


def time_base(base: object, learn: list[list[int]], args: argparse.Namespace) -> dict:
    """The frozen base model's forward, logits included, over the windows FAAST learns ([--learn-window] tokens
    overlapping by one, --learn-batch-size to a batch, right padded): its seconds."""
    import torch

    from faast.hf.tokens import overlapping_windows, pad_rows

    windows = [w for ids in learn for w in overlapping_windows(ids, args.learn_window)]
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(windows), args.learn_batch_size):
            ids, mask = pad_rows(windows[i : i + args.learn_batch_size])
            base(input_ids=ids, attention_mask=mask)
    return {"seconds": time.perf_counter() - started, "windows": len(windows)}


def time_lora(base: object, learn: list[list[int]], args: argparse.Namespace) -> dict:
    """One LoRA epoch as the suite's peer (lm_domains_peers.run_backprop): its training seconds."""
    import torch

    from faast.hf import FaastConfig
    from faast.hf.default import DEFAULT_READOUT
    from faast_lab.experiments.lm_baselines import apply_lora, fit_causal_lm
    from faast_lab.experiments.lm_domains_peers import lora_rank

    layers = FaastConfig.load(DEFAULT_READOUT / "faast_config.json").middle.layers
    torch.manual_seed(0)
    lora = apply_lora(base, lora_rank(base, layers))
    try:
        trainable = [p for p in lora.parameters() if p.requires_grad]
        stats = fit_causal_lm(lora, trainable, learn, window=args.train_window, batch_size=args.train_batch_size,
                              lr=args.lora_lr, epochs=1)  # fmt: skip
    finally:
        lora.unload()
    return {"seconds": stats.seconds, "steps": stats.steps, "last_loss": stats.last_loss}


def timed(phase: Callable[[], dict], hidden: int) -> dict:
    """A phase's times with the reference's speed just before and just after it."""
    before = reference_gflops(hidden)
    row = phase()
    return {**row, "reference_gflops": [before, reference_gflops(hidden)]}


def run_domain(name: str, base: object, tokenizer: object, args: argparse.Namespace, manifest: Mapping,
               bases: Mapping | None, tick: Callable[[], None]) -> dict:  # fmt: skip
    """One shard: `repeats` rounds of FAAST and LoRA (and the base forward, with --base) on the domain's learned
    tokens, FAAST first in even rounds and the order reversed in odd ones."""
    from faast.hf.tokens import token_lists

    learn_texts, _, record = suite.domain_texts(name, manifest, bases)
    learn = token_lists(learn_texts, tokenizer, args.learn_tokens)
    hidden = base.config.hidden_size
    # The machine reads slower when a domain's rounds begin (the reference product too, before any FAAST work): the
    # first round's first side pays for it. Untimed runs first make the rounds start on a busy machine.
    for _ in range(args.warmup):
        time_faast(base, learn, args)
    rounds = []
    for r in range(args.repeats):
        sides = {"faast": lambda: time_faast(base, learn, args), "lora": lambda: time_lora(base, learn, args)}
        if args.base:
            sides["base"] = lambda: time_base(base, learn, args)
        order = tuple(sides) if r % 2 == 0 else tuple(reversed(sides))
        row: dict = {"order": list(order)}
        for side in order:
            row[side] = timed(sides[side], hidden)
            tick()
        row["ratio"] = row["faast"]["seconds"] / row["lora"]["seconds"]
        also = ""
        if args.base:
            row["base_ratio"] = row["base"]["seconds"] / row["lora"]["seconds"]
            row["faast_over_base"] = row["faast"]["pass_s"] / row["base"]["seconds"]
            also = f", base forward {row['base']['seconds']:.1f} s"
        print(f"{name} round {r + 1}: FAAST {row['faast']['seconds']:.1f} s, LoRA {row['lora']['seconds']:.1f} s"
              f"{also}, ratio {row['ratio']:.3f}", flush=True)  # fmt: skip
        rounds.append(row)
    return {"domain": name, "kind": record["kind"], "suite_domain": record,
            "learned_tokens": sum(len(x) for x in learn), "rounds": rounds}  # fmt: skip


def protocol(args: argparse.Namespace, description: str) -> dict:
    keep = ("repeats", "warmup", "learn_tokens", "learn_window", "learn_batch_size", "train_window",
            "train_batch_size", "lora_lr")  # fmt: skip
    # "base" only where it ran, so the folders timed before it resume under the protocol they ran
    return {"model": description, "path": "float32", "reference": {"rows": REFERENCE_ROWS,
            "repeats": REFERENCE_REPEATS}, **{k: getattr(args, k) for k in keep},
            **({"base": True} if args.base else {})}  # fmt: skip


def main(argv: list[str] | None = None, *, load_model: ModelLoader | None = None, manifest: Mapping | None = None,
         bases: Mapping[str, Path] | None = None) -> list[Path]:  # fmt: skip
    """Run the shards not yet in --out (or print --report's); returns every shard's path. load_model, manifest,
    bases: as lm_suite.main's (tests)."""
    args = parse_args(argv)
    if args.report is not None:
        paths = sorted(args.report.glob("*.json"))
        print(report(paths))
        return paths
    from faast.hf.default import load_base_model
    from faast.hf.progress import Bar, enabled

    manifest = suite.load_manifest(args.manifest) if manifest is None else manifest
    names = args.domains or [d["name"] for d in manifest["domains"]]
    for name in names:
        suite.entry(name, manifest)  # an unknown name fails before any model loads
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [n for n in names if not (args.out / f"{n}.json").is_file()]
    base, tokenizer, description = (load_model or load_base_model)("smollm2")
    wanted, suite_sha = protocol(args, description), suite.manifest_sha256(manifest)
    for name in sorted(set(names) - set(todo)):
        have = json.loads((args.out / f"{name}.json").read_text(encoding="utf-8"))
        if have.get("protocol") != wanted or (have.get("suite") or {}).get("manifest_sha256") != suite_sha:
            raise SystemExit(f"--out {args.out}: the shard {name}.json ran another protocol or suite manifest; "
                             "resume with the same options or write to another folder")  # fmt: skip
    total, done = (3 if args.base else 2) * args.repeats * len(todo), 0
    bar = Bar(enabled(None), "timing")

    def tick() -> None:
        nonlocal done
        done += 1
        bar.update(0, done / total)

    try:
        write_shards(args.out, todo, lambda n: run_domain(n, base, tokenizer, args, manifest, bases, tick), suite_sha,
                     wanted)  # fmt: skip
    finally:
        bar.close()
    return [args.out / f"{n}.json" for n in names]


# ---------------------------------------------------------------------------------------------------------- report
def scaled_ratio(row: Mapping) -> float:
    """A round's ratio with each side's seconds scaled by the reference's mean speed during it (seconds × GFLOP/s:
    work at a fixed speed), so a machine that ran slower during one side does not count against it."""
    work = {s: row[s]["seconds"] * statistics.fmean(row[s]["reference_gflops"]) for s in ("faast", "lora")}
    return work["faast"] / work["lora"]


def summary(shard: Mapping) -> dict:
    """A shard's ratios as measured and scaled, their medians, the median seconds, and the reference's spread (its
    fastest reading over its slowest)."""
    rounds = shard["rounds"]
    ratios = [r["ratio"] for r in rounds]
    scaled = [scaled_ratio(r) for r in rounds]
    speeds = [g for r in rounds for s in ("faast", "lora") for g in r[s]["reference_gflops"]]
    out = {"domain": shard["domain"], "kind": shard["kind"], "rounds": len(rounds), "ratios": ratios,
           "median": statistics.median(ratios), "scaled": scaled, "scaled_median": statistics.median(scaled),
           "faast_s": statistics.median(r["faast"]["seconds"] for r in rounds),
           "solve_s": statistics.median(r["faast"]["solve_s"] for r in rounds),
           "lora_s": statistics.median(r["lora"]["seconds"] for r in rounds),
           "reference_spread": max(speeds) / min(speeds)}  # fmt: skip
    if all("base" in r for r in rounds):  # --base: the base forward's medians
        out["base_s"] = statistics.median(r["base"]["seconds"] for r in rounds)
        out["base_ratio"] = statistics.median(r["base_ratio"] for r in rounds)
        out["faast_over_base"] = statistics.median(r["faast_over_base"] for r in rounds)
    return out


def _span(values: Sequence[float], digits: int) -> str:
    """'a× to b×' over the values, or 'a×' where they read the same at `digits` decimals."""
    low, high = f"{min(values):.{digits}f}×", f"{max(values):.{digits}f}×"
    return low if low == high else f"{low} to {high}"


def report_lines(shards: Sequence[Mapping]) -> list[str]:
    """Markdown: one row per shard, the worst median first, then a line naming it (scripts/results_formats.py)."""
    if not shards:
        raise ValueError("report: expected shard records (<domain>.json), got none")
    rows = sorted((summary(s) for s in shards), key=lambda r: -r["median"])
    base = any("base_s" in r for r in rows)
    lines = [
        "| domain | kind | rounds | FAAST learn + solve / LoRA epoch, each round | median | scaled by the "
        "reference, each round | median | FAAST s (solve s) | LoRA s | reference spread |"
        + (" base forward s | FAAST's pass / base forward | base forward / LoRA epoch |" if base else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if base else ""),
    ]
    for r in rows:
        extra = " – | – | – |" if base else ""
        if "base_s" in r:
            extra = f" {r['base_s']:.1f} | {r['faast_over_base']:.2f}× | {r['base_ratio']:.3f} |"
        lines.append(
            f"| {r['domain']} | {r['kind']} | {r['rounds']} | {', '.join(f'{x:.3f}' for x in r['ratios'])} "
            f"| **{r['median']:.3f}** | {', '.join(f'{x:.3f}' for x in r['scaled'])} | "
            f"{r['scaled_median']:.3f} | {r['faast_s']:.1f} ({r['solve_s']:.1f}) | {r['lora_s']:.1f} | "
            f"{r['reference_spread']:.2f}× |{extra}"
        )
    worst, scaled = rows[0], max(rows, key=lambda r: r["scaled_median"])
    tail = ""
    if base:
        timed = [r for r in rows if "base_s" in r]
        tail = (
            f" The base forward alone is {_span([r['base_ratio'] for r in timed], 3)} of LoRA's epoch (medians), "
            f"and FAAST's pass {_span([r['faast_over_base'] for r in timed], 2)} of it: the base forward is the "
            "least a forward-only pass over these windows costs."
        )
    return [
        *lines,
        "",
        f"Worst median ratio {worst['median']:.3f}× ({worst['domain']}); scaled by the reference "
        f"{scaled['scaled_median']:.3f}× ({scaled['domain']}). Seconds are medians over the rounds; the reference "
        "spread is its fastest reading over its slowest within the shard." + tail,
    ]


def report(paths: Sequence[Path]) -> str:
    """report_lines of the shards at `paths`, then each shard's machine and run (its provenance)."""
    shards = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    lines = [*report_lines(shards), ""]
    for s in sorted(shards, key=lambda s: s["domain"]):
        prov = s["provenance"]
        lines.append(
            f"- {s['domain']}: {prov.get('cpu_model')} ({prov.get('physical_cores')} cores; "
            f"{', '.join(prov.get('cpu_flags', []))}), torch {prov.get('torch')}, git "
            f"{str(prov.get('git_sha'))[:7]}{' (dirty)' if prov.get('git_dirty') else ''}, "
            f"{prov.get('date')}, load {prov.get('loadavg_at_start')} → {prov.get('loadavg_at_end')}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
