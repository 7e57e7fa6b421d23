"""The residual output layer's two biases: what every corrected position gains besides η·key·W (docs/design.md §6.3).

- The mean-gradient bias β·curvature⁻¹·r̄ [d] (ResidualOutput.bias), in h̃'s space: r̄ = Σ r / N is the mean learned
  gradient, so this is the Newton step on it alone.
- The token bias γ·log((c + κ) / (P + κ)) [V] (ResidualOutput.token_bias), added to the logits: c [V] counts how often
  each token was a learned target and P [V] sums the probability the model gave it over the same positions. A token
  the model predicted as often as the text holds it gets nothing; one it under-predicted is raised by γ times the log
  of the shortfall. It is one iterative-scaling update of a per-token logit bias toward the learned text's token
  counts (the adaptation of a model's marginals known from n-gram models), with κ pseudo-counts on both sides so that
  tokens learned a few times move little. The mean-gradient bias is this bias seen through the head (r̄ = Hᵀ(c − P)/N),
  squeezed into d dimensions; the token bias keeps all V.

Both are sums the layer already keeps or keeps beside them (gradient_sum, target_count, token_mass), so they add,
subtract and merge with the statistics, and both need every learned position covered: statistics loaded from a file
written before a sum was kept read without that bias, and the layer says why. κ is the layer's OutputPolicy's
token_prior; γ applies from the first learned position (the κ pseudo-counts already keep a few counts from moving it).
"""

from __future__ import annotations

import torch

from ...accumulator import Accumulator
from .policy import DEFAULT_POLICY, OutputPolicy


def covers(sums: Accumulator, count: float) -> str | None:
    """None when `sums` covers all `count` learned positions, else how many it covers (a file written before it was
    kept): '<covered> of <count> positions (saved before it was kept)'."""
    covered = float(sums.count)
    if abs(covered - count) > 1e-9 * count:
        return f"{covered:.0f} of {count:.0f} positions (saved before it was kept)"
    return None


def mean_gradient(beta: float, gradient_sum: Accumulator, count: float, curvature: torch.Tensor) -> tuple:
    """(β·curvature⁻¹·r̄ [d] float64 or None, why it is None): r̄ = gradient_sum's `gradient` / count, curvature [d, d]
    float64 (the damped one)."""
    if beta <= 0.0:
        return None, "ResidualOutput.bias is 0"
    short = covers(gradient_sum, count)
    if short is not None:
        return None, f"the gradient sum covers {short}"
    mean = gradient_sum.sums()["gradient"].to(curvature.device) / count
    return beta * torch.linalg.solve(curvature, mean), None


def token_log_ratio(
    targets: torch.Tensor, mass: torch.Tensor, prior: float = DEFAULT_POLICY.token_prior
) -> torch.Tensor:
    """log((c + κ) / (P + κ)) [V] float64 for the learned targets' counts c [V] and the summed probabilities P [V]."""
    return torch.log((targets.double() + prior) / (mass.double() + prior))


def token_bias(
    gamma: float,
    target_count: Accumulator,
    token_mass: Accumulator,
    count: float,
    policy: OutputPolicy = DEFAULT_POLICY,
) -> tuple:
    """(γ·log((c + κ) / (P + κ)) [V] float64 or None, why it is None): c = target_count's `targets`, P = token_mass's
    `probability`, both over the `count` learned positions, κ = policy.token_prior."""
    if gamma <= 0.0:
        return None, "ResidualOutput.token_bias is 0"
    for name, sums in (("token counts", target_count), ("token mass", token_mass)):
        short = covers(sums, count)
        if short is not None:
            return None, f"the {name} cover {short}"
    counts, mass = target_count.sums()["targets"], token_mass.sums()["probability"]
    return gamma * token_log_ratio(counts, mass, policy.token_prior), None


def with_token_bias(logits: torch.Tensor, tokens: torch.Tensor | None, scale: float, overwrite: bool) -> torch.Tensor:
    """logits [n, V] + tokens [V] / scale (the token bias in the head's output units; tokens [B, 1, V], one per row,
    broadcast over logits [B, T, V]), in logits' dtype: in place when the caller owns them (overwrite) and they are
    contiguous, else a new tensor; logits themselves when tokens is None."""
    if tokens is None:
        return logits
    shift = (tokens if scale == 1.0 else tokens / scale).to(logits.dtype)
    if overwrite and logits.is_contiguous():
        return logits.add_(shift)
    return logits + shift
