"""`python -m faast.hardware [--json]`: the machine, each CPU candidate's measured rate on the default model's shapes
(SmolLM2-135M: 30 blocks of width 576, MLP 1536, keys and values 192 wide, a 49,152-token head; the residual output
layer's key widths 576 and 1152), and what `auto` chose.

The candidates are timed now, on random weights of those shapes (a product's time does not depend on the values),
into a scratch cache, so every figure is from this run. `auto` uses the choice in faast's autotune cache when one is
there (made by an earlier measurement on this machine; it is said when it differs from this run's fastest), and
otherwise this run's, which is then written to the cache: the report also spares the first learn() its measuring.
p·H's pooling is timed on a learning pass's own probabilities, so only its cached choice is shown.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator

import torch

from .. import __version__, hardware
from ..env import report_main
from ..hf import pass_choice
from ..hf.output import head as head_module
from ..ops import _autotune, accumulate_gram, eigh_call, eigh_gram, gram_call
from ..ops.int8 import SAMPLE_ROWS as INT8_ROWS
from ..ops.int8 import Int8Weight, int8_kernel

__all__ = ["DEFAULT_SHAPES", "main", "measure"]

# SmolLM2-135M-Instruct, the embedded default model: (in, out) of its linears with how many of each, and its head.
DEFAULT_SHAPES = {"linears": [((576, 576), 60), ((576, 192), 60), ((576, 1536), 60), ((1536, 576), 30)],
                  "hidden": 576, "vocab": 49152, "key_widths": (576, 1152), "gram_rows": 2048}  # fmt: skip


@contextlib.contextmanager
def _scratch_cache() -> Iterator[None]:
    """Measure into a cache of its own (fresh times), whatever faast's cache holds."""
    saved = os.environ.get(_autotune.CACHE_ENV)
    with tempfile.TemporaryDirectory() as folder:
        os.environ[_autotune.CACHE_ENV] = os.path.join(folder, _autotune.FILE_NAME)
        _autotune.forget_memory()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(_autotune.CACHE_ENV, None)
            else:
                os.environ[_autotune.CACHE_ENV] = saved
            _autotune.forget_memory()


def _choice(op: str, shape_class: str, measure: Callable[[], object], work: float, unit: str) -> dict:
    """Measure `op` (into the scratch cache), then say what auto uses from faast's cache (writing this run's choice
    there when it has none). work: the units of `unit` one timed sample does (its rate is work / seconds)."""
    cpu = torch.device("cpu")
    with _scratch_cache():
        measure()
        fresh = _autotune.entry(cpu, op, shape_class) or {}
    cached = _autotune.entry(cpu, op, shape_class)
    if cached is None and fresh:
        _autotune.store(cpu, op, shape_class, fresh["choice"], fresh["seconds"])
    seconds = fresh.get("seconds", {})
    rates = {name: (work / t if isinstance(t, float) and t > 0 else t) for name, t in seconds.items()}
    return {"op": op, "shape_class": shape_class, "unit": unit, "seconds": seconds, "rates": rates,
            "fastest_now": fresh.get("choice"), "auto": (cached or fresh).get("choice"),
            "from_cache": cached is not None}  # fmt: skip


def measure(shapes: dict = DEFAULT_SHAPES) -> list[dict]:
    """Time every automatic CPU choice on `shapes` (DEFAULT_SHAPES' layout); one dict per choice (`_choice`)."""
    torch.manual_seed(0)
    cpu, hidden, out = torch.device("cpu"), shapes["hidden"], []
    weights = [(torch.randn(o, i) / i**0.5, n) for (i, o), n in shapes["linears"]]
    int8_linears = sum(n for w, n in weights if w.shape[1] <= hidden)
    plan = pass_choice.sample_plan(weights)
    per_token = sum(n for _, n in weights) / sum(r for _, r in plan)  # sample products per model's, per token
    out.append(_choice("learn_pass", pass_choice.shape_class(weights),
                       lambda: pass_choice.learn_pass_mode(weights, hidden, int8_linears, cpu),
                       pass_choice.SAMPLE_ROWS / per_token, "tokens/s through the linears"))  # fmt: skip
    head = torch.randn(shapes["vocab"], hidden) / hidden**0.5
    blocks = shapes["vocab"] / min(shapes["vocab"], head_module.HEAD_SAMPLE_VOCAB)
    out.append(_choice("head_logits", head_module.head_shape_class(head, torch.float32),
                       lambda: head_module.measured_products(head, torch.float32),
                       head_module.HEAD_SAMPLE_ROWS / blocks, "tokens/s through the head"))  # fmt: skip
    for (i, o), _ in shapes["linears"]:
        if i <= hidden:
            weight = Int8Weight(torch.randn(o, i))
            out.append(_choice("int8_linear", f"rows{_autotune.size_class(INT8_ROWS)} k{i} m{_autotune.size_class(o)}",
                               functools.partial(int8_kernel, INT8_ROWS, weight),
                               2 * INT8_ROWS * i * o / 1e9, "GOP/s"))  # fmt: skip
    keys = torch.randn(shapes["gram_rows"], max(shapes["key_widths"]))
    values = torch.randn(shapes["gram_rows"], hidden)
    call = gram_call(keys, values)
    out.append(_choice("accumulate_gram", call.shape_class, lambda: accumulate_gram(keys, values),
                       shapes["gram_rows"], "rows/s"))  # fmt: skip
    for d in shapes["key_widths"]:
        k = torch.randn(4 * d, d, dtype=torch.float64)
        gram = (k.T @ k)[None]
        out.append(_choice("eigh", eigh_call(gram).shape_class, functools.partial(eigh_gram, gram), 1.0,
                           "decompositions/s"))  # fmt: skip
    for products in ("float32", "int8", "bfloat16"):
        shape_class = head_module.pool_shape_class(head, getattr(torch, products))
        found = _autotune.entry(cpu, "head_pool", shape_class)
        if found is not None:
            out.append({"op": "head_pool", "shape_class": shape_class, "unit": "s per block", "seconds":
                        found["seconds"], "rates": {}, "fastest_now": None, "auto": found["choice"],
                        "from_cache": True})  # fmt: skip
    return out


def report(shapes: dict = DEFAULT_SHAPES) -> dict:
    """The machine and `measure`'s choices."""
    return {
        "faast": __version__,
        "torch": torch.__version__,
        "cpu": hardware.cpu_model(),
        "cpu_flags": list(hardware.cpu_flags()),
        "torch_threads": torch.get_num_threads(),
        "cpu_native_bf16": hardware.cpu_has_bf16(),
        "machine_key": hardware.machine_key(),
        "autotune_cache": str(_autotune.cache_path()),
        "pins": os.environ.get("FAAST_BACKEND", "auto"),
        "choices": measure(shapes),
    }


def _rate(value: object, unit: str) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:,.3g} {unit.split()[0]}" if value < 100 else f"{value:,.0f} {unit.split()[0]}"


def format_report(info: dict) -> str:
    lines = [f"machine   {info['cpu']}, {info['torch_threads']} torch threads; flags: {' '.join(info['cpu_flags'])}",
             f"          torch {info['torch']}, faast {info['faast']}; bfloat16 native: {info['cpu_native_bf16']}",
             f"cache     {info['autotune_cache']} (FAAST_BACKEND={info['pins']})",
             "choices on the default model's shapes (each candidate's rate, measured now; auto's pick):"]  # fmt: skip
    for choice in info["choices"]:
        rates = ", ".join(f"{name.removeprefix('torch.')} {_rate(rate, choice['unit'])}"
                          for name, rate in (choice["rates"] or choice["seconds"]).items())  # fmt: skip
        auto = str(choice["auto"]).removeprefix("torch.")
        note = ""
        if choice["from_cache"] and choice["fastest_now"] and choice["fastest_now"] != choice["auto"]:
            note = f" (cached; fastest in this run: {choice['fastest_now'].removeprefix('torch.')})"
        unit = choice["unit"].split(" ", 1)[1] if " " in choice["unit"] else choice["unit"]
        lines.append(f"  {choice['op']:15} {choice['shape_class']}")
        lines.append(f"  {'':15} {unit}: {rates} -> auto: {auto}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """`python -m faast.hardware [--json]`: measure, print, return the report."""
    return report_main("python -m faast.hardware", __doc__, report, format_report, argv)
