"""The refined eigensolver against float64 eigh on a CPU, in one run: time and accuracy at d = 576, 1152 and 1600.

    python -m faast_lab.benchmarks.bench_eigh_cpu [--sizes 576 1152 1600] \
        [--out lab/benchmarks/results/eigh_cpu_<machine>]

For each width, one symmetric matrix of each spectrum (Q diag(λ) Qᵀ with Q a random rotation, summed in float64):
`graded` (λ = 10^[0, -10], the statistics' power law), `clustered` (half of λ equal to 1, the rest 10^[-1, -6]) and
`rank-deficient` (half of λ exactly 0). Cases: torch.linalg.eigh (float64, LAPACK's syevd) and faast's refined
eigh (float32 eigh + Ogita–Aishima refinement, `faast.ops.refined_eigh`), each timed as the median of 3 calls after
a warm-up (one call from d = 1152). Reported beside the times: the eigen-equation residual ‖SE − EΛ‖_F / ‖S‖_F, the
orthonormality ‖EᵀE − I‖_F, and W = S⁺T's relative difference to float64 eigh's (faast.ops.solve.solve_from_eigh,
the directions above 1e-8·λmax kept, T random): two backward-stable solvers differ there by about the kept
condition number times 2⁻⁵². faast's dispatch times the two on a call's own matrices and keeps the faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from faast import hardware
from faast.ops import eigh_call
from faast.ops.refined_eigh import eigh_refined
from faast.ops.solve import solve_from_eigh
from faast_lab.benchmarks import _harness as H

SPECTRA = ("graded", "clustered", "rank-deficient")
# W's count: alpha = 1 cuts at count⁻¹ = 1e-8 of λmax, so the graded spectrum keeps a condition number of 1e8.
COUNT = torch.tensor([1e8], dtype=torch.float64)


def _matrix(kind: str, d: int, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    if kind == "graded":
        lam = torch.logspace(0, -10, d, dtype=torch.float64)
    elif kind == "clustered":
        lam = torch.cat([torch.ones(d // 2, dtype=torch.float64), torch.logspace(-1, -6, d - d // 2,
                                                                                 dtype=torch.float64)])  # fmt: skip
    else:
        lam = torch.cat([torch.logspace(0, -3, d // 2, dtype=torch.float64), torch.zeros(d - d // 2)])
    s = (q * lam) @ q.T
    return ((s + s.T) / 2)[None]


def _timed(fn, s: torch.Tensor, reps: int) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    out = fn(s)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn(s)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _quality(s: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor, t: torch.Tensor, w64: torch.Tensor) -> dict:
    eye = torch.eye(s.shape[-1], dtype=torch.float64)
    w, _ = solve_from_eigh(lam, vecs, t, COUNT, alpha=1.0, rtol=None, ridge=None,
                           target_sqnorm=None)  # fmt: skip
    return {"residual": float((s @ vecs - vecs * lam[..., None, :]).norm() / s.norm()),
            "orthonormality": float((vecs.mT @ vecs - eye).norm()),
            "w_rel_to_float64": float((w - w64).norm() / w64.norm())}  # fmt: skip


def run(sizes: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for d in sizes:
        for kind in SPECTRA:
            s = _matrix(kind, d, g)
            t = torch.randn(1, d, 64, generator=g, dtype=torch.float64)
            reps = 1 if d >= 1152 else 3
            t64, (lam64, vec64) = _timed(torch.linalg.eigh, s, reps)
            w64, _ = solve_from_eigh(lam64, vec64, t, COUNT, alpha=1.0, rtol=None,
                                     ridge=None, target_sqnorm=None)  # fmt: skip
            tref, (lam, vecs) = _timed(eigh_refined, s, reps)
            rows.append({"d": d, "spectrum": kind, "float64_s": t64, "refined_s": tref,
                         "float64": _quality(s, lam64, vec64, t, w64), "refined": _quality(s, lam, vecs, t, w64),
                         "shape_class": eigh_call(s).shape_class})  # fmt: skip
            print(
                f"d {d:5} {kind:15} float64 {t64:.3f} s  refined {tref:.3f} s  "
                f"W diff {rows[-1]['refined']['w_rel_to_float64']:.1e}",
                flush=True,
            )
    return rows


def markdown(rows: list[dict]) -> list[str]:
    lines = [
        f"Machine: {hardware.machine_key()}.",
        "",
        "| d | spectrum | float64 eigh | refined | refined / float64 | residual (float64, refined) | "
        "orthonormality (float64, refined) | W rel. to float64's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["float64"], r["refined"]
        ratio = r["refined_s"] / r["float64_s"]
        lines.append(f"| {r['d']} | {r['spectrum']} | {r['float64_s']:.3f} s | {r['refined_s']:.3f} s | "
                     f"{ratio:.2f}× | {a['residual']:.1e}, {b['residual']:.1e} | {a['orthonormality']:.1e}, "
                     f"{b['orthonormality']:.1e} | {b['w_rel_to_float64']:.1e} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[576, 1152, 1600])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    record = H.start()
    rows = run(args.sizes)
    name = hardware.cpu_model().split("(")[0].strip().lower().replace(" ", "_")
    stem = args.out or H.RESULTS / f"eigh_cpu_{name}"
    H.write(stem, record, {"rows": rows}, "The refined eigensolver against float64 eigh on a CPU", markdown(rows))
    print("\n".join(markdown(rows)))
    return rows


if __name__ == "__main__":
    main()
