"""The folded residual projection of a memory layer: h = x + x·M in one kernel (M = W·P, folded once per solve).

Layout: x [R, d] (rows = batch·tokens, any strides), M [d, d]; out [R, d] in x's dtype. Products are accumulated in
float32 (float64 when x or M is float64) and the residual is added to the accumulator before the single rounding
to the output dtype, so bf16 in/out costs one rounding, as torch.addmm does. x and M in the same 16-bit dtype take
tensor-core dots (what a bf16 model feeds: M folded in the activations' dtype); a float32 M with 16-bit x keeps float32
products. Tiles are autotuned per (d, dtype path); R is not specialised, so a new batch length does not recompile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import autotuning, interpreting


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BR": 32, "BD": 32, "BK": 32}, num_warps=4, num_stages=1)]
    configs = [
        triton.Config({"BR": 128, "BD": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BR": 128, "BD": 128, "BK": 32}, num_warps=4, num_stages=4),
        triton.Config({"BR": 128, "BD": 64, "BK": 64}, num_warps=4, num_stages=4),
        triton.Config({"BR": 64, "BD": 128, "BK": 64}, num_warps=4, num_stages=4),
        triton.Config({"BR": 64, "BD": 64, "BK": 64}, num_warps=4, num_stages=3),
    ]
    return configs if autotuning() else configs[:1]


def _f64_configs() -> list[triton.Config]:
    return [triton.Config({"BR": 32, "BD": 32, "BK": 16 if not interpreting() else 32}, num_warps=4, num_stages=1)]


@triton.jit(do_not_specialize=["R"])
def _residual_project_kernel(
    X, M, OUT, R, D,
    stride_xr, stride_xd, stride_mk, stride_mn, stride_or, stride_od,
    F64: tl.constexpr, NATIVE_DOT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rows64 = rows.to(tl.int64)
    if F64:
        acc = tl.zeros((BR, BD), dtype=tl.float64)
    else:
        acc = tl.zeros((BR, BD), dtype=tl.float32)
    for start in range(0, D, BK):
        ks = start + tl.arange(0, BK)
        x = tl.load(X + rows64[:, None] * stride_xr + ks[None, :] * stride_xd,
                    mask=(rows[:, None] < R) & (ks[None, :] < D), other=0.0)  # fmt: skip
        m = tl.load(M + ks.to(tl.int64)[:, None] * stride_mk + cols[None, :] * stride_mn,
                    mask=(ks[:, None] < D) & (cols[None, :] < D), other=0.0)  # fmt: skip
        if F64:
            acc += tl.dot(x.to(tl.float64), m.to(tl.float64))
        elif NATIVE_DOT:
            # x and M in the same 16-bit dtype on a GPU: a tensor-core dot, exact products summed in float32.
            acc += tl.dot(x, m)
        else:
            # float32 inputs, mixed dtypes, or the Triton CPU interpreter (which mis-evaluates bf16 dots): the same
            # float32 sums from float32 copies, in IEEE precision (no TF32 rounding of the inputs).
            acc += tl.dot(x.to(tl.float32), m.to(tl.float32), input_precision="ieee")
    inside = (rows[:, None] < R) & (cols[None, :] < D)
    x_res = tl.load(X + rows64[:, None] * stride_xr + cols[None, :] * stride_xd, mask=inside, other=0.0)
    out = acc + x_res.to(acc.dtype)
    tl.store(OUT + rows64[:, None] * stride_or + cols[None, :] * stride_od, out.to(OUT.dtype.element_ty), mask=inside)


def residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """h = x + x @ m for x [R, d] (float16 / bfloat16 / float32 / float64) and m [d, d]; returns [R, d] in x.dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: expected a floating tensor [R, d], got {getattr(x, 'shape', type(x))}")
    R, D = x.shape
    if not isinstance(m, torch.Tensor) or tuple(m.shape) != (D, D) or not m.is_floating_point():
        raise ValueError(f"m: expected a floating tensor [{D}, {D}], got {getattr(m, 'shape', type(m))}")
    if m.device != x.device:
        raise ValueError(f"m: expected device {x.device}, got {m.device}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if R == 0 or D == 0:
        return out
    f64 = x.dtype == torch.float64 or m.dtype == torch.float64
    native = x.dtype == m.dtype and x.dtype in (torch.float16, torch.bfloat16) and not interpreting()

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(R, meta["BR"]), triton.cdiv(D, meta["BD"]))

    _tuned(f64)[grid](x, m, out, R, D, *x.stride(), *m.stride(), *out.stride(), F64=f64, NATIVE_DOT=native)
    return out


@functools.cache
def _tuned(f64: bool):  # noqa: ANN202 - a triton Autotuner
    return triton.autotune(configs=_f64_configs() if f64 else _configs(), key=["D", "F64", "NATIVE_DOT"])(
        _residual_project_kernel
    )


def naive_residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float64 oracle: x + x @ m, [R, d] float64."""
    x64 = x.to(torch.float64)
    return x64 + x64 @ m.to(torch.float64)
