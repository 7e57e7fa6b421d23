"""torch.library custom ops over the kernels, with fake (meta) implementations and the gradient of the statistics.

    torch.ops.faast_kernels.gram_statistics(keys [L, N, dk], values [L, N, dv], scores [L, N]?, mask [L, N]?,
                                            weighted_least_squares, precision)
        -> (S [L, dk, dk], T [L, dk, dv], ‖Y‖² [L])                      new float64 tensors, differentiable
    torch.ops.faast_kernels.gram_accumulate_(keys, values, scores?, mask?, gram!, cross!, sqnorm!,
                                             weighted_least_squares, precision) -> ()
        adds the batch into float64 accumulators in place (mutates gram, cross, sqnorm; no gradient)
    torch.ops.faast_kernels.residual_project(x [R, d], m [d, d]) -> [R, d]
    torch.ops.faast_kernels.mixture_logits(z [n, V], dz [n, V], log_odds [n], log_rest [n], full [n], scale)
        -> [n, V] in z's dtype: the probability-space read of a residual output memory (no gradient)

Custom ops are opaque to torch.compile, so a compiled module that calls them traces without graph breaks. The
functional statistics are differentiable with respect to values and scores (training a token scorer backpropagates
through T = Kᵀ diag(s) V); keys come from a frozen model and get no gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from . import gram as _gram
from . import mixture as _mixture
from . import residual as _residual


@torch.library.custom_op("faast_kernels::gram_statistics", mutates_args=())
def gram_statistics(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    weighted_least_squares: bool,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gram.gram_accumulate(
        keys, values, scores, mask, weighted_least_squares=weighted_least_squares, precision=precision
    )


@gram_statistics.register_fake
def _(keys, values, scores, mask, weighted_least_squares, precision):  # noqa: ANN001, ANN202
    L, _, dk = keys.shape
    dv = values.shape[-1]
    f64 = torch.float64
    return (
        keys.new_empty((L, dk, dk), dtype=f64),
        keys.new_empty((L, dk, dv), dtype=f64),
        keys.new_empty((L,), dtype=f64),
    )


def _setup_context(ctx: Any, inputs: tuple, output: object) -> None:  # torch.library's setup_context
    keys, values, scores, mask, wls, _ = inputs
    ctx.save_for_backward(keys, values, scores, mask)
    ctx.wls = wls


def _backward(ctx, grad_gram, grad_cross, grad_sqnorm):  # noqa: ANN001, ANN202
    keys, values, scores, mask = ctx.saved_tensors
    if ctx.needs_input_grad[0]:
        raise RuntimeError(
            "keys: faast_kernels.gram_statistics has no gradient for keys (they come from a frozen model)"
        )
    f64 = torch.float64
    k = keys.to(f64)
    v = values.to(f64)
    keep = None if mask is None else mask.bool()
    if keep is not None:
        k = torch.where(keep[..., None], k, 0.0)
        v = torch.where(keep[..., None], v, 0.0)
    kg = k @ grad_cross.to(f64)  # [L, N, dv]: row n is k_n G_T
    g_sq = grad_sqnorm.to(f64)[:, None, None]  # d/dv of Σ w_n ‖v_n‖² is 2 w_n v_n
    s = None if scores is None else scores.to(f64)
    if s is not None and keep is not None:
        s = torch.where(keep, s, 0.0)
    grad_values = grad_scores = None
    if ctx.needs_input_grad[1]:
        if s is None:
            grad_values = kg + 2 * g_sq * v
        else:
            w = s if ctx.wls else s.square()
            grad_values = s[..., None] * kg + 2 * g_sq * w[..., None] * v
        grad_values = grad_values.to(values.dtype)
    if scores is not None and ctx.needs_input_grad[2]:
        vv = v.square().sum(-1)
        ds = (kg * v).sum(-1)  # d<G_T, T>/ds_n = k_n G_T v_nᵀ
        if ctx.wls:  # S = Kᵀ diag(s) K and ‖Y‖² = Σ s‖v‖²
            ds = ds + ((k @ grad_gram.to(f64)) * k).sum(-1) + g_sq[..., 0] * vv
        else:  # ‖Y‖² = Σ s²‖v‖²
            ds = ds + 2 * g_sq[..., 0] * s * vv
        grad_scores = ds.to(scores.dtype)
    return None, grad_values, grad_scores, None, None, None


gram_statistics.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("faast_kernels::gram_accumulate_", mutates_args=("gram", "cross", "sqnorm"))
def gram_accumulate_(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    gram: torch.Tensor,
    cross: torch.Tensor,
    sqnorm: torch.Tensor,
    weighted_least_squares: bool,
    precision: str,
) -> None:
    _gram.gram_accumulate(
        keys, values, scores, mask, gram=gram, cross=cross, sqnorm=sqnorm,
        weighted_least_squares=weighted_least_squares, precision=precision,
    )  # fmt: skip


@gram_accumulate_.register_fake
def _(keys, values, scores, mask, gram, cross, sqnorm, weighted_least_squares, precision):  # noqa: ANN001, ANN202
    return None


@torch.library.custom_op("faast_kernels::residual_project", mutates_args=())
def residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _residual.residual_project(x, m)


@residual_project.register_fake
def _(x, m):  # noqa: ANN001, ANN202
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("faast_kernels::mixture_logits", mutates_args=())
def mixture_logits(
    z: torch.Tensor,
    dz: torch.Tensor,
    log_odds: torch.Tensor,
    log_rest: torch.Tensor,
    full: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return _mixture.mixture_logits(z, dz, log_odds, log_rest, full, scale)


@mixture_logits.register_fake
def _(z, dz, log_odds, log_rest, full, scale):  # noqa: ANN001, ANN202
    return torch.empty(z.shape, dtype=z.dtype, device=z.device)
