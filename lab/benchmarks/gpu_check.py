"""Every GPU claim of faast, measured by one command: build, tests, fidelity, kernels, eigh, learn -> W, HF overhead.

    bash scripts/gpu_check.sh OUTDIR            # on the GPU machine (system python3 with CUDA torch, triton, nvcc)
    bash scripts/gpu_check.sh OUTDIR --smoke    # anywhere: the same steps at tiny sizes, Triton interpreter on CPU

Steps run in order, each in its own process group under a time limit; a failing, crashing or timed-out step is
recorded and the next one still runs. The whole run stops starting work at --budget-s (default 320 s, so that a
device call of 6 minutes holds it with the machine's start and transfers, and a lent device runs it twice); SIGTERM
or SIGINT cuts the step in flight. Whatever happens, the report is written and the goals table is printed last.

Step       what it runs (a benchmark: the module beside this one, python -m faast_lab.benchmarks.NAME)     limit (s)
  build    python setup.py build_ext --inplace (faast._C, ninja, all cores; 32-61+ s on an H100)   80
  tests    pytest -v: the gpu-marked tests of the other files (the fp64 Triton mode deselected on sm_90+,   45
           where it does not compile); then tests/test_native.py's gpu tests, restarted past a test that crashes
           the process (the crashed test is named); then the unmarked kernel tests on CUDA tensors, time left
  fidelity fidelity_triton_modes.py --flush 64 256 (R = 1024 and 4096 fail on an H100)               25
  kernels  bench_kernels.py --budget-s (limit - 25); its Gram cases include the int8-slice kernel        40
           (triton_int8, timed before the slower cases, beside the float64 and bf16 torch compositions)
  eigh     bench_eigh.py --budget-s (limit - 12); its cases include torch.refined (float32 eigh and          25
           float64 refinement, 48 x 1600 batched) against torch's loop
  learn    bench_learn_stack.py --budget-s (limit - 8): Gram modes, eigh backends, Cholesky,         40
           the authors' algorithm, end to end
  hf       bench_hf_overhead.py --device cuda: SmolLM2- and 1B-shaped models in one process          45
Together 300 s; time a step leaves unused passes on to the next. A step's benchmark gets its share as --budget-s
and stops starting cases when it is spent. On a GPU the benchmarks skip the cases auto's gates keep out there
(measured earlier to fail or lose; their --all-cases times them).

OUTDIR receives at most 8 files: gpu_check.json (machine, steps, exit codes, times, the autotune choices, the goals),
gpu_check.md (every step's table and the goals against their targets), gpu_check_log.txt.gz (every step's output) and
the json of each benchmark (kernels, eigh, learn_stack, triton_fidelity, hf_overhead).

How the goals read the benchmarks' files (a contract for their authors):
  * Gram: kernels_*.json "gram" records (n, dk, L, "<case>_s" seconds). A case counts as float64-grade when it is a
    float64 GEMM by construction (torch_backend_float64, torch_float64*, triton_fp64) or when
    triton_fidelity_*.json's summary passes every case for its mode: "triton_<mode>" matches the summary entry
    "<mode>" or "<mode> R=<the kernel's default flush rows>", "torch_<mode>_r<R>" matches "torch.<mode> R=<R>".
    A record's "auto_choice" (the case auto picks) is compared with the fastest float64-grade case.
  * eigh: eigh_*.json "records" (L, d, case, seconds): torch.linalg.eigh against every other case that is not
    Cholesky; else learn_stack's "solve" section.
  * auto: auto_choice_*.json "rows" (case, auto, fastest), kernels' "auto_choice", learn_stack's "auto_check".
  * learn: learn_stack_*.json "speedup", "speedup_float64", "auto_check"; hf: hf_overhead_*.json per model
    "learn_vs_forward", "read_overhead", "read_overhead_per_token_s".
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from faast.persist import write_text_atomic
from faast_lab.benchmarks import _harness as H

# The checkout: its tests, setup.py and python/ (the steps run there). faast and the lab need no installing (the GPU
# machine has no pip index): scripts/gpu_check.sh puts python/, the root and the lab on PYTHONPATH.
ROOT = Path(__file__).resolve().parents[2]
BENCH = "faast_lab.benchmarks"

PY = sys.executable
STEPS = ("build", "tests", "fidelity", "kernels", "eigh", "learn", "hf")
# A fresh H100 machine (run 5) needed 61 s to compile batched_eigh.cu alone; the fidelity step, whose suite has passed
# on every run since run 2, gives up the time.
LIMITS = {"build": 80, "tests": 45, "fidelity": 25, "kernels": 40, "eigh": 25, "learn": 40, "hf": 45}
SMOKE_LIMITS = {"build": 60, "tests": 300, "fidelity": 300, "kernels": 300, "eigh": 60, "learn": 180, "hf": 300}
BUDGET_S = 320.0  # the whole run; smoke runs take what they need
REPORT_RESERVE_S = 8.0  # kept for the report after the last step
MAX_FILES = 8
LOG = "gpu_check_log.txt"


class Cut(Exception):
    """SIGTERM or SIGINT arrived: stop the step in flight and write the report."""


def _raise_cut(signum: int, _frame: object) -> None:
    raise Cut(signal.Signals(signum).name)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sm90_or_newer() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _has_pytest_timeout() -> bool:
    import importlib.util

    return importlib.util.find_spec("pytest_timeout") is not None


# ---------------------------------------------------------------------------------------------------- commands


def _pytest(*args: str) -> list[str]:
    timeout = ["--timeout", "30"] if _has_pytest_timeout() else []  # a hung test fails alone
    return [PY, "-X", "faulthandler", "-m", "pytest", "-v", "-p", "no:cacheprovider", *timeout, *args]


def commands(step: str, out: Path, smoke: bool, limit: float = 60.0) -> list[dict] | str:
    """The commands of a step: dicts with argv, pytest (parse its -v output; restart it past a crash when
    `isolate`) and share (seconds it may take at most; unused time passes on; None: the rest of the step's limit).
    Or a string saying why the step does not apply here."""
    flag = ["--smoke"] if smoke else []
    if step == "build":
        if not _has_cuda():
            return "no CUDA device: faast._C is compile-checked by scripts/check_cuda_sources.sh instead"
        if shutil.which("nvcc") is None:
            return "nvcc not found"
        return [{"argv": [PY, "setup.py", "build_ext", "--inplace"]}]
    if step == "tests":
        # The fp64 Triton mode does not compile on sm_90 (MMAv2 "fp64 don't support largeK MMA"): its tests only
        # spend the step's time on a known compile failure there.
        skip = ["-k", "not fp64"] if _sm90_or_newer() else []
        # The files that hold gpu-marked tests, named: collecting all of tests/ would import every test's packages.
        marked = sorted(f"tests/{f.name}" for f in (ROOT / "tests").glob("test_*.py")
                        if f.name != "test_native.py" and "mark.gpu" in f.read_text(encoding="utf-8"))  # fmt: skip
        # Smoke: the interpreter suite runs in CI already; here only that each selection collects and runs.
        kernels = ["tests/test_mixture.py", "tests/test_triton_kernels.py"]
        unmarked = ["tests/test_native.py"] + ([] if smoke else kernels)
        return [
            {"argv": _pytest("-m", "gpu", *skip, *marked), "pytest": True, "share": 0.25 * limit},
            {"argv": _pytest("-m", "gpu", "tests/test_native.py"), "pytest": True, "isolate": True,
             "share": 0.5 * limit},
            {"argv": _pytest("-m", "not slow and not gpu", *skip, *unmarked), "pytest": True, "share": None},
        ]  # fmt: skip
    if step == "fidelity":
        return [{"argv": [PY, "-m", f"{BENCH}.fidelity_triton_modes", "--out", str(out), *flag,
                          *([] if smoke else ["--flush", "64", "256"])]}]  # fmt: skip
    if step == "kernels":
        budget = f"{max(10.0, limit - 25):.0f}"
        return [{"argv": [PY, "-m", f"{BENCH}.bench_kernels", "--out", str(out), "--budget-s", budget, *flag]}]
    if step == "eigh":
        budget = f"{max(5.0, limit - 12):.0f}"
        return [{"argv": [PY, "-m", f"{BENCH}.bench_eigh", "--out", str(out), "--budget-s", budget, *flag]}]
    if step == "learn":
        budget = f"{max(10.0, limit - 8):.0f}"
        return [{"argv": [PY, "-m", f"{BENCH}.bench_learn_stack", "--out", str(out), "--budget-s", budget,
                          "--authors-budget-s", "5", *flag]}]  # fmt: skip
    if step == "hf":
        if smoke:
            return [{"argv": [PY, "-m", f"{BENCH}.bench_hf_overhead", "--model", "tiny", "--out-dir", str(out),
                              "--smoke"]}]  # fmt: skip
        return [{"argv": [PY, "-m", f"{BENCH}.bench_hf_overhead", "--model", "smollm2-shape", "llama-1b-shape",
                          "--device", "cuda", "--reps", "3", "--new-tokens", "16", "--out-dir", str(out),
                          "--budget-s", f"{max(10.0, limit - 5):.0f}"]}]  # fmt: skip
    raise ValueError(step)


# ---------------------------------------------------------------------------------------------------- running


class Console:
    """Prints step output as it arrives and keeps it in OUTDIR's log (a cut run keeps what it printed)."""

    def __init__(self, log: Path | None) -> None:
        self.file = open(log, "a", encoding="utf-8") if log else None  # noqa: SIM115 - closed by close()

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        if self.file:
            self.file.write(text)
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def run_command(argv: list[str], env: dict, limit: float, console: Console, cwd: Path = ROOT) -> tuple[int | str, str]:
    """Run argv in its own process group for at most `limit` seconds: (exit code, or 'timeout'; its output).

    On a timeout or a Cut the whole group is killed (a build's ninja and nvcc, a pytest's workers)."""
    env = {**env, "PYTHONUNBUFFERED": "1"}  # what a crashing process printed last must not die in its buffer
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)  # fmt: skip
    chunks: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            # Results are committed: paths in the checkout become relative to it, the home folder ~ (a compiler's
            # command line and a traceback name the device machine's folders otherwise).
            line = H.provenance.relative(line, ROOT)
            chunks.append(line)
            console.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code: int | str = proc.wait(timeout=max(limit, 0.1))
    except subprocess.TimeoutExpired:
        code = "timeout"
        _kill_group(proc)
    except BaseException:
        _kill_group(proc)
        reader.join(5)
        raise
    reader.join(5)
    return code, "".join(chunks)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


_RESULT = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_NODE = re.compile(r"^(\S+\.py::\S+)")


def parse_pytest(output: str) -> dict:
    """From pytest -v output: outcome counts, the ids of tests that ran (any outcome), failed ids, and the test that
    was running when the output stopped (a crash or a kill), if any."""
    counts: collections.Counter = collections.Counter()
    ran, failed, running = [], [], None
    for line in output.splitlines():
        node = _NODE.match(line)
        if not node:
            continue
        result = _RESULT.search(line[node.end() :])
        if result is None:
            running = node.group(1)  # started; its result line never came (so far)
            continue
        outcome = result.group(1).lower()
        counts[outcome] += 1
        ran.append(node.group(1))
        if outcome in ("failed", "error"):
            failed.append(node.group(1))
        running = None
    summary = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error|deselected)", ln)]
    return {"counts": dict(counts), "ran": ran, "failed": failed, "running": running,
            "summary": summary[-1].strip("= ") if summary else None}  # fmt: skip


def run_pytest(
    argv: list[str], env: dict, limit: float, console: Console, isolate: bool, restarts: int = 4, cwd: Path = ROOT
) -> dict:
    """pytest -v under `limit`, run in `cwd` (its rootdir: the ids it prints are those --deselect takes). With
    isolate, a run that a test crashes (a signal, e.g. a segfault in an extension) is restarted without that test and
    the tests already run, so one crash hides no other result."""
    deadline = time.monotonic() + limit
    record: dict = {"counts": collections.Counter(), "failed": [], "crashed": [], "exit_codes": []}
    done: list[str] = []
    for _attempt in range(1 + (restarts if isolate else 0)):
        left = deadline - time.monotonic()
        if left <= 1:
            record["exit_codes"].append("not started: limit spent")
            break
        deselect = [a for node in done + record["crashed"] for a in ("--deselect", node)]
        code, output = run_command(argv + deselect, env, left, console, cwd)
        parsed = parse_pytest(output)
        record["exit_codes"].append(code)
        record["counts"].update(parsed["counts"])
        record["failed"] += parsed["failed"]
        record["summary"] = parsed["summary"]
        record["tail"] = output[-1500:]
        done += parsed["ran"]
        crashed = isinstance(code, int) and code < 0
        again = parsed["running"] in record["crashed"]  # the deselection did not take: do not loop on it
        if parsed["running"] and (crashed or code == "timeout") and not again:
            (record["crashed"] if crashed else record.setdefault("cut_at", [])).append(parsed["running"])
            console.write(f"== tests: {parsed['running']} {'crashed the process' if crashed else 'was cut'}\n")
        if not (isolate and crashed and parsed["running"]) or again:
            break
    record["counts"] = dict(record["counts"])
    record["ok"] = bool(record["exit_codes"]) and all(c in (0, 5) for c in record["exit_codes"]) and not (
        record["crashed"])  # fmt: skip
    return record


def _shown(argv: list[str]) -> str:
    return " ".join(Path(c).name if c == PY else os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c
                    for c in argv)  # fmt: skip


def run_step(step: str, out: Path, smoke: bool, limit: float, env: dict, console: Console) -> dict:
    """Run a step's commands under `limit` seconds; returns its record (status ok / failed / skipped / cut)."""
    record: dict = {"step": step, "limit_s": round(limit, 1)}
    cmds = commands(step, out, smoke, limit)
    if isinstance(cmds, str):
        record.update(status="skipped", reason=cmds, seconds=0.0)
        console.write(f"== {step}: skipped ({cmds})\n")
        return record
    start = time.monotonic()
    record["commands"], record["exit_codes"], oks, tails = [], [], [], []
    try:
        for i, cmd in enumerate(cmds):
            left = limit - (time.monotonic() - start)
            share = left if cmd.get("share") is None else min(left, cmd["share"] + _unused(cmds, i, start, limit))
            record["commands"].append(_shown(cmd["argv"]))
            console.write(f"== {step}: {_shown(cmd['argv'])}  (limit {share:.0f} s)\n")
            if share <= 1:
                record["exit_codes"].append("not started: step limit spent")
                oks.append(False)
                continue
            if cmd.get("pytest"):
                result = run_pytest(cmd["argv"], env, share, console, cmd.get("isolate", False))
                record.setdefault("pytest", []).append({k: v for k, v in result.items() if k != "tail"})
                record["exit_codes"].append(result["exit_codes"])
                oks.append(result["ok"])
                tails.append(result.get("tail", ""))
            else:
                code, output = run_command(cmd["argv"], env, share, console)
                record["exit_codes"].append(code)
                oks.append(code == 0)
                tails.append(output[-1500:])
        record["status"] = "ok" if all(oks) else "failed"
    except Cut as cut:
        record.update(status="cut", reason=f"{cut} arrived during the step")
    record["seconds"] = round(time.monotonic() - start, 1)
    if record["status"] != "ok" and tails:
        record["tail"] = tails[-1]
    console.write(f"== {step}: {record['status']} in {record['seconds']} s\n")
    return record


def _unused(cmds: list[dict], i: int, start: float, limit: float) -> float:
    """Seconds the earlier commands of a step left of their shares (they pass on to command i)."""
    planned = sum(c["share"] for c in cmds[:i] if c.get("share") is not None)
    return max(0.0, planned - (time.monotonic() - start))


def step_environment(cache_dir: Path, smoke: bool) -> dict:
    env = dict(os.environ)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    # auto measures afresh in this run (the cache of faast.ops.backends), and the report records what it chose.
    env["FAAST_AUTOTUNE_CACHE"] = str(cache_dir / "autotune.json")
    if smoke and not _has_cuda():
        env["TRITON_INTERPRET"] = "1"
    return env


# ---------------------------------------------------------------------------------------------------- report


def _fmt(v: object) -> str:
    return "n/a" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def _step_detail(r: dict) -> str:
    if r.get("reason"):
        return r["reason"]
    parts = []
    for p in r.get("pytest", []):
        text = ", ".join(f"{n} {k}" for k, n in sorted(p["counts"].items())) or "no test ran"
        if p.get("crashed"):
            text += f"; CRASHED: {', '.join(p['crashed'])}"
        if p.get("cut_at"):
            text += f"; cut in {', '.join(p['cut_at'])}"
        parts.append(text)
    return "; ".join(parts)


def _autotune_choices(cache_dir: Path) -> dict:
    path = cache_dir / "autotune.json"
    try:
        return json.loads(path.read_text()).get("entries", {}) if path.exists() else {}
    except (OSError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def _fold_outputs(out: Path) -> list[str]:
    """Benchmarks write a markdown table beside their json: folded into gpu_check.md, so OUTDIR stays small."""
    sections = []
    for md in sorted(out.glob("*.md")):
        if md.name != "gpu_check.md":
            sections += [f"## {md.stem}", "", md.read_text().strip(), ""]
            md.unlink()
    for extra in out.iterdir():
        if extra.suffix not in (".json", ".md") and not extra.name.startswith(LOG):
            if extra.is_dir():
                shutil.rmtree(extra)
            else:
                extra.unlink()
    return sections


def report(out: Path, record: dict, records: list[dict], smoke: bool, seconds: float, cache_dir: Path,
           console: Console) -> int:  # fmt: skip
    """Write gpu_check.json / .md, print the step and goals tables (the goals last); the exit code of the run."""
    from faast_lab.benchmarks.gpu_goals import goals  # noqa: PLC0415 - read only at the end

    sections = _fold_outputs(out)
    try:
        goal_rows = goals(out, smoke)
    except Exception as err:  # noqa: BLE001 - a malformed result file must not cost the report
        goal_rows = [{"goal": "every goal", "measured": None, "target": None, "met": None, "higher_is_better": True,
                      "note": f"reading the result files failed: {type(err).__name__}: {err}"}]  # fmt: skip
    payload = {"smoke": smoke, "seconds": round(seconds, 1), "steps": records, "goals": goal_rows,
               "autotune_choices": _autotune_choices(cache_dir)}  # fmt: skip
    step_table = H.markdown_table(
        ["step", "status", "seconds", "limit", "exit codes", "detail"],
        [[r["step"], r["status"], r["seconds"], r.get("limit_s", ""), _fmt(r.get("exit_codes")), _step_detail(r)]
         for r in records],
    )  # fmt: skip
    goal_table = H.markdown_table(
        ["goal", "measured", "target", "met", "note"],
        [[g["goal"], _fmt(g["measured"]),
          "report" if g["target"] is None else ("≥ " if g["higher_is_better"] else "≤ ") + _fmt(g["target"]),
          {True: "yes", False: "NO", None: "n/a"}[g["met"]], g["note"]] for g in goal_rows],
    )  # fmt: skip
    title = f"GPU check{' (smoke)' if smoke else ''}: {record.get('gpu', 'no GPU')}"
    H.write(out / "gpu_check", record, payload, title, [*sections, "## Steps", "", step_table, "", "## Goals", "",
                                                        goal_table, ""])  # fmt: skip
    console.write("\n".join(["", *sections, f"# {title}", "", "## Steps", "", step_table, "", "## Goals", "",
                             goal_table, ""]) + "\n")  # fmt: skip
    console.close()
    log = out / LOG
    if log.exists():  # compressed: a run's log is a few hundred kB of compiler and pytest output
        with open(log, "rb") as src, gzip.open(out / (LOG + ".gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        log.unlink()
    files = sorted(p.name for p in out.iterdir())
    if len(files) > MAX_FILES:
        print(f"gpu_check: {len(files)} files in {out} (more than {MAX_FILES}): {files}", file=sys.stderr)
        return 1
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


def run_steps(steps: list[str], args: argparse.Namespace, limits: dict, deadline: float, env: dict,
              console: Console, record: dict, records: list[dict]) -> None:  # fmt: skip
    """Run the steps in order until the budget is spent or a signal cuts the run, appending each step's record."""
    carry, stopped = 0.0, None
    for step in steps:
        left = deadline - time.monotonic()
        if stopped is None and left < 2:
            stopped = f"the run's budget of {args.budget_s:.0f} s was spent before it"
        if stopped is not None:
            records.append({"step": step, "status": "cut", "seconds": 0.0, "reason": stopped})
            console.write(f"== {step}: not run ({stopped})\n")
            continue
        limit = min(limits[step] + carry, left)
        try:
            rec = run_step(step, args.out, args.smoke, limit, env, console)
        except Cut as cut:  # between two commands of the step
            rec = {"step": step, "status": "cut", "seconds": 0.0, "reason": f"{cut} arrived during the step"}
        records.append(rec)
        if rec["status"] == "cut":
            stopped = "the run was cut before it"
        carry = max(0.0, limit - rec["seconds"])
        try:
            # After every step (atomically): a run killed outright still leaves what it measured, in a file that
            # parses.
            write_text_atomic(args.out / "gpu_check.json",
                              H.provenance.to_json({"smoke": args.smoke, "steps": records}, record))  # fmt: skip
        except Cut:
            stopped = "the run was cut before it"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"stop starting steps after this many seconds (default {BUDGET_S:.0f}; smoke: none)",
    )
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--steps: unknown {unknown}; expected a subset of {list(STEPS)}")
    if args.budget_s is None:
        args.budget_s = 1e9 if args.smoke else BUDGET_S
    started = time.monotonic()
    deadline = started + args.budget_s - REPORT_RESERVE_S
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in (args.out / LOG, args.out / (LOG + ".gz")):
        stale.unlink(missing_ok=True)
    console = Console(args.out / LOG)
    record = H.start()
    console.write(H.provenance.markdown(record) + "\n")
    limits = SMOKE_LIMITS if args.smoke else LIMITS
    cache_dir = Path(tempfile.mkdtemp(prefix="faast-gpu-check-"))
    env = step_environment(cache_dir, args.smoke)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_cut)
    records: list[dict] = []
    try:
        run_steps(steps, args, limits, deadline, env, console, record, records)
    except Cut as cut:  # outside a step: the steps not recorded yet are marked
        done = {r["step"] for r in records}
        records += [{"step": s, "status": "cut", "seconds": 0.0, "reason": f"{cut} arrived before it"}
                    for s in steps if s not in done]  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # the report is written whatever arrives now
    code = report(args.out, record, records, args.smoke, time.monotonic() - started, cache_dir, console)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
