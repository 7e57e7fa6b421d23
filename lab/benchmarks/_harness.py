"""Shared helpers for the faast benchmarks: timing, memory measurement, result files with their provenance.

Provenance: every result file carries the record of faast.provenance (`start()` at the start of the run, `write()` at
its end), the same record the experiments write.

Timing: `time_cases` runs one warm-up of every case, then `reps` rounds in which every case runs once, in turn
(interleaved), so that load from other processes on a shared machine hits the competitors alike. Each case is a
(setup, fn) pair: setup runs untimed before every call and its return value is passed to fn.

Peak memory: `run_isolated` runs a function in a fresh spawned interpreter. Inside it, `MemoryProbe` takes the RSS
right before the measured work and reports two peaks above it:

* ``ru_maxrss`` (getrusage RUSAGE_SELF) minus that RSS. Caveat measured on Linux: a spawned child inherits the
  parent's high-water RSS in ru_maxrss (the exec records the old mm's peak), so this is only meaningful when the
  parent is small; benchmarks should take their memory measurements before they allocate large inputs.
* ``VmHWM`` after resetting it with /proc/self/clear_refs (Linux >= 4.0): the child's own high-water mark since
  the reset, immune to that inheritance. Preferred where available.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import math
import multiprocessing as mp
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from faast import provenance

#: The checkout the lab is installed from (editable, lab/pyproject.toml): provenance reads its git state.
REPO = Path(__file__).resolve().parents[2]
#: Where the benchmarks write their result files by default (lab/benchmarks/results).
RESULTS = Path(__file__).resolve().parent / "results"
MB = float(1 << 20)

# ---------------------------------------------------------------------------------------------------- provenance
# Every result carries faast.provenance's record (git sha and dirty flag, versions, device, load at start and end,
# the repository-relative command line, UTC time): `record = start()` first, then `write(stem, record, payload, title,
# body)`, or `provenance.finish` / `provenance.to_json` / `provenance.markdown` for a script's own file layout.


def checkout_tests_module(name: str) -> ModuleType:
    """tests/<name>.py of the checkout (REPO), loaded from its file: a benchmark that measures against the tests'
    own cases or tolerances (tests/spectra.py, tests/tolerances.py) reads them there rather than keeping a copy. The
    test helpers are not a package, so they are loaded by path; loaded once per process (kept in sys.modules under
    `faast_lab_tests.<name>`)."""
    key = f"faast_lab_tests.{name}"
    if key in sys.modules:
        return sys.modules[key]
    path = REPO / "tests" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"checkout_tests_module: no tests/{name}.py in {REPO} (the lab runs from a checkout)")
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def start() -> dict:
    """faast.provenance's record for a run of this repository's code (see its docstring for the fields)."""
    return provenance.start(REPO)


def gated(op: str, candidate: str, call: object) -> str | None:
    """Why faast's auto keeps `candidate` (a backend or backend.variant name) out of `call` (a faast.ops.backends.Call)
    on a GPU, as the note a skipped case records ("auto's gate: ... (--all-cases runs it)"), None when it
    competes there. The gates cite the GPU runs that measured the candidate failing to
    compile or losing, so a benchmark on a lent GPU skips such a case unless asked for every case (--all-cases) and
    spends its minutes on the rest. Off a CUDA device nothing is gated here: smoke runs exercise every case."""
    if call.device.type != "cuda":
        return None
    from faast.ops import backends

    reason = dict(backends.explain(op, call.device, call)).get(candidate)
    return None if reason is None else f"auto's gate: {reason} (--all-cases runs it)"


def write(stem: Path, record: dict, payload: dict, title: str, body: str | Sequence[str]) -> None:
    """<stem>.json ({"provenance": record, **payload}) and <stem>.md (title, header block, body)."""
    provenance.write(stem, record, payload, title, body)


def steps(total: int, what: str):  # noqa: ANN201 - a tqdm bar
    """A progress bar over `total` steps of long work, with the rate and the time left, on stderr; off when stderr is
    not a terminal (a log or a pipe gets no bar)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=what, unit="step", disable=not sys.stderr.isatty(), file=sys.stderr)


def set_threads(n: int | None = None) -> int:
    """torch.set_num_threads(n or the physical core count); returns the count in use."""
    import torch

    n = n or provenance.physical_cores()
    torch.set_num_threads(n)
    return torch.get_num_threads()


# ---------------------------------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Seconds of the timed repetitions (warm-ups excluded), and the CPU cores other processes used during each."""

    samples: list[float] = field(default_factory=list)
    foreign: list[float] = field(default_factory=list)
    rejected: list[tuple[float, float]] = field(default_factory=list)  # (seconds, foreign cores), timed again

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile, q in [0, 1]."""
        if not self.samples:
            return math.nan
        s = sorted(self.samples)
        pos = q * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def p20(self) -> float:
        return self.quantile(0.2)

    @property
    def p80(self) -> float:
        return self.quantile(0.8)

    def summary(self) -> dict:
        return {
            "median_s": self.median,
            "p20_s": self.p20,
            "p80_s": self.p80,
            "min_s": min(self.samples) if self.samples else math.nan,
            "reps": len(self.samples),
            "samples_s": self.samples,
            "foreign_cores": self.foreign,
            "rejected": self.rejected,
        }


def _busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds all processes spent busy, CPU seconds this process spent), from /proc/stat; None elsewhere."""
    try:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(vals) - vals[3] - vals[4]  # minus idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


class ForeignLoad:
    """CPU cores used by other processes between start() and cores(): contention on a shared machine.

    /proc/stat counts in 10 ms ticks, so readings over calls shorter than ~0.2 s are coarse.
    """

    def start(self) -> None:
        self._t, self._b = time.perf_counter(), _busy_seconds()

    def cores(self) -> float:
        b = _busy_seconds()
        wall = time.perf_counter() - self._t
        if b is None or self._b is None or wall <= 0:
            return math.nan
        return max(0.0, ((b[0] - self._b[0]) - (b[1] - self._b[1])) / wall)


def wait_for_quiet(max_cores: float = 0.3, window_s: float = 0.1, timeout_s: float = 60.0) -> float:
    """Wait (up to timeout_s) until other processes use less than max_cores; returns the seconds waited."""
    t0 = time.perf_counter()
    probe = ForeignLoad()
    while True:
        probe.start()
        time.sleep(window_s)
        if probe.cores() < max_cores or time.perf_counter() - t0 > timeout_s:
            return time.perf_counter() - t0


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_once(fn: Callable[[object], object], arg: object = None) -> tuple[float, object]:
    _sync()
    t0 = time.perf_counter()
    out = fn(arg)
    _sync()
    return time.perf_counter() - t0, out


Case = tuple[Callable[[], object] | None, Callable[[object], object]]


# Quiet gate of time_cases: before a timed call, wait until other processes use < max_cores, at most timeout_s per
# call and budget_s in all. A call of >= reject_min_s during which they used > reject_cores is timed again (at most
# retries times per sample): with as many threads as cores, an OpenMP team that loses a core to another process runs
# several times slower, which would measure the neighbours rather than the code.
QUIET = {
    "enabled": True, "max_cores": 0.3, "timeout_s": 30.0, "budget_s": 300.0, "waited_s": 0.0,
    "reject_cores": 0.5, "reject_min_s": 0.1, "retries": 2,
}  # fmt: skip


def time_cases(cases: dict[str, Case], reps: int, warmup: int = 1) -> dict[str, Timing]:
    """Interleaved timing: warm-up rounds, then `reps` rounds each running every case once in turn.

    Each case is (setup, fn): setup() runs untimed before each call (None: fn gets None) and fn(setup()) is timed.
    Results are dropped and garbage collected between calls, outside the timed region. Before each timed call it
    waits (bounded) for other processes to go quiet (QUIET), and records the cores they used during the call.
    """
    timings = {name: Timing() for name in cases}
    load = ForeignLoad()
    for rnd in range(warmup + reps):
        for name, (setup, fn) in cases.items():
            timed = rnd >= warmup
            for attempt in range(1 + (QUIET["retries"] if timed and QUIET["enabled"] else 0)):
                arg = setup() if setup is not None else None
                gc.collect()
                left = QUIET["budget_s"] - QUIET["waited_s"]
                if QUIET["enabled"] and timed and left > 0:
                    QUIET["waited_s"] += wait_for_quiet(QUIET["max_cores"], timeout_s=min(QUIET["timeout_s"], left))
                load.start()
                seconds, out = time_once(fn, arg)
                foreign = load.cores()
                del out, arg
                if not timed:
                    break
                noisy = seconds >= QUIET["reject_min_s"] and foreign > QUIET["reject_cores"]
                if noisy and QUIET["enabled"] and attempt < QUIET["retries"]:
                    timings[name].rejected.append((seconds, foreign))
                    continue
                timings[name].samples.append(seconds)
                timings[name].foreign.append(foreign)
                break
    gc.collect()
    return timings


# ---------------------------------------------------------------------------------------------------- memory


def current_rss() -> int:
    """Resident set size of this process now, in bytes."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def ru_maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _vm_hwm() -> int | None:
    try:
        m = re.search(r"^VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Return free heap pages to the OS (glibc), so that the baseline RSS is the live set, not allocator slack."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemoryProbe:
    """Peak resident memory above the RSS at `start()`; use in a fresh process (see module docstring)."""

    def start(self) -> None:
        gc.collect()
        _malloc_trim()
        self.hwm_reset = _reset_hwm()
        self.baseline = current_rss()

    def stop(self) -> dict:
        hwm = _vm_hwm() if self.hwm_reset else None
        return {
            "baseline_rss_mb": self.baseline / MB,
            "peak_ru_maxrss_mb": (ru_maxrss_bytes() - self.baseline) / MB,
            "peak_vmhwm_mb": None if hwm is None else (hwm - self.baseline) / MB,
        }


def _isolated_entry(conn, fn, args, kwargs) -> None:  # noqa: ANN001
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as exc:  # report, don't hang the parent
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


# glibc's mmap threshold grows dynamically to the largest freed block (up to 32 MB), after which large temporaries come
# from the heap and fragment it: RSS then creeps up with the number of batches although the live set does not. Fixing
# the threshold makes freed blocks go back to the OS, so peak RSS measures what the code holds, not allocator policy.
FIXED_MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ updated with `values` for the block, each variable restored (or removed) afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_isolated(fn: Callable, *args: object, env: dict[str, str] | None = None, **kwargs: object) -> object:
    """fn(*args, **kwargs) in a fresh spawned interpreter (fn must be importable); returns its picklable result.

    env: extra environment variables for the child (read at its start, e.g. glibc's MALLOC_* tunables).
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_isolated_entry, args=(child, fn, args, kwargs))
    with environ(env or {}):
        proc.start()
    child.close()
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"isolated run of {fn.__name__} died with exit code {proc.exitcode}") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"isolated run of {fn.__name__} failed:\n{payload}")
    return payload


# ---------------------------------------------------------------------------------------------------- output


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def fmt_s(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.3f}" if x >= 0.01 else f"{x * 1e3:.2f} ms"


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1f}×"


def fmt_sci(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1e}"


def slug(text: str) -> str:
    """A file-name-safe lower-case form of a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
