"""The residual output memory layer: the fast weights fitted to what the model gets wrong (docs/design.md §6.3).

After the final norm the LM head reads h̃ [d] and predicts p = softmax(h̃ Hᵀ) (H [V, d], the head's weight). For the
learned token y, the gradient of log p_y with respect to h̃ is r = H[y] − pH = Hᵀ(e_y − p): the direction that would
have raised the right token. The layer learns, in the same forward pass and without backprop,

    S = Σ h̃ h̃ᵀ,   T = Σ h̃ rᵀ          (a FastWeights(d, d): keys h̃, values r)
    C = Σ_t Cov_{p_t}(H) = Hᵀ diag(Σ p_t) H − Σ μ_t μ_tᵀ,  μ_t = p_t H      (the Fisher of the head, summed)

and reads h̃ ← h̃ + η·h̃·W with W = S⁺ T (C/N + δ·mean(diag)·I)⁻¹. W is one Newton step on the log-likelihood of the
learned tokens for a linear correction h̃W, with a Kronecker-factored curvature (keys' Gram ⊗ the head's Fisher):
S⁺T alone is the gradient step, the Fisher whitens it so that directions where the logits are sensitive move
less. The step η is chosen from the learned stream itself: the last HELD_OUT_SHARE of the learned positions (at
most `tune_tokens`) are held out, the weights are fitted on the rest (statistics subtract exactly) and η minimises
the held-out NLL, which is convex in η (a bracketed 1-D Newton search); then the full statistics are used. When the
learned stream is several documents, the fit also leaves out the held-out tail's document just before it (up to
GAP_MULTIPLE times as many positions as the tail), so that η is tuned on text unlike what was fitted. All state has a
fixed size: three d×d sums, a V-vector and a (1 + GAP_MULTIPLE)·`tune_tokens`-position buffer.

Measured on five local domains (benchmarks and choices: experiments/lm_domains.py, docs/design.md §6.3).
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import torch
from torch import nn

from .. import ops
from ..memory import FastWeights
from .config import FaastConfig

_log = logging.getLogger("faast.hf")

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
# With output_tune_tokens above TUNE_SAMPLE, the held-out NLL is evaluated on TUNE_SAMPLE positions spread evenly over
# the held-out span (the fit still leaves out all of it): bounds the cost of the [n, V] logits. A longer span is not
# better by default: 8192 chose a better step than 2048 on one domain and a worse one on another (docs/design.md §6.3).
TUNE_SAMPLE = 2048
# The fit that tunes the step also leaves out up to GAP_MULTIPLE × (held-out positions) of the tail's document just
# before the tail: nearby text of the same document shares its names and phrasing (docs/design.md §6.3).
GAP_MULTIPLE = 2
_CHUNK = 1024  # positions per logits block: bounds the [chunk, V] temporaries


def _head_logits(head: nn.Module, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [n, V] float32 of rows hidden [n, d] through the LM head (weight [V, d], optional bias). `weight`: the
    head's weight already cast to the products' dtype (float32 or bfloat16; default float32)."""
    weight = head.weight.float() if weight is None else weight
    logits = (hidden.to(weight.dtype) @ weight.T).float()
    bias = getattr(head, "bias", None)
    return logits if bias is None else logits + bias.float()


@functools.cache
def _cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo (Linux)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def products_dtype(setting: str, keys: torch.Tensor) -> torch.dtype:
    """The dtype of the head products learning takes for keys [.., d] under output_head_dtype `setting`: 'auto' is
    bfloat16 on a CUDA device or CPU that multiplies it natively and float32 otherwise, and float32 for float64 keys
    (kept exact, as the tests' references are)."""
    if setting != "auto":
        return getattr(torch, setting)
    if keys.dtype == torch.float64:
        return torch.float32
    if keys.device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if keys.device.type == "cpu" and _cpu_has_bf16() else torch.float32


class ResidualOutputLayer(nn.Module):
    """h̃ ← h̃ + η·h̃·W after the final norm, W a Newton step fitted to the head's log-likelihood gradients.

    Attributes:
        memory: FastWeights(d, d) of keys h̃ and values r = H[y] − pH (float64 statistics).
        curvature: FastWeights(d, 1) whose `gram` accumulates the head's Fisher Σ_t Cov_{p_t}(H) and `count` the
            positions (so faast.distributed and checkpoints sum and store it like any memory).
        step: 'auto' (tuned on the held-out tail at each solve) or a fixed η.
        damping: δ, added as δ·mean(diag(C/N))·I before inverting the curvature.
        last_tuning: dict of the most recent solve: chosen step, held-out loss per step, tokens fitted / held out.
    """

    def __init__(self, hidden_size: int, vocab_size: int, config: FaastConfig, device: torch.device | None = None):
        super().__init__()
        d = hidden_size
        compute = torch.float32 if config.compute_dtype == "float32" else torch.float64
        self.memory = FastWeights(d, d, alpha=config.output_alpha, compute_dtype=compute, device=device)
        # The Fisher Σ_t Cov_{p_t}(H) = Hᵀ diag(Σ_t p_t) H − Σ_t μ_t μ_tᵀ is kept as its two sums, each in a
        # FastWeights so that checkpoints and faast.distributed handle them like any memory: `curvature.gram` holds
        # Σ μ μᵀ [d, d] and `token_mass.cross[0]` holds Σ p [V]. The V×d×d product is formed once per solve.
        self.curvature = FastWeights(d, 1, compute_dtype=compute, device=device)
        self.token_mass = FastWeights(1, vocab_size, compute_dtype=compute, device=device)
        self.step, self.damping = config.output_step, float(config.output_damping)
        self.tune_tokens, self.default_step = config.output_tune_tokens, float(config.output_default_step)
        self.head_dtype = config.output_head_dtype
        # The held-out tail: the last tune_tokens learned positions (h̃ [n, d] float32, y [n], mask [n]). Learning
        # state of this process (not saved): after a load, step='auto' uses default_step until more text is learned.
        self._tail: list[tuple[torch.Tensor, ...]] = []
        # The step saved with the statistics (FaastModel.save_fast_weights writes the one in use): after a load it
        # stands in for default_step until the step can be tuned again, so a loaded model reads like the saved one.
        self._restored_step: float | None = None
        self._head: tuple[nn.Module, ...] = ()  # the model's LM head, held outside the module tree
        self._folded: tuple[tuple, torch.Tensor | None] | None = None
        self.last_tuning: dict | None = None

    def extra_repr(self) -> str:
        return f"step={self.step}, damping={self.damping}, tune_tokens={self.tune_tokens}"

    def attach_head(self, head: nn.Module) -> None:
        """The model's output embedding (LM head) whose gradients the layer fits; not a submodule of this layer."""
        self._head = (head,)

    @property
    def head(self) -> nn.Module:
        if not self._head:
            raise RuntimeError("ResidualOutputLayer: no LM head attached (FaastModel attaches it)")
        return self._head[0]

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        self._folded = None
        self._tail = []
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ learning

    @torch.no_grad()
    def learn(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        pair_mask: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> None:
        """Add the positions of hidden [B, T, d] (the final norm's output) that predict targets [B, T-1] (the next
        token ids) where pair_mask [B, T-1] is True. documents [B] int64: which document each row belongs to,
        non-decreasing along the stream (-1 or None: unknown); the step tuning uses it to leave the text just before
        the held-out tail out of its fit when both come from one document."""
        keys = hidden[:, :-1]
        if targets.shape != keys.shape[:-1] or pair_mask.shape != targets.shape:
            raise ValueError(f"targets, pair_mask: expected shape {tuple(keys.shape[:-1])}, got "
                             f"{tuple(targets.shape)} and {tuple(pair_mask.shape)}")  # fmt: skip
        if documents is not None and documents.shape != keys.shape[:1]:
            raise ValueError(f"documents: expected shape {tuple(keys.shape[:1])}, got {tuple(documents.shape)}")
        grads, mean_gram, prob_sum = self._gradients(keys, targets, pair_mask)
        k = keys if keys.dtype == torch.float64 else keys.float()
        self.memory.update(k, grads.to(k.dtype), mask=pair_mask)
        positions = pair_mask.sum().to(torch.float64)
        # Sums of the head's outputs, not rows of keys and values: added to the buffers directly.
        for memory, gram, cross in ((self.curvature, mean_gram, None), (self.token_mass, positions, prob_sum)):
            memory.gram.add_(gram.to(memory.gram.dtype))
            if cross is not None:
                memory.cross[0].add_(cross.to(memory.cross.dtype))
            memory.count.add_(positions.to(memory.count.dtype))
            memory._changed()
        if self.tune_tokens:
            self._keep_tail(keys, targets, pair_mask, documents)

    def _keep_tail(self, keys, targets, pair_mask, documents) -> None:  # noqa: ANN001 - learn's tensors
        """Keep the last (1 + GAP_MULTIPLE)·tune_tokens learned positions (states, targets, documents): the held-out
        tail and, before it, the positions of its first document the fit must leave out too. Only learned positions
        are kept: with right-padded batches the last positions of a batch are often padding (selecting them costs a
        host sync, as the learn step's own counts do)."""
        d = keys.shape[-1]
        docs = torch.full(keys.shape[:2], -1, dtype=torch.long, device=keys.device)
        if documents is not None:
            docs = docs.copy_(documents.to(torch.long)[:, None].expand_as(docs))
        keep = pair_mask.reshape(-1)
        new = (keys.reshape(-1, d)[keep].float(), targets.reshape(-1)[keep], docs.reshape(-1)[keep])
        if self._tail:
            new = tuple(torch.cat([old, part]) for old, part in zip(self._tail[0], new, strict=True))
        self._tail = [tuple(t[-(1 + GAP_MULTIPLE) * self.tune_tokens :] for t in new)]

    def _gradients(
        self, keys: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(r [B, T-1, d] float32, zero where masked; Σ μ μᵀ [d, d] and Σ p [V] float64 over unmasked positions)."""
        weight = self.head.weight
        d = keys.shape[-1]
        flat, ys, keep = keys.reshape(-1, d), targets.reshape(-1), mask.reshape(-1)
        grads = torch.empty((flat.shape[0], d), dtype=torch.float32, device=keys.device)
        prob_sum = torch.zeros(weight.shape[0], dtype=torch.float64, device=keys.device)
        mean_gram = torch.zeros((d, d), dtype=torch.float64, device=keys.device)
        w32 = weight.float()
        # The two V×d products per position are most of learning's cost beyond the backbone: in bfloat16 (float32
        # accumulation) they took 0.65× the time, and held-out perplexity moved by at most 0.04 points on three
        # validation domains (docs/design.md §6.3).
        wp = weight.to(products_dtype(self.head_dtype, keys))
        for i in range(0, flat.shape[0], _CHUNK):
            rows = slice(i, i + _CHUNK)
            kept = keep[rows, None].to(torch.float32)
            p = torch.softmax(_head_logits(self.head, flat[rows], wp), -1).mul_(kept)  # masked positions: p = 0
            mu = (p.to(wp.dtype) @ wp).float()
            grads[rows] = (w32[ys[rows]] - mu).mul_(kept)
            # float32 sums of at most _CHUNK probabilities: ample for a curvature, then summed in float64.
            prob_sum += p.sum(0).double()
            mean_gram += mu.double().T @ mu.double()
        return grads.reshape(keys.shape), mean_gram, prob_sum

    # ------------------------------------------------------------------ solving

    def _curvature(self) -> torch.Tensor:
        """(C/N + δ·mean(diag(C/N))·I) [d, d] float64: the damped mean Fisher of the head."""
        n = self.curvature.count.clamp_min(1.0)
        curvature = (self._head_second_moment() - self.curvature.gram) / n
        shift = self.damping * curvature.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny)
        return curvature + shift * torch.eye(curvature.shape[-1], dtype=torch.float64, device=curvature.device)

    def _newton(self, gram: torch.Tensor, cross: torch.Tensor, count: torch.Tensor, curvature: torch.Tensor):  # noqa: ANN202
        """W = S⁺T·curvature⁻¹, float64 [d, d], for the given key statistics."""
        w = ops.solve_fast_weights(gram, cross, count=count, alpha=self.memory.alpha)
        return torch.linalg.solve(curvature, w.T).T  # curvature is symmetric

    def _head_second_moment(self) -> torch.Tensor:
        """Hᵀ diag(Σ p) H [d, d] float64, formed in float32 blocks of the vocabulary (summed in float64)."""
        weight, mass = self.head.weight, self.token_mass.cross[0]
        out = torch.zeros((weight.shape[1],) * 2, dtype=torch.float64, device=weight.device)
        for i in range(0, weight.shape[0], 8192):
            h = weight[i : i + 8192].float()
            out += ((h.T * mass[i : i + 8192].float()) @ h).double()
        return out

    def _tail_statistics(self, held: int) -> tuple[torch.Tensor, ...]:
        """(keys [n, d] and targets [n] of at most TUNE_SAMPLE positions spread over the last `held` learned positions;
        the S, T and count of the positions the fit leaves out; how many of those precede the tail).

        Left out: the `held` tail positions and, when the first of them belongs to a known document that started
        earlier, up to GAP_MULTIPLE·`held` positions of that document just before the tail, as long as `_min_fit()`
        positions remain to fit on. Text next to the tail in the same document shares its names and phrasing, so a fit
        that saw it rewards a larger step than text of another document would (docs/design.md §6.3)."""
        keys, ys, docs = self._tail[0]
        first = int(docs[-held])
        gap = 0
        if first >= 0:
            before = docs[max(0, docs.shape[0] - (1 + GAP_MULTIPLE) * held) : -held]
            gap = int((before == first).sum())  # the document's positions are contiguous: the last `gap` of them
            if int(self.memory.count) - held - gap < self._min_fit():
                gap = 0  # one document (nearly) all along: the tail alone is held out
        out_k, out_y = keys[-held - gap :], ys[-held - gap :]
        every = torch.ones_like(out_y, dtype=torch.bool)[None]
        grads, _, _ = self._gradients(out_k[None], out_y[None], every)
        k64, g64 = out_k.double(), grads[0].double()
        count = torch.tensor(float(held + gap), dtype=torch.float64, device=keys.device)
        sample = torch.linspace(0, held - 1, min(held, TUNE_SAMPLE), device=keys.device).round().long()
        return keys[-held:][sample], ys[-held:][sample], k64.T @ k64, k64.T @ g64, count, gap

    def _tune(self, keys: torch.Tensor, ys: torch.Tensor, w: torch.Tensor) -> tuple[float, list[tuple[float, float]]]:
        """The step η >= 0 minimising the mean NLL of targets ys [n] from logits z0 + η·z1 (z1 the logits' change for
        the correction keys·w): convex in η, so a safeguarded 1-D Newton iteration from η = 0 finds it.
        Returns (η, [(η_i, NLL_i) per iteration])."""
        bias = getattr(self.head, "bias", None)
        z0 = _head_logits(self.head, keys)
        z1 = _head_logits(self.head, keys @ w.float())
        if bias is not None:
            z1 -= bias.float()
        target0 = z0.gather(-1, ys[:, None]).squeeze(-1)
        target1 = z1.gather(-1, ys[:, None]).squeeze(-1)
        n = keys.shape[0]
        eta, low, high, trace = 0.0, 0.0, MAX_STEP, []
        for _ in range(STEP_ITERATIONS):
            nll = grad = curv = 0.0
            for i in range(0, n, _CHUNK // 2):  # bounds the [rows, V] temporaries
                a, b = z0[i : i + _CHUNK // 2], z1[i : i + _CHUNK // 2]
                z = torch.add(a, b, alpha=eta)
                lse = torch.logsumexp(z, -1)
                p = z.sub_(lse[:, None]).exp_()
                m1 = (p * b).sum(-1)
                m2 = p.mul_(b).mul_(b).sum(-1)
                t0, t1 = target0[i : i + _CHUNK // 2], target1[i : i + _CHUNK // 2]
                nll += float((lse - t0 - eta * t1).sum())
                grad += float((m1 - t1).sum())
                curv += float((m2 - m1 * m1).sum())
            trace.append((eta, nll / n))
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
        return eta, trace

    def _min_fit(self) -> int:
        """Fewest positions the step's tuning fit may have: MIN_FIT_TOKENS, and FIT_PER_KEY_DIM per key dimension."""
        return max(MIN_FIT_TOKENS, FIT_PER_KEY_DIM * self.memory.dim_key)

    def held_out_positions(self) -> int:
        """Positions the step is tuned on: the last HELD_OUT_SHARE of what was learned, at most tune_tokens (0 when
        too little text was learned to fit on the rest, or after a load: the tail is learning state of this
        process)."""
        learned = int(self.memory.count)
        kept = self._tail[0][0].shape[0] if self._tail else 0
        held = min(kept, self.tune_tokens, int(learned * HELD_OUT_SHARE))
        return held if held >= MIN_HELD_OUT and learned - held >= self._min_fit() else 0

    def _choose_step(self, curvature: torch.Tensor) -> float:
        if self.step != "auto":
            return float(self.step)
        held = self.held_out_positions()
        if not held:
            restored = self._restored_step is not None
            step = self._restored_step if restored else self.default_step
            _log.info("faast: output layer: too little text to tune the step; using the %s step %s",
                      "saved" if restored else "default", step)  # fmt: skip
            self.last_tuning = {"step": step, "tuned": False, "saved_step": restored}
            return step
        keys, ys, s_tail, t_tail, n_tail, gap = self._tail_statistics(held)
        memory = self.memory
        dt = memory.gram.dtype
        # Fitted without the held-out positions: their statistics subtract exactly. The curvature keeps them: it
        # depends on the model's predictions only, not on the tokens that followed.
        w = self._newton(memory.gram - s_tail.to(dt), memory.cross - t_tail.to(dt), memory.count - n_tail.to(dt),
                         curvature)  # fmt: skip
        eta, trace = self._tune(keys, ys, w)
        self.last_tuning = {"step": eta, "tuned": True, "held_out_tokens": held, "document_gap_tokens": gap,
                            "fitted_tokens": int(memory.count) - held - gap, "held_out_nll": trace}  # fmt: skip
        return eta

    def folded(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """M = η·W [d, d] (activation dtype for bf16/fp16, else float32; float64 for float64), or None while empty
        or when the chosen step is 0. Cached until the statistics or the settings change."""
        compute = dtype if dtype in (torch.float64, torch.bfloat16, torch.float16) else torch.float32
        key = (self.memory.solution_key, self.curvature.solution_key, self.token_mass.solution_key, self.step,
               self.damping, self.tune_tokens, self.default_step, device, compute)  # fmt: skip
        if self._folded is None or self._folded[0] != key:
            m = None
            if float(self.memory.count) > 0:
                curvature = self._curvature()
                eta = self._choose_step(curvature)
                if eta > 0:
                    memory = self.memory
                    m = (eta * self._newton(memory.gram, memory.cross, memory.count, curvature)).to(compute)
            self._folded = (key, m)
        return self._folded[1]

    def chosen_step(self) -> float | None:
        """The step η the layer applies now (solving and tuning if the statistics changed); None while empty."""
        if float(self.memory.count) <= 0:
            return None
        if self.step != "auto":
            return float(self.step)
        self.folded(self.memory.gram.device, torch.float32)
        return float(self.last_tuning["step"])

    def restore_step(self, step: float | None) -> None:
        """Use `step` (saved with the statistics) where the step cannot be tuned; None: default_step again."""
        if step is not None and not (isinstance(step, (int, float)) and math.isfinite(step) and step >= 0):
            raise ValueError(f"step: expected a finite number >= 0 or None, got {step!r}")
        self._restored_step = None if step is None else float(step)
        self._folded = None

    def forget(self) -> None:
        """Drop everything learned: the statistics, the held-out buffer and any saved step."""
        for memory in (self.memory, self.curvature, self.token_mass):
            memory.reset()
        self._tail, self._restored_step, self._folded, self.last_tuning = [], None, None, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] (the final norm's output) -> hidden + hidden·M, same shape and dtype."""
        m = self.folded(hidden.device, hidden.dtype)
        return hidden if m is None else ops.residual_project(hidden, m)

    def tail_capacity_bytes(self) -> int:
        """Bytes the held-out buffer takes when full: (1 + GAP_MULTIPLE)·tune_tokens positions (float32 states, int64
        ids and documents)."""
        return (1 + GAP_MULTIPLE) * self.tune_tokens * (self.memory.dim_key * 4 + 8 + 8)
