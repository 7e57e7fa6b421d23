"""torch.library custom ops over the kernels, with fake (meta) implementations and the gradient of the statistics.

    torch.ops.faast_kernels.gram_statistics(keys [L, N, dk], values [L, N, dv], scores [L, N]?, mask [L, N]?,
                                            weighted_least_squares, precision) -> (S [L, dk, dk], T [L, dk, dv])
    torch.ops.faast_kernels.residual_project(x [R, d], m [d, d]) -> [R, d]

Custom ops are opaque to torch.compile, so a compiled module that calls them traces without graph breaks. The
statistics are differentiable with respect to values and scores (training a token scorer backpropagates through
T = Kᵀ diag(s) V); keys come from a frozen model and get no gradient.
"""

from __future__ import annotations

import torch

from . import gram as _gram
from . import residual as _residual


@torch.library.custom_op("faast_kernels::gram_statistics", mutates_args=())
def gram_statistics(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor | None,
    weighted_least_squares: bool,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gram.gram_accumulate(
        keys, values, scores, mask, weighted_least_squares=weighted_least_squares, precision=precision
    )


@gram_statistics.register_fake
def _(keys, values, scores, mask, weighted_least_squares, precision):  # noqa: ANN001, ANN202
    L, _, dk = keys.shape
    dv = values.shape[-1]
    return keys.new_empty((L, dk, dk), dtype=torch.float64), keys.new_empty((L, dk, dv), dtype=torch.float64)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    keys, values, scores, mask, wls, _ = inputs
    ctx.save_for_backward(keys, values, scores, mask)
    ctx.wls = wls


def _backward(ctx, grad_gram, grad_cross):  # noqa: ANN001, ANN202
    keys, values, scores, mask = ctx.saved_tensors
    if ctx.needs_input_grad[0]:
        raise RuntimeError(
            "keys: faast_kernels.gram_statistics has no gradient for keys (they come from a frozen model)"
        )
    k = keys.to(torch.float64)
    v = values.to(torch.float64)
    keep = None if mask is None else mask.bool()
    if keep is not None:
        k = torch.where(keep[..., None], k, 0.0)
        v = torch.where(keep[..., None], v, 0.0)
    kg = k @ grad_cross.to(torch.float64)  # [L, N, dv]: row n is k_n G_T
    s = None if scores is None else scores.to(torch.float64)
    if s is not None and keep is not None:
        s = torch.where(keep, s, 0.0)
    grad_values = grad_scores = None
    if ctx.needs_input_grad[1]:
        grad_values = (kg if s is None else s[..., None] * kg).to(values.dtype)
    if scores is not None and ctx.needs_input_grad[2]:
        ds = (kg * v).sum(-1)  # d<G_T, T>/ds_n = k_n G_T v_nᵀ
        if ctx.wls:  # S = Kᵀ diag(s) K as well
            ds = ds + ((k @ grad_gram.to(torch.float64)) * k).sum(-1)
        grad_scores = ds.to(scores.dtype)
    return None, grad_values, grad_scores, None, None, None


gram_statistics.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("faast_kernels::residual_project", mutates_args=())
def residual_project(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _residual.residual_project(x, m)


@residual_project.register_fake
def _(x, m):  # noqa: ANN001, ANN202
    return torch.empty_like(x, memory_format=torch.contiguous_format)
