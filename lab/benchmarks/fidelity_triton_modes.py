"""Which Gram precision mode passes the float64 fidelity suite? (the test that decides the defaults and the gates)

    TRITON_INTERPRET=1 python -m faast_lab.benchmarks.fidelity_triton_modes --jobs 2  # CPU interpreter, 2 processes
    python -m faast_lab.benchmarks.fidelity_triton_modes [--out DIR]                  # GPU: the compiled kernels
    python -m faast_lab.benchmarks.fidelity_triton_modes --smoke --out DIR            # two spectra, N = 1000 (it runs)
    python -m faast_lab.benchmarks.fidelity_triton_modes --modes torch torch.float32 torch.exact16 torch.syrk \
        --name fidelity_torch_modes_cpu                                           # only the torch modes (no Triton)

For every spectrum of docs/numerics.md (tests/spectra.py: well-conditioned, power laws with outliers, duplicated rows,
LayerNorm-like, N < d) at N = 1000 and 16384, d = 256, dv = 64, alpha = 0.8 and 1, keys are streamed in 4096-row
batches through faast_kernels.gram in each precision mode, solved by faast.ops.solve_fast_weights_ex, and compared with
the float64 SVD truth of the same keys: the kept rank must match and relW <= 1e-5, relP <= 1e-6 (tests/tolerances.py).
The 32-bit modes (fp64, tf32x3, fp32) get the float32 keys; the 16-bit mode (exact16) gets the keys rounded to
bf16, and its truth is that of the rounded keys. The 16-bit modes run once per flush length R (rows summed in float32
before each float64 add), which is how R is chosen. Writes triton_fidelity_<device>.{json,md} into --out (or
<--name>.{json,md}).

Beside the Triton kernel's modes, the torch candidates of faast.ops.accumulate_gram run the same suite: torch (the
float64 reference path), torch.float32 (its float32 compute mode, 4096-row float32 chunks: the float32-grade
baseline), torch.exact16 (faast.ops.gram_modes: 16-bit GEMMs with float32 output flushed into float64 every R rows;
cuBLAS on a GPU, float32 copies on a CPU) and torch.syrk (scipy's dsyrk, CPU only).

Under the interpreter, tl.dot is numpy's float32/float64 matmul per tile, so the float32 sums are IEEE sums; tensor
cores may round their float32 accumulation differently, so a GPU run of this script is what decides the GPU default.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import torch

from faast import ops
from faast_lab.benchmarks import _harness as H

# The spectra and tolerances are the tests' own (tests/spectra.py, tests/tolerances.py), read from the checkout.
spectra = H.checkout_tests_module("spectra")
_tolerances = H.checkout_tests_module("tolerances")
TRUTH_REL_P, TRUTH_REL_W, rel = _tolerances.TRUTH_REL_P, _tolerances.TRUTH_REL_W, _tolerances.rel

D, DV, N_TEST, BATCH = 256, 64, 2048, 4096
INPUT_DTYPE = {
    "fp64": torch.float32, "tf32x3": torch.float32, "fp32": torch.float32, "exact16": torch.bfloat16,
    "torch": torch.float32, "torch.float32": torch.float32, "torch.exact16": torch.bfloat16,
    "torch.syrk": torch.float32,
}  # fmt: skip
TORCH_MODES = ("torch", "torch.float32", "torch.exact16", "torch.syrk")
FLUSH_SWEEP = (64, 256, 1024, 4096)


def variants() -> list[tuple[str, int | None]]:
    """(mode, flush rows or None for the mode's default) for every precision mode of the Triton kernel (when Triton
    imports) and every torch mode."""
    out = []
    try:
        from faast_kernels import gram
    except ImportError as err:
        print(f"Triton modes skipped: {err}", flush=True)
    else:
        for mode in gram.PRECISIONS:
            flushes = "flush_rows" in gram.gram_accumulate.__code__.co_varnames
            sweep = FLUSH_SWEEP if mode == "exact16" and flushes else ()
            out += [(mode, r) for r in sweep] or [(mode, None)]
    for mode in TORCH_MODES:
        out += [(mode, r) for r in FLUSH_SWEEP] if mode == "torch.exact16" else [(mode, None)]
    return out


def _torch_mode(mode: str, flush: int | None):  # noqa: ANN202 - the accumulate_gram candidate, options bound
    from faast.ops import gram_modes, reference

    if mode == "torch.syrk":
        reason = gram_modes.syrk_unavailable_reason(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        if reason:
            raise RuntimeError(reason)
        return functools.partial(gram_modes.accumulate_gram_syrk, weighted_least_squares=False,
                                 compute_dtype=torch.float64)  # fmt: skip
    if mode == "torch.exact16":
        return functools.partial(gram_modes.accumulate_gram_exact16, weighted_least_squares=False,
                                 compute_dtype=torch.float32, flush_rows=flush)  # fmt: skip
    compute = torch.float32 if mode == "torch.float32" else torch.float64
    return functools.partial(reference.accumulate_gram_streaming, weighted_least_squares=False, compute_dtype=compute)


def _row(r: dict) -> list:
    return [r["kind"], r["n"], r["alpha"], r["mode"], r["flush_rows"] or "default", f"{r['rank']} / {r['rank_truth']}",
            H.fmt_sci(r["rel_w"]), H.fmt_sci(r["rel_p"]), "yes" if r["pass"] else "NO"]  # fmt: skip


def stream(keys: torch.Tensor, values: torch.Tensor, mode: str, flush: int | None, device: torch.device):
    s = torch.zeros(1, D, D, dtype=torch.float64, device=device)
    t = torch.zeros(1, D, DV, dtype=torch.float64, device=device)
    yy = torch.zeros(1, dtype=torch.float64, device=device)
    if mode in TORCH_MODES:
        fn = _torch_mode(mode, flush)
        for i in range(0, keys.shape[0], BATCH):
            ds, dt, dyy = fn(keys[None, i : i + BATCH].to(device), values[None, i : i + BATCH].to(device), None, None)
            s += ds
            t += dt
            yy += dyy
        return s, t
    from faast_kernels import gram as kernel

    extra = {} if flush is None else {"flush_rows": flush}
    for i in range(0, keys.shape[0], BATCH):
        k = keys[None, i : i + BATCH].to(device)
        v = values[None, i : i + BATCH].to(device)
        kernel.gram_accumulate(k, v, gram=s, cross=t, sqnorm=yy, precision=mode, **extra)
    return s, t


def measure(
    kinds: list[str], sizes: tuple[int, ...], device: torch.device, only_modes: list[str] | None, jobs: int = 1
) -> tuple[list[dict], dict[str, str]]:
    """Every (spectrum, N, mode, flush R, alpha) against the float64 SVD truth: (result rows, {mode: error} for the
    modes that could not run here). jobs > 1 runs the (spectrum, N) cases in that many forked processes (the CPU
    interpreter runs every tile in Python, one core each); rows keep the order of a serial run."""
    cases = [(kind, n) for kind in kinds for n in sizes if not (kind == "lowN_pow1o" and n > 1000)]
    if jobs > 1 and device.type == "cpu":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        fork = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(jobs, mp_context=fork, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            kinds_, sizes_ = [k for k, _ in cases], [n for _, n in cases]
            parts = list(pool.map(_measure_case, kinds_, sizes_, [device] * len(cases), [only_modes] * len(cases)))
    else:
        parts = [_measure_case(kind, n, device, only_modes) for kind, n in cases]
    results, errors = [], {}
    for rows, errs in parts:
        results += rows
        errors.update(errs)
    return results, errors


def _measure_case(kind: str, n: int, device: torch.device, only_modes: list[str] | None) -> tuple[list, dict]:
    """One spectrum at one N, every mode: (result rows, {mode: error})."""
    results, errors = [], {}
    keys32, held_out = spectra.make_keys(kind, n, D, n_test=N_TEST)
    values = spectra.make_values(keys32, DV)
    count = keys32.shape[0]  # lowN_pow1o keeps fewer rows than asked: the cut uses the rows learned
    svd = {}
    for mode, flush in variants():
        if mode in errors or (only_modes and mode not in only_modes):
            continue
        in_dtype = INPUT_DTYPE.get(mode, torch.float32)
        keys = keys32.to(in_dtype)
        if in_dtype not in svd:
            svd[in_dtype] = torch.linalg.svd(keys.double(), full_matrices=False)
        u, sv, vh = svd[in_dtype]
        start = time.perf_counter()
        try:
            s, t = stream(keys, values.to(in_dtype), mode, flush, device)
        except Exception as err:  # noqa: BLE001 - e.g. a mode Triton cannot compile for this GPU
            errors[mode] = f"{type(err).__name__}: {str(err)[:300]}"
            print(mode, errors[mode], flush=True)
            continue
        seconds = time.perf_counter() - start
        for alpha in (0.8, 1.0):
            keep = sv > count**-alpha * sv[0]
            truth = vh[keep].T @ ((u[:, keep].T @ values.to(in_dtype).double()) / sv[keep].unsqueeze(-1))
            w, info = ops.solve_fast_weights_ex(s, t, count=float(count), alpha=alpha)
            w = w[0].cpu()
            r = {
                "kind": kind, "n": count, "mode": mode, "flush_rows": flush, "input": str(in_dtype),
                "alpha": alpha, "rank": int(info.rank[0]), "rank_truth": int(keep.sum()),
                "rel_w": rel(w, truth), "rel_p": rel(held_out.double() @ w, held_out.double() @ truth),
                "learn_s": seconds,
            }  # fmt: skip
            r["pass"] = r["rank"] == r["rank_truth"] and r["rel_w"] <= TRUTH_REL_W and r["rel_p"] <= TRUTH_REL_P
            results.append(r)
            print(*_row(r), flush=True)
    return results, errors


def summarise(results: list[dict]) -> dict:
    """Per mode (and flush R): cases passed, cases, the largest relW."""
    keys_of = sorted({(r["mode"], r["flush_rows"] or 0) for r in results}, key=lambda k: (list(INPUT_DTYPE).index(
        k[0]) if k[0] in INPUT_DTYPE else 99, k[1]))  # fmt: skip
    return {f"{m}" + (f" R={f}" if f else ""): {
        "pass": sum(r["pass"] for r in results if (r["mode"], r["flush_rows"] or 0) == (m, f)),
        "cases": sum(1 for r in results if (r["mode"], r["flush_rows"] or 0) == (m, f)),
        "max_rel_w": max((r["rel_w"] for r in results if (r["mode"], r["flush_rows"] or 0) == (m, f)), default=None),
    } for m, f in keys_of}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=spectra.SPECTRA, default=None)
    parser.add_argument("--modes", nargs="+", default=None, help="precision modes to run (default: every mode)")
    parser.add_argument("--flush", type=int, nargs="+", default=None, help="exact16 flush lengths R to sweep")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--jobs", type=int, default=1, help="CPU interpreter: run the cases in this many processes")
    parser.add_argument("--out", type=Path, default=H.RESULTS)
    parser.add_argument("--name", default=None, help="file stem of the results (default: triton_fidelity_<where>)")
    args = parser.parse_args(argv)
    global D, DV, FLUSH_SWEEP
    if args.smoke:  # a smaller problem: the interpreter runs every tile in Python
        D, DV, FLUSH_SWEEP = 64, 16, (64, 1024)
    if args.flush:
        FLUSH_SWEEP = tuple(args.flush)
    kinds = args.kinds or (["pow1o"] if args.smoke else list(spectra.SPECTRA))
    sizes = (1000,) if args.smoke else (1000, 16384)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = H.start()
    where = "interpreter" if device.type == "cpu" else H.slug(record["gpu"])
    name = args.name or (
        "triton_fidelity_" + ("smoke" if args.smoke else where) + ("_" + "_".join(args.modes) if args.modes else "")
    )
    results, errors = measure(kinds, sizes, device, args.modes, args.jobs)
    summary = summarise(results)
    table = H.markdown_table(
        ["spectrum", "N", "alpha", "mode", "flush R", "rank / truth", "relW", "relP", "pass"],
        [_row(r) for r in results],
    )
    verdicts = H.markdown_table(
        ["mode", "cases passed", "max relW"],
        [[k, f"{v['pass']} / {v['cases']}", H.fmt_sci(v["max_rel_w"])] for k, v in summary.items()],
    )
    how = "CPU: Triton interpreter, torch modes on the CPU" if device.type == "cpu" else "compiled kernels, CUDA"
    failed = "".join(f"- {m}: did not run: {e}\n" for m, e in errors.items())
    text = f"{verdicts}\n\n{failed}\n{table}\n"
    payload = {"results": results, "summary": summary, "errors": errors}
    H.write(args.out / name, record, payload, f"Gram precision modes against the float64 truth ({how})", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
