"""Where a result came from: the record every benchmark and experiment writes beside its numbers.

    from faast import provenance

    record = provenance.start(root)                            # first thing in the run
    ...                                                        # the measurements
    provenance.write(folder / stem, record, payload, title, body)    # the stem plus .json, and plus .md

`start(root)` returns a flat dict of JSON values:

- ``date``: UTC time at the start, ISO 8601;
- ``git_sha``, ``git_dirty``: HEAD of the checkout at `root`, and whether a tracked file differs from it (untracked
  files do not count). A copy of the tree without ``.git`` (a lent GPU machine) is told them by ``FAAST_GIT_SHA``:
  ``<sha>`` or ``<sha>+dirty``. Both are None when neither is available;
- ``faast``, ``torch``, ``triton``, ``transformers``, ``python``: versions, None where a package is not installed;
- ``device``: the GPU's name when CUDA is available, else ``"cpu"``; ``cpu_model``, ``physical_cores``,
  ``logical_cores``, ``memory_gb``, ``torch_threads``, ``blas``, ``mkl``, ``platform``, ``cpu_native_bf16`` (whether
  the CPU multiplies bfloat16 natively), ``cpu_flags`` (its instruction-set flags that change which kernels run,
  faast.hardware.ISA_FLAGS); with CUDA also ``gpu``,
  ``gpu_capability``, ``gpu_sms``, ``gpu_memory_gb``, ``torch_cuda``, ``nvidia_smi``, ``nvcc``;
- ``cpu_capability``: the vector instruction set torch's CPU kernels dispatch to (e.g. ``"AVX512"``, ``"AVX2"``);
  ``environment``: the variables set for the run that change what it computes or how fast (``FAAST_*``, the
  instruction-set and thread limits of MKL, oneDNN, ATen and OpenMP, ``TRITON_INTERPRET``, ``CUDA_VISIBLE_DEVICES``;
  ENVIRONMENT), by name, so that a run made with a forced backend or a limited instruction set says so;
- ``loadavg_at_start``, ``loadavg_at_end``: the 1-minute load average (None where the OS has none;
  ``loadavg_at_end`` stays None until `finish`);
- ``command``: this process's command line as it was typed (``python -m faast_lab.experiments.lm_domains ...`` for a
  module run, where sys.argv holds the module's file path instead). Results are committed, so it carries no path of
  the machine that wrote them: paths inside `root` are written relative to it, the home folder as ``~``, the
  interpreter by its name.

`write` finishes the record and writes ``<stem>.json`` as ``{"provenance": record, **payload}`` and ``<stem>.md`` as
the title, the `markdown` header block, then the body, each file atomically. Scripts that lay out their own files use
`finish`, `markdown` and `to_json` directly.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .hardware import cpu_flags, cpu_has_bf16, cpu_model

if TYPE_CHECKING:
    import torch

__all__ = [
    "command_line", "environment", "finish", "machine", "markdown", "physical_cores", "relative", "relative_command",
    "start", "to_json", "write",
]  # fmt: skip

VERSIONED = ("faast", "torch", "triton", "transformers")
# Variables recorded when set: those that choose faast's backends or change the arithmetic or speed of the libraries.
ENVIRONMENT = (
    "MKL_ENABLE_INSTRUCTIONS", "MKL_NUM_THREADS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
    "OMP_NUM_THREADS", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip


def start(root: str | os.PathLike | None = None, argv: Sequence[str] | None = None) -> dict:
    """The provenance record at the start of a run (see the module docstring for its fields).

    root: the repository the run comes from (git state; paths in the command line are written relative to it);
        default: the current working directory.
    argv: the command line after the interpreter to record (default: `command_line()`).
    """
    import torch

    root = Path(root if root is not None else Path.cwd()).resolve()
    if not root.is_dir():
        raise ValueError(f"root: expected an existing folder, got {str(root)!r}")
    sha, dirty = git_state(root)
    record = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": sha,
        "git_dirty": dirty,
        **{name: _version(name) for name in VERSIONED},
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu_model": cpu_model(),
        "physical_cores": physical_cores(),
        "logical_cores": os.cpu_count(),
        "memory_gb": round(_memory_bytes() / 1e9, 1),
        "torch_threads": torch.get_num_threads(),
        "blas": _blas(),
        "mkl": bool(torch.backends.mkl.is_available()),
        "platform": platform.platform(),
        "cpu_native_bf16": cpu_has_bf16(),
        "cpu_flags": list(cpu_flags()),
        "cpu_capability": _cpu_capability(),
        "environment": {name: relative(value, root) for name, value in environment().items()},
        "loadavg_at_start": load_average(),
        "loadavg_at_end": None,
        "command": relative_command(command_line() if argv is None else argv, root),
        **_gpu(),
    }
    return record


def environment() -> dict[str, str]:
    """{name: value} of the variables in ENVIRONMENT and every FAAST_* variable that is set (FAAST_GIT_SHA aside:
    git_sha records it), sorted by name."""
    names = {n for n in os.environ if n.startswith("FAAST_") and n != "FAAST_GIT_SHA"} | set(ENVIRONMENT)
    return {n: os.environ[n] for n in sorted(names) if n in os.environ}


def _cpu_capability() -> str | None:
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # a torch without the query
        return None


def finish(record: dict) -> dict:
    """Record the load average at the end of the run (in place; returns the record)."""
    record["loadavg_at_end"] = load_average()
    return record


def markdown(record: dict) -> str:
    """The header block of a Markdown result: bullet lines for the run, versions, device and load, and the
    environment when a recorded variable was set."""
    flag = record.get("git_dirty")
    states: dict[object, str] = {True: " (working tree differs from it)", False: ""}
    dirty = states.get(flag, " (tree state unknown)")
    versions = ", ".join(f"{name} {record.get(name) or 'not installed'}" for name in (*VERSIONED, "python"))
    cores = f"{record.get('physical_cores')} physical / {record.get('logical_cores')} logical cores"
    device = f"CPU {record.get('cpu_model')} ({cores}, {record.get('memory_gb')} GB), {record.get('torch_threads')} "
    device += f"torch threads, BLAS {record.get('blas')} (MKL {'on' if record.get('mkl') else 'off'})"
    bf16 = record.get("cpu_native_bf16")
    if bf16 is not None:  # records written before the field say nothing here
        device += ", multiplies bfloat16 natively" if bf16 else ", no native bfloat16"
    if record.get("cpu_capability"):
        device += f", torch CPU kernels {record['cpu_capability']}"
    if record.get("gpu"):
        device += (
            f"; GPU {record['gpu']} (sm {record.get('gpu_capability')}, {record.get('gpu_sms')} SMs, "
            f"{record.get('gpu_memory_gb')} GB), CUDA {record.get('torch_cuda')}, driver/clocks "
            f"{record.get('nvidia_smi')}, nvcc {record.get('nvcc')}"
        )
    return "\n".join([
        f"- run: {record.get('date')} (UTC), git {record.get('git_sha') or 'unknown'}{dirty}: "
        f"`{record.get('command')}`",
        f"- versions: {versions}",
        f"- device: {device}",
        f"- load average (1 min): {_load(record.get('loadavg_at_start'))} at start, "
        f"{_load(record.get('loadavg_at_end'))} at end",
        *([f"- environment: {' '.join(f'{k}={v}' for k, v in record['environment'].items())}"]
          if record.get("environment") else []),
    ])  # fmt: skip


def to_json(payload: dict, record: dict) -> str:
    """``{"provenance": record, **payload}`` as indented JSON; non-finite floats become null, dataclasses dicts."""
    if "provenance" in payload:
        raise ValueError("payload: expected no key 'provenance' (the record goes there)")
    return json.dumps(_jsonable({"provenance": record, **payload}), indent=2, ensure_ascii=False) + "\n"


def write(
    stem: str | os.PathLike, record: dict, payload: dict, title: str, body: str | Sequence[str] = ""
) -> tuple[Path, Path]:
    """Finish the record and write ``<stem>.json`` and ``<stem>.md`` (folders created, each file atomically).

    The Markdown file is ``# <title>``, the `markdown` header block, then `body` (a string or a list of lines).
    Returns the two paths.
    """
    from .persist import write_text_atomic

    stem = Path(stem)
    if not title or "\n" in title:
        raise ValueError(f"title: expected one non-empty line, got {title!r}")
    finish(record)
    text = body if isinstance(body, str) else "\n".join(body)
    md = f"# {title}\n\n{markdown(record)}\n\n{text.strip(chr(10))}\n"
    json_path, md_path = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
    write_text_atomic(json_path, to_json(payload, record))
    write_text_atomic(md_path, md)
    return json_path, md_path


# ---------------------------------------------------------------------------------------------------- the fields


def git_state(root: Path) -> tuple[str | None, bool | None]:
    """(HEAD's sha, whether a tracked file differs from it) of the checkout at root; FAAST_GIT_SHA overrides both."""
    given = os.environ.get("FAAST_GIT_SHA")
    if given:
        sha, _, flag = given.partition("+")
        return sha, flag == "dirty"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def command_line() -> list[str]:
    """This process's arguments after the interpreter as they were given: sys.orig_argv without its first entry
    (Python 3.10+: the interpreter's options and ``-m package.module`` as typed), else sys.argv (where ``-m`` has
    already become the module's file path)."""
    given = getattr(sys, "orig_argv", None)
    return list(given[1:]) if given else list(sys.argv)


def relative_command(argv: Sequence[str], root: str | os.PathLike) -> str:
    """argv joined by spaces, prefixed by the interpreter's name, each argument through `relative`."""
    return " ".join([Path(sys.executable).name or "python", *(relative(str(a), root) for a in argv)])


def relative(text: str, root: str | os.PathLike) -> str:
    """text with the paths inside root written relative to it (root itself as .) and the home folder as ~."""
    root = str(Path(root).resolve())
    home = str(Path.home())
    text = text.replace(root + os.sep, "")
    text = re.sub(rf"{re.escape(root)}(?=$|[\s=:,])", ".", text)
    if home not in ("", os.sep):
        text = text.replace(home + os.sep, "~" + os.sep)
        text = re.sub(rf"{re.escape(home)}(?=$|[\s=:,])", "~", text)
    return text


def load_average() -> float | None:
    """The 1-minute load average, rounded to 0.01 (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def physical_cores() -> int:
    """Physical cores (not SMT threads): psutil, else unique (physical id, core id) in /proc/cpuinfo, else os."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except ImportError:
        pass
    try:
        cores = set()
        for block in Path("/proc/cpuinfo").read_text().strip().split("\n\n"):
            phys = re.search(r"^physical id\s*:\s*(\d+)", block, re.M)
            core = re.search(r"^core id\s*:\s*(\d+)", block, re.M)
            if phys and core:
                cores.add((phys.group(1), core.group(1)))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


def machine(device: torch.device | str = "cpu") -> str:
    """The processor behind `device` (a torch.device or its name) in one line, to print beside a speed: its name,
    for a CPU the cores and torch threads, and whether it multiplies bfloat16 natively (faast.hardware.native_bf16:
    a CPU without AVX512-BF16 or AMX emulates it, slower than float32)."""
    import torch

    from .hardware import native_bf16

    device = torch.device(device)
    bf16 = "multiplies bfloat16 natively" if native_bf16(device) else "no native bfloat16 (emulated)"
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}, {bf16}"
    if device.type == "cpu":
        return f"CPU {cpu_model()} ({physical_cores()} cores, {torch.get_num_threads()} torch threads), {bf16}"
    return f"{device.type} device, {bf16}"


def _version(name: str) -> str | None:
    if name == "faast":
        from . import __version__

        return __version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _blas() -> str:
    import torch

    found = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


def _gpu() -> dict:
    """The GPU, its driver and the CUDA version in use ({} without a CUDA device)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    out = {
        "gpu": props.name,
        "gpu_capability": f"{props.major}.{props.minor}",
        "gpu_sms": props.multi_processor_count,
        "gpu_memory_gb": round(props.total_memory / 1e9, 1),
        "torch_cuda": torch.version.cuda,
        "nvidia_smi": None,
        "nvcc": None,
    }
    query = ["--query-gpu=driver_version,clocks.sm,clocks.max.sm,power.limit", "--format=csv,noheader"]
    try:
        smi = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
        out["nvcc"] = nvcc.stdout.strip().splitlines()[-1] if nvcc.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return out


def _load(value: object) -> str:
    return "n/a" if value is None else str(value)


def _jsonable(x: object) -> object:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict

        return _jsonable(asdict(cast(Any, x)))  # a dataclass instance: it has __dataclass_fields__
    return x
