"""Probe, on a GPU, the torch / cuBLAS / cuSOLVER / cupy paths that issues 36 and 37 plan to build on.

    python3 -m faast_lab.benchmarks.probe_gpu_paths --out OUTDIR [--smoke] [--budget-s 90]

Measures, in one run and against float64 references:
* gram: the bf16 torch composition (KᵀK, KᵀV in bf16), 16-bit `mm` with a float32 output per R-row chunk flushed into
  float64 (the exact16 idea through cuBLAS), float64 `addmm` over large chunks, and the layer batch through `bmm`;
* eigh: torch.linalg.eigh on a 48-matrix float64 batch against cupy's batched paths, at several widths;
* cholesky: a fixed-ridge solve (S + μI)⁻¹T by batched Cholesky against the eigendecomposition.

Every case is wrapped: a path that does not exist on this torch / cupy is recorded with its error, not fatal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from faast_lab.benchmarks import _harness as H


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 3, warmup: int = 1) -> tuple[float, object]:  # noqa: ANN001
    out = None
    for _ in range(warmup):
        out = fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def gram(dev: str, smoke: bool) -> list[dict]:
    n, d = (2048, 96) if smoke else (65536, 1600)
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
    k64, v64 = k.double(), v.double()
    s_ref, t_ref = k64.T @ k64, k64.T @ v64
    del k64, v64
    flops = 2 * 2 * n * d * d
    rows: list[dict] = []

    def case(name: str, fn) -> None:  # noqa: ANN001
        try:
            sec, (s, t) = timed(fn)
            rows.append({"case": name, "seconds": sec, "tflops": flops / sec / 1e12, "relS": rel(s, s_ref),
                         "relT": rel(t, t_ref)})  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a path missing on this build is a result
            rows.append({"case": name, "error": f"{type(err).__name__}: {err}"[:300]})
        print(rows[-1], flush=True)

    case("torch bf16 composition", lambda: (k.T @ k, k.T @ v))

    def exact16(r: int):  # noqa: ANN202
        def fn():  # noqa: ANN202
            s = torch.zeros(d, d, dtype=torch.float64, device=dev)
            t = torch.zeros(d, d, dtype=torch.float64, device=dev)
            for i in range(0, n, r):
                kc = k[i : i + r]
                s += torch.mm(kc.T, kc, out_dtype=torch.float32)
                t += torch.mm(kc.T, v[i : i + r], out_dtype=torch.float32)
            return s, t

        return fn

    def exact16_fused(r: int):  # noqa: ANN202
        kv = torch.cat([k, v], dim=1)

        def fn():  # noqa: ANN202
            acc = torch.zeros(d, 2 * d, dtype=torch.float64, device=dev)
            for i in range(0, n, r):
                acc += torch.mm(k[i : i + r].T, kv[i : i + r], out_dtype=torch.float32)
            return acc[:, :d], acc[:, d:]

        return fn

    for r in (1024, 4096, 16384) if not smoke else (256, 1024):
        case(f"mm out_dtype=float32, R={r}, flush to float64", exact16(r))
        case(f"mm [K|V] fused out_dtype=float32, R={r}", exact16_fused(r))

    def f64(r: int):  # noqa: ANN202
        def fn():  # noqa: ANN202
            s = torch.zeros(d, d, dtype=torch.float64, device=dev)
            t = torch.zeros(d, d, dtype=torch.float64, device=dev)
            for i in range(0, n, r):
                kc = k[i : i + r].double()
                s.addmm_(kc.T, kc)
                t.addmm_(kc.T, v[i : i + r].double())
            return s, t

        return fn

    for r in (8192, 65536) if not smoke else (512, 2048):
        case(f"float64 addmm, R={r}", f64(r))
    # The 48-layer batch: 48 x 8192 rows, one bmm per statistic with a float32 output, flushed into float64.
    layers, rows_per = (4, 256) if smoke else (48, 8192)
    kb = torch.randn(layers, rows_per, d, device=dev, generator=g).to(torch.bfloat16)
    ref = torch.bmm(kb.double().transpose(1, 2), kb.double())
    bflops = 2 * layers * rows_per * d * d
    for name, fn in (
        ("batch bf16 bmm (bf16 out)", lambda: torch.bmm(kb.transpose(1, 2), kb)),
        (
            "batch bmm out_dtype=float32 -> float64",
            lambda: torch.bmm(kb.transpose(1, 2), kb, out_dtype=torch.float32).double(),
        ),  # fmt: skip
    ):
        try:
            sec, s = timed(fn)
            rows.append({"case": name, "seconds": sec, "tflops": bflops / sec / 1e12, "relS": rel(s, ref)})
        except Exception as err:  # noqa: BLE001
            rows.append({"case": name, "error": f"{type(err).__name__}: {err}"[:300]})
        print(rows[-1], flush=True)
    return rows


def _spd(b: int, n: int, dev: str) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(b, 2 * n, n, device=dev, dtype=torch.float64, generator=g)
    return x.transpose(1, 2) @ x / (2 * n)


def eigh(dev: str, smoke: bool, deadline: float) -> tuple[list[dict], dict]:
    rows: list[dict] = []
    info: dict = {}
    try:
        import cupy as cp
        from cupy_backends.cuda.libs import cusolver

        info["cupy"] = cp.__version__
        info["cusolver_syev_names"] = sorted(x for x in dir(cusolver) if "syev" in x.lower())
    except Exception as err:  # noqa: BLE001
        cp = None
        info["cupy_error"] = f"{type(err).__name__}: {err}"[:300]
    print(info, flush=True)
    widths = (16, 64) if smoke else (64, 256, 576, 1152, 1600)
    b = 4 if smoke else 48
    for n in widths:
        if time.monotonic() > deadline:
            rows.append({"n": n, "skipped": "budget spent"})
            continue
        a = _spd(b, n, dev)
        cases = {"torch.linalg.eigh": lambda a=a: torch.linalg.eigh(a)}
        if cp is not None:
            cases["cupy.linalg.eigh (batched)"] = lambda a=a: cp.linalg.eigh(cp.from_dlpack(a))
        for name, fn in cases.items():
            try:
                reps = 1 if n >= 1152 else 3
                sec, out = timed(fn, reps=reps)
                w = out[0] if isinstance(out, tuple) else out
                w = torch.from_dlpack(w) if not isinstance(w, torch.Tensor) else w
                ref_w = torch.linalg.eigvalsh(a)
                rows.append({"n": n, "batch": b, "case": name, "seconds": sec, "per_matrix_ms": sec / b * 1e3,
                             "eig_rel": rel(w, ref_w)})  # fmt: skip
            except Exception as err:  # noqa: BLE001
                rows.append({"n": n, "case": name, "error": f"{type(err).__name__}: {err}"[:300]})
            print(rows[-1], flush=True)
    return rows, info


def cholesky(dev: str, smoke: bool) -> list[dict]:
    b, n = (4, 64) if smoke else (48, 1600)
    s = _spd(b, n, dev)
    t = torch.randn(b, n, n, device=dev, dtype=torch.float64)
    mu = 1e-2
    eye = torch.eye(n, device=dev, dtype=torch.float64)

    def chol():  # noqa: ANN202
        return torch.cholesky_solve(t, torch.linalg.cholesky(s + mu * eye))

    def via_eigh():  # noqa: ANN202
        w, q = torch.linalg.eigh(s)
        return q @ ((q.transpose(1, 2) @ t) / (w + mu).unsqueeze(-1))

    rows = []
    sec_e, w_e = timed(via_eigh, reps=1)
    rows.append({"case": "eigh solve", "seconds": sec_e})
    sec_c, w_c = timed(chol, reps=3)
    rows.append({"case": "cholesky solve", "seconds": sec_c, "rel_vs_eigh": rel(w_c, w_e.double())})
    print(rows, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget-s", type=float, default=90.0)
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    record = H.start()
    deadline = time.monotonic() + args.budget_s
    payload: dict = {"device": dev, "smoke": args.smoke}
    for name, fn in (("gram", lambda: gram(dev, args.smoke)), ("cholesky", lambda: cholesky(dev, args.smoke)),
                     ("eigh", lambda: eigh(dev, args.smoke, deadline))):  # fmt: skip
        try:
            payload[name] = fn()
        except Exception as err:  # noqa: BLE001
            payload[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
        if dev == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    body = [f"```\n{payload}\n```"]
    H.write(args.out / f"probe_gpu_paths_{dev}", record, payload, f"GPU path probe on {dev}", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
