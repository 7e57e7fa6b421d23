"""How the residual output layer chooses its step η and mixture weight λ on the held-out tail of the learned text
(docs/design.md §6.3), and the tail buffer itself.

The last HELD_OUT_SHARE of the learned positions (at most `tune_tokens`) are held out; the layer fits its correction
on the rest (statistics subtract exactly) and hands the held-out positions' logits here as `Logits`: z0 [n, V] the base
logits, z1 [n, V] their change per unit step, and both at the targets [n]. The functions below minimise the held-out
NLL of (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1): in logit space (λ = 1) it is convex in η (a safeguarded 1-D
Newton search, `tune_step`); in probability space it is convex in λ for each η (bisection), and η is searched on a
geometric grid refined by golden section (`tune_mixture`). A mixture is used only when its gain is significant.
"""

from __future__ import annotations

import math

import torch

# The step's Newton iteration on the held-out NLL: at most this many passes, stopping at a relative change of STEP_TOL;
# η stays in [0, MAX_STEP] (0 keeps the base model when no step helps).
STEP_ITERATIONS = 12
STEP_TOL = 1e-3
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
# The held-out logits the layer computes: (z0 [n, V], z1 [n, V] float32, z0 and z1 at the targets [n]).
Logits = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_BLOCK = 512  # rows per block of the [rows, V] temporaries


def _moments(z0: torch.Tensor, z1: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits z = z0 + η·z1 [n, V]: (logsumexp z, E_p[z1], E_p[z1²]) [n] with p = softmax(z), in blocks of
    rows that bound the [rows, V] temporaries."""
    out = []
    for a, b in zip(z0.split(_BLOCK), z1.split(_BLOCK), strict=True):
        z = torch.add(a, b, alpha=eta)
        lse = torch.logsumexp(z, -1)
        p = z.sub_(lse[:, None]).exp_()
        m1 = (p * b).sum(-1)
        out.append((lse, m1, p.mul_(b).mul_(b).sum(-1)))
    return tuple(torch.cat(parts) for parts in zip(*out, strict=True))


def _log_targets(
    z0: torch.Tensor, z1: torch.Tensor, target0: torch.Tensor, target1: torch.Tensor, eta: float
) -> torch.Tensor:
    """log softmax(z0 + η·z1) at the targets [n] float64, for logits z0, z1 [n, V] and their entries at the targets
    target0, target1 [n]; the logsumexp in blocks of rows that bound the [rows, V] temporaries."""
    blocks = zip(z0.split(_BLOCK), z1.split(_BLOCK), strict=True)
    lse = torch.cat([torch.logsumexp(torch.add(a, b, alpha=eta), -1) for a, b in blocks])
    return (target0 + eta * target1 - lse).double()


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
    z0, z1, target0, target1 = logits
    log_base = (target0 - torch.logsumexp(z0, -1)).double() if weight < 1.0 else None
    eta, low, high, trace = 0.0, 0.0, MAX_STEP, []
    for _ in range(STEP_ITERATIONS):
        lse, m1, m2 = _moments(z0, z1, eta)
        gap, spread = (target1 - m1).double(), (m2 - m1 * m1).double()  # d/dη log p_y; Var_p(z1)
        log_memory = (target0 + eta * target1 - lse).double()
        if log_base is None:
            nll, grad, curv = float(-log_memory.mean()), float(-gap.mean()), float(spread.mean())
        else:
            log_mix = log_mixture(log_base, log_memory, weight)
            share = (log_memory - log_mix).exp() * weight  # λ·p_y / mixture, in [0, 1]
            nll = float(-log_mix.mean())
            grad = float(-(share * gap).mean())
            curv = float((share * spread + (share * share - share) * gap * gap).mean())
        trace.append((eta, nll))
        if eta == 0.0 and grad >= 0:  # convex and rising from 0: no step helps
            break
        # The derivative's sign brackets the minimum; a Newton step that leaves the bracket is replaced by
        # bisection (far from the minimum the curvature in η can be tiny and the step wild).
        if grad > 0:
            high = eta
        else:
            low = eta
        new = eta - grad / curv if curv > 0 else float("inf")
        if not low < new < high:
            new = 0.5 * (low + high)
        done = abs(new - eta) <= STEP_TOL * max(eta, 1e-2) or high - low <= STEP_TOL * max(high, 1e-2)
        eta = new
        if done:
            break
    if log_base is not None and eta > 0.0:
        log_memory = _log_targets(z0, z1, target0, target1, eta)
        if not significant(log_base, log_memory, weight):
            eta = 0.0
    return eta, trace


def held_out_nll(logits: Logits, eta: float, lam: float) -> float:
    """Mean NLL of the targets under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1), logits = (z0, z1, their entries
    at the targets) as `Logits`."""
    z0, z1, target0, target1 = logits
    log_base = (target0 - torch.logsumexp(z0, -1)).double()
    if eta <= 0.0 or lam <= 0.0:
        return float(-log_base.mean())
    return mixture_nll(log_base, _log_targets(z0, z1, target0, target1, eta), lam)


def tune_mixture(logits: Logits, step: float | None = None) -> tuple[float, float, list[tuple[float, float, float]]]:
    """(η, λ) minimising the mean NLL of targets ys [n] under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1), with
    η held at `step` when not None (ResidualOutput.weight='auto'). For each η the NLL is convex in λ (bisection of its
    derivative); η is searched on a geometric grid, then by golden section on log η around the best grid point.
    Returns (η, λ, [(η_i, λ_i, NLL_i)] sorted by η); (0, 0) when no mixture helps (`significant`). logits: the
    held-out logits (`Logits`)."""
    z0, z1, target0, target1 = logits
    log_base = (target0 - torch.logsumexp(z0, -1)).double()
    seen: dict[float, tuple[float, float]] = {}

    def log_memory(eta: float) -> torch.Tensor:
        return _log_targets(z0, z1, target0, target1, eta)

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


class HeldOutTail:
    """The last learned positions of a stream, kept to tune the step: keys [n, d_key] float32, targets [n] int64 and
    documents [n] int64 (negative: unknown) of at most (1 + GAP_MULTIPLE)·`tune_tokens` positions. Learning state of
    this process, not saved."""

    def __init__(self, tune_tokens: int, kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        self.tune_tokens = tune_tokens
        self._kept = kept

    def __len__(self) -> int:
        return 0 if self._kept is None else int(self._kept[0].shape[0])

    def snapshot(self) -> object:
        """What the buffer holds now, for restore (the kept tensors are replaced, never written in place)."""
        return self._kept

    def restore(self, snapshot: object) -> None:
        """Put back what snapshot() returned (a learn that failed part way leaves the buffer as it was)."""
        self._kept = snapshot

    def clear(self) -> None:
        """Forget every kept position."""
        self._kept = None

    def drop_documents(self, documents: set[int]) -> int:
        """Forget the kept positions of `documents` (document numbers; negative: rows of unknown documents, each its
        own), e.g. of texts a memory forgot: they must not tune its step. Returns how many positions were dropped."""
        if self._kept is None or not documents:
            return 0
        ids = torch.tensor(sorted(documents), dtype=torch.long, device=self._kept[2].device)
        keep = ~torch.isin(self._kept[2], ids)
        dropped = int((~keep).sum())
        self._kept = tuple(t[keep] for t in self._kept) if bool(keep.any()) else None
        return dropped

    def extended(self, later: HeldOutTail) -> HeldOutTail:
        """A new buffer holding this one's positions followed by `later`'s, cut to the capacity: what one buffer
        would hold after learning this buffer's stream and then `later`'s (merging two memories)."""
        parts = [kept for kept in (self._kept, later.snapshot()) if kept is not None]
        if not parts or not self.tune_tokens:
            return HeldOutTail(self.tune_tokens)
        joined = tuple(torch.cat([p[i].to(parts[-1][i].device) for p in parts]) for i in range(3))
        return HeldOutTail(self.tune_tokens, tuple(t[-(1 + GAP_MULTIPLE) * self.tune_tokens :] for t in joined))

    def keep(
        self, keys: torch.Tensor, targets: torch.Tensor, pair_mask: torch.Tensor, documents: torch.Tensor | None
    ) -> None:
        """Append the learned positions of keys [B, T-1, d_key], targets [B, T-1] where pair_mask [B, T-1] (documents
        [B] or None) and keep the last (1 + GAP_MULTIPLE)·tune_tokens: the held-out tail and, before it, the positions
        of its first document the fit must leave out too. Only learned positions are kept: with right-padded batches
        the last positions of a batch are often padding (selecting them costs a host sync, as the learn step's own
        counts do)."""
        d = keys.shape[-1]
        docs = torch.full(keys.shape[:2], -1, dtype=torch.long, device=keys.device)
        if documents is not None:
            docs = docs.copy_(documents.to(torch.long)[:, None].expand_as(docs))
        keep = pair_mask.reshape(-1)
        new = (keys.reshape(-1, d)[keep].float(), targets.reshape(-1)[keep], docs.reshape(-1)[keep])
        if self._kept is not None:
            new = tuple(torch.cat([old, part]) for old, part in zip(self._kept, new, strict=True))
        self._kept = tuple(t[-(1 + GAP_MULTIPLE) * self.tune_tokens :] for t in new)

    def split(
        self, held: int, learned: int, min_fit: int, *, leave_out_document: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(keys [n, d_key] and targets [n] of at most TUNE_SAMPLE positions spread over the last `held` kept
        positions; keys and targets of every position the fit leaves out; how many of those precede the tail).

        Left out: the `held` tail positions and, when the first of them belongs to a known document that started
        earlier, up to GAP_MULTIPLE·`held` positions of that document just before the tail, as long as `min_fit` of
        the `learned` positions remain to fit on. Text next to the tail in the same document shares its names and
        phrasing, so a fit that saw it rewards a larger step than text of another document would. leave_out_document:
        False leaves out the tail alone."""
        keys, ys, docs = self._kept
        first = int(docs[-held])
        gap = 0
        if first >= 0 and leave_out_document:
            before = docs[max(0, docs.shape[0] - (1 + GAP_MULTIPLE) * held) : -held]
            gap = int((before == first).sum())  # the document's positions are contiguous: the last `gap` of them
            if learned - held - gap < min_fit:
                gap = 0  # one document (nearly) all along: the tail alone is held out
        sample = torch.linspace(0, held - 1, min(held, TUNE_SAMPLE), device=keys.device).round().long()
        return keys[-held:][sample], ys[-held:][sample], keys[-held - gap :], ys[-held - gap :], gap

    def capacity_bytes(self, dim_key: int) -> int:
        """Bytes the buffer takes when full: float32 keys, int64 targets and documents."""
        return (1 + GAP_MULTIPLE) * self.tune_tokens * (dim_key * 4 + 8 + 8)
