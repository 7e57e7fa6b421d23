"""How far the default's tuned step is from the best step for the held-out files, at every curve point.

    python -m faast_lab.experiments.lm_step_probe --domains email multiprocessing licenses tkinter info

For each domain the default model (FaastConfig(), as lab/experiments/lm_domains.py runs it: the benchmark's 256-token
learning windows, a text cut at a curve point continued into the next part) learns the curve's amounts of text and
solves. Its held-out files are then read once, with the memory's own read path, and the final-norm states and the
wider keys it reads are kept. From them the base logits z0 and the memory's logit change per unit step z1 (keys·W·Hᵀ,
W = M/η) are formed, so the held-out perplexity of the mixture (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1) costs no
model pass for any η and λ.

Reported per point: the perplexity the model read (the check that the reconstruction is the read path), the tuned
step and what the tuning saw (how many documents the held-out tail came from, how many positions were fitted), the
held-out perplexity at multiples of the tuned step, and the oracle: η (λ held at the shipped weight) and (η, λ) both
chosen on the held-out files themselves. The oracle is not a method: it is the headroom of any step rule, and the
ratio oracle η / tuned η says in which direction and by how much the tail misleads (docs/design.md §6.3).

--w-grid asks whether a differently regularised W, rather than the step, is what the held-out files lack: at each
tuned point the layer's own solve and tuning run again under other curvature dampings and spectral cuts. --longest N
learns only a domain's N longest files, so that few-document streams (one long file, as tkinter's) can be studied on
the validation domains. --bias asks whether a bias in the correction (an intercept: what every position shares, e.g.
the domain's vocabulary) would reach what the held-out files lack: oracle steps for the shipped W, a bias alone, the
intercept regression, and the shipped W plus a bias with a step of its own (`bias_variants`).
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial
from pathlib import Path

from faast import provenance
from faast_lab.experiments._common import RESULTS, ROOT, ModelLoader
from faast_lab.experiments.domains import DOMAINS, EXTRA, VALIDATION, domain_texts

CURVE = (2048, 8192, 32768)
FACTORS = (0.25, 0.5, 0.71, 1.0, 1.41, 2.0)  # the report's columns
# the held-out perplexity is kept at the tuned step times 2^(k/4), k = -8..8 (any rule's step can be read off it),
# and the oracle step refined by GOLDEN golden-section steps on log η between the best point's neighbours
CURVE_STEPS = tuple(2 ** (k / 4) for k in range(-8, 9))
GOLDEN = 8
# --pairs: at the points where the step is not tuned (the default step and weight apply), the held-out perplexity on
# this grid of (η, λ): which default pair suits text the step cannot be tuned on
PAIR_STEPS = (0.02, 0.03, 0.045, 0.06, 0.09, 0.12)
PAIR_WEIGHTS = (0.1, 0.2, 0.3, 0.5)
# --w-grid: at tuned points, W under these curvature dampings δ and spectral cuts α (keep σ > N^-α·σmax), each with
# the step the tail tunes for it and the oracle step: whether a differently regularised W, not the step, is missing
W_DAMPINGS = (0.25, 1.0, 4.0)
W_ALPHAS = (1.0, 0.5, 0.25)
# --bias: the shipped W plus the bias b with step κ·η, on this grid of κ and of η as a multiple of W's oracle step
BIAS_KAPPAS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
BIAS_ETA_FACTORS = (0.5, 0.71, 1.0, 1.41)
# --fixed-bias: the shipped W plus the bias b at a fixed absolute step β (a prior chosen on validation domains, not on
# the tail), with W's step as shipped and as the tail re-tunes it with β·b in place (then the document shrink)
FIXED_BETAS = (0.25, 0.5, 0.75, 1.0)
# --folds: the held-out documents dealt into k folds, each scored by a W fitted without its own fold only (fold_steps)
FOLDS = (1, 2, 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    every = [*VALIDATION, *DOMAINS, *EXTRA]
    p.add_argument("--domains", nargs="+", choices=every, default=every)
    p.add_argument("--curve", default=",".join(map(str, CURVE)))
    p.add_argument("--learn-tokens", type=int, default=32768)
    p.add_argument("--score-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=1024, help="scoring window (tokens)")
    p.add_argument("--learn-window", type=int, default=256)
    p.add_argument("--learn-batch-size", type=int, default=8)
    p.add_argument("--pairs", action="store_true", help="at untuned points, the grid PAIR_STEPS × PAIR_WEIGHTS")
    p.add_argument("--w-grid", action="store_true", help="at tuned points, W_DAMPINGS × W_ALPHAS (w_variants)")
    p.add_argument("--bias", action="store_true", help="at tuned points, a bias in the correction (bias_variants)")
    p.add_argument("--fixed-bias", action="store_true", help="at every point, the bias at FIXED_BETAS (fixed_bias)")
    p.add_argument("--folds", action="store_true", help="at tuned points, the tail's step with FOLDS (fold_steps)")
    p.add_argument(
        "--longest",
        type=int,
        default=None,
        help="learn only the domain's N longest learn files (in their order): few-document streams",
    )
    p.add_argument(
        "--parts-as-documents",
        action="store_true",
        help="learn each curve part as new texts (the benchmark's protocol before 4c78eed); default: a part that "
        "begins with the rest of a cut text continues it (learn(continues=True)), as the benchmark does",
    )
    p.add_argument(
        "--key-layers",
        default="auto",
        help="ResidualOutput.key_layers: 'auto' (the default's) or comma-separated block indices, e.g. 4,10",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_step_probe_cpu")
    return p.parse_args(argv)


def longest_texts(texts: list[str], n: int) -> list[str]:
    """The n longest of texts (the earlier one of equal lengths), in their order."""
    longest = sorted(range(len(texts)), key=lambda i: (-len(texts[i]), i))[:n]
    return [texts[i] for i in sorted(longest)]


def read_states(model, windows: list[list[int]]):  # noqa: ANN001, ANN201
    """One pass over the held-out windows (one at a time) through the model's own read: (hidden [n, d] float32, extra
    [n, e] float32 or None, targets [n] int64, the model's perplexity) over every predicted position."""
    import torch

    layer = model.output_memory_layer
    kept: list[tuple] = []
    read = layer.read_logits

    def spy(hidden, logits, extra=None, *, overwrite=False):  # noqa: ANN001, ANN202
        h = hidden.detach().reshape(-1, hidden.shape[-1]).float().clone()
        e = None if extra is None else extra.detach().reshape(-1, extra.shape[-1]).float().clone()
        kept.append((h, e))
        return read(hidden, logits, extra, overwrite=overwrite)

    device = model.get_input_embeddings().weight.device
    hidden, extra, targets, nll = [], [], [], 0.0
    layer.read_logits = spy
    try:
        with torch.no_grad():
            for w in windows:
                ids = torch.tensor([w], device=device)
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                y = ids[0, 1:]
                nll -= float(torch.log_softmax(logits, -1).gather(-1, y[:, None]).sum())
                h, e = kept.pop()
                hidden.append(h[:-1])
                extra.append(None if e is None else e[:-1])
                targets.append(y.cpu())
    finally:
        del layer.read_logits
    n = sum(len(t) for t in targets)
    wide = extra[0] is not None
    return torch.cat(hidden), (torch.cat(extra) if wide else None), torch.cat(targets), math.exp(nll / n)


def held_out_logits(layer, states: tuple):  # noqa: ANN001, ANN201
    """(z0, z1, their entries at the targets) over the held-out positions for the layer's current solution, as
    tuning.Logits (z1: the change per unit step, (keys·M + bias)·Hᵀ/η: the layer's bias, if any, scales with
    the step here; z0: the base logits plus the layer's token bias, which both parts of the mixture read, at its
    fixed step), or None when the memory is off (z0 then the base logits alone); states: read_states' (hidden,
    extra, targets, ...)."""
    import torch

    hidden, extra, ys = states[:3]
    head = layer.head.weight.float()
    if float(getattr(layer.head, "scale", 1.0)) != 1.0:
        raise SystemExit("the probe forms logits as h·Hᵀ: a head with a logit scale is not supported")
    z0 = hidden @ head.T
    idx = ys[:, None]
    m, _ = layer.solution(head.device, torch.float32)
    if m is None:
        return (z0, None, z0.gather(-1, idx)[:, 0], None)
    keys = hidden if m.shape[0] == layer.hidden_size else layer.keys(hidden, extra)
    change = keys @ m
    bias = layer.folded_bias(head.device, torch.float32)
    z1 = ((change if bias is None else change + bias) / layer.chosen_step()) @ head.T
    tokens = layer.folded_token_bias(head.device, torch.float32)
    z0 = z0 if tokens is None else z0.add_(tokens)
    return (z0, z1, z0.gather(-1, idx)[:, 0], z1.gather(-1, idx)[:, 0])


def base_ppl(layer, states: tuple) -> float:  # noqa: ANN001
    """The base model's perplexity on the held-out positions of read_states' states (the head's logits alone)."""
    import torch

    hidden, ys = states[0], states[2]
    z0 = hidden @ layer.head.weight.float().T
    return math.exp(float((torch.logsumexp(z0, -1) - z0.gather(-1, ys[:, None])[:, 0]).double().mean()))


def oracle_step(ppl, eta: float, curve: list[tuple[float, float]] | None = None) -> tuple[float, float]:  # noqa: ANN001
    """(η, perplexity) minimising ppl(η) (λ fixed): golden section on log η between the neighbours of the best point of
    the curve [(η, ppl)] (by default eta × CURVE_STEPS), the layer's own (faast.hf.output.tuning.golden_section)."""
    from faast.hf.output.tuning import golden_section

    curve = curve or [(f * eta, ppl(f * eta)) for f in CURVE_STEPS]
    k = min(range(len(curve)), key=lambda i: curve[i][1])
    lo = math.log(curve[k - 1][0]) if k > 0 else math.log(curve[0][0] / 64)
    hi = math.log(curve[k + 1][0]) if k < len(curve) - 1 else math.log(curve[-1][0] * 64)
    log_eta, best = golden_section(lambda u: ppl(math.exp(u)), lo, hi, GOLDEN)
    return math.exp(log_eta), best


def probe(model, windows: list[list[int]], pairs: bool = False) -> tuple[dict, tuple]:  # noqa: ANN001
    """(the row of one curve point, read_states' states: kept for `w_variants`)."""
    from faast.hf.output import tuning

    layer = model.output_memory_layer
    last = dict(layer.last_tuning or {})
    eta, lam = layer.chosen_step(), layer.chosen_weight()
    started = time.perf_counter()
    states = read_states(model, windows)
    row = {"tuned_step": eta, "tuned_weight": lam, "ppl_read": states[3],
           **{k: last.get(k) for k in ("tuned", "held_out_tokens", "held_out_documents", "document_gap_tokens",
                                       "fitted_tokens", "key_width")}}  # fmt: skip
    logits = held_out_logits(layer, states)
    row["ppl_base"] = base_ppl(layer, states)
    if logits[1] is None:  # the memory is off
        none = dict.fromkeys(("oracle_step", "oracle_ppl", "joint_step", "joint_weight", "joint_ppl"))
        row.update(ppl_reconstructed=row["ppl_base"], grid={}, curve=[], **none, probe_s=time.perf_counter() - started)
        return row, states
    ppl = lambda e, w: math.exp(tuning.held_out_nll(logits, e, w))  # noqa: E731
    row["ppl_reconstructed"] = ppl(eta, lam)
    row["curve"] = [(f * eta, ppl(f * eta, lam)) for f in CURVE_STEPS]
    row["grid"] = {f"{f:g}": ppl(f * eta, lam) for f in FACTORS}
    # the oracle step at the shipped weight
    row["oracle_step"], row["oracle_ppl"] = oracle_step(lambda e: ppl(e, lam), eta, row["curve"])
    # the oracle step and weight together: the layer's own search (tune_mixture), run on the held-out files
    _, _, trace = tuning.tune_mixture(logits, policy=layer.policy)
    joint = min(trace, key=lambda t: t[2])  # the best point, whether or not it passes the significance test
    row["joint_step"], row["joint_weight"], row["joint_ppl"] = joint[0], joint[1], math.exp(joint[2])
    if pairs and not last.get("tuned"):
        row["pairs"] = [(e, w, ppl(e, w)) for e in PAIR_STEPS for w in PAIR_WEIGHTS]
    row["probe_s"] = time.perf_counter() - started
    return row, states


def w_variants(layer, states: tuple) -> list[dict]:  # noqa: ANN001
    """At a tuned point: for each damping δ in W_DAMPINGS and spectral cut α in W_ALPHAS (the layer's own solve and
    tuning, its settings patched and then put back), the step the tail tunes, the held-out perplexity at it, and the
    oracle step (λ at the tuned weight) with its perplexity. Says whether any W the layer's regularisers make, rather
    than the step, is what the held-out files lack."""
    from faast.hf.output import tuning

    shipped = layer.damping, layer.memory.alpha
    out = []
    try:
        for damping in W_DAMPINGS:
            for alpha in W_ALPHAS:
                layer.damping, layer.memory.alpha = damping, alpha
                layer.restore_step(None)
                eta, lam = layer.chosen_step(), layer.chosen_weight()
                row = {"damping": damping, "alpha": alpha, "step": eta, "weight": lam,
                       "key_width": layer.chosen_key_width()}  # fmt: skip
                logits = held_out_logits(layer, states)
                if logits[1] is None:
                    row.update(ppl=math.exp(tuning.held_out_nll(logits, 0.0, 0.0)), oracle_step=None, oracle_ppl=None)
                else:
                    weight = lam or layer.default_weight
                    ppl = lambda e, w=weight, lg=logits: math.exp(tuning.held_out_nll(lg, e, w))  # noqa: E731
                    row["ppl"] = ppl(eta) if lam else ppl(0.0)
                    row["oracle_step"], row["oracle_ppl"] = oracle_step(ppl, eta or layer.default_step)
                del logits
                out.append(row)
    finally:
        layer.damping, layer.memory.alpha = shipped
        layer.restore_step(None)
        layer.chosen_step()
    return out


def learned_sums(layer) -> dict:  # noqa: ANN001
    """Wrap the layer's learn so that it also sums, over the learned positions, the keys ("keys" [d_key] float64) and
    the targets' one-hot vectors ("targets" [V] float64): what a bias in the correction needs and the layer's
    statistics do not keep. `del layer.learn` unwraps it."""
    import torch

    sums = {"keys": 0.0, "targets": torch.zeros(layer.head.weight.shape[0], dtype=torch.float64)}
    learn = layer.learn

    def spy(hidden, targets, pair_mask, documents=None, extra=None, logits=None, hold_out=True):  # noqa: ANN001, ANN202
        keys = layer.keys(hidden, extra)[:, :-1].double()
        sums["keys"] = sums["keys"] + (keys * pair_mask[..., None]).sum((0, 1))
        sums["targets"] += torch.bincount(targets[pair_mask].cpu(), minlength=sums["targets"].numel()).double()
        return learn(hidden, targets, pair_mask, documents, extra, logits=logits, hold_out=hold_out)

    layer.learn = spy
    return sums


def learned_gradient_sum(layer, sums: dict):  # noqa: ANN001, ANN201
    """Σ r = Hᵀ(Σ e_y − Σ p) [d] float64 over the learned positions (`learned_sums`' targets, the layer's Σ p)."""
    return layer.head.weight.double().T @ (sums["targets"] - layer.token_mass.probability.double())


def with_targets(z0, target0, z, ys):  # noqa: ANN001, ANN201
    """tuning.Logits for base logits z0 [n, V] (their entries at the targets target0 [n]) and the change z."""
    return (z0, z, target0, z.gather(-1, ys[:, None])[:, 0])


def bias_corrections(layer, sums: dict) -> tuple:  # noqa: ANN001
    """(b [d], W_c [width, d], c [d]) float64 for the layer's statistics at its chosen key width. b = curvature⁻¹·r̄:
    the Newton step on the mean learned gradient r̄ = Hᵀ(Σ e_y − Σ p)/N alone. W_c and c: the regression with a
    constant key, W_c fitted on centred keys (S − N·k̄k̄ᵀ, T − N·k̄r̄ᵀ, the layer's cut) then the curvature, and its
    bias c = b − k̄·W_c. sums: `learned_sums`."""
    import torch

    from faast import ops

    memory, width = layer.memory, layer.chosen_key_width()
    n = float(memory.count)
    curvature = layer.damped_curvature()
    mean_gradient = learned_gradient_sum(layer, sums) / n
    b = torch.linalg.solve(curvature, mean_gradient)
    k_mean = (sums["keys"] / n)[:width]
    gram = memory.gram[:width, :width] - n * torch.outer(k_mean, k_mean)
    cross = memory.cross[:width] - n * torch.outer(k_mean, mean_gradient)
    w = ops.solve_fast_weights(gram, cross, count=memory.count, alpha=memory.alpha)
    w = torch.linalg.solve(curvature, w.T).T
    return b, w, b - k_mean @ w


def bias_variants(layer, states: tuple, sums: dict) -> dict:  # noqa: ANN001
    """At a tuned point, the oracle step (λ at the tuned weight) and its held-out perplexity for four corrections:
    'shipped' (W as solved); 'bias' (b = curvature⁻¹·r̄ alone, r̄ = Hᵀ(Σ e_y − Σ p)/N the mean learned gradient: the
    same change for every position); 'intercept' (the regression with a constant key: W_c fitted on centred keys,
    S − N·k̄k̄ᵀ and T − N·k̄r̄ᵀ, then the curvature, plus the bias b − k̄·W_c, at the chosen width); and 'w_plus_bias'
    (the shipped W at η plus b at κ·η, best on the BIAS_ETA_FACTORS × BIAS_KAPPAS grid). sums: `learned_sums`."""
    import torch

    from faast.hf.output import tuning

    logits = held_out_logits(layer, states)
    z0, z1, t0, _ = logits
    hidden, extra, ys = states[:3]
    head, weight = layer.head.weight.double(), layer.chosen_weight() or layer.default_weight
    b, w, c = bias_corrections(layer, sums)
    zb = (b @ head.T).float()

    def oracle(lg: tuple) -> dict:
        step, ppl = oracle_step(lambda e: math.exp(tuning.held_out_nll(lg, e, weight)), layer.chosen_step())
        return {"step": step, "ppl": ppl}

    out = {"shipped": oracle(logits), "bias": oracle((z0, zb.expand_as(z0), t0, zb[ys]))}
    keys = hidden if w.shape[0] == layer.hidden_size else layer.keys(hidden, extra)
    zc = ((keys.double() @ w + c).float()) @ head.T.float()
    out["intercept"] = oracle(with_targets(z0, t0, zc, ys))
    del zc
    best = None
    for f in BIAS_ETA_FACTORS:
        eta = f * out["shipped"]["step"]
        for kappa in BIAS_KAPPAS:
            z = torch.add(z1 * eta, zb, alpha=kappa * eta)
            ppl = math.exp(tuning.held_out_nll(with_targets(z0, t0, z, ys), 1.0, weight))
            if best is None or ppl < best["ppl"]:
                best = {"step": eta, "kappa": kappa, "ppl": ppl}
            del z
    out["w_plus_bias"] = best
    # the bias's κ and the step as the tail would tune them (then the layer's document shrink), read on the held-out
    tail = tail_bias_step(layer, sums)
    eta, kappa = tail["step"] * tail["document_shrink"], tail["kappa"]
    z = torch.add(z1 * eta, zb, alpha=kappa * eta)
    tail["ppl"] = math.exp(tuning.held_out_nll(with_targets(z0, t0, z, ys), 1.0, weight))
    out["tail_tuned"] = tail
    return out


def tail_bias_step(layer, sums: dict) -> dict:  # noqa: ANN001
    """The (η, κ) the layer's own tail would choose for W plus κ·b: W and b fitted without the left-out positions
    (their statistics, and their gradients' sum, subtract exactly), η tuned on the held-out rows at the tuned weight
    (`tune_step_rows`) for each κ in BIAS_KAPPAS, the κ of the lowest held-out NLL; with the layer's document shrink
    of η as it applies it (`last_tuning`). The chosen key width is kept."""
    import torch

    from faast.hf.output import tuning
    from faast_lab.experiments.lm_baselines import faast_min_fit

    layer.chosen_step()
    shrink = (layer.last_tuning or {}).get("document_shrink", 1.0)
    memory, width, weight = layer.memory, layer.chosen_key_width(), layer.chosen_weight() or layer.default_weight
    keys, ys, _, s_out, t_out, n_out, _, _ = layer.step_choice().tail_statistics()
    out_values = layer.held_out.split(int(memory.count), faast_min_fit(layer.hidden_size))[4]
    head = layer.head.weight.double()
    curvature = layer.damped_curvature()
    gradient_sum = learned_gradient_sum(layer, sums) - out_values.double().sum(0)
    n_fit = memory.count - n_out
    dt = memory.gram.dtype
    w = layer.newton(memory.gram - s_out.to(dt), memory.cross - t_out.to(dt), n_fit, curvature, width)
    b = torch.linalg.solve(curvature, gradient_sum / float(n_fit))
    base = layer.step_choice().tail_base(keys, ys)
    z1 = layer.step_choice().tail_logits(keys, ys, w, base)[1]
    zb = (b @ head.T).float()
    best = None
    for kappa in BIAS_KAPPAS:
        z = torch.add(z1, zb, alpha=kappa)
        logits = with_targets(base[0], base[1], z, ys)
        eta, trace, _ = tuning.tune_step_rows(logits, weight, policy=layer.policy)
        nll = min(t[1] for t in trace) if eta > 0 else float(-tuning.base_log_targets(logits).mean())
        if best is None or nll < best["tail_nll"]:
            best = {"kappa": kappa, "step": eta, "tail_nll": nll, "document_shrink": shrink}
        del z, logits
    return best


def fixed_bias(layer, states: tuple, sums: dict, tuned: bool) -> dict:  # noqa: ANN001
    """For each β in FIXED_BETAS, the held-out perplexity of the memory component softmax(z0 + η·z1 + β·b·Hᵀ) at the
    layer's weight: 'shipped' with η the layer's chosen step; at tuned points also 'tail' with η re-tuned on the
    layer's tail rows (W and b fitted without them, β·b in place, golden section from the tail's own step) times the
    document shrink. b: the Newton step on the mean learned gradient (`bias_corrections`). Keys: str(β)."""
    import torch

    from faast.hf.output import tuning

    z0, z1, t0, _ = held_out_logits(layer, states)
    ys = states[2]
    head, weight = layer.head.weight.double(), layer.chosen_weight() or layer.default_weight
    eta = layer.chosen_step()
    zb = (bias_corrections(layer, sums)[0] @ head.T).float()
    tail = tail_rows(layer, sums) if tuned else None

    def read(logits: tuple, step: float, bias, beta: float, targets) -> float:  # noqa: ANN001
        z = torch.add(logits[1] * step, bias, alpha=beta)
        return tuning.held_out_nll(with_targets(logits[0], logits[2], z, targets), 1.0, weight)

    out = {}
    for beta in FIXED_BETAS:
        row = {"shipped": {"step": eta, "ppl": math.exp(read((z0, z1, t0), eta, zb, beta, ys))}}
        if tail is not None:
            base, tz1, tzb, tys, start, shrink = tail
            step = oracle_step(partial(read, (base[0], tz1, base[1]), bias=tzb, beta=beta, targets=tys), start)[0]
            row["tail"] = {"step": step * shrink, "ppl": math.exp(read((z0, z1, t0), step * shrink, zb, beta, ys))}
        out[f"{beta:g}"] = row
    return out


def tail_rows(layer, sums: dict) -> tuple:  # noqa: ANN001
    """(base logits and their target entries, z1 per unit step, b·Hᵀ, targets, the tail's own step, the document
    shrink) on the layer's tail rows, with W and b fitted without them (as `tail_bias_step`)."""
    import torch

    from faast_lab.experiments.lm_baselines import faast_min_fit

    layer.chosen_step()
    tuning = layer.last_tuning or {}
    memory, width = layer.memory, layer.chosen_key_width()
    keys, ys, _, s_out, t_out, n_out, _, _ = layer.step_choice().tail_statistics()
    out_values = layer.held_out.split(int(memory.count), faast_min_fit(layer.hidden_size))[4]
    curvature = layer.damped_curvature()
    n_fit = memory.count - n_out
    dt = memory.gram.dtype
    w = layer.newton(memory.gram - s_out.to(dt), memory.cross - t_out.to(dt), n_fit, curvature, width)
    b = torch.linalg.solve(curvature, (learned_gradient_sum(layer, sums) - out_values.double().sum(0)) / float(n_fit))
    base = layer.step_choice().tail_base(keys, ys)
    z1 = layer.step_choice().tail_logits(keys, ys, w, base)[1]
    zb = (b @ layer.head.weight.double().T).float()
    start = tuning.get("tail_step") or layer.chosen_step()
    return base, z1, zb, ys, start, tuning.get("document_shrink", 1.0)


def gap_steps(layer) -> dict:  # noqa: ANN001
    """The step (and key width) the layer tunes with the fit leaving out gap_multiple × the held-out rows of each
    document before them, for gap_multiple 0, 1 and 2 (the shipped 2), each given to the layer as its OutputPolicy;
    the layer is given its own policy back after."""
    import dataclasses

    shipped, out = layer.policy, {}
    try:
        for gap in (0, 1, 2):
            layer.policy = dataclasses.replace(shipped, gap_multiple=gap)
            layer.restore_step(None)
            out[str(gap)] = {"step": layer.chosen_step(), "key_width": layer.chosen_key_width(),
                             "fitted_tokens": (layer.last_tuning or {}).get("fitted_tokens")}  # fmt: skip
    finally:
        layer.policy = shipped
        layer.restore_step(None)
        layer.chosen_step()
    return out


def fold_steps(layer) -> dict:  # noqa: ANN001
    """At a tuned point: the step the tail tunes (λ and key width as shipped, then the document shrink) when the
    held-out documents are dealt into k folds (by document number, in turn: FOLDS) and each document's held-out rows
    are scored by a W fitted without its own fold's left-out positions only. With k = 1 every text's end is left out
    of the one fit (the shipped rule); with k ≥ 2 a text's end is scored by a fit that holds the other folds' ends, so
    text repeated at the end of several documents (licence versions) counts as it will for other files. Keys: str(k),
    each {"step", "tail_step"}; {} where the step is not tuned."""
    import torch

    from faast.hf.output import tuning
    from faast.hf.output.diagnosis import document_shrink
    from faast_lab.experiments.lm_baselines import faast_min_fit

    layer.chosen_step()
    last = dict(layer.last_tuning or {})
    if not last.get("tuned"):
        return {}
    memory, width, weight = layer.memory, layer.chosen_key_width(), layer.chosen_weight() or layer.default_weight
    count, min_fit, dt = int(memory.count), faast_min_fit(layer.hidden_size, layer.policy), memory.gram.dtype
    keys, ys, docs, out_k, out_v, _, _ = layer.held_out.split(count, min_fit)
    out_docs = layer.held_out.left_out_documents(count, min_fit)
    order = sorted(set(out_docs.tolist()))
    curvature = layer.damped_curvature()
    base = layer.step_choice().tail_base(keys, ys)
    log_base = tuning.base_log_targets((base[0], None, base[1], None))
    shrink = document_shrink(int(last["fitted_tokens"]), int(last["held_out_documents"]), layer.hidden_size,
                             layer.policy)  # fmt: skip
    out = {}
    for k in FOLDS:
        fold = {d: i % k for i, d in enumerate(order)}
        z1 = torch.empty_like(base[0])
        for f in range(k):
            left = torch.tensor([fold[d] == f for d in out_docs.tolist()], dtype=torch.bool)
            rows = torch.tensor([fold.get(d, -1) == f for d in docs.tolist()], dtype=torch.bool).nonzero()[:, 0]
            kk = out_k[left].float()
            s_f, t_f = (kk.T @ kk).double().to(dt), (kk.T @ out_v[left].float()).double().to(dt)
            n_f = memory.count - float(left.sum())
            w = layer.newton(memory.gram - s_f, memory.cross - t_f, n_f, curvature, width)
            z1[rows] = layer.step_choice().tail_logits(keys[rows], ys[rows], w, (base[0][rows], base[1][rows]))[1]
        logits = with_targets(base[0], base[1], z1, ys)
        eta, _, _ = tuning.tune_step_rows(logits, weight, log_base, policy=layer.policy)
        out[str(k)] = {"step": eta * shrink, "tail_step": eta}
    layer.restore_step(None)
    layer.chosen_step()
    return out


def fold_table(rows: list[dict]) -> list[str]:
    """--folds: per tuned point, the step with k folds and the held-out perplexity read off the point's curve."""
    from faast_lab.experiments.lm_step_rule_fit import ppl_at

    out = ["", "## The tail's step with the held-out documents in folds (--folds)", "",
           "Each cell: the step (after the document shrink) → held-out perplexity change against the base model, read"
           " off the curve (log-linear between its steps). k = 1 is the shipped rule.", "",
           "| domain | tokens | tail docs | " + " | ".join(f"k = {k}" for k in FOLDS) + " | oracle |",
           "|---|---|---|" + "---|" * (len(FOLDS) + 1)]  # fmt: skip
    for r in rows:
        if not r.get("fold_steps"):
            continue
        cells = [f"{v['step']:.4g} → {ppl_at(r['curve'], v['step'])[0] / r['ppl_base'] - 1:+.2%}"
                 for v in r["fold_steps"].values()]  # fmt: skip
        oracle = f"{r['oracle_step']:.4g} → {r['oracle_ppl'] / r['ppl_base'] - 1:+.2%}"
        out.append(f"| {r['domain']} | {r['tokens']:,} | {r['held_out_documents']} | {' | '.join(cells)} | {oracle} |")
    tuned = [r for r in rows if r.get("fold_steps")]
    if tuned:
        means = [sum(ppl_at(r["curve"], r["fold_steps"][str(k)]["step"])[0] / r["ppl_base"] - 1 for r in tuned)
                 / len(tuned) for k in FOLDS]  # fmt: skip
        oracle = sum(r["oracle_ppl"] / r["ppl_base"] - 1 for r in tuned) / len(tuned)
        out.append(f"| mean of {len(tuned)} | | | " + " | ".join(f"{m:+.2%}" for m in means) + f" | {oracle:+.2%} |")
    return out


def summary(rows: list[dict]) -> list[str]:
    """Per domain: the perplexity change against the base model at each point as read, with the oracle step and with
    the oracle step and weight; and whether each falls at every point."""
    out = [
        "",
        "## Against the base model (perplexity change), by domain",
        "",
        "Each cell: as read (tuned) / oracle η / oracle η and λ, at each point in order.",
        "",
        "| domain | points | as read | oracle η | oracle η, λ | falls: read, η, η+λ |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["domain"] for r in rows):
        mine = [r for r in rows if r["domain"] == name]
        cols = []
        for key in ("ppl_read", "oracle_ppl", "joint_ppl"):
            values = [r[key] if r[key] is not None else r["ppl_read"] for r in mine]
            change = [f"{100 * (v / r['ppl_base'] - 1):+.1f}%" for v, r in zip(values, mine, strict=True)]
            cols.append((values, change))
        falls = ["yes" if all(b < a for a, b in zip(v, v[1:], strict=False)) else "no" for v, _ in cols]
        tokens = ", ".join(f"{r['tokens']:,}" for r in mine)
        out.append(f"| {name} | {tokens} | "
                   + " | ".join(", ".join(c) for _, c in cols) + f" | {', '.join(falls)} |")  # fmt: skip
    return out


def variant_table(rows: list[dict]) -> list[str]:
    """--w-grid: per tuned point and W (damping δ, cut α), the tail's step and the held-out perplexity change at it,
    and the oracle step's."""
    out = ["", "## Differently regularised W (--w-grid)", "",
           "Each W is the layer's own solve with its curvature damping δ and spectral cut α (keep σ > N^-α·σmax) "
           "changed, its step tuned on the tail as shipped. Cells: tail η → change as read / oracle η → change.", "",
           "| domain | tokens | δ | α | width | tail η | read | oracle η | oracle |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for v in r.get("w_variants", []):
            oracle = (f"{v['oracle_step']:.4g} | {100 * (v['oracle_ppl'] / r['ppl_base'] - 1):+.1f}%"
                      if v["oracle_step"] else "– | –")  # fmt: skip
            out.append(f"| {r['domain']} | {r['tokens']:,} | {v['damping']:g} | {v['alpha']:g} | {v['key_width']} | "
                       f"{v['step']:.4g} | {100 * (v['ppl'] / r['ppl_base'] - 1):+.1f}% | {oracle} |")  # fmt: skip
    return out


def bias_table(rows: list[dict]) -> list[str]:
    """--bias: per tuned point, each correction's oracle step and held-out perplexity change (`bias_variants`)."""
    out = ["", "## A bias in the correction (--bias)", "",
           "Oracle steps on the held-out files (λ at the tuned weight), so an upper bound for each correction: the "
           "shipped W; a bias alone (the Newton step on the mean learned gradient); the regression with a constant "
           "key (centred keys plus a bias); the shipped W plus the bias at κ·η. Cells: η → change.", "",
           "| domain | tokens | shipped | bias alone | intercept | W + κ·bias | tail-tuned W + κ·bias |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        v = r.get("bias_variants")
        if not v:
            continue
        cell = lambda x, base=r["ppl_base"]: f"{x['step']:.4g} → {100 * (x['ppl'] / base - 1):+.2f}%"  # noqa: E731
        out.append(f"| {r['domain']} | {r['tokens']:,} | {cell(v['shipped'])} | {cell(v['bias'])} | "
                   f"{cell(v['intercept'])} | {cell(v['w_plus_bias'])}, κ {v['w_plus_bias']['kappa']:g} | "
                   f"{v['tail_tuned']['step'] * v['tail_tuned']['document_shrink']:.4g} → "
                   f"{100 * (v['tail_tuned']['ppl'] / r['ppl_base'] - 1):+.2f}%, κ {v['tail_tuned']['kappa']:g} |"
                   )  # fmt: skip
    return out


def fixed_bias_table(rows: list[dict]) -> list[str]:
    """--fixed-bias: per point, the change against the base model at β = 0 (as read) and at each β, with W's step as
    shipped / as the tail re-tunes it; and per β the mean change over the points."""
    out = ["", "## A bias at a fixed step β (--fixed-bias)", "",
           "The shipped W plus β·b, b the Newton step on the mean learned gradient. Cells: change against the base "
           "model with W's step as shipped / as the tail re-tunes it with β·b in place (– where the step is not "
           "tuned).", "",
           "| domain | tokens | β = 0 | " + " | ".join(f"β = {b:g}" for b in FIXED_BETAS) + " |",
           "|---|---|---|" + "---|" * len(FIXED_BETAS)]  # fmt: skip
    means: dict[str, list[float]] = {}

    def change(r: dict, ppl: float) -> float:
        return 100 * (ppl / r["ppl_base"] - 1)

    for r in rows:
        if "fixed_bias" not in r:
            continue
        cells = []
        for beta in FIXED_BETAS:
            v = r["fixed_bias"][f"{beta:g}"]
            shipped = change(r, v["shipped"]["ppl"])
            tail = change(r, v["tail"]["ppl"]) if "tail" in v else None
            means.setdefault(f"{beta:g}", []).append(shipped if tail is None else tail)
            cells.append(f"{shipped:+.2f}% / " + (f"{tail:+.2f}%" if tail is not None else "–"))
        means.setdefault("0", []).append(change(r, r["ppl_read"]))
        out.append(f"| {r['domain']} | {r['tokens']:,} | {change(r, r['ppl_read']):+.2f}% | {' | '.join(cells)} |")
    if means:
        out += ["", "Mean over these points (the tail's step where tuned): "
                + ", ".join(f"β = {k}: {sum(v) / len(v):+.2f}%" for k, v in means.items())]  # fmt: skip
    return out


def pair_table(rows: list[dict]) -> list[str]:
    """The (η, λ) grid at untuned points: perplexity change against the base model per domain, and the mean over
    the validation domains, the benchmark's five and the extra two."""
    out = []
    for tokens in sorted({r["tokens"] for r in rows if r.get("pairs")}):
        mine = {r["domain"]: r for r in rows if r["tokens"] == tokens and r.get("pairs")}
        groups = [(g, [n for n in group if n in mine]) for g, group in
                  (("validation", VALIDATION), ("benchmark", DOMAINS), ("extra", EXTRA))]  # fmt: skip
        groups = [(g, names) for g, names in groups if names]
        out += ["", f"## Untuned ({tokens:,} tokens learned): held-out perplexity change by default step and weight",
                "", "| η | λ | " + " | ".join(mine) + " | " + " | ".join(f"mean, {g}" for g, _ in groups) + " |",
                "|---|---|" + "---|" * (len(mine) + len(groups))]  # fmt: skip
        for i, (eta, lam, _) in enumerate(next(iter(mine.values()))["pairs"]):
            change = {n: 100 * (r["pairs"][i][2] / r["ppl_base"] - 1) for n, r in mine.items()}
            means = [sum(change[n] for n in names) / len(names) for _, names in groups]
            out.append(f"| {eta:g} | {lam:g} | " + " | ".join(f"{change[n]:+.1f}%" for n in mine) + " | "
                       + " | ".join(f"{m:+.2f}%" for m in means) + " |")  # fmt: skip
    return out


def main(argv: list[str] | None = None, *, load_model: ModelLoader | None = None) -> dict:
    """Run the probe with `argv`'s options on the base model load_model gives for 'smollm2' (default
    faast.hf.default.load_base_model); returns the payload written."""
    import torch

    from faast.hf import FaastConfig, ResidualOutput, apply_faast
    from faast.hf.default import load_base_model
    from faast.hf.evaluate import token_windows
    from faast.hf.tokens import split_continuing, token_lists

    args = parse_args(argv)
    record = provenance.start(ROOT)
    torch.manual_seed(0)
    base, tokenizer, description = (load_model or load_base_model)("smollm2")
    curve = [int(x) for x in args.curve.split(",")]
    rows: list[dict] = []
    for name in args.domains:
        learn_texts, score_texts = domain_texts(name)
        if args.longest:
            learn_texts = longest_texts(learn_texts, args.longest)
        learn = token_lists(learn_texts, tokenizer, args.learn_tokens)
        windows = [w for ids in token_lists(score_texts, tokenizer, args.score_tokens)
                   for w in token_windows(ids, args.window)]  # fmt: skip
        learned = sum(map(len, learn))
        amounts = sorted({p for p in curve if p < learned} | {learned})
        # --bias and --fixed-bias study a bias added to the correction: the layer's own (ResidualOutput.bias) is off
        bias = {"bias": 0.0} if args.bias or args.fixed_bias else {}
        keys = "auto" if args.key_layers == "auto" else [int(b) for b in args.key_layers.split(",") if b]
        model = apply_faast(base, FaastConfig(output=ResidualOutput(key_layers=keys, **bias)))
        sums = learned_sums(model.output_memory_layer) if args.bias or args.fixed_bias else None
        try:
            done = 0
            for amount, (part, continues) in zip(amounts, split_continuing(learn, amounts), strict=True):
                if part:
                    model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size,
                                continues=continues and not args.parts_as_documents)  # fmt: skip
                    model.solve()
                done = amount
                point, states = probe(model, windows, args.pairs)
                row = {"domain": name, "tokens": done, "documents": len(learn), **point}
                row["gap_steps"] = gap_steps(model.output_memory_layer)
                if args.w_grid and row.get("tuned"):
                    row["w_variants"] = w_variants(model.output_memory_layer, states)
                if args.bias and row.get("tuned"):
                    row["bias_variants"] = bias_variants(model.output_memory_layer, states, sums)
                if args.folds and row.get("tuned"):
                    row["fold_steps"] = fold_steps(model.output_memory_layer)
                if args.fixed_bias and row["grid"]:  # the memory is on
                    row["fixed_bias"] = fixed_bias(model.output_memory_layer, states, sums, bool(row.get("tuned")))
                del states
                rows.append(row)
                grid = " ".join(f"{k}:{v:.3f}" for k, v in row["grid"].items())
                print(f"{name:>15} {done:>6}: η {row['tuned_step']:.4g} read {row['ppl_read']:.3f} (rebuilt "
                      f"{row['ppl_reconstructed']:.3f}) base {row['ppl_base']:.3f} | {grid} | oracle η "
                      f"{row['oracle_step'] or 0:.4g} → {row['oracle_ppl'] or 0:.3f} | joint η "
                      f"{row['joint_step'] or 0:.4g} λ {row['joint_weight'] or 0:.3f} → {row['joint_ppl'] or 0:.3f}"
                      f" | tail docs "
                      f"{row['held_out_documents']} fitted {row['fitted_tokens']} | gaps "
                      f"{ {k: round(v['step'], 4) for k, v in row['gap_steps'].items()} }", flush=True)  # fmt: skip
        finally:
            if sums is not None:
                del model.output_memory_layer.learn
            model.remove_faast()
    lines = ["Perplexity on the held-out files. `read`: the model's own read; `rebuilt`: the probe's reconstruction at"
             " the same step and weight (they must agree). Columns ×f: the tuned step times f, λ at the shipped"
             " weight. Oracle: the step chosen on the held-out files themselves (λ fixed); ratio = oracle step /"
             " tuned step. Tail docs: how many learned documents the tuning's held-out rows came from.", "",
             "| domain | tokens | base | tuned η | read | rebuilt | " + " | ".join(f"×{f:g}" for f in FACTORS)
             + " | oracle η | oracle | ratio | joint η, λ | joint | tail docs | fitted |",
             "|---|---|---|---|---|---|" + "---|" * len(FACTORS) + "---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        grid = " | ".join(f"{r['grid'][f'{f:g}']:.3f}" if r["grid"] else "–" for f in FACTORS)
        ratio = f"{r['oracle_step'] / r['tuned_step']:.2f}" if r["oracle_step"] else "–"
        oracle = f"{r['oracle_step']:.4g} | {r['oracle_ppl']:.3f}" if r["oracle_step"] else "– | –"
        joint = (f"{r['joint_step']:.4g}, {r['joint_weight']:.2f} | {r['joint_ppl']:.3f}" if r["joint_ppl"]
                 else "– | –")  # fmt: skip
        lines.append(f"| {r['domain']} | {r['tokens']:,} | {r['ppl_base']:.3f} | {r['tuned_step']:.4g} | "
                     f"{r['ppl_read']:.3f} | {r['ppl_reconstructed']:.3f} | {grid} | {oracle} | {ratio} | {joint} | "
                     f"{r['held_out_documents']} | {r['fitted_tokens']} |")  # fmt: skip
    lines += summary(rows)
    if args.w_grid:
        lines += variant_table(rows)
    if args.pairs:
        lines += pair_table(rows)
    if args.bias:
        lines += bias_table(rows)
    if args.fixed_bias:
        lines += fixed_bias_table(rows)
    if args.folds:
        lines += fold_table(rows)
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "settings": settings, "rows": rows}
    provenance.write(args.results_dir / args.out, record, payload,
                     "The tuned step against the best step for the held-out files", lines)  # fmt: skip
    return payload


if __name__ == "__main__":
    main()
