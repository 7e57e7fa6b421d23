"""The goals of issues 36 and 37 read from the result files that lab/benchmarks/gpu_check.py collects in one OUTDIR.

Every goal is a ratio measured in the same run (or a comparison of two names); a goal whose data is missing is
reported with measured None and a note saying what is missing, never dropped. How each file is read is described in
gpu_check.py's docstring.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Float64 GEMMs (and the fp64 MMA kernel) are float64-grade by construction; other modes need the fidelity suite.
# triton_int8: the int8-slice Gram, within 2^-53 of the column maxima's product per row by its bound
# (faast_kernels.gram_int8; tested against float64 in tests/test_gram_int8.py).
FLOAT64_BY_CONSTRUCTION = ("torch_backend_float64", "torch_float64", "triton_fp64", "triton_int8")
NOT_A_MODE = ("torch_bf16_composition", "torch_backend_float32", "authors_pinv", "ceiling", "floor")
EIGH_REPORT_SIZES = (64, 256, 576, 1152)


def _load(out: Path, prefix: str) -> dict | None:
    files = sorted(out.glob(f"{prefix}*.json"))
    if not files:
        return None
    try:
        return json.loads(files[0].read_text())
    except (OSError, ValueError):
        return None


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", re.sub(r"\br=", "r", name.lower())).strip("_")


def _default_flush(mode: str) -> int | None:
    try:
        from faast_kernels.gram import FLUSH_ROWS
    except Exception:  # noqa: BLE001 - no triton here: only modes named with their R match
        return None
    return FLUSH_ROWS.get(mode)


def passing_modes(fidelity: dict | None) -> set[str]:
    """Normalised names of the fidelity summary's modes that passed every case ('fp64', 'exact16_r64', ...)."""
    summary = (fidelity or {}).get("summary", {})
    return {_norm(m) for m, s in summary.items() if s.get("cases") and s.get("pass") == s.get("cases")}


def float64_grade(case: str, passing: set[str]) -> bool:
    """Whether a kernels-benchmark case (e.g. 'triton_exact16', 'torch_exact16_r4096') is float64-grade."""
    if case.startswith(FLOAT64_BY_CONSTRUCTION):
        return True
    if case.startswith("triton_"):
        mode = case[len("triton_") :]
        flush = _default_flush(mode)
        return _norm(mode) in passing or (flush is not None and _norm(f"{mode} R={flush}") in passing)
    return _norm(case) in passing


def gram_modes(record: dict, passing: set[str]) -> tuple[float | None, dict[str, float]]:
    """(the bf16 composition's seconds, {float64-grade case: seconds}) of one kernels 'gram' record."""
    # "<case>_s" are seconds; "<case>_rel_s" are the case's relative errors (relS), not times.
    times = {k[:-2]: v for k, v in record.items()
             if k.endswith("_s") and not k.endswith("_rel_s") and isinstance(v, (int, float)) and v > 0}  # fmt: skip
    modes = {
        c: t
        for c, t in times.items()
        if not c.startswith(NOT_A_MODE) and not c.endswith("_noscores") and float64_grade(c, passing)
    }
    return times.get("torch_bf16_composition"), modes


class Goals:
    def __init__(self, smoke: bool) -> None:
        self.smoke, self.rows = smoke, []

    def add(self, goal: str, measured: object, target: float | None, higher_is_better: bool = True,
            note: str = "") -> None:  # fmt: skip
        met = None
        if isinstance(measured, (int, float)) and target is not None:
            met = measured >= target if higher_is_better else measured <= target
        if self.smoke:
            met, note = None, ("smoke: tiny sizes, not judged. " + note).strip()
        self.rows.append({"goal": goal, "measured": measured, "target": target, "met": met, "note": note,
                          "higher_is_better": higher_is_better})  # fmt: skip


def gram_goals(g: Goals, out: Path) -> None:
    kernels, fidelity = _load(out, "kernels_"), _load(out, "triton_fidelity_")
    passing = passing_modes(fidelity)
    basis = "fidelity: " + (", ".join(sorted(passing)) or "no mode passed") if fidelity else (
        "no fidelity file: only float64 GEMMs counted")  # fmt: skip
    auto_rows = []
    for n, dk, layers, label in ((65536, 1600, 1, "N=65536 d=dv=1600"), (8192, 1600, 48, "48 x 8192, d=dv=1600")):
        rec = next((r for r in (kernels or {}).get("gram", []) if (r.get("n"), r.get("dk"), r.get("L")) ==
                    (n, dk, layers)), None)  # fmt: skip
        goal = f"Gram {label}: fastest float64-grade mode vs the bf16 torch composition"
        if rec is None:
            g.add(goal, None, 1.0, note="no kernels record for this shape")
            continue
        comp, modes = gram_modes(rec, passing)
        if comp is None or not modes:
            g.add(goal, None, 1.0, note=f"{'no bf16 composition time' if comp is None else 'no float64-grade mode'} "
                  f"timed; {basis}")  # fmt: skip
            continue
        best = min(modes, key=modes.__getitem__)
        g.add(goal, comp / modes[best], 1.0, note=f"{best}; {basis}")
        if rec.get("auto_choice"):
            auto_rows.append((label, rec["auto_choice"], best))
    res = next((r for r in (kernels or {}).get("residual", []) if r.get("d") == 1600 and r.get("rows", 8192) == 8192),
               None)  # fmt: skip
    g.add("Residual read vs a bf16 addmm, 8192 x 1600", None if res is None else res.get("bf16m_vs_addmm"), 0.95,
          note="" if res is not None else "no kernels residual record at d = 1600")  # fmt: skip
    auto_rows += [(r["case"], r["auto"], r["fastest"]) for r in (_load(out, "auto_choice_") or {}).get("rows", [])
                  if r.get("auto") and r.get("fastest")]  # fmt: skip
    learn = _load(out, "learn_stack_") or {}
    auto_rows += [(f"learn stack {c['op']}, compute {c['compute']}", c["auto"], c["fastest"])
                  for c in learn.get("auto_check", []) if c.get("auto") and c.get("fastest")]  # fmt: skip
    goal = "auto's choice equals the measured fastest passing mode (every benchmarked shape)"
    if not auto_rows:
        g.add(goal, None, None, note="no auto choice recorded (auto_choice_*.json rows, kernels' 'auto_choice' per "
              "gram record, learn stack's 'auto_check')")  # fmt: skip
    else:
        equal = sum(a == b for _, a, b in auto_rows)
        misses = "; ".join(f"{s}: auto {a}, fastest {b}" for s, a, b in auto_rows if a != b)
        g.add(goal, f"{equal} / {len(auto_rows)}", None, note=misses or "all equal")
        if not g.smoke:
            g.rows[-1]["met"] = equal == len(auto_rows)


def eigh_goals(g: Goals, out: Path) -> None:
    eigh = _load(out, "eigh_")
    records = [r for r in (eigh or {}).get("records", []) if isinstance(r.get("seconds"), (int, float))]

    def ratio(layers: int, d: int) -> tuple[float | None, str]:
        here = [r for r in records if r.get("L") == layers and r.get("d") == d]
        base = next((r["seconds"] for r in here if str(r.get("case", "")).startswith("torch.linalg.eigh")), None)
        rivals = [r for r in here if not str(r.get("case", "")).startswith("torch")
                  and "cholesky" not in str(r.get("case", "")).lower()]  # fmt: skip
        best = min(rivals, key=lambda r: r["seconds"], default=None)
        if base is None or best is None:
            return None, "not measured" if not here else "no faast backend timed"
        return base / best["seconds"], str(best["case"])

    measured, note = ratio(48, 1600)
    if measured is None:  # the learn-stack benchmark times the same eigh on its own statistics
        solve = (_load(out, "learn_stack_") or {}).get("solve", {})
        base = (solve.get("torch") or {}).get("eigh_s")
        rivals = {k: v["eigh_s"] for k, v in solve.items() if k in ("cuda", "cupy") and v.get("eigh_s")}
        if base and rivals:
            best = min(rivals, key=rivals.__getitem__)
            measured, note = base / rivals[best], f"{best} (learn-stack benchmark)"
    g.add("Batched float64 eigh 48 x 1600: best faast backend vs torch.linalg.eigh's loop", measured, 3.0,
          note=note)  # fmt: skip
    for d in EIGH_REPORT_SIZES:
        measured, note = ratio(48, d)
        g.add(f"Batched float64 eigh 48 x {d}: best faast backend vs torch's loop", measured, None, note=note)


def learn_goals(g: Goals, out: Path) -> None:
    learn = _load(out, "learn_stack_")
    if learn is None:
        g.add("Learn -> W, 48 x 1600 stack, 64K tokens: vs the authors' algorithm", None, 20.0, note="no file")
        return
    note = learn.get("note", "")
    g.add("Learn -> W, 48 x 1600 stack, 64K tokens: vs the authors' algorithm (fastest setting)",
          learn.get("speedup"), 20.0, note=f"{learn.get('faast_best_setting')}; {note}")  # fmt: skip
    g.add("Learn -> W, 48 x 1600 stack, 64K tokens: vs the authors' algorithm (float64 statistics)",
          learn.get("speedup_float64"), 20.0, note=str(learn.get("faast_best_float64_setting")))  # fmt: skip


def hf_goals(g: Goals, out: Path) -> None:
    found = False
    for path in sorted(out.glob("hf_overhead_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for model in data.get("models", [data]):
            if "model" not in model:
                continue
            found = True
            name = model["model"]
            if model.get("skipped"):
                g.add(f"HF {name}", None, None, note=model["skipped"])
                continue
            g.add(f"HF learning throughput / the model's forward, {name}", model.get("learn_vs_forward"), 0.8)
            g.add(f"HF read overhead per forward pass, {name}", model.get("read_overhead",
                  model.get("inference_overhead")), 0.10, higher_is_better=False)  # fmt: skip
            per_token = model.get("read_overhead_per_token_s")
            g.add(f"HF read overhead per generated token (ms), {name}",
                  None if per_token is None else per_token * 1e3, None,
                  note=f"generation {model.get('generation_overhead', float('nan')):+.1%}")  # fmt: skip
    if not found:
        g.add("HF learning throughput / the model's forward", None, 0.8, note="no hf_overhead file")


def goals(out: Path, smoke: bool = False) -> list[dict]:
    """The goal rows (goal, measured, target, met, note, higher_is_better); in smoke mode none is judged."""
    g = Goals(smoke)
    gram_goals(g, out)
    eigh_goals(g, out)
    learn_goals(g, out)
    hf_goals(g, out)
    return g.rows
