"""Learn -> W for a whole stack of memory layers: every Gram mode, every eigensolver, Cholesky for a fixed ridge, and
the authors' algorithm, in the same run.

    python -m faast_lab.benchmarks.bench_learn_stack [--out DIR] [--budget-s 40]  # CUDA: 48 x 1600, 64K tokens
    python -m faast_lab.benchmarks.bench_learn_stack --smoke --out DIR            # CPU, tiny sizes (cannot rot)

The hidden states of a learned corpus are drawn once (bf16 keys and values, fp32 scores, as a bf16 model hands them
over) and arrive in batches of 8,192 tokens for every layer at once, [L, 8192, d]. Each case selects its backend with
FAAST_BACKEND (docs/backends.md); a candidate that cannot run here is recorded with its error, not fatal.

  1. Statistics: FastWeights(d, d, batch_shape=(L,)) updated with every batch under each Gram mode: the torch
     float64 GEMMs (FAAST_AUTOTUNE=0 pins the base candidate), torch.exact16 and triton for compute_dtype float32,
     triton for float64, and auto (measured afresh with a temporary FAAST_AUTOTUNE_CACHE). relS / relT against the
     float64 statistics.
  2. Solve, from the float64 statistics: eigh under each backend (torch's loop, the extension "cuda", "cupy",
     auto), then the spectral filter; and a fixed ridge mu through solve_fast_weights_ex (a batched Cholesky where
     faast has it; SolveInfo.method says which ran), against the eigh path's ridge solution.
  3. The authors' algorithm (faast.authors_reference.StoredKeyMemory in bf16: every batch appended, then the pinv of
     all N x d keys) layer by layer until --authors-budget-s; the rest extrapolated from the mean per layer (the
     layers are independent and identically shaped); the file says how many were measured.
  4. End to end (update + W, synchronised): the fastest float64-statistics mode with the fastest eigh, the fastest
     setting overall, and auto. speedup = authors' time / faast's fastest; speedup_float64 for float64 statistics.
The extension runs last (a crash inside it must not take the other results with it); the json is rewritten after
every case and names the case in flight. Cases are skipped once --budget-s is spent (recorded as skipped), and so
are those auto's gates keep out on this GPU, measured there to fail or lose (Triton's float64 mode with bf16 inputs
does not compile on sm_90; cupy's eigh at d = 1600 took 6.3 s against torch's 1.0 s in gpu_h100_run5), unless
--all-cases.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from faast_lab.benchmarks import _harness as H

FULL = {"layers": 48, "d": 1600, "tokens": 65536, "batch": 8192}
SMOKE = {"layers": 3, "d": 32, "tokens": 512, "batch": 128}
F64, F32 = torch.float64, torch.float32
# (FAAST_BACKEND for accumulate_gram, compute dtype). "torch" with FAAST_AUTOTUNE=0 is the base candidate. The auto
# cases run last: the end-to-end auto case and lab/benchmarks/bench_auto_choice.py cover auto first.
GRAM_CASES = [("torch", F64), ("torch.exact16", F32), ("triton", F32), ("triton", F64)]
GRAM_AUTO_CASES = [("auto", F64), ("auto", F32)]
EIGH_LATER = ["cupy", "auto", "cuda"]  # after the first end-to-end numbers; the extension last
RIDGE_REL = 1e-3  # the fixed ridge mu, relative to the mean diagonal of S


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:400]


def backend(setting: str, autotune: bool):  # noqa: ANN201 - a context manager
    """FAAST_BACKEND=setting (and FAAST_AUTOTUNE) for the block, restored afterwards."""
    return H.environ({"FAAST_BACKEND": setting, "FAAST_AUTOTUNE": "1" if autotune else "0"})


def make_batches(cfg: dict, device: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(7)
    L, d, b = cfg["layers"], cfg["d"], cfg["batch"]
    # A power-law spectrum with a mean direction, like a residual stream (a random Gaussian would be too easy).
    mix = (torch.randn(d, d, device=device, generator=g) * torch.arange(1, d + 1, device=device).pow(-0.5)).T
    out = []
    for _ in range(cfg["tokens"] // b):
        z = torch.randn(L, b, d, device=device, generator=g)
        keys = (z @ mix + 0.5).to(torch.bfloat16)
        values = (torch.randn(L, b, d, device=device, generator=g) @ mix).to(torch.bfloat16)
        scores = torch.rand(L, b, device=device, generator=g)
        out.append((keys, values, scores))
    return out


def new_memory(cfg: dict, device: str, compute: torch.dtype, **options: object):  # noqa: ANN201 - FastWeights
    from faast import FastWeights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float32 compute warns that it is not exact; measured here on purpose
        return FastWeights(cfg["d"], cfg["d"], batch_shape=(cfg["layers"],), device=device, compute_dtype=compute,
                           **options)  # fmt: skip


def learn(batches: list, cfg: dict, device: str, compute: torch.dtype, solve: bool) -> tuple[object, dict]:
    """Update one memory with every batch (and read W when `solve`): (memory, {update_s, solve_s, total_s})."""
    memory = new_memory(cfg, device, compute)
    _sync(device)
    t0 = time.perf_counter()
    for keys, values, scores in batches:
        memory.update(keys, values, scores)
    _sync(device)
    times = {"update_s": time.perf_counter() - t0}
    if solve:
        memory.weights  # noqa: B018 - the solve
        _sync(device)
        times["solve_s"] = time.perf_counter() - t0 - times["update_s"]
    times["total_s"] = time.perf_counter() - t0
    return memory, times


class Run:
    """The results so far, rewritten (json + md) after every case: a crash or a kill leaves a parsing file."""

    def __init__(self, args: argparse.Namespace, cfg: dict, device: str) -> None:
        self.args, self.cfg, self.device = args, cfg, device
        self.record = H.start()
        self.deadline = time.monotonic() + args.budget_s
        self.where = self.record.get("gpu", "cpu (smoke)") if device == "cuda" else "cpu (smoke)"
        self.stem = args.out / ("learn_stack_" + ("smoke" if args.smoke else H.slug(self.where)))
        self.payload: dict = {"config": cfg, "ridge_rel": RIDGE_REL, "gram": {}, "solve": {}, "end_to_end": {},
                              "authors": {}, "running": None, "budget_s": args.budget_s}  # fmt: skip

    def spent(self) -> bool:
        return time.monotonic() > self.deadline

    def case(self, section: str, name: str):  # noqa: ANN201 - a context manager
        return _Case(self, section, name)

    def save(self) -> None:
        summarise(self)  # every write holds the speedups so far: a run cut by its step limit still has them
        H.write(self.stem, self.record, self.payload, self.title(), self.text())

    def title(self) -> str:
        c = self.cfg
        return f"Learn -> W: {c['layers']} layers x d = {c['d']}, {c['tokens']} tokens, on {self.where}"

    def text(self) -> str:
        return markdown(self.payload)


class _Case:
    def __init__(self, run: Run, section: str, name: str) -> None:
        self.run, self.section, self.name = run, section, name
        self.result: dict = {}
        self.skipped = False

    def __enter__(self) -> dict | None:
        if self.run.spent():
            self.skipped = True
            self.run.payload[self.section][self.name] = {"skipped": "time budget spent"}
            return None
        self.run.payload["running"] = f"{self.section}: {self.name}"
        self.run.save()
        return self.result

    def __exit__(self, kind: type | None, err: BaseException | None, _tb: object) -> bool:
        if self.skipped or (err is not None and not isinstance(err, Exception)):
            return False  # KeyboardInterrupt, SystemExit: not a backend's failure
        if err is not None:
            self.result = {"error": _error(err)}
        self.run.payload[self.section][self.name] = self.result
        self.run.payload["running"] = None
        print(self.section, self.name, {k: v for k, v in self.result.items() if not isinstance(v, list)}, flush=True)
        self.run.save()
        if self.run.device == "cuda":
            torch.cuda.empty_cache()
        return True  # a backend that cannot run here is recorded, not fatal


def _gated(run: Run, section: str, name: str, op: str, candidate: str, call: object) -> bool:
    """Record a case auto's gate keeps out on this GPU as skipped (unless --all-cases) and say so."""
    reason = None if run.args.all_cases else H.gated(op, candidate, call)
    if reason is not None:
        run.payload[section][name] = {"skipped": reason}
    return reason is not None


def gram_cases(run: Run, batches: list, cases: list, reference: object | None = None) -> object | None:
    """Section 1; returns the float64 reference memory (the torch base candidate's), or None. A case auto's gate
    keeps out on this GPU (Triton's float64 mode with 16-bit inputs does not compile on sm_80+) is skipped."""
    from faast import ops

    for setting, compute in cases:
        name = f"{setting}, compute {str(compute).split('.')[-1]}"
        keys, values, scores = batches[0]
        call = ops.gram_call(keys, values, scores, compute_dtype=compute)
        if setting == "triton" and _gated(run, "gram", name, "accumulate_gram", setting, call):
            continue
        with run.case("gram", name) as result:
            if result is None:
                continue
            auto = setting == "auto"
            with backend("auto" if auto else f"accumulate_gram={setting}", autotune=auto):
                learn(batches[:1], run.cfg, run.device, compute, solve=False)  # warm-up: compile, handles, tuning
                memory, times = learn(batches, run.cfg, run.device, compute, solve=False)
            result.update(backend=setting, compute=str(compute), update_s=times["update_s"],
                          tokens_per_s=run.cfg["tokens"] * run.cfg["layers"] / times["update_s"])  # fmt: skip
            if reference is None and setting == "torch" and compute == F64:
                reference = memory
            elif reference is not None:
                result.update(rel_gram=_rel(memory.gram, reference.gram), rel_cross=_rel(memory.cross,
                              reference.cross))  # fmt: skip
            del memory
    return reference


def eigh_case(run: Run, reference: object, setting: str, state: dict) -> None:
    """Section 2, one eigensolver: eigh of the 48 Grams, then the filter (alpha = 1)."""
    from faast import ops
    from faast.ops.solve import solve_from_eigh

    gram, cross, count = reference.gram, reference.cross, reference.count
    if setting == "cupy" and _gated(run, "solve", setting, "eigh", setting, ops.eigh_call(gram)):
        return
    with run.case("solve", setting) as result:
        if result is None:
            return
        auto = setting == "auto"
        with backend("auto" if auto else f"eigh={setting}", autotune=auto):
            ops.eigh_gram(gram[:2].clone())  # warm-up on two layers: handles, workspaces, a load error
            if auto:
                ops.eigh_gram(gram)  # auto times its candidates on the first call of this shape class
            _sync(run.device)
            t0 = time.perf_counter()
            lam, vecs = ops.eigh_gram(gram)
            _sync(run.device)
            eigh_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        weights, _ = solve_from_eigh(lam, vecs, cross, count, alpha=1.0, rtol=None, ridge=None, target_sqnorm=None)
        _sync(run.device)
        result.update(eigh_s=eigh_s, filter_s=time.perf_counter() - t0, per_matrix_ms=eigh_s / run.cfg["layers"] * 1e3)
        result["solve_s"] = result["eigh_s"] + result["filter_s"]
        if "weights" in state:
            result["rel_w_vs_torch"] = _rel(weights, state["weights"])
        else:
            state.update(weights=weights, lam=lam, vecs=vecs)


def ridge_case(run: Run, reference: object, state: dict) -> None:
    """Section 2, the fixed ridge: solve_fast_weights_ex(ridge=mu) against the eigh path's ridge solution."""
    from faast import ops
    from faast.ops.solve import solve_from_eigh

    gram, cross, count = reference.gram, reference.cross, reference.count
    mu = float(torch.diagonal(gram, dim1=-2, dim2=-1).mean()) * RIDGE_REL
    with run.case("solve", "ridge") as result:
        if result is None:
            return
        ops.solve_fast_weights_ex(gram[:2], cross[:2], count=count[:2], ridge=mu)  # warm-up
        _sync(run.device)
        t0 = time.perf_counter()
        weights, info = ops.solve_fast_weights_ex(gram, cross, count=count, ridge=mu)
        _sync(run.device)
        result.update(solve_s=time.perf_counter() - t0, mu=mu, method=getattr(info, "method", None))
        if "lam" in state:
            truth, _ = solve_from_eigh(state["lam"], state["vecs"], cross, count, alpha=1.0, rtol=None, ridge=mu,
                                       target_sqnorm=None)  # fmt: skip
            result["rel_w_vs_eigh_path"] = _rel(weights, truth)


def authors_case(run: Run, batches: list, weights: torch.Tensor | None) -> None:
    """Section 3: StoredKeyMemory per layer (bf16 bank, float32 pinv) until --authors-budget-s."""
    from faast.authors_reference import StoredKeyMemory

    def layer(i: int, rows: list) -> torch.Tensor:
        memory = StoredKeyMemory(alpha=1.0, dtype=torch.bfloat16)
        for k, v, s in rows:
            memory.update(k[i], v[i], s[i])
        return memory.weights

    with run.case("authors", "stored keys, pinv") as result:
        if result is None:
            return
        layer(0, batches[:1])  # warm-up: cuSOLVER handles and workspaces
        _sync(run.device)
        measured, rel_w = [], []
        deadline = time.monotonic() + run.args.authors_budget_s
        for i in range(run.cfg["layers"]):
            if measured and time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            w = layer(i, batches)
            _sync(run.device)
            measured.append(time.perf_counter() - t0)
            if weights is not None:
                rel_w.append(_rel(w, weights[i]))
        per_layer = sum(measured) / len(measured)
        result.update(layers_measured=len(measured), layer_s=measured, per_layer_s=per_layer,
                      total_s=per_layer * run.cfg["layers"], rel_w_vs_faast=rel_w)  # fmt: skip


def _fastest(section: dict, key: str, accept=lambda name, r: True) -> str | None:  # noqa: ANN001
    ok = {n: r for n, r in section.items() if isinstance(r.get(key), float) and accept(n, r)}
    return min(ok, key=lambda n: ok[n][key]) if ok else None


def end_to_end(run: Run, batches: list) -> None:
    """Section 4: update + W under the fastest explicit settings and auto."""
    gram, solve = run.payload["gram"], run.payload["solve"]
    explicit = {n: r for n, r in gram.items() if r.get("backend") not in (None, "auto")}
    eigh = _fastest({n: r for n, r in solve.items() if n not in ("ridge", "auto")}, "eigh_s") or "torch"
    settings = []  # (FAAST_BACKEND, compute)
    for accept in (lambda n, r: r["compute"] == str(F64), lambda n, r: True):
        best = _fastest(explicit, "update_s", accept)
        if best is not None:
            settings.append((f"accumulate_gram={gram[best]['backend']},eigh={eigh}", gram[best]["compute"]))
    settings.append(("auto", str(F64)))
    for setting, compute in settings:
        name = f"{setting}, compute {compute.split('.')[-1]}"
        if name in run.payload["end_to_end"]:
            continue
        with run.case("end_to_end", name) as result:
            if result is None:
                continue
            auto = setting == "auto"
            dtype = F64 if compute == str(F64) else F32
            with backend(setting, autotune=auto):
                learn(batches[:1], run.cfg, run.device, dtype, solve=True)  # warm-up (auto: its measured choice)
                _, times = learn(batches, run.cfg, run.device, dtype, solve=True)
            result.update(times, setting=setting, compute=compute)


def summarise(run: Run) -> None:
    """speedup (fastest end to end), speedup_float64, the authors' total, and auto's choices against the fastest."""
    p = run.payload
    authors = p["authors"].get("stored keys, pinv", {}).get("total_s")
    e2e = p["end_to_end"]
    best = _fastest(e2e, "total_s")
    best64 = _fastest(e2e, "total_s", lambda n, r: r.get("compute") == str(F64))
    p.update(faast_best_setting=best, faast_best_s=e2e[best]["total_s"] if best else None,
             faast_best_float64_setting=best64, authors_total_s=authors,
             speedup=authors / e2e[best]["total_s"] if best and authors else None,
             speedup_float64=authors / e2e[best64]["total_s"] if best64 and authors else None)  # fmt: skip
    layers = p["authors"].get("stored keys, pinv", {}).get("layers_measured")
    p["note"] = f"authors measured on {layers} of {run.cfg['layers']} layers, the rest extrapolated" if layers else ""
    p["auto_choices"] = _autotune_entries()
    p["auto_check"] = auto_check(p)


def auto_check(p: dict) -> list[dict]:
    """What auto chose for the run's shapes (from its cache file, measured in this run) against the fastest explicit
    case of the same op and compute dtype."""
    layers, d = p["config"]["layers"], p["config"]["d"]
    checks = []
    for entry, times in p.get("auto_choices", {}).items():
        op, _, shape_class = entry.partition(" ")
        if op == "accumulate_gram" and shape_class.startswith(f"B{layers} ") and f" dk{d} " in shape_class:
            compute = "torch.float64" if "compute torch.float64" in shape_class else "torch.float32"
            pool = {
                r["backend"]: r["update_s"]
                for r in p["gram"].values()
                if r.get("compute") == compute and r.get("backend") not in (None, "auto") and "update_s" in r
            }
        elif op == "eigh" and shape_class == f"B{1 << (layers - 1).bit_length()} d{d}":
            compute = "torch.float64"
            pool = {n: r["eigh_s"] for n, r in p["solve"].items() if n not in ("auto", "ridge") and "eigh_s" in r}
        else:
            continue
        if pool and isinstance(times, dict):
            fastest = min(pool, key=pool.__getitem__)
            checks.append({"op": op, "compute": compute, "shape_class": shape_class, "auto": times.get("choice"),
                           "fastest": fastest, "times_s": pool})  # fmt: skip
    return checks


def markdown(p: dict) -> str:
    """The report's tables from the payload (partial payloads too)."""

    def cell(r: dict, key: str, fmt=H.fmt_s) -> str:  # noqa: ANN001
        return fmt(r.get(key)) if isinstance(r.get(key), float) else "n/a"

    def status(r: dict) -> str:
        return (r.get("error") or r.get("skipped") or "")[:160]

    tokens = p["config"]["tokens"] * p["config"]["layers"]
    parts = [
        f"Statistics of {tokens:,} token-layers (bf16 keys and values, fp32 scores), one FastWeights for the stack:",
        "",
        H.markdown_table(["Gram mode (FAAST_BACKEND accumulate_gram)", "update, all batches", "M tokens/s",
                          "relS vs float64", "relT vs float64", "note"],
                         [[n, cell(r, "update_s"), cell(r, "tokens_per_s", lambda v: f"{v / 1e6:.3g}"),
                           cell(r, "rel_gram", H.fmt_sci), cell(r, "rel_cross", H.fmt_sci), status(r)]
                          for n, r in p["gram"].items()]),
        "",
        f"Solve from the float64 statistics (alpha = 1; ridge: a fixed mu = {p['ridge_rel']:g} x mean diag S):",
        "",
        H.markdown_table(["eigh backend / solve", "eigh", "per matrix", "filter", "solve", "relW", "note"],
                         [[n, cell(r, "eigh_s"), cell(r, "per_matrix_ms", lambda v: f"{v:.2f} ms"),
                           cell(r, "filter_s"), cell(r, "solve_s"),
                           cell(r, "rel_w_vs_torch" if n != "ridge" else "rel_w_vs_eigh_path", H.fmt_sci),
                           status(r) or (f"method {r.get('method')}" if n == "ridge" else "")]
                          for n, r in p["solve"].items()]),
        "",
    ]  # fmt: skip
    authors = p["authors"].get("stored keys, pinv", {})
    if "total_s" in authors:
        parts += [f"Authors' algorithm: {H.fmt_s(authors['per_layer_s'])} per layer ({authors['layers_measured']} of "
                  f"{p['config']['layers']} layers measured), {H.fmt_s(authors['total_s'])} for the stack. "
                  f"relW(authors, faast) on the first layers: "
                  f"{', '.join(H.fmt_sci(r) for r in authors['rel_w_vs_faast'][:3]) or 'n/a'}.", ""]  # fmt: skip
    elif authors:
        parts += [f"Authors' algorithm: {status(authors)}", ""]
    total = p.get("authors_total_s")
    parts += [
        H.markdown_table(["end to end (update + W)", "update", "solve", "total", "vs authors"],
                         [[n, cell(r, "update_s"), cell(r, "solve_s"), cell(r, "total_s"),
                           H.fmt_ratio(total / r["total_s"]) if total and r.get("total_s") else status(r)]
                          for n, r in p["end_to_end"].items()]),
        "",
    ]  # fmt: skip
    if p.get("speedup") is not None:
        best = p["end_to_end"][p["faast_best_setting"]]
        parts.append(f"Speedup over the authors: **{H.fmt_ratio(p['speedup'])}** ({p['faast_best_setting']}); with "
                     f"float64 statistics {H.fmt_ratio(p.get('speedup_float64'))}. The solve is "
                     f"{best['solve_s'] / best['total_s']:.0%} of the fastest total.")  # fmt: skip
    for c in p.get("auto_check", []):
        parts.append(f"- auto, {c['op']} ({c['shape_class']}): chose {c['auto']}; fastest measured {c['fastest']}.")
    if p.get("running"):
        parts.append(f"\n**In flight when this file was written: {p['running']}** (a crash there ends the run).")
    return "\n".join(parts)


def _autotune_entries() -> dict:
    from faast.ops import backends

    return backends.measured_choices()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--budget-s", type=float, default=120.0, help="start no case after this many seconds")
    parser.add_argument("--authors-budget-s", type=float, default=20.0)
    parser.add_argument("--all-cases", action="store_true", help="also time the cases auto's gates keep out")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("bench_learn_stack: the full size needs a CUDA device; --smoke runs it tiny on CPU", file=sys.stderr)
        return 2
    faulthandler.enable()  # a crash inside a native backend names the place in the log
    cfg = SMOKE if args.smoke else FULL
    # auto measures its candidates afresh in this run; the choices are read back from this folder.
    os.environ["FAAST_AUTOTUNE_CACHE"] = str(Path(tempfile.mkdtemp(prefix="faast-learn-stack-")) / "autotune.json")
    run = Run(args, cfg, device)
    batches = make_batches(cfg, device)
    _sync(device)
    # Ordered by what the goals need first (the json is rewritten after every case; --budget-s skips the rest).
    reference = gram_cases(run, batches, GRAM_CASES)
    state: dict = {}
    if reference is not None:
        eigh_case(run, reference, "torch", state)
        ridge_case(run, reference, state)
    authors_case(run, batches, state.get("weights"))
    end_to_end(run, batches)
    if reference is not None:
        for setting in EIGH_LATER:
            eigh_case(run, reference, setting, state)
        end_to_end(run, batches)  # with a faster eigh, where one was found
    gram_cases(run, batches, GRAM_AUTO_CASES, reference)
    run.save()
    print(run.text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
