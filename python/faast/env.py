"""Report what faast can use on this machine: ``python -m faast.env [--json]``.

Prints the versions of Python, torch (and the CUDA it was built for), the GPUs torch sees, whether Triton is installed
and whether its CPU interpreter is on, whether the kernels load, the state of the native cuSOLVER extension, and for
every op and device which backend `auto` picks and why the others are skipped. Paste it into bug reports.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable

import torch

from . import __version__
from .ops import _autotune, _dispatch

OPS = (
    "accumulate_gram",
    "eigh",
    "residual_project",
    "mix_probabilities",
    "int8_linear",
    "learn_pass",
    "head_logits",
    "head_pool",
)


def _native_extension() -> str:
    from .ops import _cuda_backend

    error = _cuda_backend.load_error()
    return "loaded: faast._C (torch.ops.faast.batched_eigh)" if error is None else error


def report() -> dict:
    import faast_kernels

    info: dict = {
        "faast": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "triton_installed": faast_kernels.HAS_TRITON,
        "triton_interpreter": faast_kernels.interpreting(),
        "FAAST_BACKEND": _dispatch.requested_backend(),
        "native_extension": _native_extension(),
        "autotune_cache": str(_autotune.cache_path()),
    }
    if faast_kernels.HAS_TRITON:
        try:
            import faast_kernels.ops  # noqa: F401 - registers the custom ops; reports a broken install here
            import triton

            info["triton_version"] = triton.__version__
            info["kernels"] = "loaded"
        except Exception as err:  # noqa: BLE001 - the report shows any load failure verbatim
            info["kernels"] = f"failed to load: {type(err).__name__}: {err}"
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    info["backends"] = {}
    for op in OPS:
        for dev in devices:
            chain = _dispatch.explain(op, torch.device(dev))
            info["backends"][f"{op} on {dev}"] = [{"backend": n, "skipped_because": why} for n, why in chain]
    return info


def _format(info: dict) -> str:
    lines = []
    for key, value in info.items():
        if key == "backends":
            continue
        lines.append(f"{key:20} {value}")
    lines.append("candidates (auto's preference order; those without a reason compete, timed on first use):")
    for target, chain in info["backends"].items():
        parts = [
            f"{c['backend']}" + (f" (skipped: {c['skipped_because']})" if c["skipped_because"] else "") for c in chain
        ]
        lines.append(f"  {target:28} " + " -> ".join(parts))
    return "\n".join(lines)


def report_main(
    prog: str, doc: str, build: Callable[[], dict], text: Callable[[dict], str], argv: list[str] | None
) -> dict:
    """A report's command line (`python -m faast.env`, `python -m faast.hardware`): build() the report, print it as
    text(report) or, with --json, as JSON; with --out STEM also write it as a result record with the run's
    provenance (faast.provenance.write: a JSON and a Markdown file named by STEM). Returns the report."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--out", default=None, help="also write the report and the run's provenance as JSON and Markdown named by STEM"
    )
    args = parser.parse_args(argv)
    record = None
    if args.out:
        from . import provenance

        record = provenance.start(argv=[*prog.split()[1:], *(sys.argv[1:] if argv is None else argv)])
    info = build()
    shown = text(info)
    sys.stdout.write((json.dumps(info, indent=2) if args.json else shown) + "\n")
    if record is not None:
        provenance.write(args.out, record, info, prog, ["```", shown, "```"])
    return info


def main(argv: list[str] | None = None) -> None:
    report_main("python -m faast.env", __doc__, report, _format, argv)


if __name__ == "__main__":
    main()
