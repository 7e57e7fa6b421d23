"""Streaming ("learn while reading") baselines of lab/experiments/lm_stream.py (issue 35).

A token stream is read in chunks of C tokens; each chunk is scored with what was learned from the chunks before it
(prequentially), then learned. Every method scores the windows of faast.hf.reading.chunk_windows (window t holds
chunk t and, for t >= 1, the last token of chunk t - 1 as context, so every adjacent pair is predicted once) and
gives one NLL per predicted token, so the methods compare token for token. Each method has the same shape:

- `score(window [1, L] int64) -> (token NLL [L - 1] float64, seconds)`: with the state learned so far;
- `update(window) -> seconds`: learn the window just scored (the scoring pass is not part of this time);
- `close()`: give the model back exactly as it was (LoRA unloaded, trained blocks restored), so the next method
  starts from the pristine model.

Methods: `ZeroShot`; dynamic evaluation (Krause et al., 2018) with persistent AdamW state, on LoRA adapters
(`DynamicEvalLora`) or on the last blocks (`DynamicEvalBlocks`); the neural cache (Grave et al., 2017; `NeuralCache`);
the kNN-LM over the stream (`KnnStream`, lm_baselines.knnlm's datastore growing window by window). `run_stream` runs
one over a stream; `run_faast` runs faast.hf.reading.read_stream and returns the same record. `stream_states` and
`cache_grid` / `knn_grid` score the cache's and the kNN-LM's settings grids from one base forward per window.

With a FaastModel, the baselines run its base model with the memory layers disabled (its outputs bit for bit).
Experiment code, not part of the faast package (faast_lab.experiments.lm_baselines.stream).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from faast.hf.targets import get_submodule, target_for

from .backprop import apply_lora
from .knnlm import KNNLM, KNNConfig


def _is_faast(model: nn.Module) -> bool:
    # A FaastModel delegates unknown attributes to its base model, and plain transformers models have no
    # disable_faast, so this tells the two apart (`base_model` does not: transformers models have one too).
    try:
        return callable(model.disable_faast)
    except AttributeError:
        return False


def prequential_ppl(token_nll: torch.Tensor, tokens: Sequence[int], skip_first: bool = True) -> float:
    """exp of the mean NLL over every predicted token of the chunks after the first (token_nll [N - 1] float64 in
    stream order, tokens: predicted tokens per chunk); skip_first=False: over all of them."""
    start = int(tokens[0]) if skip_first and len(tokens) > 1 else 0
    rest = token_nll[start:]
    return math.exp(float(rest.double().mean())) if rest.numel() else math.nan


class StreamMethod:
    """The frozen model read chunk by chunk (the zero-shot baseline; the others subclass it).

    model: a causal LM or a FaastModel (then its base model runs with the memory layers disabled).
    """

    name = "zero-shot"

    def __init__(self, model: nn.Module):
        self.model = model
        self.net = model.base_model if _is_faast(model) else model
        self.module: nn.Module = self.net  # what the forward pass calls (a peft wrapper for LoRA)
        self.device = next(self.net.parameters()).device
        self._stash: tuple[torch.Tensor, torch.Tensor] | None = None

    def _plain(self) -> contextlib.AbstractContextManager:
        return self.model.disable_faast() if _is_faast(self.model) else contextlib.nullcontext()

    def forward(self, window: torch.Tensor, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probabilities of the window's next tokens [L - 1] float64, the LM head's inputs at the predicted
        positions [L - 1, d] float32 or None) for window [1, L] int64, under no_grad in eval mode."""
        seen: dict[str, torch.Tensor] = {}
        handle = None
        if hidden:
            head = self.module.get_output_embeddings()
            handle = head.register_forward_pre_hook(lambda m, args: seen.__setitem__("h", args[0]))
        try:
            with self._plain(), torch.no_grad():
                logits = self.module(input_ids=window, use_cache=False).logits
        finally:
            if handle is not None:
                handle.remove()
        # log_softmax in float32 (a [L, V] float64 copy would cost 400 MB at V = 49K); the gathered values in float64.
        logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        target = logp.gather(-1, window[0, 1:].unsqueeze(-1)).squeeze(-1).double()
        return target, (seen["h"][0, :-1].float() if hidden else None)

    def score(self, window: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(NLL of each predicted token [L - 1] float64, seconds) for window [1, L] int64."""
        began = time.perf_counter()
        lm, _ = self.forward(window)
        return -lm, time.perf_counter() - began

    def update(self, window: torch.Tensor) -> float:  # noqa: ARG002 - the zero-shot model learns nothing
        """Learn the window just scored; returns the seconds it took."""
        return 0.0

    def close(self) -> None:
        """Give the model back as it was before this method touched it."""

    def settings(self) -> dict:
        return {}


ZeroShot = StreamMethod


class DynamicEval(StreamMethod):
    """Dynamic evaluation: after scoring a window, `steps` AdamW steps (no weight decay, default betas, state kept
    across chunks) on its next-token cross-entropy; gradients clipped to norm 1, as lm_baselines.fit_causal_lm
    clips them, so one unusual chunk cannot throw the weights far. The model stays in eval mode (no dropout)."""

    name = "dynamic-eval"

    def __init__(self, model: nn.Module, lr: float, steps: int = 1):
        super().__init__(model)
        if steps < 1 or lr <= 0:
            raise ValueError(f"lr, steps: expected lr > 0 and steps >= 1, got {lr!r}, {steps!r}")
        self.lr, self.steps = float(lr), int(steps)
        self.params = self._trainable()
        self.optimizer = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=0.0)

    def _trainable(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def update(self, window: torch.Tensor) -> float:
        began = time.perf_counter()
        with self._plain(), torch.enable_grad():
            for _ in range(self.steps):
                loss = self.module(input_ids=window, labels=window, use_cache=False).loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                self.optimizer.step()
        return time.perf_counter() - began

    def settings(self) -> dict:
        return {"lr": self.lr, "steps": self.steps}


class DynamicEvalLora(DynamicEval):
    """Dynamic evaluation of LoRA adapters (lm_baselines.apply_lora: q/v of every block, scale 2, B = 0 at the start
    so the first chunk is scored by the base model), torch seeded with `seed` for A's initialisation."""

    name = "dynamic-eval-lora"

    def __init__(self, model: nn.Module, lr: float, steps: int = 1, rank: int = 8, seed: int = 0):
        self.rank, self.seed = int(rank), int(seed)
        super().__init__(model, lr, steps)

    def _trainable(self) -> list[nn.Parameter]:
        with torch.random.fork_rng(devices=[]):  # A's draw is seeded without moving the caller's generator
            torch.manual_seed(self.seed)
            self.module = apply_lora(self.net, self.rank)
        return [p for p in self.module.parameters() if p.requires_grad]

    def close(self) -> None:
        if self.module is not self.net:
            self.module.unload()  # peft puts the original modules back: the base model bit for bit
            self.module = self.net

    def settings(self) -> dict:
        return {**super().settings(), "rank": self.rank}


class DynamicEvalBlocks(DynamicEval):
    """Dynamic evaluation of the last `blocks` transformer blocks and the final norm (everything else frozen). Their
    state_dict is copied first and loaded back by close(), with their parameters frozen again."""

    name = "dynamic-eval-blocks"

    def __init__(self, model: nn.Module, lr: float, steps: int = 1, blocks: int = 2):
        self.blocks = int(blocks)
        super().__init__(model, lr, steps)

    def _trainable(self) -> list[nn.Parameter]:
        target = target_for(self.net)
        all_blocks = get_submodule(self.net, target.blocks, "transformer blocks")
        if not 1 <= self.blocks <= len(all_blocks):
            raise ValueError(f"blocks: expected 1 to {len(all_blocks)}, got {self.blocks}")
        norm = get_submodule(self.net, target.final_norm, "final norm")
        self.trained = nn.ModuleList([*all_blocks[-self.blocks :], norm])
        self.saved = {k: v.detach().clone() for k, v in self.trained.state_dict().items()}
        self.frozen = {id(p): p.requires_grad for p in self.trained.parameters()}
        for p in self.trained.parameters():
            p.requires_grad_(True)
        return list(self.trained.parameters())

    def close(self) -> None:
        if self.saved is not None:
            with torch.no_grad():
                self.trained.load_state_dict(self.saved)  # copies in place: the saved values bit for bit
            for p in self.trained.parameters():
                p.requires_grad_(self.frozen[id(p)])
                p.grad = None
            self.saved = None
            self.optimizer.state.clear()

    def settings(self) -> dict:
        return {**super().settings(), "blocks": self.blocks}


def cache_log_probs(
    queries: torch.Tensor, targets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    thetas: Sequence[float], query_chunk: int = 256,
) -> torch.Tensor:  # fmt: skip
    """The neural cache's log p_cache(target) [len(thetas), M] float64: p_cache(w) ∝ Σ_i [values_i = w]·exp(θ·q·k_i)
    over every stored key, for unit queries [M, d] and unit keys [N, d] (float32, so q·k_i is the cosine), targets
    [M] and values [N] int64. −inf where no stored next token is the target. Normalised in log space (logsumexp)."""
    out = torch.empty(len(thetas), queries.shape[0], dtype=torch.float64, device=queries.device)
    for start in range(0, queries.shape[0], query_chunk):
        q = queries[start : start + query_chunk]
        cos = (q @ keys.mT).double()  # [m, N]
        miss = values.unsqueeze(0) != targets[start : start + q.shape[0]].unsqueeze(-1)
        for i, theta in enumerate(thetas):
            logits = theta * cos
            total = torch.logsumexp(logits, dim=-1)
            out[i, start : start + q.shape[0]] = torch.logsumexp(logits.masked_fill(miss, -math.inf), dim=-1) - total
    return out


def mix(lm: torch.Tensor, memory: torch.Tensor, lam: float) -> torch.Tensor:
    """log((1 − λ)·p_model + λ·p_memory) from the two log-probabilities (any shape); λ = 0 is the model exactly."""
    if lam <= 0:
        return lm
    return torch.logaddexp(lm + math.log1p(-lam), memory + math.log(lam))


def _unit(hidden: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(hidden.float(), dim=-1)


class NeuralCache(StreamMethod):
    """The neural cache over the stream: after each window, (h_i, x_{i+1}) for every predicted position, h_i the
    LM head's input; p = (1 − λ)·p_model + λ·p_cache, p_cache(w) ∝ Σ_i [x_{i+1} = w]·exp(θ·cos(h, h_i)).

    Grave et al. score θ·h·h_i on raw states; the states here are unit-normalised first, so θ is a scale on cosines
    in [−1, 1] whatever the model's hidden-state norms, and one θ grid fits every model. The stored pairs are the
    scoring pass's own states (the model is frozen), so `update` only appends them: its time is the store's."""

    name = "cache"

    def __init__(self, model: nn.Module, theta: float, lam: float, query_chunk: int = 256):
        super().__init__(model)
        self.theta, self.lam, self.query_chunk = float(theta), float(lam), int(query_chunk)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def size(self) -> int:
        return sum(v.numel() for v in self.values)

    def _key(self, hidden: torch.Tensor) -> torch.Tensor:
        """What is stored and searched for a state [M, d]: its unit vector."""
        return _unit(hidden)

    def _memory(self, keys: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p_memory(target) [M] float64 for the window's keys [M, d] and targets [M] (the store not empty)."""
        return cache_log_probs(keys, targets, torch.cat(self.keys), torch.cat(self.values), [self.theta],
                               self.query_chunk)[0]  # fmt: skip

    def score(self, window: torch.Tensor) -> tuple[torch.Tensor, float]:
        began = time.perf_counter()
        lm, hidden = self.forward(window, hidden=True)
        keys, targets = self._key(hidden), window[0, 1:]
        self._stash = (window, keys, targets)
        if self.values:
            lm = mix(lm, self._memory(keys, targets), self.lam)
        return -lm, time.perf_counter() - began

    def update(self, window: torch.Tensor) -> float:
        began = time.perf_counter()
        if self._stash is not None and torch.equal(self._stash[0], window):
            keys, targets = self._stash[1], self._stash[2]
        else:  # not the window just scored: its states need a forward pass of their own
            keys, targets = self._key(self.forward(window, hidden=True)[1]), window[0, 1:]
        self._stash = None
        self._store(keys, targets)
        return time.perf_counter() - began

    def _store(self, keys: torch.Tensor, targets: torch.Tensor) -> None:
        self.keys.append(keys)
        self.values.append(targets)

    def settings(self) -> dict:
        return {"theta": self.theta, "lam": self.lam}


class KnnStream(NeuralCache):
    """The kNN-LM over the stream: a lm_baselines.KNNLM datastore (the k nearest raw states by squared L2 distance,
    weights softmax(−d/T)) that grows by every predicted position of each window read; empty, it is the model."""

    name = "knn"

    def __init__(self, model: nn.Module, k: int, temperature: float, lam: float, query_chunk: int = 256):
        super().__init__(model, theta=0.0, lam=lam, query_chunk=query_chunk)
        self.knn = KNNLM(self.net, KNNConfig(k=int(k), lam=float(lam), temperature=float(temperature),
                                             query_chunk=self.query_chunk))  # fmt: skip
        self.values = self.knn.values  # the datastore's: a non-empty list turns the mixture on in score()

    @property
    def size(self) -> int:
        return self.knn.size

    def _key(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()

    def _memory(self, keys: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        neg, hit = self.knn.neighbours(keys, targets)
        return KNNLM.log_probs_from(neg, hit, self.knn.config.temperature).double()

    def _store(self, keys: torch.Tensor, targets: torch.Tensor) -> None:
        self.knn.add_states(keys, targets)

    def settings(self) -> dict:
        c = self.knn.config
        return {"k": c.k, "temperature": c.temperature, "lam": c.lam}


def _windows(ids: torch.Tensor | Sequence[int], chunk: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    from faast.hf.reading import chunk_windows

    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < 2:
        raise ValueError(f"ids: expected a stream of >= 2 tokens, got {ids.numel()}")
    return ids, chunk_windows(int(ids.numel()), chunk)


def run_stream(method: StreamMethod, ids: torch.Tensor | Sequence[int], chunk: int, learn_last: bool = True) -> dict:
    """Read the stream ids ([N] int64) in chunks of `chunk` tokens with `method`: score each window, then learn it
    (learn_last=False: not the last one, which nothing is scored after). Returns {"method", "settings", "chunk",
    "tokens" (predicted tokens per chunk), "token_nll" ([N - 1] float64 tensor, stream order), "nll" (mean per
    chunk), "update_s", "read_s" (seconds per chunk), "total_s" (scoring + update), "ppl" (prequential, chunks after
    the first)}."""
    ids, windows = _windows(ids, chunk)
    nlls, tokens, update_s, read_s = [], [], [], []
    for t, (start, end) in enumerate(windows):
        window = ids[start:end].unsqueeze(0).to(method.device)
        nll, seconds = method.score(window)
        nlls.append(nll.cpu())
        tokens.append(int(nll.numel()))
        read_s.append(seconds)
        update_s.append(method.update(window) if learn_last or t < len(windows) - 1 else 0.0)
    token_nll = torch.cat(nlls)
    return {"method": method.name, "settings": method.settings(), "chunk": chunk, "tokens": tokens,
            "token_nll": token_nll, "nll": [float(x.mean()) for x in nlls], "update_s": update_s, "read_s": read_s,
            "total_s": sum(update_s) + sum(read_s), "ppl": prequential_ppl(token_nll, tokens)}  # fmt: skip


def run_faast(model: nn.Module, ids: torch.Tensor | Sequence[int], chunk: int) -> dict:
    """faast.hf.reading.read_stream on the stream, from empty fast weights (reset before and after, so the next
    method and the next stream start afresh), as the same record as run_stream's, plus "steps" and "weights" (the
    report's), the update's parts ("tune_s", "statistics_s", "solve_s"), "key_widths" and "wall_s" (the whole
    call)."""
    from faast.hf.reading import read_stream

    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    model.reset_fast_weights()
    began = time.perf_counter()
    try:
        report = read_stream(model, ids, chunk=chunk)
    finally:
        wall = time.perf_counter() - began
        model.reset_fast_weights()
    token_nll = torch.as_tensor(report.token_nll, dtype=torch.float64).cpu()
    tokens = [int(n) for n in report.tokens]
    update_s, read_s = [float(s) for s in report.update_s], [float(s) for s in report.read_s]
    return {"method": "faast", "settings": {}, "chunk": chunk, "tokens": tokens, "token_nll": token_nll,
            "nll": [float(x) for x in report.nll], "update_s": update_s, "read_s": read_s,
            "total_s": sum(update_s) + sum(read_s), "ppl": prequential_ppl(token_nll, tokens),
            "steps": [float(s) for s in report.steps], "weights": [float(w) for w in report.weights],
            "key_widths": [int(w) for w in report.key_widths], "tune_s": [float(s) for s in report.tune_s],
            "statistics_s": [float(s) for s in report.statistics_s], "solve_s": [float(s) for s in report.solve_s],
            "wall_s": wall}  # fmt: skip


# ---------------------------------------------------------------------------------------------- settings grids


@dataclass
class StreamStates:
    """One base forward pass per window of a stream: per window, the LM head's inputs at the predicted positions
    ([L - 1, d] float32), the model's log-probabilities of the targets ([L - 1] float64) and the targets ([L - 1]
    int64). The cache and the kNN-LM leave the model frozen, so these determine their scores at every setting."""

    hidden: list[torch.Tensor]
    lm: list[torch.Tensor]
    targets: list[torch.Tensor]

    @property
    def tokens(self) -> list[int]:
        return [int(t.numel()) for t in self.targets]


def stream_states(model: nn.Module, ids: torch.Tensor | Sequence[int], chunk: int) -> StreamStates:
    """The base model's StreamStates of the stream's chunk windows."""
    ids, windows = _windows(ids, chunk)
    method = StreamMethod(model)
    states = StreamStates([], [], [])
    for start, end in windows:
        window = ids[start:end].unsqueeze(0).to(method.device)
        lm, hidden = method.forward(window, hidden=True)
        states.hidden.append(hidden)
        states.lm.append(lm)
        states.targets.append(window[0, 1:])
    return states


def cache_grid(states: StreamStates, thetas: Sequence[float], lams: Sequence[float]) -> dict[tuple, torch.Tensor]:
    """{(θ, λ): token NLL [N - 1] float64}: what NeuralCache(θ, λ) scores on the stream, for the whole grid (one
    cosine matrix per window for every θ)."""
    units = [_unit(h) for h in states.hidden]
    out = {(theta, lam): [-states.lm[0]] for theta in thetas for lam in lams}
    for t in range(1, len(units)):
        cache = cache_log_probs(units[t], states.targets[t], torch.cat(units[:t]), torch.cat(states.targets[:t]),
                                list(thetas))  # fmt: skip
        for i, theta in enumerate(thetas):
            for lam in lams:
                out[theta, lam].append(-mix(states.lm[t], cache[i], lam))
    return {key: torch.cat(parts).cpu() for key, parts in out.items()}


def knn_grid(
    states: StreamStates,
    ks: Sequence[int],
    temperatures: Sequence[float],
    lams: Sequence[float],
    query_chunk: int = 256,
) -> dict[tuple, torch.Tensor]:
    """{(k, T, λ): token NLL [N - 1] float64}: what KnnStream(k, T, λ) scores on the stream, for the whole grid
    (one search for the largest k per window; a smaller k takes the nearest of those, as its own search would)."""
    out = {(k, temp, lam): [-states.lm[0]] for k in ks for temp in temperatures for lam in lams}
    for t in range(1, len(states.hidden)):
        keys, values = torch.cat(states.hidden[:t]), torch.cat(states.targets[:t])
        neg, hit = KNNLM.search(states.hidden[t], states.targets[t], keys, values, max(ks), query_chunk)
        for k in ks:
            for temp in temperatures:
                knn = KNNLM.log_probs_from(neg[:, :k], hit[:, :k], temp).double()
                for lam in lams:
                    out[k, temp, lam].append(-mix(states.lm[t], knn, lam))
    return {key: torch.cat(parts).cpu() for key, parts in out.items()}
