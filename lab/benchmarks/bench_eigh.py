"""GPU benchmark of the solve's eigendecomposition and of the fixed-ridge solve that needs none, against
torch.linalg.eigh on the same batch of statistics, measured in the same run (issues 4 and 37).

    python -m faast_lab.benchmarks.bench_eigh [--quick] [--budget-s S] [--out DIR]  # CUDA; uses what is installed
    python -m faast_lab.benchmarks.bench_eigh --smoke --out DIR                     # CPU: tiny sizes (CI)

Sizes: batch 48 at d = 1600 (the goal), 64, 256, 576 and 1152 first, then L in {1, 16} and 4 x 3584 as the budget
allows (float64, power-law spectra λ = 10^[0, -10]). Cases, each where it can run:
  torch.linalg.eigh                      the baseline: torch's per-matrix loop (syevd) above n = 32
  faast._C <algorithm>                   torch.ops.faast.batched_eigh: auto, syev_batched, syevd_streams, and
                                         syevj_batched for d <= 32 (needs the built extension)
  cupy syevjBatched (faast backend)      the cupy backend's eigh: one batched Jacobi call plus its accuracy check
                                         (matrices that miss it are recomputed by torch: column "recomputed");
                                         where auto's gate keeps it out (d >= 576, measured to lose on an H100)
                                         only with --all-cases (it took 11 s at 48 x 1600 in gpu_h100_run5)
  torch eigh + filter: fixed-ridge solve W = (S + μI)^+ T the eigh way: torch.linalg.eigh + solve_from_eigh
  cholesky fixed-ridge solve             faast.ops.solve.solve_fixed_ridge (batched Cholesky of S + μI, no spectrum)
Reported: time (CUDA events; median of 3 after a warm-up below d = 1152, one timed run from there), speedup over
torch.linalg.eigh (the solves: over the eigh-path solve), the eigen-equation residual ||S E - E Λ|| / ||S||, the
orthonormality ||EᵀE - I|| and the eigenvalues' relative difference to torch's (the solves: W's relative difference
to the eigh path's). Goal: >= 3x torch.linalg.eigh at 48 x 1600. On a CPU, without --smoke, it refuses to run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from faast_lab.benchmarks import _harness as H

# Batch 48 first (the goal's size leading: the budget may end the run), then the older grid.
GRID = [(48, d) for d in (1600, 64, 256, 576, 1152)] + [(L, d) for L in (1, 16) for d in (64, 576, 1600)] + [(4, 3584)]
QUICK = [(48, 1600), (48, 256)]
SMOKE = [(3, 20), (2, 40)]
BIG = 1152  # from this width: no warm-up run and one timed run (torch's loop takes ~0.6 s at 48 x 1152 on an H100)
RIDGE = 1e-3  # μ relative to λmax = 1 of the synthetic spectra
RESULTS = Path(__file__).resolve().parent / "results"


def _time(fn, d: int):  # noqa: ANN001, ANN202
    """(median seconds, the last result)."""
    reps = 1 if d >= BIG else 3
    if d < BIG:
        fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2], out


def _statistics(layers: int, d: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """S [L, d, d] with eigenvalues 10^[0, -10] and T = S X [L, d, d] (targets in the keys' range)."""
    g = torch.Generator(device=device).manual_seed(d)
    q, _ = torch.linalg.qr(torch.randn(layers, d, d, device=device, dtype=torch.float64, generator=g))
    lam = torch.logspace(0, -10, d, device=device, dtype=torch.float64)
    gram = (q * lam) @ q.mT
    return gram, gram @ torch.randn(layers, d, d, device=device, dtype=torch.float64, generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float64).tiny))


def _quality(gram: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor, reference: torch.Tensor | None) -> dict:
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return {
        "residual": float((gram @ vecs - vecs * lam.unsqueeze(-2)).norm() / gram.norm()),
        "orthonormality": float((vecs.mT @ vecs - eye).norm()),
        "eigenvalues_rel": None if reference is None else _rel(lam, reference),
    }


def _eigh_cases(
    gram: torch.Tensor, d: int, native_error: str | None, cupy_error: str | None, all_cases: bool = False
) -> tuple[dict, dict]:
    """({case: fn}, {case: why it is skipped}): cupy's eigh where auto's gate keeps it out (it loses from d = 576 on
    an H100) is skipped unless all_cases."""
    from faast import ops
    from faast.ops import backends, refined_eigh

    cases = {"torch.linalg.eigh": lambda: torch.linalg.eigh(gram)}
    # float32 eigh refined to float64 by GEMMs (torch.refined, an eigh candidate of auto on the CPU and CUDA).
    cases["torch.refined (float32 eigh + refinement)"] = lambda: refined_eigh.eigh_refined(gram)
    skipped = {}
    algorithms = ["auto", "syev_batched", "syevd_streams"] + (["syevj_batched"] if d <= 32 else [])
    for algorithm in algorithms if native_error is None else []:
        cases[f"faast._C {algorithm}"] = lambda a=algorithm: torch.ops.faast.batched_eigh(gram, a)
    if cupy_error is None:
        name = "cupy syevjBatched (faast backend)"
        reason = None if all_cases else H.gated("eigh", "cupy", ops.eigh_call(gram))
        if reason is None:
            cases[name] = lambda: backends.implementation("cupy", "eigh")(gram)
        else:
            skipped[name] = reason
    return cases, skipped


def _solve_cases(gram: torch.Tensor, cross: torch.Tensor, spectrum: tuple | None) -> dict:
    """The fixed-ridge solves; the eigh path reuses torch's timed eigendecomposition and times only the filter."""
    from faast.ops import solve

    counts = torch.full((gram.shape[0],), 1e6, dtype=torch.float64, device=gram.device)

    def filtered():  # noqa: ANN202
        lam, vecs = spectrum
        return solve.solve_from_eigh(lam, vecs, cross, counts, alpha=1.0, rtol=None, ridge=RIDGE, target_sqnorm=None)

    cases = {"cholesky fixed-ridge solve": lambda: solve.solve_fixed_ridge(gram, cross, counts, RIDGE)}
    if spectrum is not None:
        cases = {"torch eigh + filter: fixed-ridge solve": filtered, **cases}
    return cases


def _run(name: str, fn, layers: int, d: int, deadline: float, records: list) -> tuple[dict, object] | None:  # noqa: ANN001
    if time.monotonic() > deadline:
        records.append({"L": layers, "d": d, "case": name, "skipped": "time budget spent"})
        return None
    try:
        seconds, out = _time(fn, d)
    except Exception as err:  # noqa: BLE001 - e.g. syev_batched beyond its size limit: recorded, not fatal
        records.append({"L": layers, "d": d, "case": name, "error": f"{type(err).__name__}: {err}"[:300]})
        return None
    entry = {"L": layers, "d": d, "case": name, "seconds": seconds}
    records.append(entry)
    return entry, out


def measure(
    layers: int, d: int, device: str, errors: tuple, deadline: float, records: list, all_cases: bool = False
) -> None:
    """Every case at one size, appended to records."""
    from faast.ops import backends

    gram, cross = _statistics(layers, d, device)
    base = spectrum = None
    cases, skipped = _eigh_cases(gram, d, *errors, all_cases=all_cases)
    records.extend({"L": layers, "d": d, "case": name, "skipped": why} for name, why in skipped.items())
    for name, fn in cases.items():
        done = _run(name, fn, layers, d, deadline, records)
        if done is None:
            continue
        entry, out = done
        if name == "torch.linalg.eigh":
            base, spectrum = entry["seconds"], out
        entry.update(_quality(gram, *out, None if spectrum is None else spectrum[0]))
        entry["speedup"] = base / entry["seconds"] if base else None
        if name.startswith("cupy syevjBatched"):
            entry["recomputed"] = backends.cupy_eigh_recomputed()
    path_seconds = path_weights = None
    for name, fn in _solve_cases(gram, cross, spectrum).items():
        done = _run(name, fn, layers, d, deadline, records)
        if done is None:
            continue
        entry, out = done
        if name.startswith("torch eigh"):  # the eigh-path solve: torch's timed eigendecomposition + the filter
            entry["filter_seconds"] = entry["seconds"]
            entry["seconds"] = path_seconds = entry["seconds"] + base
            entry["speedup"], path_weights = 1.0, out[0]
            continue
        entry["fell_back"] = out is None  # S + μI did not factor: ops.solve_fast_weights_ex would take eigh
        if out is not None and path_weights is not None:
            entry["w_rel_vs_eigh_path"] = _rel(out[0], path_weights)
        entry["speedup"] = path_seconds / entry["seconds"] if path_seconds else None


def _row(entry: dict) -> list:
    accuracy = entry.get("eigenvalues_rel", entry.get("w_rel_vs_eigh_path"))
    return [
        entry["L"], entry["d"], entry["case"], H.fmt_s(entry["seconds"]), H.fmt_ratio(entry.get("speedup")),
        H.fmt_sci(entry.get("residual")), H.fmt_sci(entry.get("orthonormality")), H.fmt_sci(accuracy),
        entry.get("recomputed", ""),
    ]  # fmt: skip


def _report(out: Path, record: dict, records: list[dict], errors: tuple, smoke: bool, final: bool) -> str:
    """Write (or rewrite) the result files from the records so far; returns the markdown body."""
    native_error, cupy_error = errors
    rows = [_row(r) for r in sorted((r for r in records if "seconds" in r), key=lambda r: (r["L"], r["d"]))]
    where = record.get("gpu", "cpu (smoke)")
    headers = ["L", "d", "case", "time", "vs torch", "residual", "orthonormality", "λ / W rel", "recomputed"]
    notes = [] if final else ["PARTIAL: the run stopped before its end (e.g. a crash in a case); these files hold it."]
    notes += [f"faast._C not measured: {native_error}"] if native_error else []
    notes += [f"cupy backend not measured: {cupy_error}"] if cupy_error else []
    notes.append(
        f"Fixed-ridge solves: μ = {RIDGE}·λmax, T = S X with X [d, d]; their 'vs torch' is against the eigh-path "
        "solve (torch.linalg.eigh + solve_from_eigh), their 'λ / W rel' is W's relative difference to it."
    )
    body = "\n\n".join([*notes, H.markdown_table(headers, rows)])
    left_out = [r for r in records if "seconds" not in r]
    if left_out:
        body += "\n\nNot measured: " + "; ".join(
            f"L={r['L']} d={r['d']} {r.get('case', '')}: {r.get('error') or r.get('skipped')}" for r in left_out
        )
    payload = {"device": where, "complete": final, "extension": native_error, "cupy": cupy_error, "ridge": RIDGE,
               "records": records}  # fmt: skip
    stem = "eigh_" + ("smoke" if smoke else H.slug(where))
    H.write(out / stem, record, payload, f"Batched eigh and fixed-ridge solves on {where}", body)
    return body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU the GPU-only cases are skipped")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this")
    parser.add_argument("--all-cases", action="store_true", help="also time the cases auto's gates keep out")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("bench_eigh: needs a CUDA device (there is nothing meaningful to time on a CPU)", file=sys.stderr)
        return 2
    from faast import ops
    from faast.ops import backends

    native_error = ops.native_extension_error() if device == "cuda" else "no CUDA device"
    cupy_error = backends.unavailable_reason("cupy") if device == "cuda" else "no CUDA device"
    errors = (native_error, cupy_error)
    record = H.start()
    # Every case once at a tiny size first: library loading and handle creation stay out of the first size's times.
    measure(2, 16, device, errors, math.inf, [])
    deadline = time.monotonic() + args.budget_s
    records: list[dict] = []
    for layers, d in SMOKE if args.smoke else QUICK if args.quick else GRID:
        if time.monotonic() > deadline:
            records.append({"L": layers, "d": d, "skipped": "time budget spent"})
            continue
        done = len(records)
        measure(layers, d, device, errors, deadline, records, args.all_cases)
        for entry in records[done:]:
            print({k: v for k, v in entry.items() if v is not None}, flush=True)
        _report(args.out, record, records, errors, args.smoke, final=False)  # survives a crash in a later size
    print(_report(args.out, record, records, errors, args.smoke, final=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
