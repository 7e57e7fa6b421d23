"""Does `auto` choose the fastest candidate? For each benchmarked shape: let auto measure (on its small sample) and
choose, then time every candidate it considered on the full inputs, each forced through FAAST_BACKEND, in this run.

    python -m faast_lab.benchmarks.bench_auto_choice --out OUTDIR [--smoke]

Shapes (GPU): the Gram at N = 65,536, d = dv = 1600 in bf16 (compute float64 and float32) and the 48-layer x 8,192
batch; eigh of 48 float64 matrices at n = 64, 256, 576, 1152, 1600; the residual read at 8,192 x 1600 in bf16.
--smoke: tiny shapes on the CPU (the interpreter is never a candidate there, so most rows have one candidate).
The choice auto made is read from its cache file (faast.ops.backends), which this script points at a fresh folder.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from faast import ops
from faast.ops import backends
from faast_lab.benchmarks import _harness as H


def _cases(device: str, smoke: bool) -> list[tuple[str, str, dict]]:
    """(op, label, inputs) per shape."""
    g = torch.Generator(device=device).manual_seed(0)
    cases = []
    gram_shapes = [(1, 512, 64, 64)] if smoke else [(1, 65536, 1600, 1600), (48, 8192, 1600, 1600)]
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    for layers, n, dk, dv in gram_shapes:
        keys = torch.randn(layers, n, dk, device=device, generator=g).to(dt)
        values = torch.randn(layers, n, dv, device=device, generator=g).to(dt)
        for compute in (torch.float64, torch.float32):
            label = f"accumulate_gram L={layers} N={n} d={dk} {dt} compute {compute}"
            cases.append(("accumulate_gram", label, {"keys": keys, "values": values, "compute_dtype": compute}))
    for n in (16, 40) if smoke else (64, 256, 576, 1152, 1600):
        b = 4 if smoke else 48
        x = torch.randn(b, 2 * n, n, device=device, dtype=torch.float64, generator=g)
        cases.append(("eigh", f"eigh B={b} n={n}", {"gram": x.mT @ x / (2 * n)}))
    rows, d = (256, 64) if smoke else (8192, 1600)
    x = torch.randn(rows, d, device=device, generator=g).to(dt)
    m = (torch.randn(d, d, device=device, generator=g) / d).to(dt)
    cases.append(("residual_project", f"residual rows={rows} d={d} {dt}", {"x": x, "m": m}))
    return cases


def _run(op: str, inputs: dict) -> object:
    if op == "accumulate_gram":
        return ops.accumulate_gram_unchecked(
            inputs["keys"], inputs["values"], None, None, compute_dtype=inputs["compute_dtype"]
        )
    if op == "eigh":
        return ops.eigh_gram(inputs["gram"])
    return ops.residual_project(inputs["x"], inputs["m"])


def _call(op: str, inputs: dict) -> backends.Call:
    """What the dispatch sees of the op's call (so that gates apply as in the real call)."""
    if op == "accumulate_gram":
        return ops.gram_call(inputs["keys"], inputs["values"], compute_dtype=inputs["compute_dtype"])
    if op == "eigh":
        return ops.eigh_call(inputs["gram"])
    return ops.residual_call(inputs["x"], inputs["m"])


def _choices(path: Path) -> dict[str, dict]:
    return backends.measured_choices(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--no-wait-quiet", action="store_true", help="do not wait for other processes to go quiet")
    args = p.parse_args()
    H.QUIET["enabled"] = not args.no_wait_quiet
    device = "cuda" if torch.cuda.is_available() else "cpu"
    record = H.start()
    cache = Path(tempfile.mkdtemp(prefix="faast-auto-")) / backends.AUTOTUNE_FILE_NAME
    os.environ[backends.AUTOTUNE_CACHE_ENV] = str(cache)
    os.environ.pop(backends.BACKEND_ENV_VAR, None)
    backends.forget_measurements()
    results = []
    for op, label, inputs in _cases(device, args.smoke):
        before = set(_choices(cache))
        _run(op, inputs)  # auto measures on its sample and chooses
        new = {k: v for k, v in _choices(cache).items() if k not in before}
        row: dict = {"op": op, "case": label}
        if new:
            (entry,) = new.values()
            row["auto"], row["auto_sample_seconds"] = entry["choice"], entry["seconds"]
            considered = [n for n, t in entry["seconds"].items() if isinstance(t, float)]
        else:
            eligible = [n for n, why in backends.explain(op, torch.device(device), _call(op, inputs)) if why is None]
            row["auto"], considered = (eligible[0] if eligible else None), eligible[:1]
            row["note"] = "one eligible candidate: nothing to choose"

        def force(name: str, op: str = op) -> None:
            os.environ[backends.BACKEND_ENV_VAR] = f"{op}={name}"

        timings: dict[str, float | str] = {}
        try:
            measured = H.time_cases(
                {n: (lambda n=n: force(n), lambda _a, op=op, inputs=inputs: _run(op, inputs)) for n in considered},
                reps=3,
            )  # interleaved: each round runs every candidate once
            timings = {n: t.median for n, t in measured.items()}
        except Exception as err:  # noqa: BLE001 - a candidate that fails at full size is a result
            timings = {n: f"failed: {type(err).__name__}: {err}"[:200] for n in considered}
        finally:
            os.environ.pop(backends.BACKEND_ENV_VAR, None)
        row["full_seconds"] = timings
        ok = {n: t for n, t in timings.items() if isinstance(t, float)}
        row["fastest"] = min(ok, key=ok.__getitem__) if ok else None
        row["auto_is_fastest"] = row["fastest"] == row["auto"] if ok else None
        if ok and row["auto"] in ok:
            row["auto_vs_fastest"] = ok[row["auto"]] / ok[row["fastest"]]
        results.append(row)
        print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    table = H.markdown_table(
        ["case", "auto", "fastest at full size", "auto time / fastest", "full-size seconds"],
        [[r["case"], r["auto"], r["fastest"], H.fmt_ratio(r.get("auto_vs_fastest")),
          ", ".join(f"{n} {H.fmt_s(t) if isinstance(t, float) else t}" for n, t in r["full_seconds"].items())]
         for r in results],
    )  # fmt: skip
    payload = {"device": device, "smoke": args.smoke, "rows": results,
               "all_fastest": all(r["auto_is_fastest"] is not False for r in results)}  # fmt: skip
    H.write(args.out / f"auto_choice_{device}", record, payload, f"auto's choice against the fastest, {device}", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
