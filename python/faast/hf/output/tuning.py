"""How the residual output layer chooses its step η and mixture weight λ on the held-out tail of the learned text
(docs/design.md §6.3); the tail buffer it is tuned on is faast/hf/held_out.py.

The last OutputPolicy.held_out_share of the learned positions (at most `tune_tokens`) are held out; the layer fits its
correction on the rest (statistics subtract exactly) and hands the held-out positions' logits here as `Logits`: z0
[n, V] the base logits, z1 [n, V] their change per unit step, and both at the targets [n]. The functions below
minimise the held-out NLL of (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1): in logit space (λ = 1) it is convex in η (a
safeguarded 1-D Newton search, `tune_step`); in probability space it is convex in λ for each η (bisection), and η is
searched on a geometric grid refined by golden section (`tune_mixture`, `golden_section`). A mixture is used only when
its gain is significant. Every threshold and iteration count comes from the `policy` argument (an OutputPolicy;
default the shipped one), which the layer passes as its own.

Public: `golden_section(f, low, high, iterations)`, the golden-section minimisation of a unimodal function on an
interval that `tune_mixture` refines log η with (lab/experiments/lm_step_probe.py uses it too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .policy import DEFAULT_POLICY, OutputPolicy

# The held-out logits the layer computes: (z0 [n, V] float32, z1 [n, V] float32 or bfloat16 (the head products'
# dtype, ResidualOutputLayer.change_weight), z0 and z1 at the targets [n] float32).
Logits = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_MOMENT_ROWS = 64  # rows per block of `_moments` (64 × 49,152 float32: 12.6 MB, within a server CPU's cache)


def _moments(z0: torch.Tensor, z1: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits z = z0 + η·z1 [n, V]: (logsumexp z, E_p[z1], E_p[z1²]) [n] in z0's dtype with p = softmax(z).
    One exponential per entry (the softmax's unnormalised weights give the logsumexp too), the expectations as
    vecdot's fused row products, in blocks of _MOMENT_ROWS rows in one reused buffer that stays in cache (timings:
    docs/design.md §6.3). A z1 in another dtype (bfloat16) is widened block by block into a second such buffer."""
    out = []
    shape = (min(_MOMENT_ROWS, z0.shape[0]), z0.shape[1])
    buffer = torch.empty(shape, dtype=z0.dtype, device=z0.device)
    wide = None if z1.dtype == z0.dtype else torch.empty(shape, dtype=z0.dtype, device=z0.device)
    for a, b in zip(z0.split(_MOMENT_ROWS), z1.split(_MOMENT_ROWS), strict=True):
        b = b if wide is None else wide[: b.shape[0]].copy_(b)
        z = torch.add(a, b, alpha=eta, out=buffer[: a.shape[0]])
        top = z.amax(-1)
        w = z.sub_(top[:, None]).exp_()
        total = w.sum(-1)
        m1 = torch.linalg.vecdot(w, b)
        m2 = torch.linalg.vecdot(w.mul_(b), b)
        out.append((top + total.log(), m1 / total, m2 / total))
    logsumexp, mean, square = (torch.cat(parts) for parts in zip(*out, strict=True))
    return logsumexp, mean, square


def row_logsumexp(z0: torch.Tensor, z1: torch.Tensor | None = None, eta: float = 0.0) -> torch.Tensor:
    """logsumexp of each row of z0 + η·z1 [n, V] (z0 alone when z1 is None; z1 in z0's dtype or bfloat16): [n], in
    z0's dtype, as `_moments` takes it: 1.5–2.7× faster than torch.logsumexp over blocks of 512 rows (2048 × 49,152
    logits, 2 AMD EPYC cores)."""
    out = []
    buffer = torch.empty((min(_MOMENT_ROWS, z0.shape[0]), z0.shape[1]), dtype=z0.dtype, device=z0.device)
    for i, a in enumerate(z0.split(_MOMENT_ROWS)):
        z = buffer[: a.shape[0]]
        if z1 is None:
            top = a.amax(-1)
            torch.sub(a, top[:, None], out=z)
        else:
            torch.add(a, z1[i * _MOMENT_ROWS : i * _MOMENT_ROWS + a.shape[0]], alpha=eta, out=z)
            top = z.amax(-1)
            z.sub_(top[:, None])
        out.append(top + z.exp_().sum(-1).log())
    return torch.cat(out) if out else z0.new_zeros(0)


def log_targets(
    z0: torch.Tensor, z1: torch.Tensor, target0: torch.Tensor, target1: torch.Tensor, eta: float
) -> torch.Tensor:
    """log softmax(z0 + η·z1) at the targets [n] float64, for logits z0, z1 [n, V] and their entries at the targets
    target0, target1 [n] (`row_logsumexp`)."""
    return (target0 + eta * target1 - row_logsumexp(z0, z1, eta)).double()


def significant(
    log_base: torch.Tensor, log_memory: torch.Tensor, lam: float, policy: OutputPolicy = DEFAULT_POLICY
) -> bool:
    """Whether mixing in log_memory with weight λ raises the mean log-likelihood of log_base [n] by more than
    policy.min_gain_se standard errors of the gain per position: a sharp correction mixed in with a small weight
    raises the held-out likelihood of random text a little, by chance."""
    gain = log_mixture(log_base, log_memory, lam) - log_base
    return float(gain.mean()) > policy.min_gain_se * float(gain.std()) / math.sqrt(gain.numel())


def best_weight(log_base: torch.Tensor, log_memory: torch.Tensor, policy: OutputPolicy = DEFAULT_POLICY) -> float:
    """argmin over λ in [0, 1] of −mean log((1 − λ)·a + λ·b), a = exp(log_base), b = exp(log_memory) [n] float64:
    convex in λ, so policy.weight_iterations bisections of the derivative −mean((b − a) / mix)."""

    def slope(lam: float) -> float:
        log_mix = log_mixture(log_base, log_memory, lam)
        return float(((log_base - log_mix).exp() - (log_memory - log_mix).exp()).mean())

    if slope(0.0) >= 0.0:
        return 0.0
    if slope(1.0) <= 0.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(policy.weight_iterations):
        mid = 0.5 * (low + high)
        low, high = (low, mid) if slope(mid) > 0.0 else (mid, high)
    return 0.5 * (low + high)


def log_mixture(log_base: torch.Tensor, log_memory: torch.Tensor, lam: float) -> torch.Tensor:
    """log((1 − λ)·exp(log_base) + λ·exp(log_memory)), elementwise."""
    if lam <= 0.0:
        return log_base
    if lam >= 1.0:
        return log_memory
    return torch.logaddexp(log_base + math.log1p(-lam), log_memory + math.log(lam))


def mixture_nll(log_base: torch.Tensor, log_memory: torch.Tensor, lam: float) -> float:
    return float(-log_mixture(log_base, log_memory, lam).mean())


def tune_step(
    logits: Logits, weight: float = 1.0, policy: OutputPolicy = DEFAULT_POLICY
) -> tuple[float, list[tuple[float, float]]]:
    """The step η >= 0 minimising the mean NLL of targets ys [n] under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1)
    (λ = weight; at 1, the logits z0 + η·z1), z1 the logits' change for the correction keys·w. A safeguarded
    1-D Newton iteration from η = 0, each pass giving the NLL and its first two derivatives in η: at λ = 1 the NLL
    is convex in η; a mixture's need not be, and the bracket from the derivative's sign keeps the iteration on
    the minimum it starts towards. A mixture's η is 0 unless it helps (`significant`). Returns (η, [(η_i, NLL_i)
    per iteration]). logits: the held-out logits (`Logits`)."""
    eta, trace, _ = tune_step_rows(logits, weight, policy=policy)
    return eta, trace


def tune_step_rows(
    logits: Logits,
    weight: float = 1.0,
    log_base: torch.Tensor | None = None,
    start: float = 0.0,
    sampled: bool = False,
    policy: OutputPolicy = DEFAULT_POLICY,
) -> tuple[float, list[tuple[float, float]], StepRows]:
    """`tune_step`, also returning the rows' state at the step the search ended on (before the significance test
    may set η to 0): what `diagnose` and the key width's choice read without another pass over the [n, V] logits.
    log_base: log softmax(z0) at the targets [n] float64 (`base_log_targets`), when already computed. start: the
    first point of the search (e.g. the step the narrower keys took: the wider keys' is near it, so the search takes
    fewer passes); from a start above 0 a minimum at 0 is approached by the bracket and cut by the significance
    test. With policy.search_sample_min_rows rows or more the search first runs on every
    policy.search_sample_stride-th row, and its best point starts the search on all of them: that one then ends in
    1–3 passes over the [n, V] logits, and the result is the full rows' minimum as before (within policy.step_tol).
    sampled: `start` is already a sample's best point (the key width's choice searched one): no sampled search first.
    The trace is the full rows' search."""
    if log_base is None:
        log_base = base_log_targets(logits)
    if logits[0].shape[0] >= policy.search_sample_min_rows and not sampled:
        pick = slice(None, None, policy.search_sample_stride)
        z0, z1, target0, target1 = (part[pick] for part in logits)
        _, sample_trace, _ = _search((z0, z1, target0, target1), weight, log_base[pick], start, policy)
        start = min(sample_trace, key=lambda point: point[1])[0]
    eta, trace, rows = _search(logits, weight, log_base, start, policy)
    if weight < 1.0 and eta > 0.0 and not significant(log_base, rows.log_memory, weight, policy):
        eta = 0.0
    return eta, trace, rows


def tune_width(
    logits: Logits,
    log_base: torch.Tensor,
    step: float | None,
    weight: float | None,
    start: float = 0.0,
    compare: bool = True,
    sampled: bool = False,
    policy: OutputPolicy = DEFAULT_POLICY,
) -> tuple[float, float, float, list, StepRows | None]:
    """One key width's tuning on these held-out rows: (the held-out NLL it would read, η, λ, the search's trace, the
    rows at η or None). weight None ('auto'): η and λ together (`tune_mixture`, η held at `step` when not None); else
    η for that weight from `start` (`tune_step_rows`). log_base: `base_log_targets` of the rows. compare False: the
    NLL is not needed (no other width to compare with) and is 0 where it would take another pass. sampled: `start` is
    a sample's best step (`tune_step_rows`)."""
    if weight is None:
        eta, lam, trace = tune_mixture(logits, step, policy=policy)
        if not compare:
            return 0.0, eta, lam, trace, None
        if eta <= 0 or lam <= 0:
            return float(-log_base.mean()), eta, lam, trace, None
        return mixture_nll(log_base, log_targets(*logits, eta), lam), eta, lam, trace, None
    eta, trace, rows = tune_step_rows(logits, weight, log_base, start, sampled, policy)
    nll = float(-log_base.mean()) if eta <= 0 else float(-log_mixture(log_base, rows.log_memory, weight).mean())
    return nll, eta, weight, trace, rows


def sample_first(n: int, device: torch.device, policy: OutputPolicy = DEFAULT_POLICY) -> tuple[torch.Tensor, int]:
    """(an order [n] int64 of n rows with every policy.search_sample_stride-th row first, how many those are): the
    sample a choice is made on comes first, so that its [rows, V] products are the leading rows of the full ones."""
    stride = policy.search_sample_stride
    index = torch.arange(n, device=device)
    picked = index[::stride]
    return torch.cat([picked, index[index % stride != 0]]), picked.numel()


def _search(
    logits: Logits, weight: float, log_base: torch.Tensor, start: float, policy: OutputPolicy
) -> tuple[float, list[tuple[float, float]], StepRows]:
    """The safeguarded 1-D Newton search of `tune_step_rows` on these rows, from `start`: (the last point η, [(η_i,
    NLL_i)], the rows at η), with no significance test.

    Each pass gives the NLL and its first two derivatives in η. The derivative's sign brackets the minimum. A Newton
    step that leaves the bracket (the mixture's curvature in η can be tiny, even negative, far from the minimum: from
    η = 0 its step overshot to the top of the range and then halved its way down, 7–8 passes on SmolLM2's held-out
    logits) is replaced by the step of the Gauss-Newton part of the curvature (λ·p_y/mixture · Var_p(z1), never
    below the full curvature, so a shorter step), else by bisection: geometric once the bracket's low end is above
    0 (the step's scale is unknown). In logit space (λ = 1) both curvatures are Var_p(z1)."""
    max_step, tol = policy.max_step, policy.step_tol
    eta, low, high, trace = min(max(float(start), 0.0), max_step), 0.0, max_step, []
    rows: StepRows | None = None
    for _ in range(policy.step_iterations):
        rows = step_rows(logits, eta)
        nll, grad, gauss_newton, curv = derivatives(rows, weight, log_base)
        trace.append((eta, nll))
        if eta == 0.0 and grad >= 0:  # convex and rising from 0: no step helps
            break
        if grad > 0:
            high = eta
        else:
            low = eta
        new = eta - grad / curv if curv > 0 else float("inf")
        if new <= low == 0.0 and not any(point == 0.0 for point, _ in trace):
            new = 0.0  # from a start above 0, a minimum at 0 itself is tested rather than approached
        elif not low < new < high:
            new = _fallback_step(eta, grad, gauss_newton, low, high)
        if abs(new - eta) <= tol * max(eta, 1e-2) or high - low <= tol * max(high, 1e-2):
            break  # converged: η, already evaluated, is within policy.step_tol of the next point
        eta = new
    if rows is None or rows.eta != eta:  # the iterations ran out before converging: evaluate the last point
        rows = step_rows(logits, eta)
        trace.append((eta, float(-log_mixture(log_base, rows.log_memory, weight).mean())))
    return eta, trace, rows


def derivatives(rows: StepRows, weight: float, log_base: torch.Tensor) -> tuple[float, float, float, float]:
    """The held-out mean NLL at the rows' step η under weight λ, and its derivatives in η: (NLL, first derivative,
    the Gauss-Newton part of the second, the second), for the rows' state `rows` and the base log-likelihoods
    log_base [n] float64."""
    log_memory, gap, spread = rows.log_memory, rows.gap, rows.spread
    if weight >= 1.0:
        curv = float(spread.mean())
        return float(-log_memory.mean()), float(-gap.mean()), curv, curv
    log_mix = log_mixture(log_base, log_memory, weight)
    share = (log_memory - log_mix).exp() * weight  # λ·p_y / mixture, in [0, 1]
    gauss_newton = float((share * spread).mean())
    curv = gauss_newton + float(((share * share - share) * gap * gap).mean())
    return float(-log_mix.mean()), float(-(share * gap).mean()), gauss_newton, curv


def _fallback_step(eta: float, grad: float, gauss_newton: float, low: float, high: float) -> float:
    """The next point when the Newton step leaves the bracket (low, high): the Gauss-Newton step where it lies inside
    it, else bisection of the bracket (geometric when its low end is above 0)."""
    if gauss_newton > 0 and low < eta - grad / gauss_newton < high:
        return eta - grad / gauss_newton
    return math.sqrt(low * high) if low > 0 else 0.5 * (low + high)


class StepRows(NamedTuple):
    """Per held-out row at step `eta`: log p_y under softmax(z0 + η·z1), its derivative in η (z1_y − E_p[z1]) and
    Var_p(z1), all [n] float64."""

    eta: float
    log_memory: torch.Tensor
    gap: torch.Tensor
    spread: torch.Tensor


def step_rows(logits: Logits, eta: float) -> StepRows:
    """The rows' state at step η (`StepRows`): one pass over the [n, V] logits."""
    z0, z1, target0, target1 = logits
    lse, m1, m2 = _moments(z0, z1, eta)
    return StepRows(eta, (target0 + eta * target1 - lse).double(), (target1 - m1).double(), (m2 - m1 * m1).double())


def base_log_targets(
    logits: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None],
) -> torch.Tensor:
    """log softmax(z0) at the targets [n] float64: the base model's held-out log-likelihoods (`Logits`; z1 and its
    targets are not read and may be None)."""
    z0, _, target0, _ = logits
    return (target0 - row_logsumexp(z0)).double()


def held_out_nll(logits: Logits, eta: float, lam: float) -> float:
    """Mean NLL of the targets under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1), logits = (z0, z1, their entries
    at the targets) as `Logits`."""
    z0, z1, target0, target1 = logits
    log_base = (target0 - row_logsumexp(z0)).double()
    if eta <= 0.0 or lam <= 0.0:
        return float(-log_base.mean())
    return mixture_nll(log_base, log_targets(z0, z1, target0, target1, eta), lam)


def golden_section(f: Callable[[float], float], low: float, high: float, iterations: int) -> tuple[float, float]:
    """(x, f(x)): the better end of the bracket after `iterations` golden-section steps minimising f on [low, high]
    (f unimodal there; f is called iterations + 2 times, one new point per step). The bracket shrinks by
    (√5 − 1)/2 ≈ 0.618 per step."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    left, right = high - ratio * (high - low), low + ratio * (high - low)
    f_left, f_right = f(left), f(right)
    for _ in range(iterations):  # one new point per iteration
        if f_left < f_right:
            high, right, f_right = right, left, f_left
            left = high - ratio * (high - low)
            f_left = f(left)
        else:
            low, left, f_left = left, right, f_right
            right = low + ratio * (high - low)
            f_right = f(right)
    return (left, f_left) if f_left < f_right else (right, f_right)


def tune_mixture(
    logits: Logits,
    step: float | None = None,
    log_base: torch.Tensor | None = None,
    policy: OutputPolicy = DEFAULT_POLICY,
) -> tuple:
    """(η, λ) minimising the mean NLL of targets ys [n] under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1), with
    η held at `step` when not None (ResidualOutput.weight='auto'). For each η the NLL is convex in λ (bisection of its
    derivative); η is searched on a geometric grid (factor 2 from policy.min_grid_step to policy.max_step), then by
    policy.golden_iterations golden-section steps on log η between the best grid point's neighbours. Returns (η, λ,
    [(η_i, λ_i, NLL_i)] sorted by η); (0, 0) when no mixture helps (`significant`). logits: the held-out logits
    (`Logits`); log_base: the base component's log-likelihoods when its logits are not z0."""
    z0, z1, target0, target1 = logits
    log_base = (target0 - row_logsumexp(z0)).double() if log_base is None else log_base
    seen: dict[float, tuple[float, float]] = {}

    def log_memory(eta: float) -> torch.Tensor:
        return log_targets(z0, z1, target0, target1, eta)

    def nll(eta: float) -> float:
        if eta not in seen:
            log_memory_eta = log_memory(eta)
            lam = best_weight(log_base, log_memory_eta, policy)
            seen[eta] = (mixture_nll(log_base, log_memory_eta, lam), lam)
        return seen[eta][0]

    if step is not None:
        nll(step)
    else:
        smallest = policy.min_grid_step
        grid = [smallest * 2.0**i for i in range(int(math.log2(policy.max_step / smallest)) + 1)]
        best = min(range(len(grid)), key=lambda i: nll(grid[i]))
        low, high = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, len(grid) - 1)])
        golden_section(lambda u: nll(math.exp(u)), low, high, policy.golden_iterations)  # every point lands in `seen`
    eta = min(seen, key=lambda e: seen[e][0])
    lam = seen[eta][1]
    trace = [(e, seen[e][1], seen[e][0]) for e in sorted(seen)]
    if lam <= 0.0 or not significant(log_base, log_memory(eta), lam, policy):
        return 0.0, 0.0, trace
    return eta, lam, trace
