"""Every GPU claim of faast, measured by one command: build, tests, fidelity, kernels, eigh, learn -> W, HF overhead.

    bash scripts/gpu_check.sh OUTDIR            # on the GPU machine (system python3 with CUDA torch, triton, nvcc)
    bash scripts/gpu_check.sh OUTDIR --smoke    # anywhere: the same steps at tiny sizes, Triton interpreter on CPU

Steps run in order, each in its own process under a time limit; a failing or timed-out step is recorded and the next
one still runs. OUTDIR receives at most 8 files: gpu_check.json (machine, steps, exit codes, times, the goals) and
gpu_check.md (every step's table and the goals against their targets), plus the json of each benchmark. The full
log of every step goes to stdout.

Step                 what it runs                                                      limit (s)
  build              python setup.py build_ext --inplace (faast._C, ninja, all cores)      90
  tests              pytest -m gpu tests/, then the Triton kernel tests on CUDA tensors   120
  fidelity           benchmarks/fidelity_triton_modes.py (every Gram precision mode)      60
  kernels            benchmarks/bench_kernels.py                                          110
  eigh               benchmarks/bench_eigh.py                                             50
  learn              benchmarks/bench_learn_stack.py (GPT-2-XL-shaped stack, authors')    70
  hf                 benchmarks/bench_hf_overhead.py on config-built GPU models            40
Together at most 540 s: the device's 10-minute call limit leaves room for the machine's start and the transfers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from faast.persist import write_text_atomic  # noqa: E402

ROOT = H.REPO
PY = sys.executable
STEPS = ("build", "tests", "fidelity", "kernels", "eigh", "learn", "hf")
LIMITS = {"build": 90, "tests": 120, "fidelity": 60, "kernels": 110, "eigh": 50, "learn": 70, "hf": 40}
SMOKE_LIMITS = {"build": 60, "tests": 300, "fidelity": 300, "kernels": 300, "eigh": 60, "learn": 120, "hf": 300}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def commands(step: str, out: Path, smoke: bool) -> list[list[str]] | str:
    """The command lines of a step, or a string saying why the step does not apply here."""
    bench = ROOT / "benchmarks"
    flag = ["--smoke"] if smoke else []
    if step == "build":
        if not _has_cuda():
            return "no CUDA device: faast._C is compile-checked by scripts/check_cuda_sources.sh instead"
        if shutil.which("nvcc") is None:
            return "nvcc not found"
        return [[PY, "setup.py", "build_ext", "--inplace"]]
    if step == "tests":
        # The gpu-marked tests of every file run first; these two files also hold kernel tests without the marker
        # that run on CUDA tensors where a GPU is present. No existence filter: a renamed file fails the step.
        kernel_tests = ["tests/test_triton_kernels.py", "tests/test_native.py"]
        if smoke:  # the interpreter suite runs in CI already: here only that the gpu selection collects and runs
            return [[PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_native.py"]]
        return [
            [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"],
            [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *kernel_tests],
        ]
    if step == "fidelity":
        return [[PY, str(bench / "fidelity_triton_modes.py"), "--out", str(out), *flag]]
    if step == "kernels":
        return [[PY, str(bench / "bench_kernels.py"), "--out", str(out), "--budget-s", "80", *flag]]
    if step == "eigh":
        return [[PY, str(bench / "bench_eigh.py"), "--out", str(out), "--budget-s", "40", *flag]]
    if step == "learn":
        return [[PY, str(bench / "bench_learn_stack.py"), "--out", str(out), "--authors-budget-s", "20", *flag]]
    if step == "hf":
        device = [] if smoke else ["--device", "cuda"]
        models = ["tiny"] if smoke else ["smollm2-shape", "gpt2-xl-shape"]
        return [
            [PY, str(bench / "bench_hf_overhead.py"), "--model", m, *device, "--out-dir", str(out), *flag]
            for m in models
        ]
    raise ValueError(step)


def run_step(step: str, out: Path, smoke: bool, limit: float) -> dict:
    cmds = commands(step, out, smoke)
    record: dict = {"step": step, "limit_s": limit}
    if isinstance(cmds, str):
        record.update(status="skipped", reason=cmds, seconds=0.0)
        print(f"== {step}: skipped ({cmds})", flush=True)
        return record
    env = dict(os.environ)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    if smoke and not _has_cuda():
        env["TRITON_INTERPRET"] = "1"
    start = time.monotonic()
    record["commands"], record["exit_codes"], tails = [], [], []
    for cmd in cmds:
        left = limit - (time.monotonic() - start)
        shown = " ".join(Path(c).name if c == PY else os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c
                         for c in cmd)  # fmt: skip
        record["commands"].append(shown)
        print(f"== {step}: {shown}  (limit {left:.0f} s)", flush=True)
        if left <= 0:
            record["exit_codes"].append("not started: step limit spent")
            continue
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=left, capture_output=True, text=True)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            code = "timeout"
            output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (err.stdout, err.stderr))
        print(output, flush=True)
        record["exit_codes"].append(code)
        tails.append(output[-3000:])
    record["seconds"] = round(time.monotonic() - start, 1)
    ok = all(c == 0 for c in record["exit_codes"])
    record["status"] = "ok" if ok else "failed"
    if step == "tests":
        record["summaries"] = [_pytest_summary(t) for t in tails]
    if not ok:
        record["tail"] = tails[-1][-1500:] if tails else ""
    print(f"== {step}: {record['status']} in {record['seconds']} s", flush=True)
    return record


def _pytest_summary(output: str) -> str:
    lines = [ln for ln in output.strip().splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    return lines[-1].strip("= ") if lines else "no pytest summary"


# ---------------------------------------------------------------------------------------------------- goals


def _load(out: Path, prefix: str) -> dict | None:
    files = sorted(out.glob(f"{prefix}*.json"))
    return json.loads(files[0].read_text()) if files else None


def goals(out: Path, smoke: bool = False) -> list[dict]:
    """The issue's GPU goals, each as a ratio measured in the same run (None where the step did not produce it).

    In smoke mode the sizes are not the goals' sizes, so nothing is judged (met is None)."""
    rows = []

    def add(goal: str, measured: float | None, target: float, higher_is_better: bool = True, note: str = "") -> None:
        met = None if measured is None else (measured >= target if higher_is_better else measured <= target)
        if smoke:
            met, note = None, "smoke: tiny sizes on CPU, not judged"
        rows.append({"goal": goal, "measured": measured, "target": target, "met": met, "note": note,
                     "higher_is_better": higher_is_better})

    kernels = _load(out, "kernels_")
    gram = next((r for r in (kernels or {}).get("gram", []) if (r["n"], r["dk"], r["L"]) == (65536, 1600, 1)), None)
    mode16 = "exact16" if kernels and "exact16" in kernels.get("modes", []) else "tf32x3"
    if gram is not None:
        comp, fast = gram.get("torch_bf16_composition_s"), gram.get(f"triton_{mode16}_s")
        add(f"Gram {mode16} mode vs the bf16 torch composition, N=65536 d=dv=1600", comp / fast if comp and fast
            else None, 1.3)  # fmt: skip
        add(f"Gram {mode16} mode time / bf16 FLOP floor (scores)", gram.get(f"triton_{mode16}_vs_floor"), 1.2,
            higher_is_better=False)  # fmt: skip
        add(f"Gram {mode16} mode time / bf16 FLOP floor (no scores)", gram.get(f"triton_{mode16}_noscores_vs_floor"),
            1.2, higher_is_better=False)  # fmt: skip
    res = next((r for r in (kernels or {}).get("residual", []) if r["d"] == 1600), None)
    if res is not None:
        add("Residual kernel vs torch.addmm (bf16, 8192 x 1600)", res["bf16m_vs_addmm"], 0.95)
        add("Residual kernel vs the unfolded x + (xW)P (bf16, 8192 x 1600)", res["bf16m_vs_unfolded"], 1.8)
    eigh = _load(out, "eigh_")
    if eigh is not None:
        recs = [r for r in eigh["records"] if r.get("L") == 48 and r.get("d") == 1600 and "seconds" in r]
        base = next((r["seconds"] for r in recs if r["case"] == "torch.linalg.eigh"), None)
        best = min((r for r in recs if r["case"].startswith("faast")), key=lambda r: r["seconds"], default=None)
        add("eigh: best faast._C routine vs torch.linalg.eigh at 48 x 1600",
            base / best["seconds"] if base and best else None, 3.0, note=best["case"] if best else "")  # fmt: skip
    learn = _load(out, "learn_stack_")
    if learn is not None:
        add("Learn -> W, 48 x 1600 stack, 64K tokens: authors' time / faast's", learn.get("speedup"), 100.0,
            note=learn.get("note", ""))  # fmt: skip
    for hf in sorted(out.glob("hf_overhead_*.json")):
        data = json.loads(hf.read_text())
        for name, key in (("learning", "learn_overhead"), ("inference", "inference_overhead")):
            if data.get(key) is not None:
                add(f"HF {name} overhead, {data['model']}", data[key], 0.10, higher_is_better=False)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--steps: unknown {unknown}; expected a subset of {list(STEPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = H.start()
    print(H.provenance.markdown(record), flush=True)
    limits = SMOKE_LIMITS if args.smoke else LIMITS
    started = time.monotonic()
    records = []
    for step in steps:
        records.append(run_step(step, args.out, args.smoke, limits[step]))
        # Written after every step (atomically): a run cut short (the device's call limit) still leaves what it
        # measured, in a file that parses.
        write_text_atomic(args.out / "gpu_check.json",
                          H.provenance.to_json({"smoke": args.smoke, "steps": records}, record))  # fmt: skip
    # Benchmarks write a markdown table beside their json: folded into gpu_check.md, so OUTDIR stays under 8 files.
    sections = []
    for md in sorted(args.out.glob("*.md")):
        if md.name != "gpu_check.md":
            sections += [f"## {md.stem}", "", md.read_text().strip(), ""]
            md.unlink()
    for extra in args.out.iterdir():
        if extra.suffix not in (".json", ".md"):
            extra.unlink()
    goal_rows = goals(args.out, args.smoke)
    payload = {"smoke": args.smoke, "seconds": round(time.monotonic() - started, 1), "steps": records,
               "goals": goal_rows}  # fmt: skip

    def fmt(v: object) -> str:
        return "n/a" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    step_table = H.markdown_table(
        ["step", "status", "seconds", "exit codes", "detail"],
        [[r["step"], r["status"], r["seconds"], fmt(r.get("exit_codes")),
          r.get("reason") or "; ".join(r.get("summaries", []))] for r in records],
    )  # fmt: skip
    goal_table = H.markdown_table(
        ["goal", "measured", "target", "met", "note"],
        [[g["goal"], fmt(g["measured"]), ("≥ " if g["higher_is_better"] else "≤ ") + fmt(g["target"]),
          {True: "yes", False: "NO", None: "n/a"}[g["met"]], g["note"]] for g in goal_rows],
    )  # fmt: skip
    title = f"GPU check{' (smoke)' if args.smoke else ''}: {record.get('gpu', 'no GPU')}"
    body = [step_table, "", "## Goals", "", goal_table, "", *sections]
    H.write(args.out / "gpu_check", record, payload, title, body)
    print((args.out / "gpu_check.md").read_text(), flush=True)
    files = sorted(p.name for p in args.out.iterdir())
    if len(files) > 8:
        print(f"gpu_check: {len(files)} files in {args.out} (more than 8): {files}", file=sys.stderr)
        return 1
    return 0 if all(r["status"] != "failed" for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
