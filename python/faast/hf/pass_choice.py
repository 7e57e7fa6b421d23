"""The learning pass's precision on a CPU under FaastConfig.learn_dtype='auto', measured on the model's own linears.

The decoder's linears are most of a learning pass (on SmolLM2 with float32 products, 76% of its time went to aten::mm),
so the three ways of running them are timed on the model's own weights: float32 (the model's dtype), bfloat16 (the
pass under torch.autocast) and int8 (faast/hf/int8_pass.py, whose kernel is itself a measured choice,
faast.ops.int8). Each distinct linear shape runs once per sample on SAMPLE_ROWS random rows, repeated in proportion to
how many of the model's linears have it, so the sample weighs the shapes as a pass does. The fastest is cached for the
machine (faast.ops.paths, op learn_pass); FAAST_BACKEND=learn_pass=torch.<mode> pins one.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import paths
from .int8_pass import Int8Pass, Int8Weights

__all__ = ["SAMPLE_ROWS", "learn_pass_mode", "linear_shapes", "sample_plan", "shape_class"]

# Rows per timed product: a pass multiplies batch × window rows (2,048 in the demo), and products of this many rows
# already run at their full rate, while a slow mode (int8 through torch._int_mm on a CPU without VNNI) costs < 1 s.
SAMPLE_ROWS = 256
# A shape is repeated at most this many times per sample, however much more common it is than the rarest one.
MAX_REPEATS = 4


def linear_shapes(backbone: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """The weight [out, in] of one nn.Linear of each distinct shape in the backbone, with how many have that shape,
    most common first."""
    counts: Counter = Counter()
    first: dict[tuple[int, int], torch.Tensor] = {}
    for module in backbone.modules():
        if isinstance(module, nn.Linear):
            shape = (module.in_features, module.out_features)
            counts[shape] += 1
            first.setdefault(shape, module.weight)
    return [(first[shape], n) for shape, n in counts.most_common()]


def shape_class(shapes: list[tuple[torch.Tensor, int]]) -> str:
    """The cache's key for a model's linears: each shape (in x out) with its count."""
    return " ".join(f"{w.shape[1]}x{w.shape[0]}:{n}" for w, n in shapes) + f" rows{SAMPLE_ROWS}"


def sample_plan(shapes: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """(weight, times it runs per sample) for each shape: in proportion to the counts, at most MAX_REPEATS."""
    rarest = min(n for _, n in shapes)
    return [(w, min(MAX_REPEATS, round(n / rarest))) for w, n in shapes]


def learn_pass_mode(
    shapes: list[tuple[torch.Tensor, int]], widest: int, int8_linears: int, device: torch.device
) -> str:
    """'float32', 'bfloat16' or 'int8': the fastest way to run a model's linears (`linear_shapes`: float32 weights,
    on a CPU) on this machine, measured the first time it meets these shapes (module docstring). widest: the widest
    input an int8 pass runs in int8 (the hidden size); int8_linears: how many linears it takes (0: int8 cannot
    run)."""
    options = {"int8_linears": int8_linears}
    if not shapes:  # no nn.Linear to time (GPT-2's Conv1D): FAAST_BACKEND's pin, else float32
        return paths.choose("learn_pass", device, shape_class(shapes), None, options=options)
    plan = sample_plan(shapes)
    rows = {w.shape[1]: torch.randn(SAMPLE_ROWS, w.shape[1], device=device) for w, _ in plan}
    held = Int8Weights()

    def run(mode: str) -> None:
        context: contextlib.AbstractContextManager[object]
        if mode == "bfloat16":
            context = torch.autocast(device.type, dtype=torch.bfloat16)
        elif mode == "int8":
            context = Int8Pass(held, widest)
        else:
            context = contextlib.nullcontext()
        with torch.no_grad(), context:
            for weight, repeats in plan:
                for _ in range(repeats):
                    F.linear(rows[weight.shape[1]], weight)

    with held.kept():
        if paths.current("learn_pass", device, shape_class(shapes), options) is None:
            # One untimed call of each mode first: the int8 kernels' own measured choices and the weights' int8
            # forms are made there, not inside the timing of this choice.
            for mode in paths.runnable("learn_pass", device, options):
                run(mode)
        return paths.choose("learn_pass", device, shape_class(shapes), run, options=options)
