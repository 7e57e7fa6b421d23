"""The residual output memory layer: the fast weights fitted to what the model gets wrong (docs/design.md §6.3).

After the final norm the LM head reads h̃ [d] and predicts p = softmax(h̃ Hᵀ) (H [V, d], the head's weight). For the
learned token y, the gradient of log p_y with respect to h̃ is r = H[y] − pH = Hᵀ(e_y − p): the direction that would
have raised the right token. The layer learns, in the same forward pass and without backprop,

    S = Σ h̃ h̃ᵀ,   T = Σ h̃ rᵀ          (a FastWeights(d, d): keys h̃, values r)
    C = Σ_t Cov_{p_t}(H) = Hᵀ diag(Σ p_t) H − Σ μ_t μ_tᵀ,  μ_t = p_t H      (the Fisher of the head, summed)

with W = S⁺ T (C/N + δ·mean(diag)·I)⁻¹. W is one Newton step on the log-likelihood of the learned tokens for a
linear correction h̃W, with a Kronecker-factored curvature (keys' Gram ⊗ the head's Fisher): S⁺T alone is the
gradient step, the Fisher whitens it so that directions where the logits are sensitive move less.

The keys can be wider than h̃: with ResidualOutput.key_layers, FaastModel appends the RMS-normalised inputs of
early blocks (`key_state`), k = [h̃; x̂_ℓ], S = Σ k kᵀ and the correction is kW [2d → d]. The h̃ block of S and T is
exactly the narrower statistics, so the solve uses the full keys only once enough text is fitted and they predict the
held-out tail better (docs/design.md §6.3). The model reads

    'probability' (the default):  p = (1 − λ)·softmax(z) + λ·softmax(z + (η·h̃W + β·b)Hᵀ),   z = h̃Hᵀ
    'logit':                      p = softmax((h̃ + η·h̃W + β·b)Hᵀ)                          (λ = 1 of the above)

with b = curvature⁻¹·Σr/N the Newton step on the mean learned gradient (β: ResidualOutput.bias, not tuned).

The step η (and λ with weight='auto') is tuned on the end of every learned text (held_out.HeldOutTail; together at
most `tune_tokens` positions), scored by W fitted without those ends and up to GAP_MULTIPLE times as many positions
before each (statistics subtract exactly): a 1-D Newton search on the held-out mixture's NLL (output_tuning), whose
mixture bounds what a wrong correction costs a token (at most −log(1−λ)). Where each held-out text has much fitted
text of its own, η is shrunk (output_diagnosis.document_shrink); output_folds scores the ends in folds instead. State
has a fixed size: d_key×d_key, d_key×d and d×d sums, a V- and a d-vector and a (1 + GAP_MULTIPLE)·`tune_tokens` buffer.

Measured on five local domains (benchmarks and choices: experiments/lm_domains.py, docs/design.md §6.3).
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
from torch import nn

from .. import ops
from ..accumulator import Accumulator
from ..memory import FastWeights
from . import output_folds
from . import output_tuning as tuning
from .config import FaastConfig, ResidualOutput
from .head import (
    READ_CHUNK,
    HeadBuffers,
    change_logits,
    float_products,
    head_gradients,
    head_logits,
    head_second_moment,
    pool_threshold,
    products_dtype,
)
from .held_out import HeldOutTail
from .mixture import read_blocks
from .output_diagnosis import MemoryOffWarning, diagnose, document_shrink
from .output_state import OutputState, checked_restored

_log = logging.getLogger("faast.hf")

# η when it cannot be tuned (too little text learned, nothing saved), per space, and λ when it is 'auto' and cannot be
# tuned: chosen on the validation domains after 2K tokens, for probability space at the default weight 0.5 (docs/
# design.md §6.3). ResidualOutput.default_step / default_weight override them.
DEFAULT_STEP = {"logit": 0.015, "probability": 0.03}
# ... chosen at 2K tokens, about DEFAULT_STEP_PER_DIM positions per hidden dimension of SmolLM2 (d = 576). A W fitted
# on fewer positions holds more noise, and the step that suits other text falls with the positions: after 1K tokens
# it was 0.012-0.016 on the three validation domains, where 0.03 made two of them worse than the base model. Below
# DEFAULT_STEP_PER_DIM·d learned positions the default step is scaled by positions / (DEFAULT_STEP_PER_DIM·d)
# (docs/design.md §6.3).
DEFAULT_STEP_PER_DIM = 3.5
DEFAULT_WEIGHT = 0.5
KEY_STATE_EPS = 1e-6  # key_state's guard against an all-zero state
MIX_ROWS = 32  # positions per block of the reading mixture's elementwise passes ([32, V] float32: 6 MB for V = 49K)


def key_state(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., d] (a block's input) scaled to unit root-mean-square per position, in hidden's dtype: the part of
    the residual output layer's keys ResidualOutput.key_layers adds. Normalised like the final norm's output (no
    learned scale), so that the Gram's blocks have comparable scales."""
    x = hidden if hidden.dtype == torch.float64 else hidden.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + KEY_STATE_EPS)).to(hidden.dtype)


class ResidualOutputLayer(nn.Module):
    """A correction η·h̃·W of the final norm's output h̃, W a Newton step fitted to the head's log-likelihood
    gradients, read in probability space (a mixture with the base prediction, weight λ) or in logit space.

    In logit space `forward` returns h̃ + η·h̃W and the model's head does the rest. In probability space `forward`
    leaves h̃ alone and `read_logits` turns the head's logits into the log of the mixture (FaastModel hooks it on
    the LM head).

    Attributes:
        memory: FastWeights(d + extra_key_size, d) of keys [h̃; extra] (h̃ alone when extra_key_size is 0) and
            values r = H[y] − pH (float64 statistics).
        curvature: Accumulator whose `gram` [d, d] sums μ_t μ_tᵀ (μ_t = p_t H) and `count` the positions;
        token_mass: Accumulator whose `probability` [V] sums p_t. Together they give the head's Fisher
            Σ_t Cov_{p_t}(H) = Hᵀ diag(Σ p) H − Σ μ μᵀ; faast.distributed and checkpoints sum and store them like
            the memory. gradient_sum: Accumulator whose `gradient` [d] sums r (the bias's mean gradient; older
            files lack it, OPTIONAL_IN_FILES: it loads empty there and the bias stays off).
        space: 'probability' or 'logit' (ResidualOutput.space).
        step: 'auto' (tuned on the held-out tail at each solve) or a fixed η.
        weight: the mixture weight λ in probability space: 'auto' (tuned with η) or a fixed number in [0, 1].
        damping: δ, added as δ·mean(diag(C/N))·I before inverting the curvature.
        last_tuning: dict of the most recent solve: step, weight, held-out loss per step, tokens fitted / held out.
    """

    OPTIONAL_IN_FILES = ("gradient_sum",)  # read by faast.checkpoint; mean_gradient_bias checks its coverage

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        config: FaastConfig,
        device: torch.device | None = None,
        extra_key_size: int = 0,
    ):
        super().__init__()
        d = hidden_size
        output = config.output
        if not isinstance(output, ResidualOutput):
            raise ValueError(f"config: a ResidualOutputLayer needs output=ResidualOutput(...), got {output!r}")
        if not isinstance(extra_key_size, int) or extra_key_size < 0:
            raise ValueError(f"extra_key_size: expected an int >= 0, got {extra_key_size!r}")
        self.hidden_size, self.extra_key_size = d, extra_key_size
        compute = torch.float32 if config.compute_dtype == "float32" else torch.float64
        # Keys [h̃; x] of width d + extra_key_size (x: the states FaastModel adds, key_state of early blocks' inputs);
        # values stay the d-wide gradients.
        self.memory = FastWeights(d + extra_key_size, d, alpha=output.alpha, compute_dtype=compute,
                                  device=device)  # fmt: skip
        # The Fisher Σ_t Cov_{p_t}(H) = Hᵀ diag(Σ_t p_t) H − Σ_t μ_t μ_tᵀ is kept as its two sums; the V×d×d
        # product is formed once per solve.
        self.curvature = Accumulator({"gram": (d, d)}, device=device)
        self.token_mass = Accumulator({"probability": (vocab_size,)}, device=device)
        self.gradient_sum = Accumulator({"gradient": (d,)}, device=device)
        self.bias = float(output.bias)
        self.step, self.damping = output.step, float(output.damping)
        self.space, self.weight = output.space, output.weight
        default_step = output.default_step
        self.default_step = float(DEFAULT_STEP[self.space] if default_step is None else default_step)
        default_weight = output.default_weight
        self.default_weight = float(DEFAULT_WEIGHT if default_weight is None else default_weight)
        self.tune_tokens = output.tune_tokens
        self.head_dtype, self.head_pool_below = output.head_dtype, output.head_pool_below
        self.head_buffers = HeadBuffers()  # kept across a learn() call's batches (Learner), empty between calls
        # The held-out tail: the last tune_tokens learned positions (h̃ [n, d] float32, y [n], mask [n]). Learning
        # state of this process (not saved): after a load, step='auto' uses default_step until more text is learned.
        self.held_out = HeldOutTail(self.tune_tokens)
        # The step and weight saved with the statistics (FaastModel.save_fast_weights writes the ones in use): after
        # a load they stand in for the defaults until they can be tuned again, so a loaded model reads like the saved
        # one.
        self._restored_step: float | None = None
        self._restored_weight: float | None = None
        self._restored_width: int | None = None
        self._head: tuple[nn.Module, ...] = ()  # the model's LM head, held outside the module tree
        # (cache key, M, λ, key width, bias [d] or None)
        self._folded: tuple[tuple, torch.Tensor | None, float, int, torch.Tensor | None] | None = None
        self.last_tuning: dict | None = None

    def extra_repr(self) -> str:
        weight = f", weight={self.weight}" if self.space == "probability" else ""
        keys = f", extra_key_size={self.extra_key_size}" if self.extra_key_size else ""
        return (f"space={self.space}, step={self.step}{weight}, damping={self.damping}, tune_tokens={self.tune_tokens}"
                f"{keys}")  # fmt: skip

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
        self.held_out.clear()
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ named memories (FaastModel)

    def new_state(self) -> OutputState:
        """An empty OutputState of this layer's shapes: another named memory."""
        return OutputState(self.memory.empty_like(), self.curvature.empty_like(), self.token_mass.empty_like(),
                           self.gradient_sum.empty_like(), HeldOutTail(self.tune_tokens))  # fmt: skip

    def current_state(self) -> OutputState:
        """The state read now (its objects, not copies), e.g. to merge it into another memory."""
        return OutputState(self.memory, self.curvature, self.token_mass, self.gradient_sum, self.held_out,
                           (self._restored_step, self._restored_weight, self._restored_width), self._folded,
                           self.last_tuning)  # fmt: skip

    def swap_state(self, state: OutputState) -> OutputState:
        """Read and learn `state` from now on; returns the state read before (its objects, not copies: O(1))."""
        same = isinstance(state, OutputState) and state.memory.config() == self.memory.config()
        if not same or state.token_mass.config() != self.token_mass.config():
            raise ValueError("state: expected an OutputState of this layer's shapes (from new_state)")
        previous = self.current_state()
        self.memory, self.curvature, self.token_mass = state.memory, state.curvature, state.token_mass
        self.gradient_sum = state.gradient_sum
        self.held_out, self._folded, self.last_tuning = state.held_out, state.folded, state.last_tuning
        self._restored_step, self._restored_weight, self._restored_width = state.restored
        return previous

    # ------------------------------------------------------------------ learning

    @torch.no_grad()
    def learn(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        pair_mask: torch.Tensor,
        documents: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        hold_out: bool = True,
    ) -> None:
        """Add the positions of hidden [B, T, d] (the final norm's output) that predict targets [B, T-1] (the next
        token ids) where pair_mask [B, T-1] is True. documents [B] int64: which document each row belongs to,
        non-decreasing along the stream (-1 or None: unknown); the step tuning uses it to leave the text just before
        the held-out tail out of its fit when both come from one document. extra [B, T, extra_key_size]: the rest of
        each position's key (key_state of the configured blocks' inputs), required when extra_key_size > 0. logits
        [B, T-1, V]: the head's logits of the learned positions when already computed (a stream scored them with
        them). hold_out: keep the positions in the held-out tail the step is tuned on (a stream tunes its own)."""
        states = hidden[:, :-1]
        keys = self.keys(hidden, extra)[:, :-1]
        if targets.shape != keys.shape[:-1] or pair_mask.shape != targets.shape:
            raise ValueError(f"targets, pair_mask: expected shape {tuple(keys.shape[:-1])}, got "
                             f"{tuple(targets.shape)} and {tuple(pair_mask.shape)}")  # fmt: skip
        if documents is not None and documents.shape != keys.shape[:1]:
            raise ValueError(f"documents: expected shape {tuple(keys.shape[:1])}, got {tuple(documents.shape)}")
        if logits is not None and logits.shape[:-1] != targets.shape:
            raise ValueError(f"logits: expected shape {[*targets.shape, '*']}, got {list(logits.shape)}")
        grads, mean_gram, prob_sum = self.gradients(states, targets, pair_mask, logits)
        k = keys if keys.dtype == torch.float64 else keys.float()
        self.memory.update(k, grads.to(k.dtype), mask=pair_mask)
        positions = pair_mask.sum().to(torch.float64)
        self.curvature.add(count=positions, gram=mean_gram)
        self.token_mass.add(count=positions, probability=prob_sum)
        self.gradient_sum.add(count=positions, gradient=grads.sum((0, 1), dtype=torch.float64))  # 0 where masked
        if self.tune_tokens and hold_out:
            self.held_out.keep(keys, targets, pair_mask, documents, grads)

    def keys(self, hidden: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """The keys [..., d + extra_key_size] of hidden [..., d] (the final norm's output) and extra [...,
        extra_key_size] (same leading shape; None when extra_key_size is 0), in hidden's dtype."""
        if not self.extra_key_size:
            if extra is not None:
                raise ValueError("extra: this layer's keys are h̃ alone (extra_key_size=0), got extra states")
            return hidden
        if extra is None or extra.shape[:-1] != hidden.shape[:-1] or extra.shape[-1] != self.extra_key_size:
            got = None if extra is None else list(extra.shape)
            raise ValueError(f"extra: expected shape {[*hidden.shape[:-1], self.extra_key_size]} (the states that "
                             f"widen the keys), got {got}")  # fmt: skip
        return torch.cat([hidden, extra.to(hidden.dtype)], -1)

    def gradients(
        self, keys: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the head's inputs keys [B, T-1, d] (h̃), the next tokens targets [B, T-1] and mask [B, T-1] (bool): (the
        log-likelihood gradients r = H[y] − pH [B, T-1, d] float32, zero where masked; Σ μ μᵀ [d, d] and Σ p [V]
        float64 over unmasked positions); faast/hf/head.py. logits [B, T-1, V]: the head's logits of those positions
        when already computed (a stream scored them)."""
        products = products_dtype(self.head_dtype, keys)
        pool = pool_threshold(self.head_pool_below, products, keys)
        return head_gradients(self.head, keys, targets, mask, products, logits, pool, self.head_buffers)

    # ------------------------------------------------------------------ solving

    def damped_curvature(self) -> torch.Tensor:
        """(C/N + δ·mean(diag(C/N))·I) [d, d] float64: the damped mean Fisher of the head."""
        n = self.curvature.count.clamp_min(1.0)
        curvature = (head_second_moment(self.head.weight, self.token_mass.probability) - self.curvature.gram) / n
        shift = self.damping * curvature.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny)
        return curvature + shift * torch.eye(curvature.shape[-1], dtype=torch.float64, device=curvature.device)

    def newton(
        self,
        gram: torch.Tensor,
        cross: torch.Tensor,
        count: torch.Tensor,
        curvature: torch.Tensor,
        width: int | None = None,
    ) -> torch.Tensor:
        """W = S⁺T·curvature⁻¹, float64 [d_key, d], for the given key statistics, fitted on the first `width` key
        columns only (the rows of W beyond them are 0): S's leading block and T's leading rows are exactly the
        statistics of the narrower keys. width None: all of them."""
        width = gram.shape[-1] if width is None else width
        w = ops.solve_fast_weights(gram[:width, :width], cross[:width], count=count, alpha=self.memory.alpha)
        w = torch.linalg.solve(curvature, w.T).T  # curvature is symmetric
        if width < gram.shape[-1]:
            w = torch.cat([w, w.new_zeros((gram.shape[-1] - width, w.shape[-1]))])
        return w

    def tail_statistics(self) -> tuple:
        """The positions the step is tuned on now (HeldOutTail.split): (keys [m, d_key] float32, targets [m] and
        documents [m] of the sampled held-out positions; the S [d_key, d_key], T [d_key, d] float64 and count of every
        position the fit leaves out; how many are held out; how many are gaps before them)."""
        keys, ys, docs, out_k, out_v, held, gap = self.held_out.split(int(self.memory.count), self._min_fit())
        # float32 products of the kept (rounded) keys and gradients: their rounding already bounds the precision.
        k32 = out_k.float()
        count = torch.tensor(float(held + gap), dtype=torch.float64, device=out_k.device)
        return keys, ys, docs, (k32.T @ k32).double(), (k32.T @ out_v.float()).double(), count, held, gap

    def tail_logits(
        self,
        keys: torch.Tensor,
        ys: torch.Tensor,
        w: torch.Tensor,
        base: tuple | None = None,
        rows: slice = slice(None),
        out: torch.Tensor | None = None,
    ) -> tuning.Logits:
        """(z0 [m, V] float32 and z1 [m, V] in `change_weight`'s dtype, the logits of the keys' h̃ and their change
        per unit step keys·w through the head without its bias; both at the targets ys [n], float32) for the keys
        [n, d_key] at `rows` (default all m = n). base: `tail_base` of the same keys, reused. out: a [n, V] buffer of
        z1's dtype written at `rows` (two calls on complementary rows fill one)."""
        if base is None:
            base = self.tail_base(keys, ys)
        weight = self.change_weight()
        if out is None:
            out = torch.empty((keys.shape[0], base[0].shape[-1]), dtype=weight.dtype, device=keys.device)
        z1 = change_logits(self.head, keys[rows] @ w.float(), out=out[rows], weight=weight)
        return base[0][rows], z1, base[1][rows], z1.gather(-1, ys[rows, None]).squeeze(-1).float()

    def change_weight(self) -> torch.Tensor:
        """The head's weight [V, d] in the dtype the step's tuning forms z1 in: the head products' (`head_dtype`;
        'auto' is bfloat16 where the device multiplies it natively: half the time and memory, docs/design.md §6.3),
        float32 where they are int8 (only learning's logits are)."""
        products = float_products(products_dtype(self.head_dtype, self.head.weight))
        return self.head_buffers.weight(self.head.weight, products)

    def tail_base(self, keys: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z0 [n, V] float32, its entries at the targets ys [n]): the base logits of the keys' h̃ [n, d_key]."""
        z0 = head_logits(self.head, keys[:, : self.hidden_size])
        return z0, z0.gather(-1, ys[:, None]).squeeze(-1)

    def _min_fit(self) -> int:
        """Fewest positions the step's tuning fit may have: MIN_FIT_TOKENS, and FIT_PER_KEY_DIM per key dimension."""
        return max(tuning.MIN_FIT_TOKENS, tuning.FIT_PER_KEY_DIM * self.hidden_size)

    def held_out_positions(self) -> int:
        """Positions the step is tuned on: the last round(f·n) of every learned document, f = min(HELD_OUT_SHARE,
        tune_tokens / learned) (held_out.tail_plan); 0 when too little text was learned to fit on the rest, or
        after a load (the tail is learning state of this process)."""
        return self.held_out.held_positions(int(self.memory.count), self._min_fit())

    def untuned_step(self) -> float:
        """The step used when none can be tuned or was saved: default_step, scaled by positions /
        (DEFAULT_STEP_PER_DIM·d) while fewer positions than that are learned (d: the hidden size, the width an
        untuned correction reads)."""
        full = DEFAULT_STEP_PER_DIM * self.hidden_size
        return self.default_step * min(1.0, float(self.memory.count) / full)

    def _fixed_weight(self) -> float | None:
        """λ when it is not tuned: 1 in logit space (the correction replaces the base logits), else the configured
        number; None for 'auto'."""
        if self.space == "logit":
            return 1.0
        return None if self.weight == "auto" else float(self.weight)

    def _widths(self, fitted: int) -> list[int]:
        """Key widths a fit on `fitted` positions may use: h̃ alone (d), and the full keys when they are wider and
        at least FIT_PER_KEY_DIM positions per key dimension are fitted."""
        d, full = self.hidden_size, self.memory.dim_key
        return [d, full] if full > d and fitted >= tuning.FIT_PER_KEY_DIM * full else [d]

    def _choose_step(self, curvature: torch.Tensor) -> tuple[float, float, int]:
        """(η, λ, key width) for the current statistics: fixed ones, tuned ones, or the saved/default ones when too
        little text was learned to tune them. The width is the full keys' where enough text was fitted to tune them
        and they give the lower held-out NLL; else h̃ alone (d)."""
        fixed_step = None if self.step == "auto" else float(self.step)
        fixed_weight = self._fixed_weight()
        held = self.held_out_positions()
        if fixed_step is not None and fixed_weight is not None:
            fitted = int(self.memory.count) - held if held else int(self.memory.count)
            return fixed_step, fixed_weight, self._widths(fitted)[-1]
        if not held:
            restored = self._restored_step is not None or self._restored_weight is not None
            step = fixed_step if fixed_step is not None else self._restored_step
            step = self.untuned_step() if step is None else step
            weight = fixed_weight if fixed_weight is not None else self._restored_weight
            weight = self.default_weight if weight is None else weight
            width = self.hidden_size if self._restored_width is None else self._restored_width
            _log.info("faast: output layer: too little text to tune the step; using the %s step %s and weight %s",
                      "saved" if restored else "default", step, weight)  # fmt: skip
            self.last_tuning = {"step": step, "weight": weight, "tuned": False, "saved_step": restored,
                                "key_width": width}  # fmt: skip
            return step, weight, width
        keys, ys, docs, s_tail, t_tail, n_tail, held, gap = self.tail_statistics()
        memory = self.memory
        dt = memory.gram.dtype
        fitted = int(memory.count) - held - gap
        widths = self._widths(fitted)
        # With two widths and many held-out rows, the width is chosen on a sample (its rows first), and only the chosen
        # width's change is formed for the rest: the [n, V] head products are most of the solve's time.
        sampled = keys.shape[0]
        if len(widths) > 1 and keys.shape[0] >= tuning.WIDTH_SAMPLE_MIN_ROWS:
            order, sampled = tuning.sample_first(keys.shape[0], keys.device)
            keys, ys, docs = keys[order], ys[order], docs[order]
        base = self.tail_base(keys, ys)  # the base logits are the same for every width
        log_base = tuning.base_log_targets((base[0], None, base[1], None))
        sample_rows, results = slice(0, sampled), {}
        for width in widths:
            # Fitted without the held-out positions: their statistics subtract exactly. The curvature keeps them: it
            # depends on the model's predictions only, not on the tokens that followed.
            w = self.newton(memory.gram - s_tail.to(dt), memory.cross - t_tail.to(dt), memory.count - n_tail.to(dt),
                             curvature, width)  # fmt: skip
            out = base[0].new_empty(base[0].shape, dtype=self.change_weight().dtype)  # z1 [n, V]: sample, then rest
            logits = self.tail_logits(keys, ys, w, base, sample_rows, out)
            start = max((r[1] for r in results.values()), default=0.0)  # the narrower keys' step
            tuned = tuning.tune_width(logits, log_base[sample_rows], fixed_step, fixed_weight, start, len(widths) > 1)
            results[width] = (*tuned, logits, w, out)
        # The narrower keys win ties: a wider W fitted on the same text is the noisier one.
        width = min(results, key=lambda k: (results[k][0], k))
        _, eta, lam, trace, rows, logits, w, out = results[width]
        if sampled < keys.shape[0]:  # the chosen width on every held-out row, from the sample's step
            rest = self.tail_logits(keys, ys, w, base, slice(sampled, None), out)
            logits = (base[0], out, base[1], torch.cat([logits[3], rest[3]]))
            start = min(trace, key=lambda t: t[-1])[0]  # the sample's best step, before its significance test
            tuned = tuning.tune_width(logits, log_base, fixed_step, fixed_weight, start, compare=False, sampled=True)
            _, eta, lam, trace, rows = tuned
        one_fit, fold = eta, output_folds.FoldTuning(None, "fixed step or weight 0")
        if lam > 0 and fixed_step is None:  # the held-out ends in folds (also where η is 0), taken where much larger
            spare = next((r[-1] for k, r in results.items() if k != width), None)  # the other width's z1
            fold = output_folds.fold_tuning(self, keys, ys, docs, base, log_base, width, curvature, lam, eta,
                                            self._min_fit(), spare)  # fmt: skip
            eta, trace, rows, logits = fold.taken or (eta, trace, rows, logits)
        check_weight = lam if lam > 0 else (fixed_weight if fixed_weight is not None else self.default_weight)
        candidate = min(trace, key=lambda t: t[-1])[0]  # the search's best step, before the significance test
        diagnosis = diagnose(logits, docs, eta, check_weight, candidate, rows, log_base)
        documents = self.held_out.documents(int(memory.count), self._min_fit())
        shrink = document_shrink(fitted, documents, self.hidden_size) if fixed_step is None else 1.0
        tail_step, eta = eta, eta * shrink
        if shrink < 1.0:
            _log.info("faast: output layer: %.0f fitted positions per held-out text, so the tail's step %.3g is "
                      "shrunk ×%.2f", fitted / max(documents, 1), tail_step, shrink)  # fmt: skip
        self.last_tuning = {"step": eta, "weight": lam, "tuned": True, "held_out_tokens": held,
                            "held_out_documents": documents, "tail_step": tail_step, "document_shrink": shrink,
                            "document_gap_tokens": gap, "fitted_tokens": fitted, "key_width": width,
                            "one_fit_step": one_fit, "fold_step": fold.step, "fold_check": fold.check,
                            "held_out_nll": trace, **diagnosis,
                            "by_key_width": {k: {"held_out_nll": v[0], "step": v[1], "weight": v[2], "rows": sampled}
                                             for k, v in results.items() if len(results) > 1}}  # fmt: skip
        if diagnosis["warning"] is not None:
            warnings.warn(diagnosis["warning"], MemoryOffWarning, stacklevel=2)
        return eta, lam, width

    def solution(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor | None, float]:
        """(M = η·W [width, d] in the activation dtype for bf16/fp16, else float32 (float64 for float64), λ): M is
        None while empty or when the chosen step or weight is 0. width: the key width chosen (`chosen_key_width`):
        d when M reads h̃ alone, d + extra_key_size when it reads the full keys. Cached until the statistics or the
        settings change."""
        compute = dtype if dtype in (torch.float64, torch.bfloat16, torch.float16) else torch.float32
        key = (self.memory.solution_key, self.curvature.state_key, self.token_mass.state_key,
               self.gradient_sum.state_key, self.step, self.weight, self.space, self.damping, self.tune_tokens,
               self.default_step, self.default_weight, self.bias, device, compute)  # fmt: skip
        if self._folded is None or self._folded[0] != key:
            m, lam, width, bias = None, 0.0, self.hidden_size, None
            if float(self.memory.count) > 0:
                curvature = self.damped_curvature()
                with self.head_buffers.kept():  # the head's cast for z1, once per solve
                    eta, lam, width = self._choose_step(curvature)
                if eta > 0 and lam > 0:
                    memory = self.memory
                    w = self.newton(memory.gram, memory.cross, memory.count, curvature, width)
                    m = (eta * w[:width]).to(compute)
                    bias, beta, off = self.mean_gradient_bias(curvature)
                    if off and beta > 0:  # said once per solve; last_tuning keeps the reason
                        _log.info("faast: output layer: no bias: %s", off)
                    self.last_tuning = {**(self.last_tuning or {}), "bias_step": 0.0 if off else beta, "bias_off": off}
                    bias = None if bias is None else bias.to(compute)
            self._folded = (key, m, lam, width, bias)
        return self._folded[1], self._folded[2]

    def mean_gradient_bias(self, curvature: torch.Tensor) -> tuple[torch.Tensor | None, float, str | None]:
        """(β'·curvature⁻¹·r̄ [d] float64 or None, β', why it is None): r̄ = Σ r / N the mean learned gradient, β' =
        `bias` scaled like `untuned_step`, curvature the damped one. None when β' is 0 or the gradient sum does not
        cover every learned position (statistics loaded from a file written before faast kept it)."""
        count, covered = float(self.memory.count), float(self.gradient_sum.count)
        beta = self.bias * min(1.0, count / (DEFAULT_STEP_PER_DIM * self.hidden_size))
        if beta <= 0.0:
            return None, beta, "ResidualOutput.bias is 0"
        if abs(covered - count) > 1e-9 * count:
            why = f"the gradient sum covers {covered:.0f} of {count:.0f} positions (saved before it was kept)"
            return None, beta, why
        mean = self.gradient_sum.gradient.to(curvature.device) / count
        return beta * torch.linalg.solve(curvature, mean), beta, None

    def folded_bias(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The bias [d] added to every corrected position with M (`solution`'s dtype), None when there is none."""
        self.solution(device, dtype)
        return self._folded[4]

    def folded(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """M = η·W [width, d] of `solution` (None while empty or when η or λ is 0)."""
        return self.solution(device, dtype)[0]

    def chosen_step(self) -> float | None:
        """The step η the layer applies now (solving and tuning if the statistics changed); None while empty."""
        if float(self.memory.count) <= 0:
            return None
        if self.step != "auto":
            return float(self.step)
        self.folded(self.memory.gram.device, torch.float32)
        return float(self.last_tuning["step"])

    def chosen_key_width(self) -> int | None:
        """How many key columns the correction reads now: d (h̃ alone) or d + extra_key_size; None while empty."""
        if float(self.memory.count) <= 0:
            return None
        self.folded(self.memory.gram.device, torch.float32)
        return self._folded[3]

    def chosen_weight(self) -> float | None:
        """The mixture weight λ the layer applies now (1.0 in logit space); None while empty."""
        if float(self.memory.count) <= 0:
            return None
        fixed = self._fixed_weight()
        return fixed if fixed is not None else self.solution(self.memory.gram.device, torch.float32)[1]

    def restore_step(self, step: float | None, weight: float | None = None, key_width: int | None = None) -> None:
        """Use `step`, `weight` and `key_width` (saved with the statistics) where they cannot be tuned; None: the
        defaults (h̃ alone for the width)."""
        widths = sorted({self.hidden_size, self.memory.dim_key})
        step, weight, key_width = checked_restored(step, weight, key_width, widths)
        self._restored_step, self._restored_weight, self._restored_width, self._folded = step, weight, key_width, None

    def discard_held_out(self) -> None:
        """Drop the held-out tail: after a load, what was learned before it is not in the loaded statistics."""
        self.held_out.clear()
        self._folded = None

    def forget(self) -> None:
        """Drop everything learned: the statistics, the held-out buffer and any saved step and weight."""
        for memory in (self.memory, self.curvature, self.token_mass, self.gradient_sum):
            memory.reset()
        self.held_out.clear()
        self._restored_step, self._restored_weight, self._restored_width = None, None, None
        self._folded, self.last_tuning = None, None

    def forward(self, hidden: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, d] (the final norm's output) -> hidden + key·M in logit space (key = [hidden; extra] when M
        reads the full keys, else hidden; extra [B, T, extra_key_size] as in `learn`), same shape and dtype;
        unchanged in probability space (read_logits mixes at the head)."""
        if self.space == "probability":
            return hidden
        m = self.folded(hidden.device, hidden.dtype)
        if m is None:
            return hidden
        bias = self._folded[4]
        if m.shape[0] == self.hidden_size:
            out = ops.residual_project(hidden, m)
            return out if bias is None else out + bias.to(out.dtype)
        change = self.keys(hidden, extra).to(m.dtype) @ m
        return hidden + (change if bias is None else change + bias).to(hidden.dtype)

    def read_logits(
        self, hidden: torch.Tensor, logits: torch.Tensor, extra: torch.Tensor | None = None, *, overwrite: bool = False
    ) -> torch.Tensor:
        """Probability space: the head's output logits [..., V] for its input hidden [..., d] (the final norm's output)
        -> log((1 − λ)·softmax(z) + λ·softmax(z + (key·M)Hᵀ)) with z the logits the model reads (the head's output
        times the type's logit scale), divided by that scale again so the model's own scaling restores it; key =
        [hidden; extra] (extra [..., extra_key_size], as in `learn`) when M reads the full keys, else hidden. Same
        shape and dtype, computed in float32 (float64 for float64 logits), differentiable in hidden and logits.
        Unchanged while empty or in logit space. overwrite: `logits` is the caller's to reuse (mixture.read_blocks)."""
        if self.space != "probability":
            return logits
        m, lam = self.solution(hidden.device, hidden.dtype)
        if m is None:
            return logits
        if m.shape[0] != self.hidden_size:
            hidden = self.keys(hidden, extra)
        scale = float(getattr(self.head, "scale", 1.0))
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        # The logit change goes through the head in the model's own 16-bit dtype, as the head itself does (a float32
        # copy of a 49K-row head per forward, and float32 products, cost more than the model's own head on a GPU).
        head_dtype = hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float16) else compute
        weight = self.head.weight.to(head_dtype)  # the scaled head for a type that scales its logits (ScaledHead)
        rows_h, rows_z = hidden.reshape(-1, hidden.shape[-1]), logits.reshape(-1, logits.shape[-1])
        # On a CPU the mixture's [rows, V] temporaries should stay in cache; on a GPU small blocks only add launches.
        block = READ_CHUNK if hidden.device.type == "cuda" else MIX_ROWS
        odds, rest = (0.0, 0.0) if lam >= 1.0 else (math.log(lam / (1.0 - lam)), math.log1p(-lam))
        change = rows_h.to(m.dtype) @ m
        if self._folded[4] is not None:
            change += self._folded[4]
        out = read_blocks(change, rows_z, weight, compute=compute, scale=scale, log_odds=odds, log_rest=rest,
                          full=lam >= 1.0, chunk=READ_CHUNK, block=block, overwrite=overwrite)  # fmt: skip
        return out.reshape(logits.shape)

    def tail_capacity_bytes(self) -> int:
        """Bytes the held-out buffer takes at its usual fullest: (1 + GAP_MULTIPLE)·tune_tokens positions (float16
        keys and gradients, int64 ids and documents; HeldOutTail.capacity_bytes)."""
        return self.held_out.capacity_bytes(self.memory.dim_key, self.hidden_size)
