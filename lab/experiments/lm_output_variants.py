"""Variants of the residual output layer measured on cached hidden states (lab/experiments/lm_output_states.py).

    python -m faast_lab.experiments.lm_output_states --cache /tmp/faast_states
    python -m faast_lab.experiments.lm_output_variants --cache /tmp/faast_states

For each cached domain and each amount of learned text on the curve, the layer (faast/hf/output.py) learns the
cached final-norm states through its own `learn`, then every variant solves from the same statistics and is scored
on the held-out states: perplexity change against the frozen model, and the step it chose. The `oracle` row tunes
η on the held-out text itself (not a method: the headroom of any step rule). Settings are chosen on the validation
domains (email, multiprocessing, licenses); the benchmark's five are reported beside them, not used to choose.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from faast import provenance
from faast_lab.experiments._common import RESULTS, ROOT

CURVE = (2048, 8192, 32768)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--domains", nargs="+", default=None, help="default: every cached domain")
    p.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--curve", default=",".join(map(str, CURVE)))
    p.add_argument("--score-sample", type=int, default=0, help="score this many held-out positions (0: all)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument(
        "--head-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="output_head_dtype of the layer: the dtype of its head products while learning",
    )
    p.add_argument(
        "--head-pool-below",
        default="auto",
        type=lambda v: v if v == "auto" else float(v),
        help="ResidualOutput.head_pool_below of the layer: p·H pools the columns below this probability ('auto')",
    )
    p.add_argument("--out", default="lm_output_variants_smollm2")
    return p.parse_args(argv)


class Scorer:
    """Held-out NLL of h + h·M through the head, from cached base logits (z0) so a step sweep costs no GEMM; it also
    carries what the variants read of the learned stream: its keys [n, d], targets [n] and documents' first
    positions (`learned`), and the tail fit of the current curve point (`variant_tail`)."""

    def __init__(self, head, hidden, targets, learned=None):  # noqa: ANN001
        import torch

        self.head, self.hidden, self.targets = head, hidden, targets
        self.keys, self.learned_targets, self.doc_starts = learned if learned is not None else (None, None, [])
        self.variant_tail = None
        self.weight = head.weight.detach().float()
        self.z0 = hidden @ self.weight.T
        self.t0 = self.z0.gather(-1, targets[:, None]).squeeze(-1)
        self.base_tokens = torch.logsumexp(self.z0, -1) - self.t0  # [n] the frozen model's NLL per position
        self.base = float(self.base_tokens.mean())
        self.extra: dict = {}  # what a variant reports beside its perplexity (leverage_bins), taken by main()

    def token_nll(self, m, weight=1.0):  # noqa: ANN001, ANN201
        """NLL per held-out position [n] with the correction M read in logit space (weight 1) or as a mixture
        (1 − λ)·p + λ·p_M; weight: λ, or a tensor [n] of λ per position (a gate)."""
        import torch

        per_position = isinstance(weight, torch.Tensor)
        if m is None or (not per_position and weight <= 0):
            return self.base_tokens
        out = []
        for i in range(0, len(self.targets), 1024):
            h, z0, y = self.hidden[i : i + 1024], self.z0[i : i + 1024], self.targets[i : i + 1024, None]
            z = z0 + (h @ m.detach().float()) @ self.weight.T
            log_p = z.gather(-1, y).squeeze(-1) - torch.logsumexp(z, -1)
            log_p0 = z0.gather(-1, y).squeeze(-1) - torch.logsumexp(z0, -1)
            if per_position:
                lam = weight[i : i + 1024].double()
                log_p = torch.logaddexp(log_p0.double() + torch.log1p(-lam), log_p.double() + torch.log(lam))
            elif weight < 1:
                log_p = torch.logaddexp(log_p0 + math.log1p(-weight), log_p + math.log(weight))
            out.append(-log_p.double())
        return torch.cat(out)

    def nll(self, m, weight=1.0) -> float:  # noqa: ANN001
        """Mean NLL over the held-out positions (token_nll)."""
        return float(self.token_nll(m, weight).mean())


def layer_for(head, dim: int, vocab: int, **residual):  # noqa: ANN001, ANN201
    """A ResidualOutputLayer of FaastConfig(output=ResidualOutput(**residual)) reading `head`."""
    from faast.hf.config import FaastConfig, ResidualOutput
    from faast.hf.output import ResidualOutputLayer

    layer = ResidualOutputLayer(dim, vocab, FaastConfig(output=ResidualOutput(**residual)))
    layer.attach_head(head)
    return layer


def feed(layer, keys, targets, starts: list[int], offset: int = 0, chunk: int = 4096) -> None:  # noqa: ANN001
    """layer.learn over keys [n, d] -> targets [n] as a stream of batches of at most `chunk` positions, one row per
    document piece with its document number, as FaastModel.learn passes them: the shipped step rule then sees where
    documents start. `starts`: the first position of each document in the whole cached stream; `offset`: the stream
    position of keys[0]."""
    import bisect

    import torch

    cuts = sorted({0, len(targets)} | {s - offset for s in starts if 0 < s - offset < len(targets)}
                  | set(range(0, len(targets), chunk)))  # fmt: skip
    for i, j in zip(cuts[:-1], cuts[1:], strict=True):
        k, y = keys[i:j], targets[i:j]
        hidden = torch.cat([k, k[-1:]])[None]  # learn reads hidden[:, :-1]: the appended row predicts nothing
        doc = torch.tensor([bisect.bisect_right(starts, offset + i) - 1], dtype=torch.long)
        layer.learn(hidden, y[None], torch.ones_like(y, dtype=torch.bool)[None], doc)


# ----------------------------------------------------------------------------------------------- variants


def tail_statistics(layer, held: int):  # noqa: ANN001, ANN201, ARG001
    """(keys, targets, S, T, count, gap) of the layer's held-out split (layer.tail_statistics: every document's
    end, and the text before it in that document). The results committed before the split became per-document
    (their provenance says when) held out the stream's last `held` positions alone."""
    keys, ys, _, s_tail, t_tail, n_tail, _, gap = layer.step_choice().tail_statistics()
    return keys, ys, s_tail, t_tail, n_tail, gap


def tune(layer, keys, ys, w):  # noqa: ANN001, ANN201
    """(η, trace) of the logit-space step rule for W on the held-out keys [n, d] and targets ys [n]."""
    from faast.hf.output.tuning import tune_step

    return tune_step(layer.step_choice().tail_logits(keys, ys, w))


def shipped(layer, scorer):  # noqa: ANN001, ANN201
    """The layer as it ships (probability space, λ = output_weight, η tuned): (M, chosen step, chosen weight)."""
    m, weight = layer.solution(layer.memory.gram.device, torch_float32())
    return m, (layer.last_tuning or {}).get("step"), weight


def space(name: str, weight: float | str = "auto"):  # noqa: ANN201
    """The shipped rule read in another space, or with the mixture weight fixed: (M, step, weight)."""

    def variant(layer, scorer):  # noqa: ANN001, ANN202
        shipped_as = layer.space, layer.weight, layer.default_step
        # The untuned step is per space (what output_default_step=None gives a layer configured in that space).
        # The layer's solution is cached under its settings, so changing them re-solves.
        layer.space, layer.weight, layer.default_step = name, weight, layer.policy.default_step(name)
        try:
            m, lam = layer.solution(layer.memory.gram.device, torch_float32())
            return m, (layer.last_tuning or {}).get("step"), lam
        finally:
            layer.space, layer.weight, layer.default_step = shipped_as

    return variant


def torch_float32():  # noqa: ANN201
    import torch

    return torch.float32


def oracle(layer, scorer):  # noqa: ANN001, ANN201
    """The shipped W with η tuned on the held-out text itself: the best any step rule can do with this W."""
    mem = layer.memory
    w = layer.newton(mem.gram, mem.cross, mem.count, layer.damped_curvature())
    every = max(1, len(scorer.targets) // 4096)
    eta, _ = tune(layer, scorer.hidden[::every], scorer.targets[::every], w)
    return eta * w, eta


def shrunk(fraction: float):  # noqa: ANN201
    """The tuned step cut to the smallest η whose held-out-tail gain is `fraction` of the best gain."""

    def variant(layer, scorer):  # noqa: ANN001, ANN202
        m, eta, _ = shipped(layer, scorer)
        if not (layer.last_tuning or {}).get("tuned") or not eta:
            return m, eta
        trace = layer.last_tuning["held_out_nll"]
        base, best = trace[0][1], min(v for _, v in trace)
        # NLL(η) on the tail is convex; between 0 and η* bisect for NLL = base - fraction·(base - best).
        keys, ys, w = scorer.variant_tail
        goal = base - fraction * (base - best)
        low, high = 0.0, eta
        for _ in range(20):
            mid = 0.5 * (low + high)
            if tail_nll(layer, keys, ys, w, mid) > goal:
                low = mid
            else:
                high = mid
        return m * (high / eta), high

    return variant


def ridge_joint(grid: tuple[float, ...]):  # noqa: ANN201
    """A ridge μ on the keys' Gram (relative to its mean eigenvalue) chosen with η on the held-out tail."""

    def variant(layer, scorer):  # noqa: ANN001, ANN202
        import torch

        curvature = layer.damped_curvature()
        held = layer.held_out_positions()
        mem = layer.memory
        if not held:
            return None, None
        keys, ys, s_tail, t_tail, n_tail, _ = tail_statistics(layer, held)
        fit = (mem.gram - s_tail, mem.cross - t_tail)
        best = None
        for mu in grid:
            w = ridge_newton(fit[0], fit[1], curvature, mu)
            eta, trace = tune(layer, keys, ys, w)
            nll = min(v for _, v in trace)
            if best is None or nll < best[0]:
                best = (nll, mu, eta)
        _, mu, eta = best
        w = ridge_newton(mem.gram, mem.cross, curvature, mu)
        return (eta * w).to(torch.float32), f"{eta:.3f}@{mu:g}"

    return variant


def ridge_per_token(c: float):  # noqa: ANN201
    """A ridge that fades with the text learned: μ = c·d/N (relative to the keys' mean eigenvalue), a prior worth
    c·d positions; η tuned on the held-out tail with the fit's own μ (c·d/N_fit)."""

    def variant(layer, scorer):  # noqa: ANN001, ANN202
        import torch

        curvature = layer.damped_curvature()
        held = layer.held_out_positions()
        mem = layer.memory
        if not held:
            return None, None
        d = mem.gram.shape[-1]
        keys, ys, s_tail, t_tail, n_tail, _ = tail_statistics(layer, held)
        n_fit = float(mem.count - n_tail)
        w = ridge_newton(mem.gram - s_tail, mem.cross - t_tail, curvature, c * d / n_fit)
        eta, _ = tune(layer, keys, ys, w)
        w = ridge_newton(mem.gram, mem.cross, curvature, c * d / float(mem.count))
        return (eta * w).to(torch.float32), f"{eta:.3f}"

    return variant


def ridge_newton(gram, cross, curvature, mu: float):  # noqa: ANN001, ANN201
    import torch

    lam, vecs = torch.linalg.eigh(gram)
    shift = mu * lam.clamp_min(0).mean()
    inv = torch.where(lam > 1e-12 * lam[-1], 1.0 / (lam + shift), torch.zeros_like(lam))
    w = vecs @ (inv[:, None] * (vecs.T @ cross))
    return torch.linalg.solve(curvature, w.T).T


def damping(value: float):  # noqa: ANN201
    def variant(layer, scorer):  # noqa: ANN001, ANN202
        layer.damping = value  # part of the layer's cache key: it re-solves
        try:
            return shipped(layer, scorer)
        finally:
            layer.damping = 1.0

    return variant


def doc_aware(layer, scorer, cap: float | None = None):  # noqa: ANN001, ANN201
    """The tail held out as now, but the fit also leaves out the earlier part of the document the tail starts in, so
    the step is tuned on text of documents the fit never saw (falls back to the tail rule within one document)."""
    import torch

    held = layer.held_out_positions()
    if not held:
        return shipped(layer, scorer)
    learned = int(layer.memory.count)
    tail_start = learned - held
    starts = [s for s in scorer.doc_starts if s <= tail_start]
    doc_start = starts[-1] if starts else 0
    if cap is not None:
        doc_start = max(doc_start, tail_start - int(cap * held))
    if tail_start - doc_start >= learned - held - 256:  # within one document: nothing to leave out
        m, eta, _ = shipped(layer, scorer)
        return m, f"{eta:.3f} (1 doc)"
    keys, ys, s_tail, t_tail, n_tail, _ = tail_statistics(layer, held)
    mem, curvature = layer.memory, layer.damped_curvature()
    gram, cross, count = mem.gram - s_tail, mem.cross - t_tail, mem.count - n_tail
    if tail_start > doc_start:
        gap_k, gap_y = scorer.keys[doc_start:tail_start], scorer.learned_targets[doc_start:tail_start]
        grads, _, _ = layer.gradients(gap_k[None], gap_y[None], torch.ones_like(gap_y, dtype=torch.bool)[None])
        k64, g64 = gap_k.double(), grads[0].double()
        gram, cross, count = gram - k64.T @ k64, cross - k64.T @ g64, count - len(gap_y)
    eta, _ = tune(layer, keys, ys, layer.newton(gram, cross, count, curvature))
    full = layer.newton(mem.gram, mem.cross, mem.count, curvature)
    return (eta * full).float(), f"{eta:.3f} (gap {tail_start - doc_start})"


def prefix(share: float):  # noqa: ANN201
    """η tuned on the held-out tail with W fitted on the stream's first `share` only: far from the tail, the fit
    shares less of its names and phrasing even when the whole stream is one document."""

    def variant(layer, scorer):  # noqa: ANN001, ANN202
        import torch

        held = layer.held_out_positions()
        if not held:
            return shipped(layer, scorer)
        keys, ys, *_ = tail_statistics(layer, held)
        n = int(int(layer.memory.count) * share)
        k, y = scorer.keys[:n], scorer.learned_targets[:n]
        grads, _, _ = layer.gradients(k[None], y[None], torch.ones_like(y, dtype=torch.bool)[None])
        k64, g64 = k.double(), grads[0].double()
        mem, curvature = layer.memory, layer.damped_curvature()
        w = layer.newton(k64.T @ k64, k64.T @ g64, torch.tensor(float(n), dtype=torch.float64), curvature)
        eta, _ = tune(layer, keys, ys, w)
        return (eta * layer.newton(mem.gram, mem.cross, mem.count, curvature)).float(), eta

    return variant


def fixed(eta: float, weight: float = 1.0):  # noqa: ANN201
    """The shipped W at a fixed step η (what `output_default_step` gives when the step cannot be tuned), read in logit
    space (weight 1) or mixed in probability space with weight λ."""

    def variant(layer, scorer):  # noqa: ANN001, ANN202
        mem = layer.memory
        return (eta * layer.newton(mem.gram, mem.cross, mem.count, layer.damped_curvature())).float(), eta, weight

    return variant


LEVERAGE_RIDGE = 1e-3  # the ridge of the leverage's inverse, relative to the keys' mean eigenvalue


def relative_leverage(layer, keys):  # noqa: ANN001, ANN201
    """r = kᵀ(S/N + μI)⁻¹k / d per key of keys [n, d] (S, N: the layer's learned h̃ statistics; μ: LEVERAGE_RIDGE of
    the mean eigenvalue): about 1 for keys distributed as the learned ones (E kᵀC⁻¹k = d), large for keys in
    directions the learned text rarely took. A closed-form posterior variance of the memory's read at k."""
    import torch

    d = keys.shape[1]
    lam, vecs = torch.linalg.eigh(layer.memory.gram[:d, :d] / float(layer.memory.count))
    lam = lam.clamp_min(0)
    inv = 1.0 / (lam + LEVERAGE_RIDGE * lam.mean())
    return ((keys.double() @ vecs).square() * inv).sum(-1) / d


def leverage_bins(layer, scorer, bins: int = 5):  # noqa: ANN001, ANN201
    """The shipped read, plus its per-position gain (base NLL − memory NLL) by quintile of the held-out keys'
    relative leverage, in scorer.extra["bins"]: [[mean r, mean gain in nats, positions], ...] from low r to high."""
    import torch

    m, eta, lam = shipped(layer, scorer)
    if m is not None and lam:
        gain = scorer.base_tokens.double() - scorer.token_nll(m, lam)
        r = relative_leverage(layer, scorer.hidden)
        order = torch.argsort(r)
        scorer.extra["bins"] = [[float(r[part].mean()), float(gain[part].mean()), int(part.numel())]
                                for part in torch.tensor_split(order, bins)]  # fmt: skip
    return m, eta, lam


def leverage_gate(gamma: float, two_sided: bool = False):  # noqa: ANN201
    """The shipped M and λ, with λ per held-out position scaled by r^−γ (r: relative_leverage of its key): capped at
    λ (shrinks only where the key is rarer than the learned ones) or, two-sided, up to 0.95 where it is commoner."""

    def variant(layer, scorer):  # noqa: ANN001, ANN202
        m, eta, lam = shipped(layer, scorer)
        if m is None or not lam:
            return m, eta, lam
        factor = relative_leverage(layer, scorer.hidden).clamp_min(1e-6).pow(-gamma)
        if not two_sided:
            factor = factor.clamp_max(1.0)
        return m, eta, (lam * factor).clamp(0.0, 0.95)

    return variant


VARIANTS = {
    "prefix0.5": prefix(0.5),
    "prefix0.7": prefix(0.7),
    "fixed0.03": fixed(0.03),
    "fixed0.015": fixed(0.015),
    "fixed0.01": fixed(0.01),
    "tail": lambda layer, scorer: doc_aware(layer, scorer, cap=0.0),  # the tail alone held out (the earlier rule)
    "docaware": doc_aware,
    "docaware_cap1": lambda layer, scorer: doc_aware(layer, scorer, cap=1.0),
    "docaware_cap2": lambda layer, scorer: doc_aware(layer, scorer, cap=2.0),
    "docaware_cap3": lambda layer, scorer: doc_aware(layer, scorer, cap=3.0),
    "shipped": shipped,
    "logit": space("logit"),
    "weight0.3": space("probability", 0.3),
    "weight0.5": space("probability", 0.5),
    "weightauto": space("probability", "auto"),
    **{f"mix{eta}_{lam}": fixed(eta, lam) for eta in (0.02, 0.03, 0.05, 0.07) for lam in (0.3, 0.5)},
    "oracle": oracle,
    "shrink90": shrunk(0.9),
    "shrink75": shrunk(0.75),
    "shrink50": shrunk(0.5),
    "ridge": ridge_joint((0.0, 1e-3, 1e-2, 1e-1, 1.0)),
    "damping0.3": damping(0.3),
    "ridgeN0.25": ridge_per_token(0.25),
    "ridgeN1": ridge_per_token(1.0),
    "ridgeN4": ridge_per_token(4.0),
    "damping3": damping(3.0),
    "levbins": leverage_bins,
    **{f"lev{g}": leverage_gate(g) for g in (0.5, 1.0, 2.0)},
    **{f"lev{g}x2": leverage_gate(g, two_sided=True) for g in (0.25, 0.5, 1.0)},
}


def variant_tail(layer):  # noqa: ANN001, ANN201
    """What `shrunk` needs: the tail's keys, targets and the W fitted without them (None when nothing is held out)."""
    held = layer.held_out_positions()
    if not held:
        return None
    keys, ys, s_tail, t_tail, n_tail, _ = tail_statistics(layer, held)
    mem = layer.memory
    w = layer.newton(mem.gram - s_tail, mem.cross - t_tail, mem.count - n_tail, layer.damped_curvature())
    return keys, ys, w


def tail_nll(layer, keys, ys, w, eta: float) -> float:  # noqa: ANN001
    """Mean NLL of the tail's targets ys under the logits of keys + η·keys·W (logit space)."""
    import torch

    z = (keys + eta * (keys @ w.float())) @ layer.head.weight.float().T
    return float((torch.logsumexp(z, -1) - z.gather(-1, ys[:, None]).squeeze(-1)).mean())


def doc_starts(name: str, tokenizer, positions: int, budget: int) -> list[int]:  # noqa: ANN001
    """First position of each learned document in the cached stream (each text of n tokens gives n - 1 positions);
    `budget` is the token count the cache was made with (its --learn-tokens)."""
    from faast.hf.tokens import token_lists
    from faast_lab.experiments.domains import domain_texts

    learn_texts, _ = domain_texts(name)
    starts, at = [], 0
    for ids in token_lists(learn_texts, tokenizer, budget):
        starts.append(at)
        at += len(ids) - 1
    assert at == positions, (name, at, positions)
    return starts


def main(argv: list[str] | None = None) -> dict:
    import copy

    import torch

    from faast.hf.default import load_base_model

    args = parse_args(argv)
    record = provenance.start(ROOT)
    base, tokenizer, description = load_base_model("smollm2")
    head = base.get_output_embeddings()
    names = args.domains or sorted(p.stem for p in args.cache.glob("*.pt"))
    chosen = list(VARIANTS) if args.variants is None else args.variants.split(",")
    curve = [int(x) for x in args.curve.split(",")]
    rows = []
    for name in names:
        data = torch.load(args.cache / f"{name}.pt")
        keys, targets = data["learn"]
        hidden, ys = data["score"]
        if args.score_sample and len(ys) > args.score_sample:
            pick = torch.linspace(0, len(ys) - 1, args.score_sample).round().long()
            hidden, ys = hidden[pick], ys[pick]
        budget = int(data["settings"].get("learn_tokens", 32768))
        starts = doc_starts(name, tokenizer, len(targets), budget)
        scorer = Scorer(head, hidden, ys, learned=(keys, targets, starts))
        layer = layer_for(head, keys.shape[1], head.weight.shape[0], head_dtype=args.head_dtype,
                          head_pool_below=args.head_pool_below)  # fmt: skip
        done = 0
        for point in curve:
            amount = min(point, len(targets))
            started = time.perf_counter()
            feed(layer, keys[done:amount], targets[done:amount], starts, done)
            done = amount
            learn_s = time.perf_counter() - started
            scorer.variant_tail = variant_tail(layer)
            for variant in chosen:
                started = time.perf_counter()
                m, step, weight = (*VARIANTS[variant](copy.copy(layer) if variant == "shipped" else layer, scorer),
                                   1.0)[:3]  # fmt: skip
                solve_s = time.perf_counter() - started
                nll = scorer.nll(m, weight)
                if isinstance(weight, torch.Tensor):  # a gate: λ per position, reported by its mean
                    weight = float(weight.double().mean())
                row = {"domain": name, "point": point, "tokens": amount, "variant": variant, "ppl": math.exp(nll),
                       "zero_shot": math.exp(scorer.base), "change": math.exp(nll - scorer.base) - 1,
                       "step": step, "weight": weight, "solve_s": solve_s, "learn_s": learn_s,
                       **scorer.extra}  # fmt: skip
                scorer.extra = {}
                rows.append(row)
                print(f"{name:>15} {amount:>6} {variant:>11}: {100 * row['change']:+6.1f}%  step {step}  "
                      f"({solve_s:.1f} s)", flush=True)  # fmt: skip
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "settings": settings, "rows": rows}
    markdown = table(rows, chosen)
    provenance.write(args.results_dir / args.out, provenance.finish(record), payload,
                     "Residual output layer: variants on cached states", markdown)  # fmt: skip
    return payload


LEGEND = [
    "Variants (docs/design.md §6.3): `shipped` is the layer as it ships (read in probability space with the mixture"
    " weight λ fixed at `output_weight` 0.5, η tuned on the held-out tail, the fit also leaving out up to 2× the"
    " tail's size of the tail's document before it; the"
    " default step and weight when under 4 fitted positions per key dimension); `logit` is the same rule read in logit"
    " space (the earlier default); `weightX` fixes the mixture weight λ at X and tunes η (`weightauto` tunes both);"
    " `mixE_L` is the fixed step E mixed with weight L (what the default step gives); the other variants read in"
    " logit space: `tail` holds out the tail alone (the earlier rule); `docaware` leaves out"
    " the whole earlier part of the tail's document, `docaware_capK` at most K times the tail's size of it (all three"
    " tune at any size); `prefixF` fits on the stream's first share F and tunes on the tail; `fixedX` is the step X;"
    " `shrinkF` cuts the tuned η to the smallest step with F of the tail's best gain; `ridge` chooses a ridge with η"
    " on the tail; `dampingX` sets the curvature damping; `oracle` tunes η on the held-out files themselves (not a"
    " method: the headroom of any step rule). `levG` scales the shipped λ per held-out position by r^−G, capped at"
    " λ, where r = kᵀ(S/N + μI)⁻¹k / d is the relative leverage of its key (about 1 for keys like the learned ones);"
    " `levGx2` lets it grow up to 0.95 where r < 1; `levbins` is `shipped`, with its gain by quintile of r below.",
    "",
]


def table(rows: list[dict], variants: list[str]) -> list[str]:
    """One table per curve point (tokens learned, at most the domain's cached positions): the change per domain, and
    the means over the validation domains (where settings are chosen) and over the others."""
    from faast_lab.experiments.domains import VALIDATION

    domains = list(dict.fromkeys(r["domain"] for r in rows))
    groups = [("mean, validation", [d for d in domains if d in VALIDATION]),
              ("mean, others", [d for d in domains if d not in VALIDATION])]  # fmt: skip
    groups = [(label, members) for label, members in groups if members]
    lines = list(LEGEND)
    for point in sorted({r.get("point", r["tokens"]) for r in rows}):
        lines += [f"## {point} tokens learned (perplexity change vs zero-shot)", "",
                  "| variant | " + " | ".join([*domains, *(g[0] for g in groups)]) + " |",
                  "|---|" + "---|" * (len(domains) + len(groups))]  # fmt: skip
        for v in variants:
            here = [x for x in rows if x.get("point", x["tokens"]) == point and x["variant"] == v]
            change = {x["domain"]: x["change"] for x in here}
            cells = [f"{100 * change[d]:+.1f}%" if d in change else "" for d in domains]
            for _, members in groups:
                got = [change[d] for d in members if d in change]
                cells.append(f"{100 * sum(got) / len(got):+.1f}%" if len(got) == len(members) else "")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        lines.append("")
    binned = [r for r in rows if r.get("bins")]
    if binned:
        lines += ["## The shipped read's gain by quintile of the held-out keys' relative leverage r", "",
                  "Each cell: mean r / mean gain per position in millinats (base NLL − memory NLL), low r first.", "",
                  "| domain | tokens | " + " | ".join(f"q{i + 1}" for i in range(len(binned[0]["bins"]))) + " |",
                  "|---|---|" + "---|" * len(binned[0]["bins"])]  # fmt: skip
        for r in binned:
            cells = [f"{b[0]:.2f} / {1e3 * b[1]:+.0f}" for b in r["bins"]]
            lines.append(f"| {r['domain']} | {r['tokens']:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
