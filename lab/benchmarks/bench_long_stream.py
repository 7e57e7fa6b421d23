"""A long stream through FastWeights: 10^8 rows at d=256 on CPU, constant memory, error against float64 truth.

Keys are float32 (as a model emits them) with a realistic spectrum: a common mean direction (hidden states are
anisotropic) plus a power-law covariance λ_i ∝ i^-1.5 in a random basis and a few outlier coordinates; values are a
fixed linear map of the keys plus noise (dv = 64). Batches are generated on the fly from a per-batch seed, so nothing
is stored and any batch can be regenerated.

Three accumulators see every batch, in the same run:
* faast float64 (the default FastWeights),
* faast float32 compute (FastWeights(compute_dtype=float32): each chunk's GEMMs in float32, summed in float64),
* truth: each batch's statistics from a plain float64 GEMM (a different summation order from faast's blocked
  upper-triangle kernel), summed across batches with Neumaier compensation, so the error that could grow with the
  stream length is removed from the reference.

At log-spaced checkpoints it records rel. errors of S, T and W (alpha = 1) against the truth, whether the row count
is exact, the process RSS, the update throughput of each faast path (update time only, not generation), and the
cost of an atomic checkpoint (faast.checkpoint) of the float64 memory.

    python -m faast_lab.benchmarks.bench_long_stream [--rows 1e8] [--quick] [--out lab/benchmarks/results]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import warnings
from pathlib import Path

import torch

import faast
from faast.checkpoint import Checkpointer
from faast_lab.benchmarks import _harness as H

SEED = 20261121
DIM, DIM_VALUE, BATCH = 256, 64, 65536
# Goals: the float64 default must not drift (relative error of S at the float64 level at every checkpoint), memory
# must stay flat (RSS growth from the first to the last checkpoint), and the row count must be exact.
GOAL_REL_S64 = 1e-12
GOAL_RSS_GROWTH_MB = 64.0


def make_source(dim: int, dim_value: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    scale = torch.arange(1, dim + 1, dtype=torch.float64).pow(-0.75)  # sqrt of λ_i ∝ i^-1.5
    mix = scale[:, None] * basis.T
    mean = 3.0 * torch.randn(dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    outliers = torch.randperm(dim, generator=g)[:4]
    mapping = torch.randn(dim, dim_value, generator=g, dtype=torch.float64) / math.sqrt(dim)
    return {"mix": mix.float(), "mean": mean.float(), "outliers": outliers, "mapping": mapping.float()}


def batch(source: dict[str, torch.Tensor], index: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1 + index)
    dim = source["mix"].shape[0]
    keys = torch.randn(rows, dim, generator=g) @ source["mix"] + source["mean"]
    keys[:, source["outliers"]] *= 8.0  # a few "massive activation" coordinates
    values = keys @ source["mapping"] + 0.1 * torch.randn(rows, source["mapping"].shape[1], generator=g)
    return keys, values


class CompensatedSum:
    """Neumaier-compensated float64 running sum of tensors."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.total = torch.zeros(shape, dtype=torch.float64)
        self.comp = torch.zeros(shape, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        t = self.total + x
        big = self.total.abs() >= x.abs()
        self.comp += torch.where(big, (self.total - t) + x, (x - t) + self.total)
        self.total = t

    def value(self) -> torch.Tensor:
        return self.total + self.comp


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float((a - b).norm() / b.norm())


def truth_weights(gram: torch.Tensor, cross: torch.Tensor, count: float) -> tuple[torch.Tensor, int, float]:
    """W at alpha = 1, its kept rank, and cond(S) = λmax / λmin (how much S's rounding can move W)."""
    w, info = faast.ops.solve_fast_weights_ex(gram, cross, count=count, alpha=1.0, out_dtype=torch.float64)
    lam = torch.linalg.eigvalsh(gram)
    return w, int(info.rank), float(lam[-1] / lam[0])


def checkpoints(total_rows: int, batch_rows: int) -> list[int]:
    """Batch counts at which to report: roughly 10^5, 3·10^5, 10^6, ... and the end."""
    marks, r = set(), 1e5
    while r < total_rows:
        marks.add(max(1, round(r / batch_rows)))
        r *= math.sqrt(10)
    marks.add(math.ceil(total_rows / batch_rows))
    return sorted(marks)


def run(total_rows: int, dim: int, dim_value: int, batch_rows: int) -> dict:
    source = make_source(dim, dim_value)
    fw64 = faast.FastWeights(dim, dim_value, dtype=torch.float64)  # float64 W, so relW shows the statistics
    fw32 = faast.FastWeights(dim, dim_value, compute_dtype=torch.float32, dtype=torch.float64)
    truth_s, truth_t = CompensatedSum((dim, dim)), CompensatedSum((dim, dim_value))
    marks = set(checkpoints(total_rows, batch_rows))
    num_batches = math.ceil(total_rows / batch_rows)
    seconds = {"f64": 0.0, "f32": 0.0, "truth": 0.0, "generate": 0.0}
    rows_done, reports = 0, []
    rss_start = H.current_rss()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(tmp, keep=1)
        for i in range(num_batches):
            rows = min(batch_rows, total_rows - rows_done)
            t0 = time.perf_counter()
            keys, values = batch(source, i, rows)
            t1 = time.perf_counter()
            fw64.update(keys, values)
            t2 = time.perf_counter()
            fw32.update(keys, values)
            t3 = time.perf_counter()
            k64, v64 = keys.double(), values.double()
            truth_s.add(k64.T @ k64)
            truth_t.add(k64.T @ v64)
            t4 = time.perf_counter()
            seconds["generate"] += t1 - t0
            seconds["f64"] += t2 - t1
            seconds["f32"] += t3 - t2
            seconds["truth"] += t4 - t3
            rows_done += rows
            if i + 1 not in marks:
                continue
            s_true, t_true = truth_s.value(), truth_t.value()
            w_true, rank, cond = truth_weights(s_true, t_true, float(rows_done))
            t5 = time.perf_counter()
            path = ckpt.save(fw64, {"batches": i + 1, "rows": rows_done})
            save_s = time.perf_counter() - t5
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # float32's resolution warning, reported below
                w32 = fw32.solve(alpha=1.0).double()
            w64 = fw64.solve(alpha=1.0).double()
            report = {
                "rows": rows_done,
                "count_exact": float(fw64.count) == rows_done and float(fw32.count) == rows_done,
                "rank_truth": rank,
                "cond_s": cond,
                "rank_f64": int(fw64.solve_info.rank),
                "rel_s_f64": rel(fw64.gram, s_true),
                "rel_t_f64": rel(fw64.cross, t_true),
                "rel_w_f64": rel(w64, w_true),
                "rel_s_f32": rel(fw32.gram, s_true),
                "rel_t_f32": rel(fw32.cross, t_true),
                "rel_w_f32": rel(w32, w_true),
                "rss_mb": H.current_rss() / H.MB,
                "rows_per_s_f64": rows_done / seconds["f64"],
                "rows_per_s_f32": rows_done / seconds["f32"],
                "checkpoint_s": save_s,
                "checkpoint_bytes": path.stat().st_size,
                "elapsed_s": time.perf_counter() - began,
            }
            reports.append(report)
            print(
                f"{rows_done:>12,} rows  relS f64 {report['rel_s_f64']:.1e} f32 {report['rel_s_f32']:.1e}  "
                f"relW f64 {report['rel_w_f64']:.1e} f32 {report['rel_w_f32']:.1e}  "
                f"rss {report['rss_mb']:.0f} MB  f64 {report['rows_per_s_f64']:,.0f} rows/s  "
                f"f32 {report['rows_per_s_f32']:,.0f} rows/s  [{report['elapsed_s']:.0f} s]",
                flush=True,
            )
    return {"reports": reports, "seconds": seconds, "rss_start_mb": rss_start / H.MB}


def write_results(out: Path, record: dict, payload: dict, name: str) -> None:
    reports, cfg = payload["result"]["reports"], payload["config"]
    rows = [
        [
            f"{r['rows']:,}",
            "yes" if r["count_exact"] else "NO",
            H.fmt_sci(r["cond_s"]),
            H.fmt_sci(r["rel_s_f64"]),
            H.fmt_sci(r["rel_t_f64"]),
            H.fmt_sci(r["rel_w_f64"]),
            H.fmt_sci(r["rel_s_f32"]),
            H.fmt_sci(r["rel_w_f32"]),
            f"{r['rss_mb']:.0f}",
            f"{r['rows_per_s_f64'] / 1e3:,.0f}k",
            f"{r['rows_per_s_f32'] / 1e3:,.0f}k",
            f"{r['checkpoint_s'] * 1e3:.0f} ms",
        ]  # fmt: skip
        for r in reports
    ]
    headers = ["rows", "count exact", "cond(S)", "relS f64", "relT f64", "relW f64", "relS f32", "relW f32", "RSS MB",
               "f64 rows/s", "f32 rows/s", "checkpoint"]  # fmt: skip
    goals = payload["goals"]
    title = f"Long stream: {cfg['rows']:,} rows, d={cfg['dim']}, dv={cfg['dim_value']}, batches of {cfg['batch']:,}"
    text = [
        "Truth: per-batch float64 GEMMs summed with Neumaier compensation (see the script's docstring). relW at "
        "alpha = 1 (eps = N^-1); W is cond(S) times more sensitive than S, so relW's floor is about cond(S)·1e-16 "
        "for float64 and cond(S)·(float32 relS) for float32, and what matters is that it does not grow. "
        "Throughput is update time only (key generation and the truth excluded). "
        "Checkpoint: atomic write of the float64 memory "
        f"({reports[-1]['checkpoint_bytes'] / 1e6:.2f} MB).",
        "",
        H.markdown_table(headers, rows),
        "",
        f"- float64 relS at most {goals['max_rel_s_f64']:.1e} (goal <= {GOAL_REL_S64:g}): "
        f"{'met' if goals['rel_s_met'] else 'NOT met'}",
        f"- RSS growth (largest later checkpoint minus the first): {goals['rss_growth_mb']:.1f} MB "
        f"(goal <= {GOAL_RSS_GROWTH_MB:g}): "
        f"{'met' if goals['rss_met'] else 'NOT met'}",
        f"- counts exact at every checkpoint: {'yes' if goals['counts_exact'] else 'NO'}",
        f"- total seconds: {', '.join(f'{k} {v:.0f}' for k, v in payload['result']['seconds'].items())}",
    ]
    H.write(out / name, record, payload, title, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=float, default=1e8)
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--dim-value", type=int, default=DIM_VALUE)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--quick", action="store_true", help="10^6 rows, for a smoke run")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    rows = int(1e6 if args.quick else args.rows)
    H.set_threads(args.threads)
    record = H.start()
    print(H.provenance.markdown(record), flush=True)
    result = run(rows, args.dim, args.dim_value, args.batch)
    reports = result["reports"]
    # RSS of the first report already holds a batch and its temporaries; later peaks above it would be growth.
    growth = max(r["rss_mb"] for r in reports) - reports[0]["rss_mb"]
    max_s = max(r["rel_s_f64"] for r in reports)
    goals = {
        "max_rel_s_f64": max_s,
        "rel_s_met": max_s <= GOAL_REL_S64,
        "rss_growth_mb": growth,
        "rss_met": growth <= GOAL_RSS_GROWTH_MB,
        "counts_exact": all(r["count_exact"] for r in reports),
    }
    payload = {
        "config": {"rows": rows, "dim": args.dim, "dim_value": args.dim_value, "batch": args.batch, "seed": SEED},
        "result": result,
        "goals": goals,
    }
    name = "long_stream_cpu_quick" if args.quick else "long_stream_cpu"
    write_results(args.out, record, payload, name)
    print(f"wrote {args.out / (name + '.md')}")


if __name__ == "__main__":
    main()
