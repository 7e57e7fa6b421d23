"""The learning pass's decoder products in int8 on a CPU (FaastConfig.learn_dtype='int8', and what 'auto' takes where
it measured fastest, faast/hf/pass_choice.py): docs/design.md §6.4.

While an `Int8Pass` is active, every torch.nn.functional.linear call (what nn.Linear runs) with a float32 input
[.., k] and a float32 weight [n, k] on the CPU, with k no wider than the model's hidden size and no gradient asked
for, is formed by faast.ops.int8.int8_linear, as int8 head logits are: each input row and each weight row on its own
int8 scale, summed exactly in integers, with the INT8_OUTLIERS input columns largest in magnitude multiplied in float32
(through whichever int8 kernel measured fastest for the shape).
Everything else (norms, attention, the residual stream, the linears with wider inputs) keeps float32, so the states
the hooks capture are float32 tensors as before.

The linears whose input is wider than the hidden size stay float32: on SmolLM2 those are the MLPs' down projections,
whose input (the gated product, 1,536 wide) is heavy-tailed enough that per-row int8 scales lose it. With every
linear in int8 the next-token distribution moved by a KL of 0.006 nats (0.0046 of it from the down projections, whose
inputs' rounding alone gave 0.0042); with them in float32, 0.0015 (bfloat16 autocast: 0.0003), at 1.0 ms per token
against 1.5 for the float32 pass (2,048 asyncio tokens, 2 AMD EPYC cores; docs/design.md §6.4).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..ops.int8 import Int8Input, Int8Weight, int8_linear
from .call_scope import CallScope
from .output import head


class Int8Weights:
    """The int8 forms (faast.ops.int8.Int8Weight) of the weights an int8 pass multiplies. Inside `kept()` (one learn()
    call) each weight is rounded once and reused by every batch, and again after an in-place change; outside it each
    call rounds afresh and keeps nothing."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[tuple, Int8Weight]] = {}
        self.scope = CallScope(self.drop)

    def kept(self) -> contextlib.AbstractContextManager[None]:
        """Hold the int8 forms made inside (one learn() call); free them when the outermost block ends."""
        return self.scope.kept()

    def drop(self) -> None:
        """Free the int8 forms held."""
        self._held.clear()

    def held_bytes(self) -> int:
        """Bytes of the int8 weights and scales kept now."""
        return sum(w.nbytes() for _, w in self._held.values())

    def get(self, weight: torch.Tensor) -> Int8Weight:
        """The int8 forms of `weight` [n, k] float32."""
        if not self.scope.active:
            return Int8Weight(weight.detach())
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        held = self._held.get(id(weight))
        if held is None or held[0] != key:
            held = self._held[id(weight)] = (key, Int8Weight(weight.detach()))
        return held[1]


class Int8Pass(TorchFunctionMode):
    """A torch function mode under which eligible linears (module docstring) run in int8.

    Args:
        weights: where the weights' int8 forms are kept (`Int8Weights`).
        widest: the widest input (the model's hidden size) a linear may have to run in int8.
        outliers: input columns multiplied in float32 (None: faast.hf.output.head.INT8_OUTLIERS, read now).
    """

    def __init__(self, weights: Int8Weights, widest: int, outliers: int | None = None) -> None:
        super().__init__()
        self.weights, self.widest = weights, int(widest)
        self.outliers = head.INT8_OUTLIERS if outliers is None else int(outliers)
        self.calls = 0  # linears formed in int8 while active (tests and diagnostics read it)
        # The last input prepared for int8: a block's q, k and v projections (and gate and up) read the same tensor.
        self._last: Int8Input | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - TorchFunctionMode's
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if self.eligible(x, weight, bias):
                self.calls += 1
                return self.linear(x, weight, bias)
        return func(*args, **kwargs)

    def eligible(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether F.linear(x, weight, bias) runs in int8 here: float32 CPU tensors, a 2-D weight, an input no wider
        than `widest`, at least one row, and no gradient asked for (the int8 products have none)."""
        tensors = [t for t in (x, weight, bias) if t is not None]
        return (
            all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and weight.dim() == 2
            and x.dim() >= 1
            and x.shape[-1] <= self.widest
            and x.numel() > 0
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [.., k] · weightᵀ (+ bias) [.., n] float32 through the int8 products (faast.ops.int8.int8_linear)."""
        rows = x.reshape(-1, x.shape[-1])
        if self._last is None or not self._last.same(rows, self.outliers):
            self._last = Int8Input(rows, self.outliers)
        out = int8_linear(self._last, self.weights.get(weight))
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], weight.shape[0])
