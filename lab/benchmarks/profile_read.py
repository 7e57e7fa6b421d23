"""Where a forward pass that reads a solved memory spends its time: torch.profiler over the base forward pass and the
reads in probability and logit space, on one config-built model. Written for the gap lab/benchmarks/results/
gpu_h100_run4.md shows (+73% per forward pass in probability space on the SmolLM2 shape, where the arithmetic of the
read predicts a few per cent), so that one device call says whether operators, kernels or host synchronisations cost
it.

    python -m faast_lab.benchmarks.profile_read --device cuda        # SmolLM2-shaped, bf16, on a GPU (estimated 1 min)
    python -m faast_lab.benchmarks.profile_read --model tiny --smoke           # anywhere: a tiny Llama, a quick check

Per case (the base forward pass, the probability-space read, the logit-space read; the same [B, T] batch): the median
wall time of --reps passes and its ratio to the base pass, the operators (aten::*) and device kernels one pass
launches, its host synchronisations (aten::_local_scalar_dense, cudaStreamSynchronize, cudaDeviceSynchronize,
cudaMemcpy), and the operators with the most self time on the device (CUDA) and on the host. Then the mixture alone
on one read chunk (min(B·T, 1024) rows of the model's vocabulary): the torch composition against the fused kernel.
On a GPU (and in --smoke) the probability-space read runs twice more with each mixture backend forced through
FAAST_BACKEND, and the report gives auto's choice with the seconds it measured (a fresh autotune cache unless
FAAST_AUTOTUNE_CACHE names one), so that one run says what the dispatch picked and what the other choice costs.
The memory is learned from --learn-batches batches of random tokens and solved untimed; if the tuned step leaves it
off (random weights can), step 1 and weight 0.5 are set so that the read does its full work, and the report says so.
Writes profile_read_<model>_<device>.{json,md} through the results writer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from faast_kernels import interpreting

from faast.ops import BACKEND_ENV_VAR
from faast_lab.benchmarks import _harness as H
from faast_lab.benchmarks.bench_hf_overhead import SHAPES, load

RESULTS = Path(__file__).resolve().parent / "results"
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
TOP = 12
_AUTOTUNE_CACHE_ENV = "FAAST_AUTOTUNE_CACHE"
# The probability-space read again with each mixture backend forced (FAAST_BACKEND): what auto's choice costs.
MIXTURE_CASES = (("probability, torch mixture", "mix_probabilities=torch"),
                 ("probability, fused mixture", "mix_probabilities=triton"))  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-shape", choices=["tiny", *SHAPES])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--learn-batches", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="batch 2 x 64, 2 repetitions")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--out", default=None, help="result file stem (default: profile_read_<model>_<device>)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.reps, args.learn_batches = 2, 64, 2, 2
    for name in ("batch", "seq", "reps", "learn_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    return args


def _self_device_us(avg) -> float:  # noqa: ANN001 - a profiler FunctionEventAvg
    # torch >= 2.4 names it self_device_time_total; older releases self_cuda_time_total.
    return float(getattr(avg, "self_device_time_total", getattr(avg, "self_cuda_time_total", 0.0)))


def profile_pass(run, device: str) -> dict:  # noqa: ANN001 - a callable running one forward pass
    """One profiled pass of run(): operator, kernel and synchronisation counts, and the top operators."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        H.time_once(lambda _: run())  # synchronised before and after: the device's work lands inside the profile
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    averages = prof.key_averages()
    rows = [
        {"name": a.key, "count": int(a.count), "self_host_us": float(a.self_cpu_time_total),
         "self_device_us": _self_device_us(a)}
        for a in averages
    ]  # fmt: skip
    host_rows = [r for r in rows if r["name"].startswith("aten::")]
    return {
        "aten_ops": sum(r["count"] for r in host_rows),
        "op_counts": {r["name"]: r["count"] for r in host_rows},
        "kernels": len(kernels),
        "device_kernel_us": sum(e.device_time_total if hasattr(e, "device_time_total") else 0.0 for e in kernels),
        "syncs": {name: sum(r["count"] for r in rows if r["name"].startswith(name)) for name in SYNC_EVENTS},
        "top_device": sorted((r for r in rows if r["self_device_us"] > 0), key=lambda r: -r["self_device_us"])[:TOP],
        "top_host": sorted(host_rows, key=lambda r: -r["self_host_us"])[:TOP],
    }


def time_mixture(n: int, v: int, dtype: torch.dtype, device: str, reps: int) -> dict:
    """The mixture alone on [n, V] logits and products of `dtype`: faast.ops' torch composition against
    faast_kernels' fused kernel (called directly, not through the dispatch), median ms of `reps` calls each, and the
    kernel's largest difference from the composition. The kernel needs a CUDA device (or TRITON_INTERPRET=1)."""
    from faast.ops import backends
    from faast.ops.mixture import mix_probabilities_torch

    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(n, v, generator=g)).to(device, dtype)
    dz = torch.randn(n, v, generator=g).to(device, dtype)
    odds = torch.zeros(n, device=device)
    rest = torch.full((n,), -0.6931, device=device)
    result: dict = {"rows": n, "vocab": v, "dtype": str(dtype).replace("torch.", "")}
    candidates = {"torch": mix_probabilities_torch, "triton": backends.implementation("triton", "mix_probabilities")}
    outs = {}
    for name, fn in candidates.items():
        if name == "triton" and not device.startswith("cuda") and not interpreting():
            result["triton_skipped"] = "needs a CUDA device (or TRITON_INTERPRET=1)"
            continue
        outs[name] = fn(z, dz, odds, rest, None, 1.0)  # warm-up: the kernel compiles here
        times = [H.time_once(lambda _, f=fn: f(z, dz, odds, rest, None, 1.0))[0] for _ in range(reps)]
        result[f"{name}_ms"] = 1e3 * statistics.median(times)
    if len(outs) == 2:
        result["torch_over_triton"] = result["torch_ms"] / result["triton_ms"]
        result["max_abs_diff"] = float((outs["torch"].double() - outs["triton"].double()).abs().max())
    return result


def run(args: argparse.Namespace) -> dict:
    # auto measures afresh (a cached choice from another process would hide what it picks) and the report reads it.
    os.environ.setdefault(_AUTOTUNE_CACHE_ENV, str(Path(tempfile.mkdtemp(prefix="faast-profile-")) / "autotune.json"))
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model, ids, description = load(args.model, args.device, dtype)
    model = model.to(args.device)
    b, t = args.batch, args.seq
    batch = torch.tensor(ids[: b * t], device=args.device).reshape(b, t)
    mask = torch.ones_like(batch)
    with torch.no_grad():
        model.learn(ids[b * t : b * t + args.learn_batches * b * t], max_length=t, batch_size=b)
    output = model.output_memory_layer
    model.solve()
    forced = not output.chosen_step() or not output.chosen_weight()
    if forced:  # random weights can leave the memory off; the profile is of a read that does its work
        output.step, output.weight = 1.0, 0.5
    shipped_space = output.space

    def forward(disabled: bool):  # noqa: ANN202
        def one() -> None:
            with torch.no_grad():
                if disabled:
                    with model.disable_faast():
                        model(input_ids=batch, attention_mask=mask, use_cache=False)
                else:
                    model(input_ids=batch, attention_mask=mask, use_cache=False)

        return one

    plan = [("base", None, True, None), ("probability", "probability", False, None)]
    if args.device.startswith("cuda") or args.smoke:  # a CPU's read does not dispatch the mixture: same as auto there
        plan += [(name, "probability", False, backend) for name, backend in MIXTURE_CASES]
    plan.append(("logit", "logit", False, None))
    cases = {}
    for name, space, disabled, backend in plan:
        if space is not None:
            output.space = space
            model.solve()
        one = forward(disabled)
        with _backend(backend):
            one()  # warm-up: kernels compiled and autotuned, the solution cached
            seconds = [H.time_once(lambda _, fn=one: fn())[0] for _ in range(args.reps)]
            profile = profile_pass(one, args.device)
        cases[name] = {"wall_s": seconds, "median_s": statistics.median(seconds), **profile}
        if backend is not None:
            cases[name]["backend"] = backend
    output.space = shipped_space
    base = cases["base"]["median_s"]
    for case in cases.values():
        case["vs_base"] = case["median_s"] / base
    vocab = int(output.head.weight.shape[0])
    mixture = time_mixture(min(b * t, 1024), vocab, getattr(torch, dtype), args.device, args.reps)
    return {"model": description, "batch": [b, t], "reps": args.reps, "forced_step": forced,
            "step": output.chosen_step(), "weight": output.chosen_weight(), "cases": cases,
            "mixture": mixture, "auto_mixture": _auto_mixture_choices()}  # fmt: skip


@contextlib.contextmanager
def _backend(request: str | None) -> Iterator[None]:
    """FAAST_BACKEND set to `request` (None: left as it is) for the duration, then restored."""
    if request is None:
        yield
        return
    before = os.environ.get(BACKEND_ENV_VAR)
    os.environ[BACKEND_ENV_VAR] = request
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV_VAR, None)
        else:
            os.environ[BACKEND_ENV_VAR] = before


def _auto_mixture_choices() -> dict:
    """What auto chose for the mixture and the seconds it measured, by shape class, from this run's autotune cache
    ({} where it timed nothing: a CPU's read does not dispatch the mixture)."""
    from faast.ops import backends

    return {key: entry for key, entry in backends.measured_choices().items() if key.startswith("mix_probabilities ")}


def report(payload: dict) -> list[str]:
    b, t = payload["batch"]
    lines = [
        f"{payload['model']}; batch {b} x {t}; {payload['reps']} timed passes per case (median), then one profiled.",
        "The memory " + ("was off after tuning, so step 1 and weight 0.5 were set." if payload["forced_step"]
                         else f"reads with its tuned step {payload['step']:.4g} and weight {payload['weight']:.3g}."),
        "",
    ]  # fmt: skip
    rows = []
    for name, c in payload["cases"].items():
        syncs = ", ".join(f"{k} {v}" for k, v in c["syncs"].items() if v) or "none"
        rows.append([name, H.fmt_s(c["median_s"]), f"{c['vs_base']:.3f}", c["aten_ops"], c["kernels"],
                     f"{c['device_kernel_us'] / 1e3:.2f} ms", syncs])  # fmt: skip
    lines += [H.markdown_table(["case", "wall", "vs base", "aten ops", "kernels", "kernel time", "syncs"], rows), ""]
    auto = payload.get("auto_mixture") or {}
    if auto:

        def measured(seconds: dict) -> str:
            return ", ".join(f"{n} {v:.3g}" if isinstance(v, float) else f"{n} {v}" for n, v in seconds.items())

        lines += ["auto's choice for the mixture, by shape class (seconds it measured): " + "; ".join(
            f"{key.removeprefix('mix_probabilities ')}: {entry['choice']} ({measured(entry['seconds'])})"
            for key, entry in auto.items()) + ".", ""]  # fmt: skip
    else:
        lines += ["auto timed no mixture in this run (a CPU's read does not dispatch it).", ""]
    mix = payload["mixture"]
    lines += [
        f"The mixture alone, {mix['rows']} x {mix['vocab']:,} {mix['dtype']} (one read chunk): torch composition "
        f"{mix['torch_ms']:.3f} ms; fused kernel "
        + (f"{mix['triton_ms']:.3f} ms ({mix['torch_over_triton']:.2f}x faster; max |difference| "
           f"{mix['max_abs_diff']:.1e})." if "triton_ms" in mix else f"not run: {mix['triton_skipped']}."),
        "",
    ]  # fmt: skip
    for name in ("probability", "logit"):
        c = payload["cases"][name]
        for key, label, field in (("top_device", "self device time", "self_device_us"),
                                  ("top_host", "self host time", "self_host_us")):  # fmt: skip
            if not c[key]:
                continue
            table = [[r["name"], r["count"], f"{r[field] / 1e3:.3f}"] for r in c[key]]
            lines += [f"{name}: operators by {label}", "", H.markdown_table(["operator", "calls", "ms"], table), ""]
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    record = H.start()
    payload = run(args)
    lines = report(payload)
    where = "cpu" if args.device == "cpu" else H.slug(record.get("gpu", args.device))
    stem = args.out or f"profile_read_{args.model}_{'smoke' if args.smoke else where}"
    H.write(args.out_dir / stem, record, payload, f"Profile of a read: {payload['model']}", lines)
    print("\n".join(lines))
    return payload


if __name__ == "__main__":
    main()
