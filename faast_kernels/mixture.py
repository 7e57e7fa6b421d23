"""The probability-space read of a residual output memory in one kernel: per row of logits z and their change dz,
out = log((1 − λ)·softmax(z·s) + λ·softmax(z·s + dz)) / s, or log_softmax(z·s + dz) / s on rows where λ = 1.

Layout: z [n, V] (the head's logits, any float dtype, any strides), dz [n, V] (the correction's head products, any
float dtype), log_odds = log(λ / (1 − λ)) and log_rest = log(1 − λ) [n] float32, full [n] bool (λ = 1), s a number
(the model type's logit scale). out [n, V] in z's dtype. One program per row streams the row twice: the first pass
keeps both log-sum-exps online (a running maximum and sum per lane), the second writes
    out = (z·s − lse(z·s) + log(1 − λ) + softplus(dz − c + log_odds)) / s,   c = lse(z·s + dz) − lse(z·s),
in float32. Memory traffic: z and dz read twice, out written once, against about 25 passes over float32 [n, V]
temporaries for the torch composition (python/faast/ops/mixture.py), which is what the kernel is for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting


@triton.jit(do_not_specialize=["V"])
def _mixture_kernel(
    Z, DZ, ODDS, REST, FULL, OUT, V,
    stride_zn, stride_zv, stride_dn, stride_dv, stride_on, stride_ov,
    scale, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    z_row, d_row, o_row = Z + row * stride_zn, DZ + row * stride_dn, OUT + row * stride_on
    # Per-lane running maxima and sums of exp(x − max) for a = z·s and b = a + dz.
    max_a = tl.full((BLOCK,), float("-inf"), tl.float32)
    max_b = tl.full((BLOCK,), float("-inf"), tl.float32)
    sum_a = tl.zeros((BLOCK,), tl.float32)
    sum_b = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        inside = cols < V
        a = tl.load(z_row + cols * stride_zv, mask=inside, other=float("-inf")).to(tl.float32) * scale
        b = a + tl.load(d_row + cols * stride_dv, mask=inside, other=0.0).to(tl.float32)
        new_a = tl.maximum(max_a, a)
        new_b = tl.maximum(max_b, b)
        # A lane that has seen only -inf keeps a zero sum (exp(-inf − 0)), never exp(-inf − -inf) = NaN.
        ref_a = tl.where(new_a == float("-inf"), 0.0, new_a)
        ref_b = tl.where(new_b == float("-inf"), 0.0, new_b)
        sum_a = sum_a * tl.exp(max_a - ref_a) + tl.exp(a - ref_a)
        sum_b = sum_b * tl.exp(max_b - ref_b) + tl.exp(b - ref_b)
        max_a, max_b = new_a, new_b
    top_a = tl.max(max_a, axis=0)
    top_b = tl.max(max_b, axis=0)
    top_a = tl.where(top_a == float("-inf"), 0.0, top_a)
    top_b = tl.where(top_b == float("-inf"), 0.0, top_b)
    lse_a = tl.log(tl.sum(sum_a * tl.exp(max_a - top_a), axis=0)) + top_a
    lse_b = tl.log(tl.sum(sum_b * tl.exp(max_b - top_b), axis=0)) + top_b
    log_odds = tl.load(ODDS + row)
    log_rest = tl.load(REST + row)
    full = tl.load(FULL + row) != 0
    shift = lse_b - lse_a - log_odds
    for start in range(0, V, BLOCK):
        cols = start + lanes
        inside = cols < V
        a = tl.load(z_row + cols * stride_zv, mask=inside, other=0.0).to(tl.float32) * scale
        d = tl.load(d_row + cols * stride_dv, mask=inside, other=0.0).to(tl.float32)
        x = d - shift
        softplus = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))  # stable at both ends
        mixed = tl.where(full, a + d - lse_b, a - lse_a + log_rest + softplus)
        tl.store(o_row + cols * stride_ov, (mixed / scale).to(OUT.dtype.element_ty), mask=inside)


def _block(v: int) -> int:
    if interpreting():
        return 64  # several blocks per row in the small test vocabularies: the loop and the ragged tail run
    return 2048 if v >= 2048 else max(16, triton.next_power_of_2(v))


def mixture_logits(
    z: torch.Tensor,
    dz: torch.Tensor,
    log_odds: torch.Tensor,
    log_rest: torch.Tensor,
    full: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """out [n, V] in z.dtype (module docstring) for z [n, V], dz [n, V], log_odds / log_rest [n] float32 and full
    [n] bool, all on one device; scale a positive finite number."""
    if not isinstance(z, torch.Tensor) or z.dim() != 2 or not z.is_floating_point():
        raise ValueError(f"z: expected a floating tensor [n, V], got {getattr(z, 'shape', type(z))}")
    n, v = z.shape
    if not isinstance(dz, torch.Tensor) or tuple(dz.shape) != (n, v) or not dz.is_floating_point():
        raise ValueError(f"dz: expected a floating tensor [{n}, {v}], got {getattr(dz, 'shape', type(dz))}")
    for name, t, dtype in (("log_odds", log_odds, torch.float32), ("log_rest", log_rest, torch.float32),
                           ("full", full, torch.bool)):  # fmt: skip
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype != dtype:
            raise ValueError(f"{name}: expected a {dtype} tensor [{n}], got {getattr(t, 'shape', type(t))}")
    for name, t in (("dz", dz), ("log_odds", log_odds), ("log_rest", log_rest), ("full", full)):
        if t.device != z.device:
            raise ValueError(f"{name}: expected device {z.device}, got {t.device}")
    out = torch.empty((n, v), dtype=z.dtype, device=z.device)
    if n == 0 or v == 0:
        return out
    odds, rest, flags = log_odds.contiguous(), log_rest.contiguous(), full.to(torch.int8).contiguous()
    _mixture_kernel[(n,)](
        z, dz, odds, rest, flags, out, v, *z.stride(), *dz.stride(), *out.stride(), float(scale),
        BLOCK=_block(v), num_warps=1 if interpreting() else 8,
    )  # fmt: skip
    return out


def naive_mixture_logits(
    z: torch.Tensor,
    dz: torch.Tensor,
    log_odds: torch.Tensor,
    log_rest: torch.Tensor,
    full: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """float64 oracle, from the definition: logaddexp(log(1 − λ) + log_softmax(a), log λ + log_softmax(a + dz)) / s
    with a = z·s and log λ = log_odds + log(1 − λ); log_softmax(a + dz) / s on full rows. [n, V] float64."""
    a = z.to(torch.float64) * scale
    b = a + dz.to(torch.float64)
    rest = log_rest.to(torch.float64)[:, None]
    mixed = torch.logaddexp(rest + torch.log_softmax(a, -1), log_odds.to(torch.float64)[:, None] + rest
                            + torch.log_softmax(b, -1))  # fmt: skip
    return torch.where(full[:, None], torch.log_softmax(b, -1), mixed) / scale
