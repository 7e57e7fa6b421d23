"""GPU micro-benchmarks of the Triton kernels against their competitors, measured in the same run.

    python benchmarks/bench_kernels.py [--quick] [--out benchmarks/results]      # needs a CUDA device

Gram (keys/values bf16, scores, dv = d), for N in {8k, 64k}, d in {768, 1600, 3584}, L in {1, 16}:
  * faast_kernels gram_accumulate in each precision mode (fp64, tf32x3),
  * the best torch composition: scale V by s, then two fp32-accumulating bf16 GEMMs (Kᵀ K and Kᵀ (sV)), added
    into float64 accumulators,
  * the authors' algorithm for the same rows (store keys; pinv of the N x d matrix; their learn cost),
  * the bf16 matmul ceiling: torch.matmul of [d, N] x [N, d] in bf16, TFLOP/s measured now.
  Reported: time, TFLOP/s on the upper-triangle floor (N·d·(d + 1) + 2·N·d·dv flops), fraction of the ceiling,
  speedups. Goals (issue 3): within 1.2x of the floor at the ceiling and >= 1.3x the torch composition at
  N = 64k, d = 1600.
Residual projection h = x + x·M (bf16, rows = 8·1024): against torch.addmm (goal >= 0.95x) and the unfolded path
x + (x W) P (goal >= 1.8x).

On a CPU there is nothing meaningful to time (the Triton interpreter is a correctness tool), so it refuses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

H.add_source_path()
sys.path.insert(0, str(H.REPO))

import torch  # noqa: E402

GRID = [(n, d, L) for n in (8192, 65536) for d in (768, 1600, 3584) for L in (1, 16)]
QUICK = [(8192, 768, 1), (65536, 1600, 1)]


def _bench(fn) -> float:  # noqa: ANN001
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=50) / 1e3  # seconds


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> float32 output (tensor cores, float32 accumulation), batched."""
    try:
        return torch.matmul(a, b, out_dtype=torch.float32)
    except TypeError:  # a torch without out_dtype: the bf16-output GEMM, upcast (one more rounding)
        return torch.matmul(a, b).float()


def gram_case(n: int, d: int, L: int) -> dict:
    from faast_kernels.gram import gram_accumulate

    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(L, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn(L, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.rand(L, n, device="cuda", generator=g)
    gram = torch.zeros(L, d, d, device="cuda", dtype=torch.float64)
    cross = torch.zeros(L, d, d, device="cuda", dtype=torch.float64)
    flops = L * (n * d * (d + 1) + 2 * n * d * d)

    def composition() -> None:
        sv = (values.float() * scores[..., None]).to(torch.bfloat16)
        kt = keys.mT
        gram.add_(_mm_fp32(kt, keys))
        cross.add_(_mm_fp32(kt, sv))

    ceiling_a, ceiling_b = keys[0].mT.contiguous(), values[0]
    ceiling_s = _bench(lambda: ceiling_a @ ceiling_b)
    ceiling = 2 * n * d * d / ceiling_s
    row = {"n": n, "d": d, "L": L, "ceiling_tflops": ceiling / 1e12, "torch_s": _bench(composition)}
    for precision in ("fp64", "tf32x3"):
        row[f"{precision}_s"] = _bench(
            lambda p=precision: gram_accumulate(keys, values, scores, gram=gram, cross=cross, precision=p)
        )
        row[f"{precision}_tflops"] = flops / row[f"{precision}_s"] / 1e12
        row[f"{precision}_vs_torch"] = row["torch_s"] / row[f"{precision}_s"]
        row[f"{precision}_vs_floor"] = row[f"{precision}_s"] / (flops / ceiling)
    if L == 1 and n <= 8192:  # the authors' learn: pinv of the stored N x d keys (float32), then @ V
        k32, v32 = keys[0].float(), values[0].float()
        row["authors_s"] = _bench(lambda: torch.linalg.pinv(k32, rtol=1 / n) @ v32)
    return row


def residual_case(rows: int, d: int) -> dict:
    from faast_kernels.residual import residual_project

    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    m = (0.01 * torch.randn(d, d, device="cuda")).to(torch.bfloat16)
    w = (0.01 * torch.randn(d, d, device="cuda")).to(torch.bfloat16)
    p = (0.01 * torch.randn(d, d, device="cuda")).to(torch.bfloat16)
    row = {
        "rows": rows, "d": d,
        "kernel_s": _bench(lambda: residual_project(x, m)),
        "addmm_s": _bench(lambda: torch.addmm(x, x, m)),
        "unfolded_s": _bench(lambda: x + (x @ w) @ p),
    }  # fmt: skip
    row["vs_addmm"] = row["addmm_s"] / row["kernel_s"]
    row["vs_unfolded"] = row["unfolded_s"] / row["kernel_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device: the Triton interpreter on CPU checks correctness, not speed")
    machine = H.machine_header() | {"gpu": torch.cuda.get_device_name()}
    grams = [gram_case(*case) for case in (QUICK if args.quick else GRID)]
    residuals = [residual_case(8 * 1024, d) for d in (768, 1600, 3584)]
    name = "kernels_" + machine["gpu"].replace(" ", "_")
    H.write_json(args.out / f"{name}.json", {"machine": machine, "gram": grams, "residual": residuals})
    lines = ["# Triton kernels on " + machine["gpu"], "", "```", H.format_header(machine), "```", ""]
    lines.append(H.markdown_table(
        ["N", "d", "L", "ceiling TF/s", "fp64 s", "fp64 TF/s", "tf32x3 s", "tf32x3 TF/s", "tf32x3 / floor",
         "tf32x3 vs torch", "fp64 vs torch", "authors s"],
        [[r["n"], r["d"], r["L"], f"{r['ceiling_tflops']:.0f}", H.fmt_s(r["fp64_s"]), f"{r['fp64_tflops']:.1f}",
          H.fmt_s(r["tf32x3_s"]), f"{r['tf32x3_tflops']:.1f}", f"{r['tf32x3_vs_floor']:.2f}",
          H.fmt_ratio(r["tf32x3_vs_torch"]), H.fmt_ratio(r["fp64_vs_torch"]), H.fmt_s(r.get("authors_s"))]
         for r in grams],
    ))  # fmt: skip
    lines += ["", H.markdown_table(
        ["rows", "d", "kernel s", "addmm s", "unfolded s", "vs addmm", "vs unfolded"],
        [[r["rows"], r["d"], H.fmt_s(r["kernel_s"]), H.fmt_s(r["addmm_s"]), H.fmt_s(r["unfolded_s"]),
          H.fmt_ratio(r["vs_addmm"]), H.fmt_ratio(r["vs_unfolded"])] for r in residuals],
    )]  # fmt: skip
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    plot(grams, args.out / f"{name}.png")
    print("\n".join(lines))


def plot(grams: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"N{r['n'] // 1024}k d{r['d']} L{r['L']}" for r in grams]
    fig, ax = plt.subplots(figsize=(9, 4))
    for key, label in (
        ("tf32x3_tflops", "faast tf32x3"),
        ("fp64_tflops", "faast fp64"),
        ("ceiling_tflops", "bf16 ceiling"),
    ):
        ax.plot(labels, [r[key] for r in grams], marker="o", label=label)
    ax.set_ylabel("TFLOP/s")
    ax.tick_params(axis="x", rotation=60)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
