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

    'probability' (the default):  p = (1 − λ)·softmax(z + γu) + λ·softmax(z + γu + (η·h̃W + β·b)Hᵀ),   z = h̃Hᵀ
    'logit':                      p = softmax(γu + (h̃ + η·h̃W + β·b)Hᵀ)                          (λ = 1 of the above)

with b = curvature⁻¹·Σr/N the Newton step on the mean learned gradient (β: ResidualOutput.bias) and u [V] the
learned text's token counts against the model's summed probabilities, log((c + κ)/(P + κ)) (γ:
ResidualOutput.token_bias); neither is tuned (bias.py).

The step η (and λ with weight='auto') is tuned on the end of every learned text (held_out.HeldOutTail; together at
most `tune_tokens` positions), scored by W fitted without those ends and up to gap_multiple times as many positions
before each (statistics subtract exactly): a 1-D Newton search on the held-out mixture's NLL (tuning.py), whose
mixture bounds what a wrong correction costs a token (at most −log(1−λ)). Where each held-out text has much fitted
text of its own, η is shrunk (diagnosis.document_shrink). State has a fixed size: d_key×d_key, d_key×d and d×d sums,
two V-vectors, a d-vector and a (1 + gap_multiple)·`tune_tokens` buffer. Every tuned constant of these rules is a
field of the layer's OutputPolicy (ResidualOutput.policy, faast/hf/output/policy.py). The step choice is
step.StepChoice, built per solve from the layer's state.

Measured on five local domains (benchmarks and choices: lab/experiments/lm_domains.py, docs/design.md §6.3).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ... import ops
from ...accumulator import Accumulator
from ...memory import FastWeights
from ..config import FaastConfig, ResidualOutput
from ..config_groups import check_real
from ..held_out import HeldOutTail
from ..progress import enabled, say_slow
from ..targets import LMHead
from . import bias as output_bias
from .diagnosis import MemoryOffWarning
from .head import HeadBuffers, head_gradients, head_second_moment, head_weight, pool_threshold, products_dtype
from .policy import OutputPolicy
from .read import mixed_logits
from .state import OutputState, checked_restored
from .step import StepChoice, StepSettings, fixed_weight, min_fit

_log = logging.getLogger("faast.hf")

# A solve's cache entry: (cache key, M, λ, key width, bias [d] or None, token bias [V] or None).
Folded = tuple[tuple, torch.Tensor | None, float, int, torch.Tensor | None, torch.Tensor | None]


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
            files lack it, OPTIONAL_IN_FILES: it loads empty there and the bias stays off). target_count:
            Accumulator whose `targets` [V] counts the learned targets (the token bias's c; optional in files too).
        space: 'probability' or 'logit' (ResidualOutput.space).
        step: 'auto' (tuned on the held-out tail at each solve) or a fixed η.
        weight: the mixture weight λ in probability space: 'auto' (tuned with η) or a fixed number in [0, 1].
        damping: δ, added as δ·mean(diag(C/N))·I before inverting the curvature.
        policy: the OutputPolicy whose tuned constants the layer's rules read (ResidualOutput.policy); setting it
            makes the next solve use the new one (an experiment probing a learned state).
        last_tuning: dict of the most recent solve: step, weight, held-out loss per step, tokens fitted / held out.
    """

    # read by faast.checkpoint; output_bias checks their coverage
    OPTIONAL_IN_FILES = ("gradient_sum", "target_count")

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
        self.target_count = Accumulator({"targets": (vocab_size,)}, device=device)
        self._bias, self._token_bias = float(output.bias), float(output.token_bias)
        self.step, self.damping = output.step, float(output.damping)
        self.space, self.weight = output.space, output.weight
        policy = output.policy
        default_step = output.default_step
        self.default_step = float(policy.default_step(self.space) if default_step is None else default_step)
        default_weight = output.default_weight
        self.default_weight = float(policy.default_weight if default_weight is None else default_weight)
        self.tune_tokens = output.tune_tokens
        self.head_dtype, self.head_pool_below = output.head_dtype, output.head_pool_below
        self.head_buffers = HeadBuffers()  # kept across a learn() call's batches (Learner), empty between calls
        # The held-out tail: the last tune_tokens learned positions (h̃ [n, d] float32, y [n], mask [n]). Learning
        # state of this process (not saved): after a load, step='auto' uses default_step until more text is learned.
        self.held_out = HeldOutTail(self.tune_tokens, policy=policy)
        self._policy = policy
        # The step and weight saved with the statistics (FaastModel.save_fast_weights writes the ones in use): after
        # a load they stand in for the defaults until they can be tuned again, so a loaded model reads like the saved
        # one.
        self._restored_step: float | None = None
        self._restored_weight: float | None = None
        self._restored_width: int | None = None
        self._head: tuple[LMHead, ...] = ()  # the model's LM head, held outside the module tree
        self._folded: Folded | None = None
        self.last_tuning: dict | None = None
        # Whether a solve that takes over a second says so on stderr (faast/hf/progress.py; None: when stderr is a
        # terminal): `saying` sets it for a FaastModel.solve(progress=...) call.
        self._progress: bool | None = None

    @property
    def policy(self) -> OutputPolicy:
        """The tuned constants the layer's rules read (ResidualOutput.policy)."""
        return self._policy

    @policy.setter
    def policy(self, policy: OutputPolicy) -> None:
        """Read `policy` from the next solve on (the held-out tail too). The untuned step and weight stay the ones
        the layer was built with; a tail kept under a smaller gap_multiple or held_out_share holds less than a larger
        one would ask for."""
        if not isinstance(policy, OutputPolicy):
            raise ValueError(f"policy: expected an OutputPolicy, got {policy!r}")
        self._policy, self.held_out.policy, self._folded = policy, policy, None

    @property
    def bias(self) -> float:
        """β, the mean-gradient bias's step (ResidualOutput.bias)."""
        return self._bias

    @bias.setter
    def bias(self, value: float) -> None:
        """Read β from the next solve on: nothing learned depends on it (the step is tuned without the biases). The
        layer's alone, as `policy`: the model's faast_config, and so a save, keep ResidualOutput.bias."""
        check_real("bias", value, low=0)
        self._bias = float(value)

    @property
    def token_bias(self) -> float:
        """γ, the token bias's step (ResidualOutput.token_bias)."""
        return self._token_bias

    @token_bias.setter
    def token_bias(self, value: float) -> None:
        """Read γ from the next solve on, as `bias`."""
        check_real("token_bias", value, low=0)
        self._token_bias = float(value)

    @contextlib.contextmanager
    def saying(self, progress: bool | None) -> Iterator[None]:
        """Inside, a solve over a second says so on stderr as `progress` asks (None: when stderr is a terminal)."""
        outer, self._progress = self._progress, progress
        try:
            yield
        finally:
            self._progress = outer

    def extra_repr(self) -> str:
        weight = f", weight={self.weight}" if self.space == "probability" else ""
        keys = f", extra_key_size={self.extra_key_size}" if self.extra_key_size else ""
        return (f"space={self.space}, step={self.step}{weight}, damping={self.damping}, tune_tokens={self.tune_tokens}"
                f"{keys}")  # fmt: skip

    def attach_head(self, head: LMHead) -> None:
        """The model's output embedding (LM head) whose gradients the layer fits; not a submodule of this layer."""
        self._head = (head,)

    @property
    def head(self) -> LMHead:
        if not self._head:
            raise RuntimeError("ResidualOutputLayer: no LM head attached (FaastModel attaches it)")
        return self._head[0]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ResidualOutputLayer:
        self._folded = None
        self.held_out.clear()
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ named memories (FaastModel)

    def new_state(self) -> OutputState:
        """An empty OutputState of this layer's shapes: another named memory."""
        return OutputState(self.memory.empty_like(), self.curvature.empty_like(), self.token_mass.empty_like(),
                           self.gradient_sum.empty_like(), HeldOutTail(self.tune_tokens, policy=self._policy),
                           target_count=self.target_count.empty_like())  # fmt: skip

    def current_state(self) -> OutputState:
        """The state read now (its objects, not copies), e.g. to merge it into another memory."""
        return OutputState(self.memory, self.curvature, self.token_mass, self.gradient_sum, self.held_out,
                           (self._restored_step, self._restored_weight, self._restored_width), self._folded,
                           self.last_tuning, target_count=self.target_count)  # fmt: skip

    def swap_state(self, state: OutputState) -> OutputState:
        """Read and learn `state` from now on; returns the state read before (its objects, not copies: O(1))."""
        same = isinstance(state, OutputState) and state.memory.config() == self.memory.config()
        if not same or state.token_mass.config() != self.token_mass.config():
            raise ValueError("state: expected an OutputState of this layer's shapes (from new_state)")
        previous = self.current_state()
        self.memory, self.curvature, self.token_mass = state.memory, state.curvature, state.token_mass
        self.gradient_sum, self.target_count = state.gradient_sum, state.target_count
        self.held_out, self._folded, self.last_tuning = state.held_out, state.folded, state.last_tuning
        self.held_out.policy = self._policy
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
        vocab = self.target_count.sums()["targets"].shape[0]
        self.target_count.add(count=positions, targets=torch.bincount(targets[pair_mask], minlength=vocab).double())
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
        products = products_dtype(self.head_dtype, keys, head_weight(self.head))
        pool = pool_threshold(self.head_pool_below, products, keys, self._policy)
        return head_gradients(self.head, keys, targets, mask, products, logits, pool, self.head_buffers, self._policy)

    # ------------------------------------------------------------------ solving

    def damped_curvature(self) -> torch.Tensor:
        """(C/N + δ·mean(diag(C/N))·I) [d, d] float64: the damped mean Fisher of the head."""
        n = self.curvature.count.clamp_min(1.0)
        mass, gram = self.token_mass.sums()["probability"], self.curvature.sums()["gram"]
        curvature = (head_second_moment(head_weight(self.head), mass) - gram) / n
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

    def untuned_step(self) -> float:
        """The step used when none can be tuned or was saved: default_step, scaled by positions /
        (policy.default_step_per_dim·d) while fewer positions than that are learned (d: the hidden size, the width an
        untuned correction reads)."""
        return self.default_step * self._data_scale()

    def step_choice(self) -> StepChoice:
        """A StepChoice of what the layer holds now (statistics, held-out tail, head, settings, policy): the step,
        weight and key width are chosen on it (`solution`), and its tail_statistics / tail_base / tail_logits /
        change_weight give the held-out rows' statistics and logits the choice reads."""
        settings = StepSettings(self.step, self.weight, self.space, self.default_weight, self.untuned_step(),
                                (self._restored_step, self._restored_weight, self._restored_width))  # fmt: skip
        return StepChoice(self.memory, self.held_out, self.head, self.head_dtype, self.head_buffers, self.hidden_size,
                          settings, self._policy, self.newton)  # fmt: skip

    def held_out_positions(self) -> int:
        """Positions the step is tuned on: the last round(f·n) of every learned document, f = min(held_out_share,
        tune_tokens / learned) (held_out.tail_plan); 0 when too little text was learned to fit on the rest, or
        after a load (the tail is learning state of this process)."""
        return self.held_out.held_positions(int(self.memory.count), min_fit(self._policy, self.hidden_size))

    def solution(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor | None, float]:
        """(M = η·W [width, d] in the activation dtype for bf16/fp16, else float32 (float64 for float64), λ): M is
        None while empty or when the chosen step or weight is 0. width: the key width chosen (`chosen_key_width`):
        d when M reads h̃ alone, d + extra_key_size when it reads the full keys. Cached until the statistics or the
        settings change."""
        folded = self.solved(device, dtype)
        return folded[1], folded[2]

    def solved(self, device: torch.device, dtype: torch.dtype) -> Folded:
        """`solution`'s cache entry (`Folded`: key, M, λ, key width, bias, token bias), solving first if the
        statistics or the settings changed."""
        compute = dtype if dtype in (torch.float64, torch.bfloat16, torch.float16) else torch.float32
        key = (self.memory.solution_key, self.curvature.state_key, self.token_mass.state_key,
               self.gradient_sum.state_key, self.target_count.state_key, self.step, self.weight, self.space,
               self.damping, self.tune_tokens, self.default_step, self.default_weight, self.bias, self.token_bias,
               self._policy, device, compute)  # fmt: skip
        if self._folded is None or self._folded[0] != key:
            started = time.perf_counter()
            m, lam, width, bias, tokens = None, 0.0, self.hidden_size, None, None
            if float(self.memory.count) > 0:
                curvature = self.damped_curvature()
                with self.head_buffers.kept():  # the head's cast for z1, once per solve
                    eta, lam, width, record = self.step_choice().choose(curvature)
                if record is not None:  # None: fixed step and weight, nothing chosen
                    self.last_tuning = record
                    if record.get("warning") is not None:
                        warnings.warn(str(record["warning"]), MemoryOffWarning, stacklevel=1)
                if eta > 0 and lam > 0:
                    memory = self.memory
                    w = self.newton(memory.gram, memory.cross, memory.count, curvature, width)
                    m = (eta * w[:width]).to(compute)
                    bias, beta, off = self.mean_gradient_bias(curvature)
                    tokens, gamma, tokens_off = self.token_logit_bias()
                    for what, why, size in (("bias", off, beta), ("token bias", tokens_off, gamma)):
                        if why and size > 0:  # said once per solve; last_tuning keeps the reason
                            _log.info("faast: output layer: no %s: %s", what, why)
                    self.last_tuning = {**(self.last_tuning or {}), "bias_step": 0.0 if off else beta, "bias_off": off,
                                        "token_bias_step": 0.0 if tokens_off else gamma,
                                        "token_bias_off": tokens_off}  # fmt: skip
                    bias = None if bias is None else bias.to(compute)
                    tokens = None if tokens is None else tokens.to(torch.promote_types(compute, torch.float32))
            self._folded = (key, m, lam, width, bias, tokens)
            say_slow("solving the output memory", time.perf_counter() - started, enabled(self._progress))
        return self._folded

    def _data_scale(self) -> float:
        """How far the untuned settings are scaled down: positions / (policy.default_step_per_dim·d), at most 1."""
        return min(1.0, float(self.memory.count) / (self._policy.default_step_per_dim * self.hidden_size))

    def mean_gradient_bias(self, curvature: torch.Tensor) -> tuple[torch.Tensor | None, float, str | None]:
        """(β'·curvature⁻¹·r̄ [d] float64 or None, β', why it is None): r̄ = Σ r / N the mean learned gradient, β' =
        `bias` scaled like `untuned_step`, curvature the damped one (output_bias.mean_gradient). None when β' is 0 or
        the gradient sum does not cover every learned position (statistics loaded from a file written before faast
        kept it)."""
        beta = self.bias * self._data_scale()
        bias, why = output_bias.mean_gradient(beta, self.gradient_sum, float(self.memory.count), curvature)
        return bias, beta, why

    def token_logit_bias(self) -> tuple[torch.Tensor | None, float, str | None]:
        """(γ·log((c + κ) / (P + κ)) [V] float64 or None, γ, why it is None): the token bias added to the logits of
        every corrected position (output_bias.token_bias), γ = `token_bias`. None when γ is 0 or the token counts do
        not cover every learned position (statistics from an older file)."""
        count, gamma = float(self.memory.count), self.token_bias
        tokens, why = output_bias.token_bias(gamma, self.target_count, self.token_mass, count, self._policy)
        return tokens, gamma, why

    def folded_bias(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The bias [d] added to every corrected position with M (`solution`'s dtype), None when there is none."""
        return self.solved(device, dtype)[4]

    def folded_token_bias(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The token bias γ·u [V] added to the logits of every corrected position (float32; float64 for float64),
        None when there is none (`token_logit_bias`) or M is None."""
        return self.solved(device, dtype)[5]

    def logit_bias(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Logit space: the head's output logits [..., V] plus the token bias (over the head's logit scale), same
        dtype; None when there is none (the logits stand)."""
        tokens = self.folded_token_bias(logits.device, logits.dtype)
        if self.space == "probability" or tokens is None:
            return None
        return logits + (tokens / float(getattr(self.head, "scale", 1.0))).to(logits.dtype)

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
        return float((self.last_tuning or {})["step"])

    def chosen_key_width(self) -> int | None:
        """How many key columns the correction reads now: d (h̃ alone) or d + extra_key_size; None while empty."""
        if float(self.memory.count) <= 0:
            return None
        return self.solved(self.memory.gram.device, torch.float32)[3]

    def chosen_weight(self) -> float | None:
        """The mixture weight λ the layer applies now (1.0 in logit space); None while empty."""
        if float(self.memory.count) <= 0:
            return None
        fixed = fixed_weight(self.space, self.weight)
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
        for memory in (self.memory, self.curvature, self.token_mass, self.gradient_sum, self.target_count):
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
        _, m, _, _, bias, _ = self.solved(hidden.device, hidden.dtype)
        if m is None:
            return hidden
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
        _, m, lam, _, bias, tokens = self.solved(hidden.device, hidden.dtype)
        if m is None:
            return logits
        if m.shape[0] != self.hidden_size:
            hidden = self.keys(hidden, extra)
        return mixed_logits(hidden, logits, m, lam, bias, tokens, self.head, overwrite=overwrite)

    def tail_capacity_bytes(self) -> int:
        """Bytes the held-out buffer takes at its usual fullest: (1 + gap_multiple)·tune_tokens positions (float16
        keys and gradients, int64 ids and documents; HeldOutTail.capacity_bytes)."""
        return self.held_out.capacity_bytes(self.memory.dim_key, self.hidden_size)
