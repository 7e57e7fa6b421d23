"""GPU benchmark of the solve's eigendecomposition: faast._C's cuSOLVER routines against torch.linalg.eigh on the
same batch of statistics, measured in the same run (issue 4).

    python benchmarks/bench_eigh.py [--quick] [--out DIR]   # needs a CUDA device and the built extension faast._C
    python benchmarks/bench_eigh.py --smoke --out DIR       # CPU: torch.linalg.eigh only, tiny sizes (CI)

For L in {1, 16, 48} memory layers and d in {64, 576, 768, 1600} plus 4 x 3584 (float64, power-law spectra): every
applicable
routine of torch.ops.faast.batched_eigh (syevj_batched for d <= 32, syev_batched, syevd_streams, and "auto"), cupy's
eigh when cupy is installed (a no-compiler path to cuSOLVER), and torch.linalg.eigh. Reported: time (CUDA events,
median of repeats), speedup over torch.linalg.eigh, and the eigen-equation residual ||S E - E Λ|| / ||S|| and
orthonormality ||EᵀE - I|| of each result. Goal: >= 3x torch.linalg.eigh at 48 x 1600. The fastest routine per size
is what `auto` inside csrc/cuda/batched_eigh.cu should pick; its order is unmeasured until this runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

H.add_source_path()

import torch  # noqa: E402

GRID = [(L, d) for L in (1, 16, 48) for d in (64, 576, 768, 1600)] + [(4, 3584)]
QUICK = [(48, 1600), (16, 768)]
SMOKE = [(3, 20), (2, 40)]
RESULTS = Path(__file__).resolve().parent / "results"


def _time(fn, reps: int = 5) -> float:  # noqa: ANN001
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _statistics(layers: int, d: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(d)
    q, _ = torch.linalg.qr(torch.randn(layers, d, d, device=device, dtype=torch.float64, generator=g))
    lam = torch.logspace(0, -10, d, device=device, dtype=torch.float64)
    return (q * lam) @ q.mT


def _quality(gram: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor) -> tuple[float, float]:
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    residual = float((gram @ vecs - vecs * lam.unsqueeze(-2)).norm() / gram.norm())
    return residual, float((vecs.mT @ vecs - eye).norm())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU only torch.linalg.eigh runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new sizes after this")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("bench_eigh: needs a CUDA device (there is nothing meaningful to time on a CPU)", file=sys.stderr)
        return 2
    from faast import ops

    error = ops.native_extension_error() if device == "cuda" else "no CUDA device"
    if error is not None and not args.smoke:
        print(f"bench_eigh: {error}", file=sys.stderr)
        return 2
    try:
        import cupy
    except ImportError:
        cupy = None
    if device == "cpu":
        cupy = None
    record = H.start()
    deadline = time.monotonic() + args.budget_s
    rows, records = [], []
    for layers, d in SMOKE if args.smoke else QUICK if args.quick else GRID:
        if time.monotonic() > deadline:
            records.append({"L": layers, "d": d, "skipped": "time budget spent"})
            continue
        gram = _statistics(layers, d, device)
        cases = {"torch.linalg.eigh": lambda g=gram: torch.linalg.eigh(g)}
        algorithms = ["auto", "syev_batched", "syevd_streams"] + (["syevj_batched"] if d <= 32 else [])
        for algorithm in algorithms if error is None else []:
            cases[f"faast {algorithm}"] = lambda g=gram, a=algorithm: torch.ops.faast.batched_eigh(g, a)
        if cupy is not None:
            cases["cupy.linalg.eigh"] = lambda g=gram: tuple(
                torch.as_tensor(x, device="cuda") for x in cupy.linalg.eigh(cupy.asarray(g))
            )
        base = None
        for name, fn in cases.items():
            try:
                seconds = _time(fn)
                residual, orth = _quality(gram, *fn())
            except Exception as err:  # noqa: BLE001 - e.g. syev_batched beyond its size limit; recorded, not fatal
                records.append({"L": layers, "d": d, "case": name, "error": str(err)})
                continue
            base = seconds if name == "torch.linalg.eigh" else base
            speedup = base / seconds if base else float("nan")
            records.append({"L": layers, "d": d, "case": name, "seconds": seconds, "speedup": speedup,
                            "residual": residual, "orthonormality": orth})  # fmt: skip
            rows.append(
                [layers, d, name, H.fmt_s(seconds), H.fmt_ratio(speedup), H.fmt_sci(residual), H.fmt_sci(orth)]
            )
        print(rows[-1], flush=True)
    where = record.get("gpu", "cpu (smoke)")
    stem = "eigh_" + ("smoke" if args.smoke else H.slug(where))
    table = H.markdown_table(["L", "d", "case", "time", "vs torch", "residual", "orthonormality"], rows)
    note = "" if error is None else f"faast._C not measured: {error}\n\n"
    payload = {"device": where, "extension": error, "records": records}
    H.write(args.out / stem, record, payload, f"Batched eigh on {where}", note + table)
    print(note + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
