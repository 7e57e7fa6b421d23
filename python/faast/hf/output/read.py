"""How the model reads the residual output layer's correction (docs/design.md §6.3): the keys' extra states
(`key_state`) and, in probability space, the mixture of the base prediction and the corrected one
(`mixed_logits`, which ResidualOutputLayer.read_logits calls with its solution)."""

from __future__ import annotations

import math

import torch

from ..mixture import read_blocks
from ..targets import LMHead
from .bias import with_token_bias
from .head import READ_CHUNK, head_weight

KEY_STATE_EPS = 1e-6  # key_state's guard against an all-zero state
MIX_ROWS = 32  # positions per block of the reading mixture's elementwise passes ([32, V] float32: 6 MB for V = 49K)


def key_state(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., d] (a block's input) scaled to unit root-mean-square per position, in hidden's dtype: the part of
    the residual output layer's keys ResidualOutput.key_layers adds. Normalised like the final norm's output (no
    learned scale), so that the Gram's blocks have comparable scales."""
    x = hidden if hidden.dtype == torch.float64 else hidden.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + KEY_STATE_EPS)).to(hidden.dtype)


def mixed_logits(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    m: torch.Tensor,
    lam: float,
    bias: torch.Tensor | None,
    tokens: torch.Tensor | None,
    head: LMHead,
    *,
    overwrite: bool = False,
) -> torch.Tensor:
    """log((1 − λ)·softmax(z + γu) + λ·softmax(z + γu + (key·M + b)Hᵀ)) / scale for the head's output logits [..., V]
    (z: times the head's logit scale) of the keys hidden [..., d_key] (M's rows' width), M [d_key, d] and λ
    (`ResidualOutputLayer.solution`), the bias b [d] (or None) and the token bias γu [V] (or None) of the same
    solution, and the LM head (weight H [V, d], optional `scale`). Same shape and dtype as logits, computed in float32
    (float64 for float64 logits), differentiable in hidden and logits. overwrite: `logits` is the caller's to reuse
    (mixture.read_blocks)."""
    scale = float(getattr(head, "scale", 1.0))
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    # The logit change goes through the head in the model's own 16-bit dtype, as the head itself does (a float32
    # copy of a 49K-row head per forward, and float32 products, cost more than the model's own head on a GPU).
    head_dtype = hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float16) else compute
    weight = head_weight(head).to(head_dtype)  # the scaled head for a type that scales its logits (ScaledHead)
    rows_h, rows_z = hidden.reshape(-1, hidden.shape[-1]), logits.reshape(-1, logits.shape[-1])
    # On a CPU the mixture's [rows, V] temporaries should stay in cache; on a GPU small blocks only add launches.
    block = READ_CHUNK if hidden.device.type == "cuda" else MIX_ROWS
    odds, rest = (0.0, 0.0) if lam >= 1.0 else (math.log(lam / (1.0 - lam)), math.log1p(-lam))
    change = rows_h.to(m.dtype) @ m
    if bias is not None:
        change += bias
    rows_z = with_token_bias(rows_z, tokens, scale, overwrite)
    out = read_blocks(change, rows_z, weight, compute=compute, scale=scale, log_odds=odds, log_rest=rest,
                      full=lam >= 1.0, chunk=READ_CHUNK, block=block, overwrite=overwrite)  # fmt: skip
    return out.reshape(logits.shape)
