"""Micro-benchmarks of the Triton kernels against their competitors, measured in the same run.

    python -m faast_lab.benchmarks.bench_kernels [--out DIR] [--budget-s 240]      # a CUDA device: the real numbers
    python -m faast_lab.benchmarks.bench_kernels --smoke --out DIR                # CPU, Triton interpreter, tiny sizes

Gram S += KᵀK, T += Kᵀ diag(s) V (keys/values bf16, scores fp32), cases (N, dk, dv, L) from the issue's goal
(N = 65,536, d = dv = 1600), one SmolLM2 and one Qwen2-7B layer, d = 256 / dv = 64 (few output tiles), and the
layer-batched shapes of a learned batch (GPT-2-XL: 48 x 1600; SmolLM2: 6 x 576). Per case:
  * every precision mode of faast_kernels.gram (fp64, tf32x3, fp32, bf16 where the kernel has it),
  * the torch compositions: faast's own torch backend (what `auto` runs on CUDA today) in float64 and in float32
    compute, and the best 16-bit composition (scale V by s in fp32, round to bf16, two bf16 GEMMs with fp32 output
    added into float64),
  * the torch candidates of faast.ops.gram_modes: torch.exact16 at several flush lengths R (one cuBLAS bmm per group
    of R-row chunks with 16-bit inputs and a float32 output, flushed into float64; with and without scores), and a
    float64 path over large chunks (the rows upcast once, one fused float64 GEMM Kᵀ[K | sV] per chunk: FP64 tensor
    cores), each with its relative error on S against float64 (layer 0),
  * the int8-slice Gram of faast_kernels.gram_int8 (float64-grade by its stated bound; docs/numerics.md §4), with
    and without scores,
  * the bf16 matmul ceiling: torch.matmul [d, N] x [N, d] in bf16 at this N, TFLOP/s measured now,
  * the authors' learn at L = 1, N <= 8192: pinv of the stored N x d keys (float32) @ V.
Floor: the upper triangle of S and all of T, N·dk·(dk + 1) + 2·N·dk·dv flops, at the measured bf16 ceiling.
Residual h = x + x·M (x bf16, rows = 8 x 1024): the kernel with M in bf16 (tensor cores) against torch.addmm in bf16,
and with M in float32 against faast's torch backend (float32 addmm, rounded once); the unfolded path x + (x W) P.

Timing: triton.testing.do_bench (CUDA events, median). On a CPU the interpreter gives no meaningful time: --smoke
runs every path once at tiny sizes so the script cannot rot, and labels its numbers as such.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from faast_lab.benchmarks import _harness as H

# (N, dk, dv, L)
GRID = [
    (65536, 1600, 1600, 1),
    (65536, 768, 768, 1),
    (65536, 576, 576, 1),
    (65536, 256, 64, 1),
    (65536, 3584, 3584, 1),
    (8192, 1600, 1600, 48),
    (8192, 576, 576, 6),
    (8192, 1600, 1600, 1),
]
SMOKE = [(70, 40, 24, 2), (33, 20, 20, 1)]
RESIDUAL = [(8192, 576), (8192, 1600), (8192, 3584)]
SMOKE_RESIDUAL = [(37, 24)]
EXACT16_FLUSHES = (1024, 4096, 16384)
SMOKE_EXACT16_FLUSHES = (16, 64)
# Rows per chunk of the fused float64 path: its float64 [L, rows, dk + dv] copy stays near this size.
FLOAT64_CHUNK_BYTES = 1 << 30
BROKEN: dict[str, str] = {}  # kernel cases that failed once in this run (e.g. no compiler support on this GPU)


def timer(device: str, smoke: bool):  # noqa: ANN201 - fn -> seconds
    if device == "cuda" and not smoke:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") / 1e3

    def once(fn) -> float:  # noqa: ANN001
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> float32 output (tensor cores, float32 accumulation)."""
    try:
        return torch.matmul(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # a torch without out_dtype (or not for this device): one more rounding
        return torch.matmul(a, b).float()


def modes() -> tuple[str, ...]:
    from faast_kernels.gram import PRECISIONS

    return tuple(m for m in PRECISIONS if m != "fp32")  # plain IEEE float32: the slow opt-in, not timed


def float64_fused(keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S, T in float64 from one float64 GEMM Kᵀ [K | sV] per chunk of about FLOAT64_CHUNK_BYTES (full S, no
    triangle blocks: one long DGEMM per chunk)."""
    L, n, dk = keys.shape
    width = dk + values.shape[-1]
    rows = max(64, min(n, FLOAT64_CHUNK_BYTES // (L * width * 8)))
    acc = torch.zeros(L, dk, width, dtype=torch.float64, device=keys.device)
    buf = torch.empty(L, rows, width, dtype=torch.float64, device=keys.device)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        x = buf[:, :m]
        x[..., :dk].copy_(keys[:, start : start + m])
        torch.mul(values[:, start : start + m], scores[:, start : start + m, None], out=x[..., dk:])
        acc.baddbmm_(x[..., :dk].mT, x)
    return acc[..., :dk], acc[..., dk:]


def int8_cases(keys, values, scores, acc, full: bool) -> dict:  # noqa: ANN001
    """The int8-slice Gram (faast_kernels.gram_int8, float64-grade by its bound), timed beside the float64 and bf16
    compositions, before the slower cases so that a spent budget skips others first. Off a GPU (the interpreter) only
    the unscored case on the smallest smoke shape: its scored factor needs eight slices, minutes interpreted."""
    from faast_kernels.gram_int8 import gram_accumulate_int8

    gram, cross, sqnorm = acc
    cases = {"triton_int8_noscores": lambda: gram_accumulate_int8(keys, values, gram=gram, cross=cross, sqnorm=sqnorm)}
    if full:
        cases = {"triton_int8": lambda: gram_accumulate_int8(keys, values, scores, gram=gram, cross=cross,
                                                             sqnorm=sqnorm), **cases}  # fmt: skip
    elif keys.shape[1] * keys.shape[2] > 33 * 20:
        return {}
    return cases


def gram_case(  # noqa: ANN001
    n: int,
    dk: int,
    dv: int,
    L: int,
    *,
    device: str,
    bench,
    deadline: float,
    flushes: tuple[int, ...] = (),
    all_cases: bool = False,
) -> dict:
    from faast_kernels.gram import gram_accumulate

    from faast import ops
    from faast.ops import gram_modes, reference

    g = torch.Generator(device=device).manual_seed(n + dk + L)
    keys = torch.randn(L, n, dk, device=device, dtype=torch.bfloat16, generator=g)
    values = torch.randn(L, n, dv, device=device, dtype=torch.bfloat16, generator=g)
    scores = torch.rand(L, n, device=device, generator=g)
    gram = torch.zeros(L, dk, dk, device=device, dtype=torch.float64)
    cross = torch.zeros(L, dk, dv, device=device, dtype=torch.float64)
    sqnorm = torch.zeros(L, device=device, dtype=torch.float64)
    flops = L * (n * dk * (dk + 1) + 2 * n * dk * dv)
    row: dict = {"n": n, "dk": dk, "dv": dv, "L": L, "flops": flops}

    def composition_bf16() -> None:
        sv = (values.float() * scores[..., None]).to(torch.bfloat16)
        kt = keys.mT
        gram.add_(_mm_fp32(kt, keys))
        cross.add_(_mm_fp32(kt, sv))

    def torch_backend(compute: torch.dtype):  # noqa: ANN202
        return lambda: reference.accumulate_gram_streaming(
            keys, values, scores, None, weighted_least_squares=False, compute_dtype=compute
        )

    ceiling_a, ceiling_b = keys[0].mT.contiguous(), values[0]
    row["ceiling_s"] = bench(lambda: ceiling_a @ ceiling_b)
    row["ceiling_tflops"] = 2 * n * dk * dv / row["ceiling_s"] / 1e12
    floor_s = flops / (row["ceiling_tflops"] * 1e12)
    row["floor_s"] = floor_s
    cases = {
        "torch_bf16_composition": composition_bf16,
        "torch_backend_float64": torch_backend(torch.float64),
        **int8_cases(keys, values, scores, (gram, cross, sqnorm), device == "cuda"),
        "torch_backend_float32": torch_backend(torch.float32),
    }
    for mode in modes():
        # A mode auto's gate keeps out on this GPU (fp64 with bf16 inputs: does not compile on sm_80+) is not tried:
        # each failed compile cost seconds of a fresh machine's budget (gpu_h100_run5). --all-cases tries it.
        call = ops.gram_call(keys, values, scores, compute_dtype=torch.float64 if mode == "fp64" else torch.float32)
        reason = None if all_cases else H.gated("accumulate_gram", "triton", call)
        if reason is not None:
            for name in (f"triton_{mode}", f"triton_{mode}_noscores"):
                row.setdefault("gated", {})[name] = reason
            continue
        cases[f"triton_{mode}"] = lambda p=mode: gram_accumulate(keys, values, scores, gram=gram, cross=cross,
                                                                 sqnorm=sqnorm, precision=p)  # fmt: skip
        cases[f"triton_{mode}_noscores"] = lambda p=mode: gram_accumulate(keys, values, gram=gram, cross=cross,
                                                                          sqnorm=sqnorm, precision=p)  # fmt: skip
    # Their S is checked against float64 on layer 0 (relS); the kernels above write into shared accumulators.
    checked = {"torch_float64_fused": lambda: float64_fused(keys, values, scores)}
    # Scores split s·v into two 16-bit terms (a wider right operand); without them, only the longest R (time budget).
    for r in flushes:
        for scored in (True, False) if r == max(flushes) else (True,):
            checked[f"torch_exact16_r{r}" + ("" if scored else "_noscores")] = (
                lambda r=r, sc=scored: gram_modes.accumulate_gram_exact16(keys, values, scores if sc else None, None,
                    weighted_least_squares=False, compute_dtype=torch.float32, flush_rows=r)[:2]
            )  # fmt: skip
    cases.update(checked)
    if L == 1 and n <= 8192:
        k32, v32 = keys[0].float(), values[0].float()
        cases["authors_pinv"] = lambda: torch.linalg.pinv(k32, rtol=1 / n) @ (v32 * scores[0, :, None])
    for name, fn in cases.items():
        if name in BROKEN:
            row[f"{name}_s"] = None
            row.setdefault("errors", {})[name] = "failed earlier in this run: " + BROKEN[name]
            continue
        if time.monotonic() > deadline:
            row[f"{name}_s"] = None
            row.setdefault("skipped", []).append(name)
            continue
        try:
            row[f"{name}_s"] = bench(fn)
        except Exception as err:  # noqa: BLE001 - one failing competitor is recorded, the others still run
            row[f"{name}_s"] = None
            row.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:500]
            if name.startswith("triton_"):  # a kernel that does not compile here will not compile at the next size
                BROKEN[name] = f"{type(err).__name__}: {str(err)[:200]}"
    for name in cases:
        s = row.get(f"{name}_s")
        if s:
            row[f"{name}_tflops"] = flops / s / 1e12
            row[f"{name}_vs_floor"] = s / floor_s
    k0 = keys[0].double()
    s_ref = k0.mT @ k0
    del k0
    for name, fn in checked.items():
        if row.get(f"{name}_s"):
            s_got = fn()[0][0]
            row[f"{name}_rel_s"] = float((s_got - s_ref).norm() / s_ref.norm())
    return row


def residual_case(rows: int, d: int, *, device: str, bench) -> dict:  # noqa: ANN001
    from faast_kernels.residual import residual_project

    from faast.ops import reference

    g = torch.Generator(device=device).manual_seed(rows + d)
    x = torch.randn(rows, d, device=device, dtype=torch.bfloat16, generator=g)
    m32 = 0.01 * torch.randn(d, d, device=device, generator=g)
    m16 = m32.to(torch.bfloat16)
    w = (0.01 * torch.randn(d, d, device=device, generator=g)).to(torch.bfloat16)
    p = (0.01 * torch.randn(d, d, device=device, generator=g)).to(torch.bfloat16)
    row = {
        "rows": rows, "d": d,
        "kernel_bf16m_s": bench(lambda: residual_project(x, m16)),
        "addmm_bf16_s": bench(lambda: torch.addmm(x, x, m16)),
        "kernel_fp32m_s": bench(lambda: residual_project(x, m32)),
        "torch_backend_fp32m_s": bench(lambda: reference.residual_project(x, m32)),
        "unfolded_s": bench(lambda: x + (x @ w) @ p),
    }  # fmt: skip
    row["bf16m_vs_addmm"] = row["addmm_bf16_s"] / row["kernel_bf16m_s"]
    row["bf16m_vs_unfolded"] = row["unfolded_s"] / row["kernel_bf16m_s"]
    row["fp32m_vs_torch_backend"] = row["torch_backend_fp32m_s"] / row["kernel_fp32m_s"]
    return row


def _cell(r: dict, key: str, fmt) -> str:  # noqa: ANN001
    v = r.get(key)
    return "n/a" if v is None else fmt(v)


def ratio_of(r: dict, a: str, b: str) -> str:
    """a's time over b's in row r, or n/a."""
    sa, sb = r.get(f"{a}_s"), r.get(f"{b}_s")
    return "n/a" if not sa or not sb else f"{sa / sb:.2f}"


def tables(grams: list[dict], residuals: list[dict]) -> list[str]:
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    lines = ["Gram: time in ms (TFLOP/s on the triangle floor in parentheses); ratios are the competitor's time over "
             "the kernel's (> 1: the kernel is faster).", ""]  # fmt: skip
    names = ["torch_bf16_composition", "torch_backend_float64", "torch_backend_float32", "torch_float64_fused"]
    names += (
        ["triton_int8", "triton_int8_noscores"]
        + [f"triton_{m}" for m in modes()]
        + [f"triton_{m}_noscores" for m in modes()]
        + ["authors_pinv"]
    )
    timed16 = {k[:-2] for r in grams for k in r if k.startswith("torch_exact16_r") and k.endswith("_s")}
    torch16 = sorted((k for k in timed16 if not k.endswith("_rel")), key=lambda k: (int(k[15:].split("_")[0]), k))
    names[4:4] = torch16
    head = ["N", "dk", "dv", "L", "bf16 ceiling TF/s", "floor ms"] + names
    rows = []
    for r in grams:
        cells = [r["n"], r["dk"], r["dv"], r["L"], f"{r['ceiling_tflops']:.0f}", ms(r["floor_s"])]
        for name in names:
            s, tf = r.get(f"{name}_s"), r.get(f"{name}_tflops")
            cells.append("n/a" if s is None else f"{ms(s)} ({tf:.0f})")
        rows.append(cells)
    lines.append(H.markdown_table(head, rows))
    ratio_rows = []
    for r in grams:

        def ratio(a: str, b: str, r: dict = r) -> str:
            sa, sb = r.get(f"{a}_s"), r.get(f"{b}_s")
            return "n/a" if not sa or not sb else f"{sa / sb:.2f}"

        cells = [r["n"], r["dk"], r["dv"], r["L"]]
        for mode in modes():
            cells.append(_cell(r, f"triton_{mode}_vs_floor", lambda v: f"{v:.2f}"))
        cells += [ratio("torch_backend_float64", "triton_fp64"), ratio("torch_backend_float32", "triton_tf32x3")]
        best16 = "triton_exact16" if "exact16" in modes() else "triton_tf32x3"
        cells += [ratio("torch_bf16_composition", best16), ratio("torch_bf16_composition", best16 + "_noscores")]
        cells += [ratio("torch_backend_float64", "triton_int8"), ratio("torch_bf16_composition", "triton_int8"),
                  ratio("torch_bf16_composition", "triton_int8_noscores")]  # fmt: skip
        ratio_rows.append(cells)
    lines += ["", H.markdown_table(
        ["N", "dk", "dv", "L"] + [f"{m} / floor" for m in modes()]
        + ["torch float64 / fp64", "torch float32 / tf32x3", "bf16 composition / 16-bit mode",
           "bf16 composition / 16-bit mode (no scores)", "torch float64 / int8", "bf16 composition / int8",
           "bf16 composition / int8 (no scores)"], ratio_rows)]  # fmt: skip
    if torch16 or any("torch_float64_fused_s" in r for r in grams):
        checked = ["torch_float64_fused", *torch16]
        lines += ["", "torch candidates: the bf16 composition's time over theirs (> 1: faster than the composition) "
                  "and their relative error on S against float64 (layer 0).", "", H.markdown_table(
            ["N", "dk", "dv", "L"] + [f"{c} speed / relS" for c in checked],
            [[r["n"], r["dk"], r["dv"], r["L"]] + [
                f"{ratio_of(r, 'torch_bf16_composition', c)} / {_cell(r, c + '_rel_s', lambda v: f'{v:.1e}')}"
                for c in checked] for r in grams])]  # fmt: skip
    gated = {name: why for r in grams for name, why in r.get("gated", {}).items()}
    if gated:
        lines += ["", "Not tried (n/a above): " + "; ".join(f"{name}: {why}" for name, why in gated.items())]
    lines += ["", "Residual h = x + x·M, x bf16 (ms):", "", H.markdown_table(
        ["rows", "d", "kernel, M bf16", "addmm bf16", "vs addmm", "unfolded x+(xW)P", "vs unfolded",
         "kernel, M fp32", "torch backend, M fp32", "vs torch backend"],
        [[r["rows"], r["d"], ms(r["kernel_bf16m_s"]), ms(r["addmm_bf16_s"]), f"{r['bf16m_vs_addmm']:.2f}",
          ms(r["unfolded_s"]), f"{r['bf16m_vs_unfolded']:.2f}", ms(r["kernel_fp32m_s"]),
          ms(r["torch_backend_fp32m_s"]), f"{r['fp32m_vs_torch_backend']:.2f}"] for r in residuals])]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU through the Triton interpreter")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new Gram cases after this")
    parser.add_argument("--all-cases", action="store_true", help="also try the modes auto's gates keep out")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not args.smoke:
            print("bench_kernels: needs a CUDA device (the interpreter checks correctness, not speed); --smoke runs "
                  "it on tiny sizes", file=sys.stderr)  # fmt: skip
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")
    bench = timer(device, args.smoke)
    record = H.start()
    deadline = time.monotonic() + args.budget_s
    # The residual read first: a few seconds, and its goal is lost when the Gram grid outlasts the step's limit (as
    # on gpu_h100_run5's fresh machine, where Triton's first compiles took the whole step).
    residuals = [residual_case(*c, device=device, bench=bench) for c in (SMOKE_RESIDUAL if args.smoke else RESIDUAL)]
    grams = []
    for case in SMOKE if args.smoke else GRID:
        flushes = SMOKE_EXACT16_FLUSHES if args.smoke else EXACT16_FLUSHES
        grams.append(gram_case(*case, device=device, bench=bench, deadline=deadline, flushes=flushes,
                               all_cases=args.all_cases))  # fmt: skip
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in grams[-1].items()}, flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    where = record.get("gpu", "cpu (smoke: interpreter, times meaningless)")
    stem = "kernels_" + ("smoke" if args.smoke else H.slug(where))
    body = tables(grams, residuals)
    payload = {"modes": list(modes()), "gram": grams, "residual": residuals}
    H.write(args.out / stem, record, payload, f"Triton kernels on {where}", body)
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
