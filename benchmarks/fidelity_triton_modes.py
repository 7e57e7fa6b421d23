"""Which Triton Gram precision mode passes the float64 fidelity suite? (the test that decides the GPU default)

    TRITON_INTERPRET=1 python benchmarks/fidelity_triton_modes.py      # CPU: Triton's interpreter
    python benchmarks/fidelity_triton_modes.py                         # GPU: the compiled kernels

For every spectrum of numerics.md (tests/spectra.py: well-conditioned, power laws with outliers, duplicated rows,
LayerNorm-like, N < d) at N = 1000 and 16384, d = 256, dv = 64, alpha = 0.8 and 1, keys are streamed through
FastWeights with FAAST_BACKEND=triton in each kernel mode (fp64 through compute_dtype=float64, tf32x3 through
float32), and the solution is compared with the float64 SVD truth of the same keys: the kept rank must match and
relW <= 1e-5, relP <= 1e-6 (tests/tolerances.py). Writes results/triton_fidelity_<device>.{json,md}.

Under the interpreter, tl.dot is numpy's float32/float64 matmul per tile, so the float32 sums are IEEE sums of at most
256 rows between float64 flushes; tensor cores may round their float32 accumulation differently, so a GPU run of this
script is what decides the GPU default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "python"), str(ROOT)]
os.environ["FAAST_BACKEND"] = "triton"
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import _harness as H  # noqa: E402
import torch  # noqa: E402

import spectra  # noqa: E402
from faast import FastWeights  # noqa: E402
from tolerances import TRUTH_REL_P, TRUTH_REL_W, rel  # noqa: E402

D, DV, N_TEST = 256, 64, 2048
MODES = {"fp64": torch.float64, "tf32x3": torch.float32}


def _row(r: dict) -> list:
    return [r["kind"], r["n"], r["alpha"], r["mode"], f"{r['rank']} / {r['rank_truth']}", H.fmt_sci(r["rel_w"]),
            H.fmt_sci(r["rel_p"]), "yes" if r["pass"] else "NO"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=spectra.SPECTRA, default=list(spectra.SPECTRA),
                        help="rerun these spectra only, merged into the existing results file")  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "triton_fidelity_" + ("interpreter" if device.type == "cpu" else torch.cuda.get_device_name())
    name = name.replace(" ", "_")
    out = ROOT / "benchmarks" / "results"
    partial = set(args.kinds) != set(spectra.SPECTRA)
    results = []
    if partial and (out / f"{name}.json").exists():
        kept = json.loads((out / f"{name}.json").read_text())["results"]
        results = [r for r in kept if r["kind"] not in args.kinds]
    for kind in args.kinds:
        for n in (1000, 16384):
            if kind == "lowN_pow1o" and n > 1000:
                continue
            keys, held_out = spectra.make_keys(kind, n, D, n_test=N_TEST)
            values = spectra.make_values(keys, DV)
            count = keys.shape[0]  # lowN_pow1o keeps fewer rows than asked: the cut uses the rows learned
            u, s, vh = torch.linalg.svd(keys.double(), full_matrices=False)
            for mode, compute in MODES.items():
                start = time.perf_counter()
                memory = FastWeights(D, DV, dtype=torch.float64, compute_dtype=compute, device=device)
                for i in range(0, count, 4096):
                    memory.update(keys[i : i + 4096].to(device), values[i : i + 4096].to(device))
                seconds = time.perf_counter() - start
                for alpha in (0.8, 1.0):
                    keep = s > count**-alpha * s[0]
                    truth = vh[keep].T @ ((u[:, keep].T @ values.double()) / s[keep].unsqueeze(-1))
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        w = memory.solve(alpha=alpha).cpu()
                    r = {
                        "kind": kind, "n": count, "mode": mode, "alpha": alpha, "rank": int(memory.solve_info.rank),
                        "rank_truth": int(keep.sum()), "rel_w": rel(w, truth),
                        "rel_p": rel(held_out.double() @ w, held_out.double() @ truth), "learn_s": seconds,
                    }  # fmt: skip
                    r["pass"] = (
                        r["rank"] == r["rank_truth"] and r["rel_w"] <= TRUTH_REL_W and r["rel_p"] <= TRUTH_REL_P
                    )
                    results.append(r)
                    print(*_row(r), flush=True)
    order = {k: i for i, k in enumerate(spectra.SPECTRA)}
    results.sort(key=lambda r: (order[r["kind"]], r["n"], list(MODES).index(r["mode"]), r["alpha"]))
    machine = H.machine_header()
    summary = {m: all(r["pass"] for r in results if r["mode"] == m) for m in MODES}
    H.write_json(out / f"{name}.json", {"machine": machine, "results": results, "all_pass": summary})
    table = H.markdown_table(
        ["spectrum", "N", "alpha", "mode", "rank / truth", "relW", "relP", "pass"], [_row(r) for r in results]
    )
    how = "Triton interpreter" if device.type == "cpu" else "compiled kernels"
    rerun = (
        f" The {', '.join(args.kinds)} rows were rerun by this run; the others come from the previous one."
        if partial
        else ""
    )
    verdicts = "\n".join(f"- {m}: {'passes' if ok else 'FAILS'} the whole suite" for m, ok in summary.items())
    text = f"```\n{H.format_header(machine)}\n```\n\nDevice: {device} ({how}).{rerun}\n\n{table}\n\n{verdicts}\n"
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
