"""How the residual output layer chooses its step η and mixture weight λ on the held-out tail of the learned text
(docs/design.md §6.3); the tail buffer it is tuned on is faast/hf/held_out.py.

The last HELD_OUT_SHARE of the learned positions (at most `tune_tokens`) are held out; the layer fits its correction
on the rest (statistics subtract exactly) and hands the held-out positions' logits here as `Logits`: z0 [n, V] the base
logits, z1 [n, V] their change per unit step, and both at the targets [n]. The functions below minimise the held-out
NLL of (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1): in logit space (λ = 1) it is convex in η (a safeguarded 1-D
Newton search, `tune_step`); in probability space it is convex in λ for each η (bisection), and η is searched on a
geometric grid refined by golden section (`tune_mixture`). A mixture is used only when its gain is significant.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# The step's Newton iteration on the held-out NLL: at most this many passes, stopping once the next step would move η
# by less than STEP_TOL relative (the NLL is quadratic at its minimum: a 1% error in η costs ~1e-4 of the gain);
# η stays in [0, MAX_STEP] (0 keeps the base model when no step helps).
STEP_ITERATIONS = 12
STEP_TOL = 1e-2
MAX_STEP = 4.0
# The step is tuned on the last HELD_OUT_SHARE of the learned positions (at most tune_tokens of them), and only when
# at least MIN_HELD_OUT are held out and MIN_FIT_TOKENS remain to fit on.
HELD_OUT_SHARE = 0.2
MIN_HELD_OUT = 128
MIN_FIT_TOKENS = 256
# ... and at least FIT_PER_KEY_DIM × d positions (d = the key width). A d×d map fitted on fewer is mostly noise, and a
# tail cut from the same text cannot tell: SmolLM2 (d = 576) learning one 2K-token file chose a step 5× the one that
# suits other files and doubled their perplexity, while three validation domains lost at most 2.4% by not stepping
# (docs/design.md §6.3).
FIT_PER_KEY_DIM = 4
# The step's search first runs on every SEARCH_SAMPLE_STRIDE-th held-out row when there are at least
# SEARCH_SAMPLE_MIN_ROWS, and its best point starts the search on all rows: on SmolLM2's held-out logits (2,048 rows ×
# 49,152) the whole search then read the [n, V] logits 3–4.25 times instead of 7–8 (docs/design.md §6.3).
SEARCH_SAMPLE_STRIDE = 4
SEARCH_SAMPLE_MIN_ROWS = 1024
# With two key widths to compare on at least WIDTH_SAMPLE_MIN_ROWS held-out rows, the width is chosen on the same
# sample (each width tuned on it), and only the chosen width's change is formed for every row: on SmolLM2 at 32K tokens
# one [2048, 576] × [576, 49,152] product and one full search fewer (docs/design.md §6.3).
WIDTH_SAMPLE_MIN_ROWS = 1024
# With ResidualOutput.tune_tokens above TUNE_SAMPLE, the held-out NLL is evaluated on TUNE_SAMPLE positions spread
# evenly over the held-out span (the fit still leaves out all of it): bounds the cost of the [n, V] logits. A longer
# span is not better by default: 8192 chose a better step than 2048 on one domain and a worse one on another
# (docs/design.md §6.3).
TUNE_SAMPLE = 2048
# The fit that tunes the step also leaves out up to GAP_MULTIPLE × (held-out positions) of the tail's document just
# before the tail: nearby text of the same document shares its names and phrasing (docs/design.md §6.3).
GAP_MULTIPLE = 2
# Probability space: η is searched on a geometric grid (factor 2, from MIN_GRID_STEP to MAX_STEP), then refined by
# GOLDEN_ITERATIONS golden-section steps on log η between the best grid point's neighbours; for each η, λ in [0, 1] is
# the exact minimiser of the held-out NLL (convex in λ), found by WEIGHT_ITERATIONS bisections of its derivative.
MIN_GRID_STEP = 1 / 256
GOLDEN_ITERATIONS = 8
WEIGHT_ITERATIONS = 40
# ... and a mixture is used only when its mean held-out gain per position exceeds MIN_GAIN_SE standard errors.
MIN_GAIN_SE = 2.0
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
    return tuple(torch.cat(parts) for parts in zip(*out, strict=True))


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


def significant(log_base: torch.Tensor, log_memory: torch.Tensor, lam: float) -> bool:
    """Whether mixing in log_memory with weight λ raises the mean log-likelihood of log_base [n] by more than
    MIN_GAIN_SE standard errors of the gain per position: a sharp correction mixed in with a small weight raises the
    held-out likelihood of random text a little, by chance."""
    gain = log_mixture(log_base, log_memory, lam) - log_base
    return float(gain.mean()) > MIN_GAIN_SE * float(gain.std()) / math.sqrt(gain.numel())


def best_weight(log_base: torch.Tensor, log_memory: torch.Tensor) -> float:
    """argmin over λ in [0, 1] of −mean log((1 − λ)·a + λ·b), a = exp(log_base), b = exp(log_memory) [n] float64:
    convex in λ, so bisection of the derivative −mean((b − a) / mix)."""

    def slope(lam: float) -> float:
        log_mix = log_mixture(log_base, log_memory, lam)
        return float(((log_base - log_mix).exp() - (log_memory - log_mix).exp()).mean())

    if slope(0.0) >= 0.0:
        return 0.0
    if slope(1.0) <= 0.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(WEIGHT_ITERATIONS):
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


def tune_step(logits: Logits, weight: float = 1.0) -> tuple[float, list[tuple[float, float]]]:
    """The step η >= 0 minimising the mean NLL of targets ys [n] under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1)
    (λ = weight; at 1, the logits z0 + η·z1), z1 the logits' change for the correction keys·w. A safeguarded
    1-D Newton iteration from η = 0, each pass giving the NLL and its first two derivatives in η: at λ = 1 the NLL
    is convex in η; a mixture's need not be, and the bracket from the derivative's sign keeps the iteration on
    the minimum it starts towards. A mixture's η is 0 unless it helps (`significant`). Returns (η, [(η_i, NLL_i)
    per iteration]). logits: the held-out logits (`Logits`)."""
    eta, trace, _ = tune_step_rows(logits, weight)
    return eta, trace


def tune_step_rows(
    logits: Logits,
    weight: float = 1.0,
    log_base: torch.Tensor | None = None,
    start: float = 0.0,
    sampled: bool = False,
) -> tuple[float, list[tuple[float, float]], StepRows]:
    """`tune_step`, also returning the rows' state at the step the search ended on (before the significance test
    may set η to 0): what `diagnose` and the key width's choice read without another pass over the [n, V] logits.
    log_base: log softmax(z0) at the targets [n] float64 (`base_log_targets`), when already computed. start: the
    first point of the search (e.g. the step the narrower keys took: the wider keys' is near it, so the search takes
    fewer passes); from a start above 0 a minimum at 0 is approached by the bracket and cut by the significance
    test. With SEARCH_SAMPLE_MIN_ROWS rows or more the search first runs on every SEARCH_SAMPLE_STRIDE-th row, and
    its best point starts the search on all of them: that one then ends in 1–3 passes over the [n, V] logits, and
    the result is the full rows' minimum as before (within STEP_TOL). sampled: `start` is already a sample's best
    point (the key width's choice searched one): no sampled search first. The trace is the full rows' search."""
    if log_base is None:
        log_base = base_log_targets(logits)
    if logits[0].shape[0] >= SEARCH_SAMPLE_MIN_ROWS and not sampled:
        pick = slice(None, None, SEARCH_SAMPLE_STRIDE)
        _, sample_trace, _ = _search(tuple(part[pick] for part in logits), weight, log_base[pick], start)
        start = min(sample_trace, key=lambda point: point[1])[0]
    eta, trace, rows = _search(logits, weight, log_base, start)
    if weight < 1.0 and eta > 0.0 and not significant(log_base, rows.log_memory, weight):
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
) -> tuple[float, float, float, list, StepRows | None]:
    """One key width's tuning on these held-out rows: (the held-out NLL it would read, η, λ, the search's trace, the
    rows at η or None). weight None ('auto'): η and λ together (`tune_mixture`, η held at `step` when not None); else
    η for that weight from `start` (`tune_step_rows`). log_base: `base_log_targets` of the rows. compare False: the
    NLL is not needed (no other width to compare with) and is 0 where it would take another pass. sampled: `start` is
    a sample's best step (`tune_step_rows`)."""
    if weight is None:
        eta, lam, trace = tune_mixture(logits, step)
        if not compare:
            return 0.0, eta, lam, trace, None
        if eta <= 0 or lam <= 0:
            return float(-log_base.mean()), eta, lam, trace, None
        return mixture_nll(log_base, log_targets(*logits, eta), lam), eta, lam, trace, None
    eta, trace, rows = tune_step_rows(logits, weight, log_base, start, sampled)
    nll = float(-log_base.mean()) if eta <= 0 else float(-log_mixture(log_base, rows.log_memory, weight).mean())
    return nll, eta, weight, trace, rows


def sample_first(n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(an order [n] int64 of n rows with every SEARCH_SAMPLE_STRIDE-th row first, how many those are): the sample a
    choice is made on comes first, so that its [rows, V] products are the leading rows of the full ones."""
    index = torch.arange(n, device=device)
    picked = index[::SEARCH_SAMPLE_STRIDE]
    return torch.cat([picked, index[index % SEARCH_SAMPLE_STRIDE != 0]]), picked.numel()


def _search(
    logits: Logits, weight: float, log_base: torch.Tensor, start: float
) -> tuple[float, list[tuple[float, float]], StepRows]:
    """The safeguarded 1-D Newton search of `tune_step_rows` on these rows, from `start`: (the last point η, [(η_i,
    NLL_i)], the rows at η), with no significance test.

    Each pass gives the NLL and its first two derivatives in η. The derivative's sign brackets the minimum. A Newton
    step that leaves the bracket (the mixture's curvature in η can be tiny, even negative, far from the minimum: from
    η = 0 its step overshot to the top of the range and then halved its way down, 7–8 passes on SmolLM2's held-out
    logits) is replaced by the step of the Gauss-Newton part of the curvature (λ·p_y/mixture · Var_p(z1), never
    below the full curvature, so a shorter step), else by bisection: geometric once the bracket's low end is above
    0 (the step's scale is unknown). In logit space (λ = 1) both curvatures are Var_p(z1)."""
    eta, low, high, trace = min(max(float(start), 0.0), MAX_STEP), 0.0, MAX_STEP, []
    rows = None
    for _ in range(STEP_ITERATIONS):
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
        if abs(new - eta) <= STEP_TOL * max(eta, 1e-2) or high - low <= STEP_TOL * max(high, 1e-2):
            break  # converged: η, already evaluated, is within STEP_TOL of the next point
        eta = new
    if rows.eta != eta:  # the iterations ran out before converging: evaluate the last point
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


def base_log_targets(logits: Logits) -> torch.Tensor:
    """log softmax(z0) at the targets [n] float64: the base model's held-out log-likelihoods."""
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


def tune_mixture(logits: Logits, step: float | None = None, log_base: torch.Tensor | None = None) -> tuple:
    """(η, λ) minimising the mean NLL of targets ys [n] under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1), with
    η held at `step` when not None (ResidualOutput.weight='auto'). For each η the NLL is convex in λ (bisection of its
    derivative); η is searched on a geometric grid, then by golden section on log η around the best grid point.
    Returns (η, λ, [(η_i, λ_i, NLL_i)] sorted by η); (0, 0) when no mixture helps (`significant`). logits: the
    held-out logits (`Logits`); log_base: the base component's log-likelihoods when its logits are not z0."""
    z0, z1, target0, target1 = logits
    log_base = (target0 - row_logsumexp(z0)).double() if log_base is None else log_base
    seen: dict[float, tuple[float, float]] = {}

    def log_memory(eta: float) -> torch.Tensor:
        return log_targets(z0, z1, target0, target1, eta)

    def nll(eta: float) -> float:
        if eta not in seen:
            log_memory_eta = log_memory(eta)
            lam = best_weight(log_base, log_memory_eta)
            seen[eta] = (mixture_nll(log_base, log_memory_eta, lam), lam)
        return seen[eta][0]

    if step is not None:
        nll(step)
    else:
        grid = [MIN_GRID_STEP * 2.0**i for i in range(int(math.log2(MAX_STEP / MIN_GRID_STEP)) + 1)]
        best = min(range(len(grid)), key=lambda i: nll(grid[i]))
        low, high = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, len(grid) - 1)])
        ratio = (math.sqrt(5.0) - 1.0) / 2.0
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        f_left, f_right = nll(math.exp(left)), nll(math.exp(right))
        for _ in range(GOLDEN_ITERATIONS):  # one new point per iteration
            if f_left < f_right:
                high, right, f_right = right, left, f_left
                left = high - ratio * (high - low)
                f_left = nll(math.exp(left))
            else:
                low, left, f_left = left, right, f_right
                right = low + ratio * (high - low)
                f_right = nll(math.exp(right))
    eta = min(seen, key=lambda e: seen[e][0])
    lam = seen[eta][1]
    trace = [(e, seen[e][1], seen[e][0]) for e in sorted(seen)]
    if lam <= 0.0 or not significant(log_base, log_memory(eta), lam):
        return 0.0, 0.0, trace
    return eta, lam, trace
