"""Cost of FAAST inside a causal LM: learning overhead over the plain forward pass, inference overhead of the memory
layers (prefill and KV-cached generation), and the state size against the tokens learned.

    python -m faast_lab.benchmarks.bench_hf_overhead                 # the embedded default model and configuration
    python -m faast_lab.benchmarks.bench_hf_overhead --model tiny    # a tiny Llama built in-process (a quick check)
    python -m faast_lab.benchmarks.bench_hf_overhead --model smollm2-shape llama-1b-shape --device cuda  # GPU, no hub

The default is SmolLM2-135M-Instruct (GGUF Q4_1 dequantised) with faast's default configuration (the residual
output layer). The "-shape" models are built from a config in-process with random weights: SmolLM2-135M's Llama shape
(d = 576, 30 blocks), Llama-3.2-1B's (d = 2048, 16 blocks, a 128K vocabulary) and GPT-2-XL's (d = 1600, 48 blocks).
Their timings are those of the real models (the weights' values do not change the work), so the GPU needs neither
network nor a model file; the learning overhead is measured on random token ids. A model that does not fit in the
GPU's free memory (4x its parameters) is recorded as skipped. Several --model values run one after the other in the
same process and write one file; --budget-s skips the models not started by then.

Reported per model (the goals of issue 37): learn tokens/s against the model's own forward pass
(learn_vs_forward = forward time / learn time), the read overhead per forward pass (read_overhead) and per
generated token (read_overhead_per_token_s, with KV cache), and the solve time (model.solve() after a learned batch).
With a residual output layer, the shipped learning is also timed against itself with p·H exact (head_pool_below=0),
what its pooling saves, and on a CPU the float32 pass is timed with the head's logits in float32 and in int8
(head_dtype), what a CPU without native bfloat16 runs.

Every case runs in the same process on the same batch of real text (the stdlib package's Python source), interleaved
(lab/benchmarks/_harness.py), and the table reports ratios to the base model measured in the same run. Learning runs
the decoder without the LM head (learning needs no logits); it is compared with that same decoder pass and with the
full forward pass a user would otherwise run. Random weights can leave the residual output memory off after tuning, and
a memory that is off reads nothing; the read cases then force a step (FORCED_STEP, FORCED_WEIGHT) and the report says
so (forced_step), so that the read overhead is always that of a read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from faast_lab.benchmarks import _harness as H

RESULTS = Path(__file__).resolve().parent / "results"
EXACT_PH = "learn, p·H exact (head_pool_below=0)"
# A CPU without native bfloat16 learns in float32; on a CPU its head logits can be int8 (head_dtype='int8'), and with
# AVX2 'auto' now takes the decoder's linears in int8 too (learn_dtype='int8').
FP32_HEAD = "learn, float32 pass and head products"
INT8_HEAD = "learn, float32 pass, int8 head logits"
INT8_PASS = "learn, int8 pass and head logits"


SHAPES = {
    "smollm2-shape": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                    tie_word_embeddings=True)),
    "llama-1b-shape": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                     tie_word_embeddings=True)),
    "gpt2-xl-shape": ("gpt2", dict(vocab_size=50257, n_embd=1600, n_layer=48, n_head=25, n_positions=1024)),
}  # fmt: skip


def _classes(family: str):  # noqa: ANN202 - (config class, model class)
    import transformers

    if family == "llama":
        return transformers.LlamaConfig, transformers.LlamaForCausalLM
    return transformers.GPT2Config, transformers.GPT2LMHeadModel


def too_big(kind: str, device: str, dtype: str) -> str | None:
    """Why a -shape model does not fit in the device's free memory (4x its parameters), or None."""
    if kind not in SHAPES or not device.startswith("cuda"):
        return None
    family, kwargs = SHAPES[kind]
    config_cls, model_cls = _classes(family)
    with torch.device("meta"):
        params = sum(p.numel() for p in model_cls(config_cls(**kwargs)).parameters())
    need = 4 * params * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    free, _ = torch.cuda.mem_get_info()
    return None if need <= free else f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def load(kind: str, device: str = "cpu", dtype: str = "float32"):  # noqa: ANN201 - (FaastModel, token ids)
    from faast.hf import FaastConfig, MiddleLayers, apply_faast
    from faast.hf.demo import domain_files, tokens_of

    if kind in SHAPES:
        family, kwargs = SHAPES[kind]
        config_cls, model_cls = _classes(family)
        config = config_cls(**kwargs)
        torch.manual_seed(0)
        with torch.device(device):
            base = model_cls(config)
        base = base.to(getattr(torch, dtype)).eval()
        model = apply_faast(base, FaastConfig())
        ids = torch.randint(0, config.vocab_size, (256 * 1024,)).tolist()
        return model, ids, f"{kind} ({family}, random weights, {dtype}, {device})"
    if kind == "tiny":
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024,
        )  # fmt: skip
        model = apply_faast(
            transformers.LlamaForCausalLM(config).eval(), FaastConfig(middle=MiddleLayers(num_layers=3))
        )
        ids = torch.randint(0, 512, (64 * 1024,)).tolist()
        return model, ids, "tiny Llama (d=128, 8 blocks)"
    from faast.hf.default import SMOLLM2_NAME, load_default_model

    model, tokenizer = load_default_model()
    files, _ = domain_files("asyncio")
    ids = [t for f in tokens_of(files, tokenizer, 200_000) for t in f]
    return model, ids, f"{SMOLLM2_NAME}, faast default (residual output layer)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["default"], choices=["default", "tiny", *SHAPES])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--smoke", action="store_true", help="tiny batch and 1 repetition (with --model tiny)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="result file stem (default: hf_overhead_<model>_<device>)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no further model after this many seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.reps, args.new_tokens = 2, 64, 1, 4
    return args


FORCED_STEP, FORCED_WEIGHT = 1.0, 0.5


def timed_cases(  # noqa: ANN001 - a FaastModel
    model, batch: torch.Tensor, new_tokens: int, forced: list[str] | None = None
) -> dict[str, H.Case]:
    """The interleaved cases on one [B, T] int64 batch: base passes, learning, reading and generation.

    Random weights can leave the residual output memory off after tuning, and a memory that is off returns the
    head's logits untouched, so its read would time nothing: the read cases then set FORCED_STEP and FORCED_WEIGHT
    (the learn and solve cases keep the tuned settings) and append the space they forced to `forced`."""
    mask = torch.ones_like(batch)
    backbone = model.base_model.get_submodule({"gpt2": "transformer"}.get(model.faast_config.model_type, "model"))

    # 'auto': a bfloat16 pass where the device multiplies it natively. The learner reads its own copy of the setting,
    # so the cases switch that one (switching the config's alone leaves every learn case in the shipped dtype).
    shipped_learn = model.learner.learn_dtype
    output = model.output_memory_layer
    shipped_pool = getattr(output, "head_pool_below", None)  # the residual output layer's p·H pooling ('auto')
    shipped_head = getattr(output, "head_dtype", None)

    def with_compute(dtype: torch.dtype, learn_dtype: str = shipped_learn, pool: object = shipped_pool,
                     head: object = shipped_head):  # noqa: ANN202  # fmt: skip
        def setup() -> None:
            model.learner.learn_dtype = learn_dtype
            if shipped_pool is not None:
                output.head_pool_below, output.head_dtype = pool, head
            for layer in model.faast_layers():
                layer.memory.compute_dtype = dtype

        return setup

    def backbone_pass(_: object) -> None:
        with torch.no_grad(), model.disable_faast():
            backbone(input_ids=batch, attention_mask=mask, use_cache=False)

    def full_pass(_: object) -> None:
        with torch.no_grad(), model.disable_faast():
            model(input_ids=batch, attention_mask=mask, use_cache=False)

    def learn(_: object) -> None:
        with torch.no_grad():
            model.learn_batch(batch, mask)

    shipped_space = getattr(output, "space", None)  # the residual output layer reads in 'probability' or 'logit' space
    shipped = (output.step, output.weight) if shipped_space is not None else None

    def tuned() -> None:
        if shipped is not None:
            output.step, output.weight = shipped

    def solved(space: str | None = shipped_space):  # noqa: ANN202
        def setup() -> None:
            # The learn cases run in the same rounds and change the statistics: solve (and tune the step) untimed, so
            # the read pass measures reading, not the solve a changed memory owes at its next read.
            with_compute(torch.float64)()
            tuned()
            if space is not None:
                output.space = space
            model.solve()
            if space is not None and not (output.chosen_step() and output.chosen_weight()):
                output.step, output.weight = FORCED_STEP, FORCED_WEIGHT
                if forced is not None and space not in forced:
                    forced.append(space)

        return setup

    def read_pass(_: object) -> None:
        with torch.no_grad():
            model(input_ids=batch, attention_mask=mask, use_cache=False)

    prompt = batch[:1, :64]

    def generate(disabled: bool):  # noqa: ANN202
        def run(_: object) -> None:
            kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            if disabled:
                with model.disable_faast():
                    model.generate(prompt, **kwargs)
            else:
                model.generate(prompt, **kwargs)

        return run

    def relearn() -> None:
        # One learned batch changes the statistics, so the solve that follows has its full work to do.
        with_compute(torch.float64)()
        tuned()
        with torch.no_grad():
            model.learn_batch(batch[:1], mask[:1])

    def solve(_: object) -> None:
        model.solve()

    cases = {
        "decoder pass, base": (None, backbone_pass),
        "full forward, base": (None, full_pass),
        "learn, float64 statistics": (with_compute(torch.float64), learn),
        "learn, float32 compute": (with_compute(torch.float32), learn),
        "learn, the model's dtype (learn_dtype='model')": (with_compute(torch.float64, "model"), learn),
        "forward with fast weights": (solved(), read_pass),
        "generate, base": (None, generate(True)),
        "generate with fast weights": (solved(), generate(False)),
        "solve after a learned batch": (relearn, solve),
    }
    if shipped_pool is not None:
        # The shipped learning with p·H exact (head_pool_below=0), in the same rounds: what pooling saves.
        cases[EXACT_PH] = (with_compute(torch.float64, pool=0.0), learn)
        if batch.device.type == "cpu":
            cases[FP32_HEAD] = (with_compute(torch.float64, "model", head="float32"), learn)
            cases[INT8_HEAD] = (with_compute(torch.float64, "model", head="int8"), learn)
            if model.learner.int8_linears():  # GPT-2's Conv1D blocks have none
                cases[INT8_PASS] = (with_compute(torch.float64, "int8", head="int8"), learn)
    if shipped_space == "probability":
        # The same memory read in logit space (one head product per position instead of two), in the same rounds.
        cases["forward with fast weights, logit space"] = (solved("logit"), read_pass)
        cases["generate with fast weights, logit space"] = (solved("logit"), generate(False))
    return cases


def overhead_rows(med: dict[str, float], tokens: int, new_tokens: int) -> list[list[str]]:
    """[case, reference, tokens/s, reference tokens/s, extra time] from the median seconds of each case."""
    rows = []
    for name, ref in (
        ("learn, float64 statistics", "decoder pass, base"),
        ("learn, float64 statistics", "full forward, base"),
        ("learn, float64 statistics", EXACT_PH),
        ("learn, float32 compute", "decoder pass, base"),
        ("learn, float32 compute", "full forward, base"),
        ("learn, the model's dtype (learn_dtype='model')", "decoder pass, base"),
        ("learn, the model's dtype (learn_dtype='model')", "full forward, base"),
        (FP32_HEAD, "decoder pass, base"),
        (INT8_HEAD, "decoder pass, base"),
        (INT8_HEAD, FP32_HEAD),
        (INT8_PASS, "decoder pass, base"),
        (INT8_PASS, FP32_HEAD),
        (INT8_PASS, INT8_HEAD),
        ("forward with fast weights", "full forward, base"),
        ("generate with fast weights", "generate, base"),
        ("forward with fast weights, logit space", "full forward, base"),
        ("generate with fast weights, logit space", "generate, base"),
    ):
        if name not in med:
            continue
        per = new_tokens if name.startswith("generate") else tokens
        rows.append(
            [
                name,
                ref,
                f"{per / med[name]:,.0f}",
                f"{per / med[ref]:,.0f}",
                f"{100 * (med[name] / med[ref] - 1):+.1f}%",
            ]
        )
    return rows


def state_rows(model) -> list[list[str]]:  # noqa: ANN001 - a FaastModel
    """[tokens learned, faast state, stored bf16 keys + values] for 10^3 to 10^8 tokens."""
    state = model.fast_weight_bytes()
    d = model.faast_config.hidden_size
    layers = len(list(model.faast_layers()))
    return [
        [f"{n:,}", H.fmt_sci(state / H.MB) + " MB", H.fmt_sci(n * layers * d * 2 * 2 / H.MB) + " MB"]
        for n in (10**3, 10**4, 10**5, 10**6, 10**8)
    ]


def model_report(args: argparse.Namespace, payload: dict, layers: list[int], size_rows: list) -> list[str]:
    """The Markdown of one model's measurements."""
    b, t = payload["batch"]
    solve = payload["median_s"].get("solve after a learned batch")
    forced = payload.get("forced_step")
    forced_note = (
        [
            f"Tuning left the output memory off on these random weights, so the read cases in {' and '.join(forced)} "
            f"space set step {FORCED_STEP} and weight {FORCED_WEIGHT}: they time a read that does its work.",
            "",
        ]
        if forced
        else []
    )
    return [
        f"Memory layers before blocks {layers} + the output layer; batch {b} x {t} tokens; {args.reps} interleaved "
        f"repetitions, medians. Generation: {args.new_tokens} new tokens after a 64-token prompt, greedy, KV cache.",
        "",
        H.markdown_table(["case", "against", "tokens/s", "reference tokens/s", "extra time"], payload["overheads"]),
        "",
        f"Learning runs at {payload['learn_vs_forward']:.2f}x the model's forward-pass throughput (float64 "
        f"statistics, learn_dtype {payload['learn_dtype']!r}); reading costs {payload['read_overhead']:+.1%} per "
        f"forward pass and {payload['read_overhead_per_token_s'] * 1e3:+.2f} ms per generated token; the solve "
        f"(model.solve() after a learned batch) takes {H.fmt_s(solve)}.",
        "",
        *forced_note,
        "State after learning n tokens (float64 statistics of every memory layer) against storing keys and values "
        "(bf16, as the authors' memory bank holds them):",
        "",
        H.markdown_table(["tokens learned", "faast state", "stored keys + values"], size_rows),
        "",
    ]


def run_model(args: argparse.Namespace, kind: str, dtype: str) -> tuple[dict, list[str]]:
    """Build, learn and time one model: (payload, its Markdown)."""
    model, ids, description = load(kind, args.device, dtype)
    if kind == "tiny":
        model = model.to(args.device)
    b, t = args.batch, args.seq
    batch = torch.tensor(ids[: b * t], device=args.device).reshape(b, t)

    # Learn a first corpus so the inference cases read real, non-empty fast weights.
    with torch.no_grad():
        model.learn(ids[b * t : b * t + 16 * t], max_length=t, batch_size=b)

    learn_dtype = model.learner.learn_dtype  # the cases switch it; the report names the shipped setting
    forced: list[str] = []
    timings = H.time_cases(timed_cases(model, batch, args.new_tokens, forced), reps=args.reps)
    model.learner.learn_dtype = learn_dtype
    med = {k: v.median for k, v in timings.items()}
    forward = med["full forward, base"]
    payload = {
        "model": description,
        "layers": [int(k) for k in model.memory_layers],
        "batch": [b, t],
        "new_tokens": args.new_tokens,
        "timings_s": {k: v.samples for k, v in timings.items()},
        "median_s": med,
        "overheads": overhead_rows(med, b * t, args.new_tokens),
        "state_bytes": model.fast_weight_bytes(),
        # The goals: learning against the forward pass a user would run, reading against the base forward.
        "learn_vs_forward": forward / med["learn, float64 statistics"],
        "learn_tokens_per_s": b * t / med["learn, float64 statistics"],
        "forward_tokens_per_s": b * t / forward,
        "learn_overhead": med["learn, float64 statistics"] / forward - 1,
        "learn_overhead_float32": med["learn, float32 compute"] / forward - 1,
        "learn_overhead_model_dtype": med["learn, the model's dtype (learn_dtype='model')"] / forward - 1,
        "learn_dtype": learn_dtype,
        "read_overhead": med["forward with fast weights"] / forward - 1,
        "inference_overhead": med["forward with fast weights"] / forward - 1,
        "generation_overhead": med["generate with fast weights"] / med["generate, base"] - 1,
        "read_overhead_per_token_s": (med["generate with fast weights"] - med["generate, base"]) / args.new_tokens,
        "solve_s": med["solve after a learned batch"],
        # The spaces whose read cases ran with FORCED_STEP / FORCED_WEIGHT because tuning left the memory off.
        "forced_step": forced,
    }
    md = model_report(args, payload, [int(k) for k in model.memory_layers], state_rows(model))
    del model, batch
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return payload, md


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.monotonic()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    H.set_threads(args.threads)
    if args.smoke or args.device.startswith("cuda"):  # the CPU-quiet gate is for CPU timings
        H.QUIET.update(timeout_s=1.0, budget_s=5.0)
    record = H.start()
    payloads, md, last = [], [], 0.0
    for kind in args.model:
        # The next model would take about as long as the last one: start it only if that fits in --budget-s.
        late = payloads and args.budget_s is not None and time.monotonic() - started + last > args.budget_s
        skip = "time budget spent" if late else too_big(kind, args.device, dtype)
        if skip:
            payloads.append({"model": kind, "skipped": skip})
            md += [f"## {kind}", "", f"Skipped: {skip}.", ""]
        else:
            begun = time.monotonic()
            payload, lines = run_model(args, kind, dtype)
            last = time.monotonic() - begun
            payloads.append(payload)
            md += ([f"## {payload['model']}", ""] if len(args.model) > 1 else []) + lines
        result = write_result(args, record, payloads, md)  # after every model: a cut run keeps the ones done
    print("\n".join(["# FAAST overhead in causal LMs", "", H.provenance.markdown(record), "", *md]))
    return result


def write_result(args: argparse.Namespace, record: dict, payloads: list[dict], md: list[str]) -> dict:
    """hf_overhead_<model>_<device>.{json,md} for one model; hf_overhead_shapes_<device> with a list for several."""
    where = "cpu" if args.device == "cpu" else H.slug(record.get("gpu", args.device))
    models = args.model[0] if len(args.model) == 1 else "shapes"
    stem = args.out or f"hf_overhead_{models}_{'smoke' if args.smoke else where}"
    if len(args.model) == 1:
        result, title = payloads[0], f"FAAST overhead in a causal LM: {payloads[0]['model']}"
    else:
        result, title = {"models": payloads}, f"FAAST overhead in causal LMs on {where}"
    H.write(args.out_dir / stem, record, result, title, md)
    return result


if __name__ == "__main__":
    main()
