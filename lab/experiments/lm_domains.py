"""Test-time learning on local text domains, every method in the same run (the multi-domain LM benchmark).

    python -m faast_lab.experiments.lm_domains                  # the five + two extra domains, 32K learned / 8K scored
    python -m faast_lab.experiments.lm_domains --domains asyncio --learn-tokens 4096 --score-tokens 1024  # quick

For each domain of lab/experiments/domains.py (learn files -> held-out files, no file in both) on the embedded default
(SmolLM2-135M-Instruct, GGUF Q4_1 dequantised, with the shipped readout), in one process:
- zero-shot: the frozen model;
- FAAST: the shipped middle memory layers plus the residual output layer (docs/design.md §6.3), learned in
  growing parts (the PPL-vs-tokens curve) and scored after each, as it is and with the middle layers disabled (the
  residual output layer alone; `--ablations` adds the middle layers alone). The report judges the goals on the
  variant the shipped configuration builds (`default_variant`);
- FAAST (paper output layer): the middle layers plus the paper's interpolating output layer (the previous default);
- kNN-LM (k = 1024, λ = 0.25, the paper's settings), also along the curve;
- LoRA (peft, q/v of every block, 1 epoch) and a linear projection at FAAST's layers (backprop, 1 epoch): the methods
  a user would otherwise pick, trained on the same tokens (lab/experiments/lm_baselines);
- the peers tuned as FAAST tunes its step, on the same held-out tail of the learned text (lm_baselines.tuning:
  faast.hf.held_out.tail_plan's split): LoRA-best (learning rate and epochs chosen on the tail, then trained on
  all the text), LoRA at FAAST's time (as many steps as fit in FAAST's learn + solve time of this run) and the kNN-LM
  tuned (λ and T chosen on the tail). Their tuning time is recorded apart from their learn time (`tuning_s`).
Each row records perplexity, learn time, scoring time and the memory the method adds. Results: one JSON (written
after every domain, so a cut run keeps what it measured), a Markdown report with the per-domain tables, the averages
and the issue's goals, and the curve plot.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path

from faast import provenance
from faast_lab.experiments._common import RESULTS, ROOT, ModelLoader, measured_by
from faast_lab.experiments.domains import DOMAINS, EXTRA, VALIDATION, domain_texts
from faast_lab.experiments.lm_domains_peers import run_backprop, run_knn, run_knn_tuned, run_lora_best, run_lora_time

METHODS = ("default", "narrow", "fp32learn", "int8learn", "int8pass", "logit", "faast", "output", "paper",
           "knn", "knn_tuned", "lora", "lora_bf16", "linear", "lora_best", "lora_time")  # fmt: skip
# "lora_bf16": LoRA with its forward pass under bfloat16 autocast, the precision FAAST's learning pass uses.
# "fp32learn": the default as a CPU without native bfloat16 runs it: the learning pass in float32 (learn_dtype='model')
# and the head's products in float32 (head_dtype='float32'; 'auto' takes them in bfloat16 where it is native).
# "int8learn": the default as a CPU without native bfloat16 but with AVX2 runs it: the learning pass in float32 and the
# head's logits in int8 (head_dtype='int8', what 'auto' picked there before the int8 pass; its p·H stays float32).
# "int8pass": the default as a CPU without native bfloat16 but with AVX2 runs it now: the decoder's linears of inputs
# up to the hidden size in int8 (learn_dtype='int8', faast/hf/int8_pass.py) and the head's logits in int8.
# "narrow": the default with the output layer's keys h̃ alone (output_key_layers=[]: the default before wider keys).
# "logit": the residual output layer read in logit space (the default before probability space), along the curve.
# "faast" (the shipped middle layers + the residual output layer, both variants along the curve) and "paper" (the
# paper's output layer) on request: each is one more pass.
# "knn_tuned", "lora_best": the peers tuned on FAAST's held-out tail; "lora_time": LoRA for FAAST's learn + solve time
# (needs "default", which measures it).
DEFAULT_METHODS = ("default", "narrow", "fp32learn", "int8learn", "int8pass", "knn", "knn_tuned", "lora", "linear",
                   "lora_best", "lora_time")  # fmt: skip
CURVE = (2048, 8192, 32768)
RUN_ORDER = ("asyncio", "man", "copyright", "perl", "tkinter")  # code, roff, legal prose, then the rest


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--domains",
        nargs="+",
        choices=(*DOMAINS, *EXTRA, *VALIDATION),
        default=[*RUN_ORDER, *EXTRA],
        help="default: the benchmark's five, then the extra two chosen after the settings; or the validation domains"
        " settings are chosen on",
    )
    p.add_argument("--learn-tokens", type=int, default=32768)
    p.add_argument("--score-tokens", type=int, default=8192)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--ablations", action="store_true", help="also score FAAST's middle layers alone")
    p.add_argument("--parts-as-documents", action="store_true",
                   help="learn each curve part as new texts, so a text cut at a curve point is two documents to the "
                        "step's tuning (the protocol before 4c78eed); default: the part continues it "
                        "(learn(continues=True)), as one call over all the text would")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="keep the domains already in the result JSON, run the rest")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument(
        "--learn-window",
        type=int,
        default=None,
        help="tokens per window while FAAST learns (default: --window); LoRA trains on --train-window",
    )
    p.add_argument(
        "--output-tune-tokens",
        type=int,
        default=None,
        help="held-out positions the output layer's step is tuned on (default: FaastConfig's)",
    )
    p.add_argument(
        "--learn-batch-size", type=int, default=None, help="windows per learning batch (default: --batch-size)"
    )
    p.add_argument("--train-window", type=int, default=256)
    p.add_argument("--train-batch-size", type=int, default=4)
    p.add_argument("--linear-lr", type=float, default=1e-4)
    p.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA's lr (LoRA at FAAST's time: without LoRA-best)")
    p.add_argument("--lora-lrs", default="3e-4,1e-3,3e-3", help="LoRA-best's learning-rate grid")
    p.add_argument("--lora-max-epochs", type=int, default=3, help="LoRA-best's epochs grid: 1 .. this")
    p.add_argument("--knn-k", type=int, default=1024, help="the tuned kNN-LM's k")
    p.add_argument("--knn-lams", default="0.05,0.1,0.25,0.4,0.6", help="the tuned kNN-LM's λ grid")
    p.add_argument("--knn-temperatures", default="1,3,10,30,100", help="the tuned kNN-LM's temperature grid")
    p.add_argument("--baselines-from", type=Path, nargs="+", default=[],
                   help="earlier result JSONs: rows of kNN-LM, LoRA and linear are taken from the first that has the"
                        " domain with the same zero-shot perplexity (same text, same model) instead of re-run; each"
                        " such row records the run it came from")  # fmt: skip
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_domains_smollm2")
    args = p.parse_args(argv)
    args.learn_window = args.learn_window or args.window
    args.learn_batch_size = args.learn_batch_size or args.batch_size
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if set(args.methods) - set(METHODS):
        p.error(f"--methods: expected a subset of {list(METHODS)}, got {args.methods}")
    if "lora_time" in args.methods and "default" not in args.methods:
        p.error("--methods: lora_time trains for FAAST's default learn + solve time, which 'default' measures; add it")
    for name in ("lora_lrs", "knn_lams", "knn_temperatures"):
        try:
            setattr(args, name, [float(x) for x in getattr(args, name).split(",") if x.strip()])
        except ValueError:
            p.error(f"--{name.replace('_', '-')}: expected comma-separated numbers, got {getattr(args, name)!r}")
        if not getattr(args, name):
            p.error(f"--{name.replace('_', '-')}: expected at least one number")
    return args


def output_overrides(args: argparse.Namespace) -> dict:
    """ResidualOutput fields set on the command line."""
    return {} if args.output_tune_tokens is None else {"tune_tokens": args.output_tune_tokens}


def points(limit: int, grid: tuple[int, ...]) -> list[int]:
    """The curve's learned-token amounts up to `limit` (the last is always `limit`)."""
    return sorted({p for p in grid if p < limit} | {limit})


class Domain:
    """One domain's token lists and the rows measured on it."""

    def __init__(self, name: str, tokenizer: object, args: argparse.Namespace):
        from faast.hf.evaluate import token_windows
        from faast.hf.tokens import token_lists

        learn_texts, score_texts = domain_texts(name)
        self.name = name
        self.learn = token_lists(learn_texts, tokenizer, args.learn_tokens)
        self.windows = [w for ids in token_lists(score_texts, tokenizer, args.score_tokens)
                        for w in token_windows(ids, args.window)]  # fmt: skip
        self.learned = sum(len(x) for x in self.learn)
        self.scored = sum(len(w) - 1 for w in self.windows)
        self.rows: list[dict] = []
        self.curve: dict[str, dict[str, list]] = {}
        self.tuned: dict[str, object] = {}  # the baselines' tuning choices (LoraChoice, KnnChoice) by method
        self._split = None

    def add(self, method: str, result, learn_s: float, memory: int, **extra) -> None:  # noqa: ANN001
        self.rows.append({"method": method, "ppl": result.ppl, "learn_s": learn_s, "score_s": result.seconds,
                          "memory_bytes": memory, **extra})  # fmt: skip
        print(f"  {self.name} {method}: ppl {result.ppl:.3f} (learn {learn_s:.1f} s, score {result.seconds:.1f} s,"
              f" {memory / 2**20:.1f} MB)", flush=True)  # fmt: skip

    def split(self, base, args: argparse.Namespace):  # noqa: ANN001, ANN201 - lm_baselines.TuningSplit
        """The held-out tail FAAST's default tunes its step on, which the tuned baselines tune on: tail_plan with
        FAAST's tune_tokens and min_fit (lm_baselines.tuning_split) over the documents as FAAST's default learns
        them: the texts, each one document across the curve's parts (with --parts-as-documents a text cut at a curve
        point is two, so it is here)."""
        if self._split is None:
            from faast.hf import ResidualOutput
            from faast.hf.tokens import split_by_tokens
            from faast_lab.experiments.lm_baselines import faast_min_fit, tuning_split

            tune_tokens = output_overrides(args).get("tune_tokens", ResidualOutput().tune_tokens)
            pieces = self.learn
            if args.parts_as_documents:
                pieces = [p for part in split_by_tokens(self.learn, points(self.learned, CURVE)) for p in part]
            self._split = tuning_split(pieces, tune_tokens, faast_min_fit(base.config.hidden_size))
        return self._split

    def row(self, method: str) -> dict | None:
        """The row recorded under exactly this method name."""
        return next((r for r in self.rows if r["method"] == method), None)

    def payload(self) -> dict:
        zero = self.rows[0]["ppl"]
        for r in self.rows:
            r["reduction"] = 1 - r["ppl"] / zero
        return {"domain": self.name, "learned_tokens": self.learned, "scored_tokens": self.scored,
                "rows": self.rows, "curve": self.curve}  # fmt: skip


# The float32 row's name. Runs before 2026-11-27 named it "..., float32 learning pass", with the head's products at
# head_dtype='auto' (bfloat16 on a CPU that multiplies it natively): their variants map records which.
FP32_LEARN = "FAAST: residual output only, float32 learning pass and head products"
INT8_LEARN = "FAAST: residual output only, float32 learning pass, int8 head logits"
INT8_PASS = "FAAST: residual output only, int8 learning pass and head logits"
VARIANTS = {"full": "FAAST: middle layers + residual output", "output": "FAAST: residual output only",
            "logit": "FAAST: logit-space residual output (earlier default)",
            "narrow": "FAAST: residual output, keys h̃ only (previous default)",
            "fp32learn": FP32_LEARN, "int8learn": INT8_LEARN, "int8pass": INT8_PASS}  # fmt: skip


def curve_parts(domain: Domain, amounts: list[int], args: argparse.Namespace) -> list[tuple[list[list[int]], bool]]:
    """The learned text in the curve's parts, each with whether FAAST learns it with continues=True: where it begins
    with the rest of a text cut at the curve point before it (never with --parts-as-documents)."""
    from faast.hf.tokens import split_continuing

    return [(part, continues and not args.parts_as_documents)
            for part, continues in split_continuing(domain.learn, amounts)]  # fmt: skip


def run_faast(domain: Domain, base, readout: Path, args: argparse.Namespace) -> None:  # noqa: ANN001
    """One learning pass of the shipped middle layers + the residual output layer, scored along the curve as it is
    and with the middle layers disabled (the residual output layer alone: its statistics do not depend on them)."""
    from faast.hf import FaastConfig, ResidualOutput, from_pretrained
    from faast.hf.evaluate import perplexity

    # The residual output layer as the readout's configuration sets it (its own if it has one), overrides applied.
    saved = FaastConfig.load(readout / "faast_config.json").output
    output = dataclasses.replace(
        saved if isinstance(saved, ResidualOutput) else ResidualOutput(), **output_overrides(args)
    )
    model = from_pretrained(base, readout, output=output)
    try:
        amounts = points(domain.learned, CURVE)
        # With the "default" method in the run, the residual output layer alone is its row and curve.
        keys = [k for k in ("full", "output") if not (k == "output" and "default" in args.methods)]
        curves = {key: {"tokens": amounts, "ppl": [], "bytes": [], "step": []} for key in keys}
        learn_s, results = 0.0, {}
        bank_bytes = sum(b.numel() * b.element_size() for b in model.memory_bank.buffers())
        for part, continues in curve_parts(domain, amounts, args):
            started = time.perf_counter()
            if part:
                model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size, continues=continues)
                model.output_memory_layer.folded(base.device, base.dtype)  # the solve and the step tuning
            learn_s += time.perf_counter() - started
            step = (model.output_memory_layer.last_tuning or {}).get("step")
            for key in keys:
                with model.disable_faast("middle") if key == "output" else contextlib.nullcontext():
                    result = perplexity(model, domain.windows, batch_size=args.batch_size)
                    size = model.fast_weight_bytes() - (bank_bytes if key == "output" else 0)
                curves[key]["ppl"].append(result.ppl)
                curves[key]["bytes"].append(size)
                curves[key]["step"].append(step)
                results[key] = (result, size)
        tuning = {k: v for k, v in (model.output_memory_layer.last_tuning or {}).items() if k != "held_out_nll"}
        for key in keys:
            domain.curve[key] = curves[key]
            domain.add(VARIANTS[key], results[key][0], learn_s, results[key][1], tuning=tuning)
        if args.ablations:
            with model.disable_faast("output"):
                domain.add("FAAST: middle layers only", perplexity(model, domain.windows, batch_size=args.batch_size),
                           learn_s, bank_bytes)  # fmt: skip
    finally:
        model.remove_faast()


def run_default(domain: Domain, base, args: argparse.Namespace, key: str = "output", residual: dict | None = None,  # noqa: ANN001
                extra: dict | None = None, **config: object) -> None:  # fmt: skip
    """FAAST's default configuration (FaastConfig(output=ResidualOutput(**residual), **config): the residual output
    layer, no readout) learned in
    growing parts and scored after each (the PPL-vs-tokens curve), recorded as VARIANTS[key]. Learn time is what
    learning all the text costs: every part's learning pass and the last solve (with its step tuning). The solves at
    the earlier curve points exist only to score them (LoRA is trained once, on all the text): their time is reported
    apart, as curve_solve_s."""
    from faast.hf import FaastConfig, ResidualOutput, apply_faast
    from faast.hf.evaluate import perplexity

    output = ResidualOutput(**(residual or {}), **output_overrides(args))
    model = apply_faast(base, FaastConfig(output=output, **config))
    try:
        amounts = points(domain.learned, CURVE)
        curve = domain.curve[key] = {"tokens": amounts, "ppl": [], "bytes": [], "step": [], "weight": []}
        learn_s, solves, solved = 0.0, [], None
        for part, continues in curve_parts(domain, amounts, args):
            started = time.perf_counter()
            if part:
                model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size, continues=continues)
            learned = time.perf_counter()
            if part:
                solved = model.solve()
            learn_s += learned - started
            solves.append(time.perf_counter() - learned)
            result = perplexity(model, domain.windows, batch_size=args.batch_size)
            curve["ppl"].append(result.ppl)
            curve["bytes"].append(model.fast_weight_bytes())
            curve["step"].append((model.output_memory_layer.last_tuning or {}).get("step"))
            curve["weight"].append((model.output_memory_layer.last_tuning or {}).get("weight"))
        tuning = {k: v for k, v in (model.output_memory_layer.last_tuning or {}).items() if k != "held_out_nll"}
        curve["solve_s"] = solves
        report = solve_report(solved, model)
        extra = {**(extra or {}), **({"solve_report": report} if report is not None else {})}
        domain.add(VARIANTS[key], result, learn_s + solves[-1], model.fast_weight_bytes(), tuning=tuning,
                   curve_solve_s=sum(solves[:-1]), precision=model.learner.precision(), **extra)  # fmt: skip
    finally:
        model.remove_faast()


def solve_report(solved: object, model: object) -> object:
    """What the last solve() returned, as JSON, when it is a report (a dict or an object of fields) rather than the
    model itself or None: whatever the solve reports (e.g. whether the memory ended up off) goes in the row."""
    if solved is None or solved is model:
        return None
    if dataclasses.is_dataclass(solved) and not isinstance(solved, type):
        solved = dataclasses.asdict(solved)
    elif not isinstance(solved, dict | list | tuple | str | int | float | bool) and hasattr(solved, "__dict__"):
        solved = {k: v for k, v in vars(solved).items() if not k.startswith("_")}
    return json.loads(json.dumps(solved, default=str))


def run_output(domain: Domain, base, args: argparse.Namespace) -> None:  # noqa: ANN001
    """The residual output layer alone, as FaastConfig() builds it (no middle layers): its own learn time."""
    from faast.hf import FaastConfig, ResidualOutput, apply_faast
    from faast.hf.evaluate import perplexity

    model = apply_faast(base, FaastConfig(output=ResidualOutput(**output_overrides(args))))
    try:
        started = time.perf_counter()
        model.learn(domain.learn, max_length=args.learn_window, batch_size=args.learn_batch_size)
        model.solve()
        learn_s = time.perf_counter() - started
        tuning = {k: v for k, v in (model.output_memory_layer.last_tuning or {}).items() if k != "held_out_nll"}
        domain.add("FAAST: residual output only, alone (FaastConfig(num_layers=0))",
                   perplexity(model, domain.windows, batch_size=args.batch_size), learn_s, model.fast_weight_bytes(),
                   tuning=tuning)  # fmt: skip
    finally:
        model.remove_faast()


def run_paper(domain: Domain, base, readout: Path, args: argparse.Namespace) -> None:  # noqa: ANN001
    from faast.hf import EmbeddingOutput, from_pretrained
    from faast.hf.evaluate import perplexity

    model = from_pretrained(base, readout, output=EmbeddingOutput())
    try:
        started = time.perf_counter()
        model.learn(domain.learn, max_length=args.learn_window, batch_size=args.learn_batch_size)
        learn_s = time.perf_counter() - started
        domain.add(
            "FAAST (paper output layer, previous default)",
            perplexity(model, domain.windows, batch_size=args.batch_size),
            learn_s,
            model.fast_weight_bytes(),
        )
    finally:
        model.remove_faast()


def run_domain(name: str, base, tokenizer, readout: Path, layers: list[int], args: argparse.Namespace) -> dict:  # noqa: ANN001
    from faast.hf.evaluate import perplexity

    domain = Domain(name, tokenizer, args)
    print(f"{name}: learn {domain.learned:,} tokens, score {domain.scored:,}", flush=True)
    domain.add("zero-shot", perplexity(base, domain.windows, batch_size=args.batch_size), 0.0, 0)
    if "default" in args.methods:
        run_default(domain, base, args)
    if "narrow" in args.methods:
        run_default(domain, base, args, "narrow", residual={"key_layers": []})
    if "fp32learn" in args.methods:
        run_default(domain, base, args, "fp32learn", residual={"head_dtype": "float32"}, learn_dtype="model")
    if "int8learn" in args.methods:
        run_default(domain, base, args, "int8learn", residual={"head_dtype": "int8"}, learn_dtype="model")
    if "int8pass" in args.methods:
        run_default(domain, base, args, "int8pass", residual={"head_dtype": "int8"}, learn_dtype="int8")
    if "logit" in args.methods:
        run_default(domain, base, args, "logit", residual={"space": "logit"})
    if "faast" in args.methods:
        run_faast(domain, base, readout, args)
    if "output" in args.methods:
        run_output(domain, base, args)
    if "paper" in args.methods:
        run_paper(domain, base, readout, args)
    if "knn" in args.methods:
        run_knn(domain, base, args)
    if "knn_tuned" in args.methods:
        run_knn_tuned(domain, base, args)
    for method in ("lora", "lora_bf16", "linear"):
        if method in args.methods:
            run_backprop(domain, base, layers, method, args)
    if "lora_best" in args.methods:
        run_lora_best(domain, base, layers, args)
    import_baselines(domain, args)
    if "lora_time" in args.methods:  # after lora_best and the imports: it takes LoRA-best's lr
        run_lora_time(domain, base, layers, args, VARIANTS["output"])
    return domain.payload()


# The baselines' row names before " (": rows are matched by exactly this ("LoRA" is not "LoRA-best").
BASELINE_PREFIXES = {"knn": "kNN-LM", "knn_tuned": "kNN-LM tuned", "lora": "LoRA", "linear": "linear",
                     "lora_best": "LoRA-best"}  # fmt: skip


def import_baselines(domain: Domain, args: argparse.Namespace) -> None:
    """Rows of the baselines not run here, from the first earlier run (--baselines-from) that scored the same held-out
    tokens with the same zero-shot perplexity (rel. 1e-4; runs differ by ~1e-5 in float32 sums): the baselines do not
    depend on FAAST's code, so a row measured there is the row this run would measure, up to timing. Each keeps the
    provenance of its run."""
    zero = domain.rows[0]
    for method, prefix in BASELINE_PREFIXES.items():
        if method in args.methods:
            continue
        for path in args.baselines_from:
            earlier = json.loads(path.read_text(encoding="utf-8"))
            match = next((d for d in earlier["domains"] if d["domain"] == domain.name), None)
            if match is None or match["scored_tokens"] != domain.scored:
                continue
            if abs(match["rows"][0]["ppl"] / zero["ppl"] - 1) > 1e-4:
                earlier_zero = match["rows"][0]["ppl"]
                raise SystemExit(f"--baselines-from {path}: {domain.name}'s zero-shot perplexity {earlier_zero:.6f}"
                                 f" differs from this run's {zero['ppl']:.6f}")  # fmt: skip
            row = next((r for r in match["rows"] if r["method"].split(" (")[0] == prefix), None)
            if row is None:
                continue
            source = earlier.get("provenance") or earlier.get("header") or {}
            domain.rows.append({**{k: v for k, v in row.items() if k != "reduction"}, "imported_from": {
                "file": path.name, "git_sha": source.get("git_sha"), "date": source.get("date")}})  # fmt: skip
            if method in match.get("curve", {}):
                domain.curve[method] = match["curve"][method]
            print(f"  {domain.name} {row['method']}: ppl {row['ppl']:.3f} (from {path.name})", flush=True)
            break


def main(argv: list[str] | None = None, *, load_model: ModelLoader | None = None) -> dict:
    """Run the benchmark with `argv`'s options on the base model load_model gives for 'smollm2' (default
    faast.hf.default.load_base_model); returns the payload written."""
    import torch

    from faast.hf import FaastConfig
    from faast.hf.default import DEFAULT_READOUT, load_base_model

    args = parse_args(argv)
    torch.manual_seed(0)
    record = provenance.start(ROOT)
    base, tokenizer, description = (load_model or load_base_model)("smollm2")
    layers = FaastConfig.load(DEFAULT_READOUT / "faast_config.json").middle.layers
    # The default variant is what FaastConfig() builds: the residual output layer alone (no middle layers).
    default = "full" if FaastConfig().middle is not None else "output"
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "provenance": record, "settings": settings,
               "variants": VARIANTS, "default_variant": default, "domains": []}  # fmt: skip
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{args.out}.json"
    if args.resume and path.is_file():
        earlier = json.loads(path.read_text(encoding="utf-8"))
        earlier_record = earlier.get("provenance", earlier.get("header")) or {}
        # A domain kept from an earlier run keeps that run's machine: times are comparable only within a domain.
        payload["domains"] = [{"measured_by": measured_by(earlier_record), **d} for d in earlier["domains"]
                              if d["domain"] in args.domains]  # fmt: skip
        payload["earlier_runs"] = [*earlier.get("earlier_runs", []), earlier_record]
    done = {d["domain"] for d in payload["domains"]}
    for name in [n for n in args.domains if n not in done]:
        result = run_domain(name, base, tokenizer, DEFAULT_READOUT, layers, args)
        payload["domains"].append({**result, "measured_by": measured_by(record)})
        provenance.finish(record)
        write_json(path, payload)
    from faast_lab.experiments.lm_domains_report import write_report

    write_report(payload, args.results_dir / args.out)
    return payload


def write_json(path: Path, payload: dict) -> None:
    from faast.persist import write_text_atomic

    write_text_atomic(path, json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
