"""The residual output layer (faast/hf/output/, docs/design.md §6.3) on tiny models built in-process: its statistics
against a float64 hand computation from hooked states, the Newton step, the step tuned on the held-out tail against
a brute-force search, ablations, persistence, fixed state size and configuration errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from faast import Accumulator, FastWeights
from faast.hf import (
    EmbeddingOutput,
    FaastConfig,
    MemoryOffWarning,
    MiddleLayers,
    OutputPolicy,
    ResidualOutput,
    apply_faast,
)
from faast.hf import held_out as held_out_module
from faast.hf import learning as learning_module
from faast.hf.output import DEFAULT_POLICY, StepChoice
from faast.hf.output import head as head_module
from faast.hf.output import layer as output_module
from faast.hf.output import tuning as tuning_module
from faast.hf.persistence import per_layer_holder
from faast.hf.targets import TARGETS
from hf_models import KINDS, VOCAB, tiny_model
from legacy_configs import V1_DEFAULT
from tolerances import (
    BF16_AUTOCAST_REL,
    BF16_HEAD_PRODUCTS_REL,
    HELD_OUT_NLL_REL,
    INT8_HEAD_PRODUCTS_REL,
    REORDER_REL,
    rel,
)

# The statistics are float64 sums of float32 products (keys and logits come from the float32 model).
STAT_REL = 1e-6


def ids(batch=3, seq=40, seed=0, period=None):
    g = torch.Generator().manual_seed(seed)
    if period is None:
        return torch.randint(3, VOCAB, (batch, seq), generator=g)
    # A repeated random phrase: text the model can learn from its own stream.
    phrase = torch.randint(3, VOCAB, (period,), generator=g)
    return phrase.repeat(batch * seq // period + 1)[: batch * seq].reshape(batch, seq)


def final_states(model, x, mask):
    """The final norm's output [B, T, d] float64 from a plain hook, faast disabled."""
    norm = model.base_model.get_submodule(TARGETS[model.faast_config.model_type].final_norm)
    seen = {}
    handle = norm.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.detach()))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    try:
        with model.disable_faast(), torch.no_grad():
            model.base_model(input_ids=x, attention_mask=mask.long(), position_ids=positions)
    finally:
        handle.remove()
    return seen["h"].double()


def block_inputs(model, x, mask):
    """The inputs of the blocks ResidualOutput.key_layers names, each scaled to unit root-mean-square per
    position, concatenated [B, T, d·len] float64 (None without such blocks), from plain hooks, faast disabled."""
    blocks = model.base_model.get_submodule(TARGETS[model.faast_config.model_type].blocks)
    seen, handles = {}, []
    for i in model.faast_config.output.key_layers:

        def capture(module, args, kwargs, i=i):
            seen[i] = (args[0] if args else kwargs["hidden_states"]).detach().double()

        handles.append(blocks[i].register_forward_pre_hook(capture, with_kwargs=True))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    try:
        with model.disable_faast(), torch.no_grad():
            model.base_model(input_ids=x, attention_mask=mask.long(), position_ids=positions)
    finally:
        for handle in handles:
            handle.remove()
    if not seen:
        return None
    return torch.cat([v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) for _, v in sorted(seen.items())], -1)


def full_keys(model, x, mask):
    """The residual output layer's keys [B, T, d_key] float64: the final norm's output, then the block inputs."""
    h, extra = final_states(model, x, mask), block_inputs(model, x, mask)
    return h if extra is None else torch.cat([h, extra], -1)


def reference_statistics(model, x, mask):
    """(keys [n, d_key], targets [n], S, T, Σ μμᵀ, Σ p) in float64 over the learned pairs; the keys are the final
    norm's output h̃ [n, d] followed by the block inputs ResidualOutput.key_layers names."""
    h = full_keys(model, x, mask)
    d = model.faast_config.hidden_size
    pair = (mask[:, :-1] & mask[:, 1:]).reshape(-1)
    k = h[:, :-1].reshape(-1, h.shape[-1])[pair]
    y = x[:, 1:].reshape(-1)[pair]
    head = model.base_model.get_output_embeddings().weight.double()
    p = torch.softmax(k[:, :d] @ head.T, -1)
    mu = p @ head
    r = head[y] - mu
    return k, y, k.T @ k, k.T @ r, mu.T @ mu, p.sum(0)


def newton(s, t, n, mu_gram, mass, head, damping, alpha=1.0, n_curvature=None):
    """W = S⁺T (C/N_c + δ·mean diag·I)⁻¹ in float64, S⁺ the pseudo-inverse keeping σ > n^-α·σmax (the keys' count
    n), C = Hᵀ diag(Σp) H − Σ μμᵀ over N_c positions (default n)."""
    vals, vecs = torch.linalg.eigh(s)
    keep = vals.clamp_min(0).sqrt() > n**-alpha * vals.clamp_min(0).sqrt().max()
    w = vecs[:, keep] @ ((vecs[:, keep].T @ t) / vals[keep, None])
    c = (head.T * mass) @ head - mu_gram
    c = c / (n if n_curvature is None else n_curvature)
    c = c + damping * c.diagonal().mean() * torch.eye(c.shape[0], dtype=torch.float64)
    return w @ torch.linalg.inv(c)


def mean_gradient_bias(y, mass, mu_gram, head, n, damping, beta):
    """β'·C⁻¹·r̄ [d] float64: the residual output layer's bias for the learned targets y [n] (Σp = mass, Σμμᵀ =
    mu_gram), r̄ = (Σ H[y] − Σ pH)/n, C damped as in `newton`, β' = β scaled like the untuned step below
    OutputPolicy.default_step_per_dim positions per hidden dimension."""
    d = head.shape[1]
    c = ((head.T * mass) @ head - mu_gram) / n
    c = c + damping * c.diagonal().mean() * torch.eye(d, dtype=torch.float64)
    r_mean = (head[y].sum(0) - mass @ head) / n
    return beta * min(1.0, n / (DEFAULT_POLICY.default_step_per_dim * d)) * torch.linalg.solve(c, r_mean)


def token_bias(y, mass, vocab, gamma, prior=DEFAULT_POLICY.token_prior):
    """γ·log((c + κ) / (P + κ)) [V] float64: the residual output layer's token bias for the learned targets y [n]
    (c their counts, P = mass the summed probabilities)."""
    counts = torch.bincount(y, minlength=vocab).double()
    return gamma * torch.log((counts + prior) / (mass + prior))


def tail_split(lengths, tune_tokens, gap_multiple=2, min_fit=256, share=DEFAULT_POLICY.held_out_share):
    """A hand reference of the step's held-out choice for documents of `lengths` learned positions in stream order:
    (held-out indices, left-out indices) into the flattened positions. Each document holds out its last
    round(f·n) positions, f = min(tune_tokens, share·N) / N, and leaves out up to gap_multiple times as many just
    before them (none when that would leave fewer than min_fit to fit on)."""
    learned = sum(lengths)
    fraction = min(tune_tokens, int(share * learned)) / learned
    held = [min(n, int(fraction * n + 0.5)) for n in lengths]
    gaps = [min(gap_multiple * h, n - h) for h, n in zip(held, lengths, strict=True)]
    if learned - sum(held) - sum(gaps) < min_fit:
        gaps = [0] * len(lengths)
    held_index, out_index, start = [], [], 0
    for n, h, g in zip(lengths, held, gaps, strict=True):
        held_index += range(start + n - h, start + n)
        out_index += range(start + n - h - g, start + n)
        start += n
    return torch.tensor(held_index), torch.tensor(out_index)


def fit_without(k, y, head, out):
    """(S, T, count) of the positions not in `out`, as the layer forms them: the full sums less those of the left-out
    positions, whose keys and gradients the tail buffer stores rounded to its KEY_STORAGE dtype."""
    d = head.shape[1]
    r = head[y] - torch.softmax(k[:, :d] @ head.T, -1) @ head
    kept, r_out = (v[out].to(held_out_module.KEY_STORAGE).double() for v in (k, r))
    return k.T @ k - kept.T @ kept, k.T @ r - kept.T @ r_out, float(k.shape[0] - out.numel())


def held_keys(k, held):
    """The held-out keys as the tail buffer stores them (KEY_STORAGE), in float64."""
    return k[held].to(held_out_module.KEY_STORAGE).double()


@pytest.mark.parametrize("key_layers", ["auto", [], [1, 3]])
@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("kind", KINDS)
def test_statistics_equal_a_float64_hand_computation_under_padding(monkeypatch, kind, head_dtype, key_layers):
    # key_layers: the keys are h̃ alone, or h̃ and the RMS-normalised inputs of early blocks ('auto': block L // 7)
    # int8 logits keep 4 of the 32 columns of h̃ in float32 (SmolLM2's 32 of 576 would keep them all here).
    monkeypatch.setattr(head_module, "INT8_OUTLIERS", 4)
    config = FaastConfig(output=ResidualOutput(head_dtype=head_dtype, key_layers=key_layers), learn_dtype="model")
    model = apply_faast(tiny_model(kind), config)
    width = 32 * (1 + {"auto": 1, (): 0, (1, 3): 2}[key_layers if key_layers == "auto" else tuple(key_layers)])
    assert model.output_memory_layer.memory.dim_key == width
    tol = {"float32": STAT_REL, "bfloat16": BF16_HEAD_PRODUCTS_REL, "int8": INT8_HEAD_PRODUCTS_REL}[head_dtype]
    x = ids(batch=3, seq=24)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 17:] = False  # right padding
    mask[2, :5] = False  # left padding
    model.learn(x, mask)
    layer = model.output_memory_layer
    k, _, s, t, mu_gram, mass = reference_statistics(model, x, mask)
    assert layer.memory.count.item() == k.shape[0] == layer.curvature.count.item() == layer.token_mass.count.item()
    assert rel(layer.memory.gram, s) < STAT_REL  # the keys are the model's states whatever the head products' dtype
    assert rel(layer.memory.cross, t) < tol
    assert rel(layer.curvature.gram, mu_gram) < tol
    assert rel(layer.token_mass.probability, mass) < tol


@pytest.mark.parametrize("gamma", [0.6, 0.0])
@pytest.mark.parametrize(("key_layers", "batch", "width"), [([], 8, 32), ("auto", 8, 64), ("auto", 4, 32)])
@pytest.mark.parametrize("space", ["logit", "probability"])
def test_the_folded_matrix_is_the_step_times_the_kronecker_factored_newton_step(space, key_layers, batch, width,
                                                                                gamma):  # fmt: skip
    # width: the key columns the correction reads. With the keys widened by block 0's input ('auto' on 4 blocks), the
    # full keys (64) once FIT_PER_KEY_DIM positions per key dimension were learned (8 × 39 = 312 >= 4 × 64), else the
    # leading h̃ block of the same statistics alone (4 × 39 = 156).
    # and the bias β·C⁻¹·r̄ (β = 0.8) is added to every corrected position in both spaces, and the token bias
    # γ·log((c + κ)/(P + κ)) (γ = 0.6; 0: none) to its logits: to both parts of the probability-space mixture.
    output = ResidualOutput(step=0.37, damping=0.5, head_dtype="float32", space=space, weight=0.4,
                            key_layers=key_layers, bias=0.8, token_bias=gamma)  # fmt: skip
    config = FaastConfig(output=output, learn_dtype="model")
    model = apply_faast(tiny_model("llama"), config)
    x = ids(batch=batch, seq=40)
    mask = torch.ones_like(x, dtype=torch.bool)
    model.learn(x, mask)
    _, y, s, t, mu_gram, mass = reference_statistics(model, x, mask)
    head = model.base_model.get_output_embeddings().weight.double()
    n = float(mask[:, 1:].sum())
    expected = 0.37 * newton(s[:width, :width], t[:width], n, mu_gram, mass, head, damping=0.5)
    expected_bias = mean_gradient_bias(y, mass, mu_gram, head, n, 0.5, 0.8)
    expected_tokens = token_bias(y, mass, head.shape[0], gamma)
    layer = model.output_memory_layer
    m = layer.folded(torch.device("cpu"), torch.float64)
    bias = layer.folded_bias(torch.device("cpu"), torch.float64)
    tokens = layer.folded_token_bias(torch.device("cpu"), torch.float64)
    assert layer.chosen_key_width() == width and m.shape == (width, 32)
    assert rel(m, expected) < 1e-6 and rel(bias, expected_bias) < 1e-6
    if gamma == 0.0:
        assert tokens is None and layer.last_tuning["token_bias_off"] == "ResidualOutput.token_bias is 0"
    else:
        assert rel(tokens, expected_tokens) < 1e-6 and layer.last_tuning["token_bias_off"] is None
    assert layer.last_tuning["token_bias_step"] == gamma
    probe = ids(batch=1, seq=9, seed=3)
    keys = full_keys(model, probe, torch.ones_like(probe, dtype=torch.bool))
    h = keys[..., :32]
    logits = model(probe).logits.double()
    corrected = h + keys[..., :width] @ m + bias
    if space == "logit":  # the model reads h̃ + key·M after the final norm, and the token bias after the head
        assert rel(logits, corrected @ head.T + expected_tokens) < 1e-5
    else:  # the log of 0.6·softmax(h̃Hᵀ + u) + 0.4·softmax((h̃ + key·M)Hᵀ + u)
        mixture = 0.6 * torch.softmax(h @ head.T + expected_tokens, -1)
        mixture += 0.4 * torch.softmax(corrected @ head.T + expected_tokens, -1)
        assert rel(logits, mixture.log()) < 1e-5
        assert rel(logits.exp().sum(-1), torch.ones(1, 9, dtype=torch.float64)) < 1e-5


@pytest.mark.parametrize("sample", [None, 37])
def test_the_tuned_step_minimises_the_held_out_loss_found_by_brute_force(sample):
    # sample: the NLL is evaluated on `sample` positions spread evenly over the held-out span (tune_sample), while the
    # fit still leaves out the whole span.
    policy = OutputPolicy() if sample is None else OutputPolicy(tune_sample=sample)
    config = FaastConfig(output=ResidualOutput(key_layers=[], tune_tokens=4096, space="logit", policy=policy))
    model = apply_faast(tiny_model("llama"), config)
    x = ids(batch=8, seq=100, period=23)
    model.learn(x)
    layer = model.output_memory_layer
    layer.folded(torch.device("cpu"), torch.float32)
    tuning = layer.last_tuning
    k, y, _, _, mu_gram, mass = reference_statistics(model, x, torch.ones_like(x, dtype=torch.bool))
    # Each row (a document of its own) holds out its last 20 of 99 positions and leaves out 40 before them.
    held, out = tail_split([99] * 8, 4096)
    assert tuning["tuned"] and tuning["held_out_tokens"] == held.numel() == 160
    assert tuning["document_gap_tokens"] == out.numel() - held.numel() == 320 and tuning["held_out_documents"] == 8
    # Fitted without the left-out positions; the curvature keeps them.
    head = model.base_model.get_output_embeddings().weight.double()
    s_fit, t_fit, n_fit = fit_without(k, y, head, out)
    w = newton(s_fit, t_fit, n_fit, mu_gram, mass, head, damping=1.0, n_curvature=k.shape[0])
    # The sample is spread over the held-out rows with the documents ordered by their own content (the rows' targets
    # differ here): not by the order they were learned in.
    held = torch.cat(sorted(held.split(20), key=lambda rows: (rows.numel(), y[rows].tolist())))
    picked = torch.arange(held.numel()) if sample is None else torch.linspace(0, 159, sample).round().long()
    kh, yh = held_keys(k, held[picked]), y[held[picked]]
    z0, z1 = kh @ head.T, (kh @ w) @ head.T

    def nll(eta):
        z = z0 + eta * z1
        return float((torch.logsumexp(z, -1) - z.gather(-1, yh[:, None]).squeeze(-1)).mean())

    grid = torch.linspace(0, 4, 801).tolist()
    best = min(grid, key=nll)
    assert tuning["step"] > 0.05  # a repeated phrase: the correction helps
    assert abs(tuning["step"] - best) <= 0.01 + 0.02 * best
    assert nll(tuning["step"]) <= nll(best) + 1e-5
    assert_predicts_better_than_base(model, x)  # the model, solved on everything, beats the base model


def assert_predicts_better_than_base(model, x):
    """The adapted model's LM loss on x is below the base model's (memory disabled)."""
    with torch.no_grad():
        adapted = model(x, labels=x).loss
        with model.disable_faast():
            base = model(x, labels=x).loss
    assert adapted < base


def test_the_tuned_step_and_weight_minimise_the_held_out_mixture_loss_found_by_brute_force():
    # A repeated phrase with a fifth of its tokens replaced at random: the memory predicts most tokens, so the best
    # mixture weight lies inside (0, 1) and the step is far from both ends of its range.
    x = ids(batch=8, seq=100, period=23)
    noise = ids(batch=8, seq=100, seed=7)
    x = torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.8, x, noise)
    config = FaastConfig(
        output=ResidualOutput(tune_tokens=4096, head_dtype="float32", weight="auto", key_layers=[]),
        learn_dtype="model",
    )
    model = apply_faast(tiny_model("llama"), config)
    assert model.faast_config.output.space == "probability"  # the default
    model.learn(x)
    layer = model.output_memory_layer
    m, lam = layer.solution(torch.device("cpu"), torch.float32)
    tuning = layer.last_tuning
    k, y, _, _, mu_gram, mass = reference_statistics(model, x, torch.ones_like(x, dtype=torch.bool))
    held, out = tail_split([99] * 8, 4096)
    assert tuning["tuned"] and tuning["held_out_tokens"] == held.numel() and lam == tuning["weight"]
    head = model.base_model.get_output_embeddings().weight.double()
    s_fit, t_fit, n_fit = fit_without(k, y, head, out)
    w = newton(s_fit, t_fit, n_fit, mu_gram, mass, head, damping=1.0, n_curvature=k.shape[0])
    kh, yh = held_keys(k, held), y[held]
    z0, z1 = kh @ head.T, (kh @ w) @ head.T
    log_a = torch.log_softmax(z0, -1).gather(-1, yh[:, None]).squeeze(-1)
    lams = torch.linspace(0, 1, 1001, dtype=torch.float64)[:, None]

    def nll(eta, lam):  # [len(lam)] mean held-out NLL of the mixture, float64
        log_b = torch.log_softmax(z0 + eta * z1, -1).gather(-1, yh[:, None]).squeeze(-1)
        return -torch.logaddexp(log_a + torch.log1p(-lam.clamp(max=1 - 1e-12)), log_b + lam.clamp_min(1e-300).log()
                                ).mean(-1)  # fmt: skip

    etas = torch.logspace(-3, 0.6, 400).tolist()
    best_nll, best_eta, best_lam = min((float(v.min()), e, float(lams[int(v.argmin())])) for e in etas
                                       for v in [nll(e, lams)])  # fmt: skip
    assert 0.2 < best_eta < 3.0 and 0.1 < best_lam < 0.95  # an interior optimum: the search is really tested
    assert abs(tuning["step"] - best_eta) <= 0.05 * best_eta and abs(tuning["weight"] - best_lam) <= 0.01
    assert float(nll(tuning["step"], torch.tensor([[tuning["weight"]]], dtype=torch.float64))) <= best_nll + 1e-6
    # The default holds λ at 0.5 and tunes η alone: the 1-D minimum at λ = 0.5.
    fixed = apply_faast(
        tiny_model("llama"), FaastConfig(output=ResidualOutput(tune_tokens=4096, head_dtype="float32"))
    )
    fixed.learn(x)
    assert fixed.output_memory_layer.chosen_step() > 0
    assert fixed.output_memory_layer.chosen_weight() == 0.5 == FaastConfig().output.weight
    half = torch.tensor([[0.5]], dtype=torch.float64)
    eta_half = min(etas, key=lambda e: float(nll(e, half)))
    assert abs(fixed.output_memory_layer.last_tuning["step"] - eta_half) <= 0.05 * eta_half
    r = head[y] - torch.softmax(k @ head.T, -1) @ head  # the full statistics are solved at this step
    assert rel(m, tuning["step"] * newton(k.T @ k, k.T @ r, float(k.shape[0]), mu_gram, mass, head, 1.0)) < 1e-5
    assert_predicts_better_than_base(model, x)


def test_the_best_weight_is_the_minimum_of_the_convex_mixture_loss():
    # Synthetic target probabilities: where the memory is better (b > a) on a share of positions, λ* is interior.
    g = torch.Generator().manual_seed(0)
    log_a = torch.rand(500, generator=g, dtype=torch.float64).mul(-6)
    log_b = torch.where(torch.rand(500, generator=g) < 0.4, log_a + 3, log_a - 4).clamp(max=0)
    lams = torch.linspace(0, 1, 100001, dtype=torch.float64)
    losses = torch.stack([torch.tensor(tuning_module.mixture_nll(log_a, log_b, float(v))) for v in lams[::100]])
    coarse = float(lams[::100][int(losses.argmin())])
    lam = tuning_module.best_weight(log_a, log_b)
    assert abs(lam - coarse) <= 1e-3 and 0.05 < lam < 0.95
    assert tuning_module.mixture_nll(log_a, log_b, lam) <= float(losses.min()) + 1e-12
    assert tuning_module.best_weight(log_a, log_a + 1.0) == 1.0  # the memory better everywhere
    assert tuning_module.best_weight(log_a, log_a - 1.0) == 0.0  # worse everywhere


@pytest.mark.parametrize("multiple", [1, 2])
def test_every_text_holds_out_its_end_and_the_fit_leaves_out_the_text_before_it(multiple):
    # Five texts (a repeated phrase at different offsets, 700 pairs) learned two windows per batch. Each text holds
    # out its last round(0.2·n) positions (28, 24, 32, 22, 35: 141) and the fit leaves out `multiple` times as many
    # just before them.
    lengths = (140, 120, 160, 110, 175)
    phrase = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(3))
    texts = [phrase.roll(5 * i).repeat(8)[:n].tolist() for i, n in enumerate(lengths)]
    model = apply_faast(
        tiny_model("llama"),
        FaastConfig(output=ResidualOutput(key_layers=[], tune_tokens=160, space="logit",
                                          policy=OutputPolicy(gap_multiple=multiple))),
    )  # fmt: skip
    model.learn(texts, max_length=200, batch_size=2)
    layer = model.output_memory_layer
    layer.folded(torch.device("cpu"), torch.float32)
    tuning = layer.last_tuning
    held, out = tail_split([n - 1 for n in lengths], 160, gap_multiple=multiple)
    assert held.numel() == 141 and out.numel() - held.numel() == 141 * multiple
    assert (tuning["held_out_tokens"], tuning["document_gap_tokens"]) == (141, 141 * multiple)
    assert tuning["held_out_documents"] == 5
    x = torch.zeros((len(texts), max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(x, dtype=torch.bool)
    for i, t in enumerate(texts):
        x[i, : len(t)], mask[i, : len(t)] = torch.tensor(t), True
    k, y, _, _, mu_gram, mass = reference_statistics(model, x, mask)
    assert k.shape[0] == sum(lengths) - len(lengths) and tuning["fitted_tokens"] == k.shape[0] - out.numel()
    head = model.base_model.get_output_embeddings().weight.double()
    s_fit, t_fit, n_fit = fit_without(k, y, head, out)
    w = newton(s_fit, t_fit, n_fit, mu_gram, mass, head, damping=1.0, n_curvature=k.shape[0])
    kh = held_keys(k, held)
    z0, z1 = kh @ head.T, (kh @ w) @ head.T

    def nll(eta):
        z = z0 + eta * z1
        return float((torch.logsumexp(z, -1) - z.gather(-1, y[held, None]).squeeze(-1)).mean())

    best = min(torch.linspace(0, 4, 801).tolist(), key=nll)
    # the tail's own step; what is read is it times the long-text shrink (tests/test_hf_tuning_documents.py)
    assert tuning["tail_step"] > 0.05
    assert abs(tuning["tail_step"] - best) <= 0.01 + 0.02 * best
    assert tuning["step"] == pytest.approx(tuning["tail_step"] * tuning["document_shrink"], rel=1e-12)
    # The same tokens as one text: its last 140 positions are held out and gap_multiple times as many before them
    # left out (704 learned); when that would leave fewer than min_fit_tokens to fit on, only the held-out ones are.
    for min_fit, gap in ((256, 140), (500, 0)):
        policy = OutputPolicy(gap_multiple=1, min_fit_tokens=min_fit)
        one = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(tune_tokens=160, policy=policy)))
        one.learn([sum(texts, [])], max_length=200, batch_size=2)
        one.output_memory_layer.folded(torch.device("cpu"), torch.float32)
        tuning = one.output_memory_layer.last_tuning
        assert (tuning["held_out_tokens"], tuning["document_gap_tokens"]) == (140, gap)
    # A tensor batch's rows are documents of their own: the same split as the five texts (no gaps at min_fit 500:
    # 700 − 141 − 141 < 500).
    policy = OutputPolicy(gap_multiple=1, min_fit_tokens=500)
    rows = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(tune_tokens=160, policy=policy)))
    rows.learn(x, mask)
    rows.output_memory_layer.folded(torch.device("cpu"), torch.float32)
    tuning = rows.output_memory_layer.last_tuning
    assert (tuning["held_out_tokens"], tuning["document_gap_tokens"], tuning["held_out_documents"]) == (141, 0, 5)


@pytest.mark.parametrize(("per_dim", "tuned"), [(16, True), (18, False)])
def test_the_step_is_tuned_only_on_a_fit_of_at_least_fit_per_key_dim_positions_per_key_dimension(per_dim, tuned):
    # 704 learned positions of one text, 140 held out: 564 left to fit. With d = 32, 16 per dimension (512) allows
    # tuning, but no gap (the 140 positions before the tail would leave 424); 18 per dimension (576) does not.
    phrase = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(3))
    text = phrase.repeat(40)[:705].tolist()
    config = FaastConfig(output=ResidualOutput(tune_tokens=160, default_step=0.03, key_layers=[],
                                               policy=OutputPolicy(fit_per_key_dim=per_dim)))  # fmt: skip
    model = apply_faast(tiny_model("llama"), config)
    model.learn([text], max_length=200, batch_size=2)
    layer = model.output_memory_layer
    assert layer.memory.dim_key == 32 and int(layer.memory.count) == 704
    layer.folded(torch.device("cpu"), torch.float32)
    if tuned:
        assert layer.last_tuning["tuned"] and layer.last_tuning["fitted_tokens"] == 564
        assert layer.last_tuning["document_gap_tokens"] == 0 and layer.last_tuning["step"] > 0.05
    else:
        default = {"step": 0.03, "weight": DEFAULT_POLICY.default_weight, "tuned": False, "saved_step": False,
                   "key_width": 32, "bias_step": 0.5, "bias_off": None,
                   "token_bias_step": ResidualOutput().token_bias,
                   "token_bias_off": None}  # fmt: skip
        assert layer.last_tuning == default


def test_a_tuned_step_is_saved_with_the_statistics_and_a_loaded_model_reads_exactly_like_the_saved_one(tmp_path):
    from faast.checkpoint import save_state

    phrase = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(3))
    # fit_per_key_dim 16 lets the tiny model tune (see the test above)
    config = FaastConfig(output=ResidualOutput(tune_tokens=160, default_step=0.03,
                                               policy=OutputPolicy(fit_per_key_dim=16)))  # fmt: skip
    model = apply_faast(tiny_model("llama"), config)
    model.learn([phrase.repeat(40)[:705].tolist()], max_length=200, batch_size=2)
    step, weight = model.output_memory_layer.chosen_step(), model.output_memory_layer.chosen_weight()
    assert model.output_memory_layer.last_tuning["tuned"] and step > 0.05 and 0 < weight <= 1
    path = model.save_fast_weights(tmp_path / "fw.safetensors")
    fresh = apply_faast(tiny_model("llama"), config).load_fast_weights(path)
    probe = ids(batch=2, seq=15, seed=9)
    with torch.no_grad():
        assert torch.equal(fresh(probe).logits, model(probe).logits)
    saved = {"step": step, "weight": weight, "tuned": False, "saved_step": True, "key_width": 32, "bias_step": 0.5,
             "bias_off": None, "token_bias_off": None,
             "token_bias_step": ResidualOutput().token_bias}  # fmt: skip
    assert fresh.output_memory_layer.last_tuning == saved
    # A file whose step is not a finite number >= 0, or whose weight is not in [0, 1], is refused before anything is
    # copied.
    holder = per_layer_holder(model, copy=True)
    bad_values = [("output_step", bad, "a finite number >= 0") for bad in (-0.5, float("nan"), "0.1", True)]
    bad_values += [("output_weight", bad, r"a number in \[0, 1\]") for bad in (1.5, -0.1, float("nan"), "0.3")]
    for name, bad, expected in bad_values:
        save_state(tmp_path / "bad.safetensors", holder, {name: bad})
        other = apply_faast(tiny_model("llama"), config)
        with pytest.raises(ValueError, match=f"{name}: expected {expected}"):
            other.load_fast_weights(tmp_path / "bad.safetensors")
        assert int(other.output_memory_layer.memory.count) == 0
    # Forgetting drops the saved step and weight and the held-out buffer: a little new text gets the defaults again.
    fresh.reset_fast_weights()
    assert fresh.output_memory_layer.chosen_step() is None and fresh.output_memory_layer.chosen_weight() is None
    fresh.learn(ids(batch=1, seq=30))  # 29 positions: the default step scaled to them
    full = DEFAULT_POLICY.default_step_per_dim * fresh.output_memory_layer.hidden_size
    assert fresh.output_memory_layer.chosen_step() == pytest.approx(config.output.default_step * 29 / full, rel=1e-12)
    assert fresh.output_memory_layer.chosen_weight() == DEFAULT_POLICY.default_weight
    assert not fresh.output_memory_layer.last_tuning["saved_step"]
    # A fixed step is the configuration's: nothing extra is saved.
    fixed = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(step=0.2)))
    fixed.learn(ids(batch=1, seq=30))
    fixed.save_fast_weights(tmp_path / "fixed.safetensors")
    again = apply_faast(tiny_model("llama"), FaastConfig())
    again.load_fast_weights(tmp_path / "fixed.safetensors")
    assert again.output_memory_layer._restored_step is None


def test_head_products_in_bfloat16_learn_what_float32_learns_within_the_declared_tolerance(monkeypatch):
    x = ids(batch=4, seq=60, period=13)
    learned = {}
    for dtype in ("float32", "bfloat16"):
        model = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(step=0.5, head_dtype=dtype)))
        model.learn(x)
        layer = model.output_memory_layer
        learned[dtype] = (layer.memory.gram, layer.memory.cross, layer.folded(torch.device("cpu"), torch.float32))
    (s32, t32, m32), (s16, t16, m16) = learned["float32"], learned["bfloat16"]
    assert torch.equal(s16, s32)  # the keys are the model's own states either way
    t_err, m_err = rel(t16, t32), rel(m16, m32)
    assert 0 < t_err <= BF16_HEAD_PRODUCTS_REL and 0 < m_err <= BF16_HEAD_PRODUCTS_REL
    # 'auto' on a CPU is measured (tests/test_cpu_paths.py); unmeasured it takes float32, and float32 for float64
    # states; an explicit dtype is itself.
    keys32, keys64, weight = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64), torch.zeros(9, 4)
    assert output_module.products_dtype("auto", keys32, weight) == torch.float32
    assert output_module.products_dtype("auto", keys64, weight) == torch.float32
    assert output_module.products_dtype("float32", keys32, weight) == torch.float32
    assert output_module.products_dtype("bfloat16", keys64, weight) == torch.bfloat16
    with pytest.raises(
        ValueError, match="ResidualOutput.head_dtype: expected 'auto', 'float32', 'bfloat16' or 'int8'"
    ):
        FaastConfig(output=ResidualOutput(head_dtype="float16"))


@pytest.mark.parametrize(
    ("setting", "head_dtype", "pooled_faster", "expected"),
    [("auto", "float32", True, "POOL_AUTO"), ("auto", "float32", False, 0.0), ("auto", "bfloat16", True, "POOL_AUTO"),
     ("auto", "int8", False, 0.0), (0.0, "float32", True, 0.0), (0.0, "bfloat16", True, 0.0),
     (0.02, "bfloat16", False, 0.02)],
)  # fmt: skip
def test_learning_pools_p_h_at_the_configured_threshold(timed, monkeypatch, setting, head_dtype, pooled_faster,
                                                        expected):  # fmt: skip
    """ResidualOutput.head_pool_below reaches the head products learn forms: 'auto' on a CPU pools where pooling
    measured faster on the first block (head_gradients gets None and times it), whatever the products' dtype."""
    timed.times = {"torch.exact": 1.0, "torch.pooled": 0.5 if pooled_faster else 2.0}
    seen = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((args[4], args[6]))
        return head_module.head_gradients(*args, **kwargs)

    monkeypatch.setattr(output_module, "head_gradients", spy)
    config = FaastConfig(output=ResidualOutput(step=0.5, head_dtype=head_dtype, head_pool_below=setting),
                         learn_dtype="model")  # fmt: skip
    model = apply_faast(tiny_model("llama"), config)
    model.learn(ids(batch=2, seq=30))
    pool = DEFAULT_POLICY.pool_auto if expected == "POOL_AUTO" else expected
    given = None if setting == "auto" else setting
    assert seen and all(s == (getattr(torch, head_dtype), given) for s in seen)
    assert model.learner.precision()["head_pool_below"] == pool
    assert ("torch.pooled" in timed.sampled) is (setting == "auto")


def test_a_learn_calls_batches_share_the_head_buffers_and_release_them_after(monkeypatch):
    # The exact products (pool 0), the path that fills all four buffers; 'auto' would pool p·H on this CPU.
    config = FaastConfig(output=ResidualOutput(step=0.5, head_dtype="bfloat16", head_pool_below=0.0))
    model = apply_faast(tiny_model("llama"), config)
    buffers = model.output_memory_layer.head_buffers
    seen, get = [], buffers.get

    def spy(name, *args):  # noqa: ANN001, ANN002, ANN202
        out = get(name, *args)
        seen.append((name, out.data_ptr(), buffers.held_bytes()))
        return out

    monkeypatch.setattr(buffers, "get", spy)
    model.learn([list(range(1, 60)), list(range(3, 50)), list(range(7, 40))], max_length=32, batch_size=1)
    assert len(seen) >= 4 * 4  # four buffers per batch (z, p and their bfloat16 copies), at least four batches
    for name in ("z", "p", "z16", "p16"):
        assert len({ptr for n, ptr, _ in seen if n == name}) == 1  # the first batch's, reused by every other
    assert all(size > 0 for *_, size in seen) and buffers.held_bytes() == 0  # held while learning, freed after


@pytest.mark.parametrize("kind", KINDS)
def test_learning_under_bfloat16_autocast_learns_the_autocast_states_and_auto_picks_it_where_fastest(
    kind, monkeypatch, tmp_path
):
    x = ids(batch=3, seq=40, period=11)
    mask = torch.ones_like(x, dtype=torch.bool)

    def learned_gram(model_dtype, learn_dtype):
        base = tiny_model(kind).to(model_dtype)
        model = apply_faast(base, FaastConfig(output=ResidualOutput(step=0.3), learn_dtype=learn_dtype))
        model.learn(x)
        return model, model.output_memory_layer.memory.gram

    model, s16 = learned_gram(torch.float32, "bfloat16")
    exact = reference_statistics(model, x, mask)[2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h16 = full_keys(model, x, mask)  # float32 tensors: the residual stream and the norms stay float32
    k16 = h16[:, :-1].reshape(-1, h16.shape[-1])
    assert rel(s16, k16.T @ k16) <= STAT_REL  # learn() ran the autocast pass, and only the pass
    assert 0 < rel(s16, exact) <= BF16_AUTOCAST_REL
    _, s32 = learned_gram(torch.float32, "model")
    assert rel(s32, exact) <= STAT_REL
    # 'auto' on a CPU: autocast where bfloat16 measured fastest, for float32 weights only (float64 keep theirs).
    monkeypatch.setenv("FAAST_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setenv("FAAST_AUTOTUNE", "1")
    for fastest, model_dtype, expected in (("torch.bfloat16", torch.float32, s16),
                                           ("torch.float32", torch.float32, s32),
                                           ("torch.bfloat16", torch.float64, None)):  # fmt: skip
        pin = f"learn_pass={fastest},head_logits=torch.float32"  # the measured choice pinned: no timing here
        monkeypatch.setenv("FAAST_BACKEND", pin)
        auto_model, auto = learned_gram(model_dtype, "auto")
        if expected is None:  # float64 weights learn exactly what the float64 model computes
            _, expected = learned_gram(torch.float64, "model")
        assert torch.equal(auto, expected), (fastest, model_dtype)
        # What the learner says it runs (lm_domains records it) is what it learned.
        autocast = fastest == "torch.bfloat16" and model_dtype == torch.float32
        assert auto_model.learner.autocasts(torch.device("cpu")) == autocast
    monkeypatch.delenv("FAAST_BACKEND")
    plain_model, _ = learned_gram(torch.float32, "model")
    assert model.learner.autocasts(torch.device("cpu")) and not plain_model.learner.autocasts(torch.device("cpu"))
    with pytest.raises(ValueError, match="learn_dtype: expected 'auto', 'model', 'bfloat16' or 'int8'"):
        FaastConfig(learn_dtype="float16")
    saved_before = {k: v for k, v in V1_DEFAULT.items() if k != "learn_dtype"}  # written before the field existed
    assert FaastConfig.from_dict(saved_before, version=1).learn_dtype == "model"
    assert FaastConfig.from_dict(FaastConfig(learn_dtype="bfloat16").to_dict()).learn_dtype == "bfloat16"


def test_no_step_when_it_does_not_help_and_the_default_step_when_it_cannot_be_tuned():
    # Random tokens: nothing to learn, so the held-out loss rises with any step and η = 0 keeps the base model.
    model = apply_faast(tiny_model("qwen2"), FaastConfig())
    x = ids(batch=8, seq=120, seed=5)
    model.learn(x)
    # The memory ends up off although it had text to tune on: it says so once, and why, and last_tuning records it.
    with pytest.warns(MemoryOffWarning, match=r"memory is off: no step raised the likelihood .* 8 document"):
        assert model.output_memory_layer.folded(torch.device("cpu"), torch.float32) is None
    assert model.output_memory_layer.last_tuning["step"] == 0.0 and model.output_memory_layer.last_tuning["off"]
    with torch.no_grad(), model.disable_faast():
        base = model(x).logits
    assert torch.equal(model(x).logits, base)
    # Too little text to hold any out: the configured default step and weight, else the space's own defaults; the
    # step scaled by the positions learned below DEFAULT_STEP_PER_DIM per hidden dimension (29 of its 7 × 32 here).
    scale = 29 / (DEFAULT_POLICY.default_step_per_dim * 32)
    for space, kwargs, expected in (
        (
            "probability",
            {"default_step": 0.02, "default_weight": 0.6, "weight": "auto"},
            (0.02, 0.6),
        ),
        ("probability", {"default_weight": 0.6}, (DEFAULT_POLICY.default_step_probability, 0.5)),
        (
            "probability",
            {"weight": "auto"},
            (DEFAULT_POLICY.default_step_probability, DEFAULT_POLICY.default_weight),
        ),
        ("logit", {}, (DEFAULT_POLICY.default_step_logit, 1.0)),
    ):
        few = apply_faast(tiny_model("qwen2"), FaastConfig(output=ResidualOutput(space=space, **kwargs)))
        few.learn(ids(batch=1, seq=30))
        few.output_memory_layer.folded(torch.device("cpu"), torch.float32)
        step, weight = expected
        # the bias's step is scaled as the step is
        assert few.output_memory_layer.last_tuning == {"step": pytest.approx(step * scale, rel=1e-12),
                                                       "weight": weight, "tuned": False, "saved_step": False,
                                                       "key_width": 32, "bias_off": None,
                                                       "bias_step": pytest.approx(0.5 * scale, rel=1e-12),
                                                       "token_bias_off": None,
                                                       "token_bias_step": ResidualOutput().token_bias}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_empty_and_disabled_give_the_base_logits_and_the_ablation_equals_an_output_only_model(kind):
    x = ids(batch=2, seq=30, period=11)
    base_logits = tiny_model(kind)(x).logits
    both = apply_faast(
        tiny_model(kind), FaastConfig(output=ResidualOutput(step=0.5), middle=MiddleLayers(layers=[1, 2]))
    )
    assert torch.equal(both(x).logits, base_logits)  # empty memories
    for layer in both.memory_layers.values():  # non-zero readouts, so the middle layers change h
        torch.nn.init.normal_(layer.readout.weight, std=0.3)
    both.learn(x)
    output_only = apply_faast(tiny_model(kind), FaastConfig(output=ResidualOutput(step=0.5)))
    output_only.learn(x)
    with torch.no_grad():
        with both.disable_faast():
            assert torch.equal(both(x).logits, base_logits)
        with both.disable_faast("middle"):
            assert torch.equal(both(x).logits, output_only(x).logits)
        full = both(x).logits
        with both.disable_faast("output"):
            middle_only = both(x).logits
    assert not torch.equal(full, middle_only) and not torch.equal(middle_only, base_logits)
    with pytest.raises(ValueError, match="which: expected 'all', 'middle' or 'output'"):
        with both.disable_faast("nope"):
            pass


def test_state_size_is_fixed_and_save_load_round_trips_exactly(tmp_path):
    config = FaastConfig(output=ResidualOutput(step=0.3, tune_tokens=64), middle=MiddleLayers(num_layers=1))
    model = apply_faast(tiny_model("llama"), config)
    model.learn(ids(batch=1, seq=20))
    small = model.fast_weight_bytes()
    model.learn(ids(batch=8, seq=120, seed=1))
    assert model.fast_weight_bytes() == small
    names = [n for n, _ in model.learned_state()]
    assert names == ["memory_bank", "output_memory_layer.memory", "output_memory_layer.curvature",
                     "output_memory_layer.token_mass", "output_memory_layer.gradient_sum",
                     "output_memory_layer.target_count"]  # fmt: skip
    # fast_weights() lists the memories only: the curvature and token mass are sums, not fast weights.
    states = dict(model.learned_state())
    assert model.fast_weights() == [states["memory_bank"], states["output_memory_layer.memory"]]
    assert all(isinstance(m, FastWeights) for m in model.fast_weights())
    assert all(isinstance(states[n], Accumulator) for n in names[2:])
    path = model.save_fast_weights(tmp_path / "fw.safetensors")
    fresh = apply_faast(tiny_model("llama"), config)
    fresh.load_fast_weights(path)
    probe = ids(batch=2, seq=15, seed=9)
    with torch.no_grad():
        assert torch.equal(fresh(probe).logits, model(probe).logits)
    for (_, a), (_, b) in zip(fresh.learned_state(), model.learned_state(), strict=True):
        for name, tensor in b.state_dict().items():
            assert torch.equal(a.state_dict()[name], tensor), name


@pytest.mark.parametrize("layout", ["fast_weights", "no_gradient_sum", "no_target_count"])
def test_a_file_saved_before_the_current_output_sums_loads_exactly_and_reads_without_the_bias(
    tmp_path, layout, caplog
):
    # Before faast.Accumulator, the curvature Σμμᵀ lived in a FastWeights(d, 1)'s gram and the token mass Σp in a
    # FastWeights(1, V)'s cross; before ResidualOutput.bias there was no gradient sum, and before
    # ResidualOutput.token_bias no target count. Such files must keep loading, to the same statistics, with the sums
    # they lack empty: the layer then reads without the biases those sums give, says why, and reads exactly like the
    # saved model with those biases turned off.
    from torch import nn

    from faast.checkpoint import save_state

    config = FaastConfig(output=ResidualOutput(step=0.3, key_layers=[]), middle=MiddleLayers(num_layers=1))
    model = apply_faast(tiny_model("llama"), config)
    model.learn(ids(batch=2, seq=40, seed=3))
    layer = model.output_memory_layer
    curvature, token_mass = layer.curvature, layer.token_mass
    if layout == "fast_weights":
        d, vocab = layer.curvature.gram.shape[0], layer.token_mass.probability.shape[0]
        curvature, token_mass = FastWeights(d, 1), FastWeights(1, vocab)
        with torch.no_grad():  # what the old layer wrote: the sums in these tensors, the position count in both
            curvature.gram.copy_(layer.curvature.gram)
            token_mass.cross[0].copy_(layer.token_mass.probability)
            token_mass.gram.fill_(float(layer.token_mass.count))
            for old, new in ((curvature, layer.curvature), (token_mass, layer.token_mass)):
                old.count.copy_(new.count)
    old_layer = nn.Module()
    old_layer.memory, old_layer.curvature, old_layer.token_mass = layer.memory, curvature, token_mass
    if layout == "no_target_count":
        old_layer.gradient_sum = layer.gradient_sum
    missing = {"output_memory_layer.target_count"}
    missing |= set() if layout == "no_target_count" else {"output_memory_layer.gradient_sum"}
    holder = per_layer_holder(model, copy=True)
    holder.output_memory_layer = old_layer
    path = save_state(tmp_path / "old.safetensors", holder, {"output_step": 0.3})
    fresh = apply_faast(tiny_model("llama"), config)
    fresh.load_fast_weights(path)
    for (name, a), (_, b) in zip(fresh.learned_state(), model.learned_state(), strict=True):
        assert type(a) is type(b), name
        for key, tensor in b.state_dict().items():
            expected = torch.zeros_like(tensor) if name in missing else tensor
            assert torch.equal(a.state_dict()[key], expected), (name, key)
    probe = ids(batch=2, seq=15, seed=9)
    with torch.no_grad(), caplog.at_level("INFO", logger="faast.hf"):
        read = fresh(probe).logits
        assert not torch.equal(read, model(probe).logits)  # the saved model reads with its biases
        layer.token_bias = 0.0
        if layout != "no_target_count":
            assert not torch.equal(read, model(probe).logits)
            layer.bias = 0.0
        assert torch.equal(read, model(probe).logits)
    tuning = fresh.output_memory_layer.last_tuning
    assert tuning["token_bias_step"] == 0.0 and "cover 0 of 78 positions" in tuning["token_bias_off"]
    assert sum("no token bias: the token counts cover 0" in r.getMessage() for r in caplog.records) == 1
    if layout == "no_target_count":
        assert tuning["bias_off"] is None and tuning["bias_step"] == pytest.approx(
            0.5 * 78 / (DEFAULT_POLICY.default_step_per_dim * 32)
        )
        return
    assert tuning["bias_step"] == 0.0 and "covers 0 of 78 positions" in tuning["bias_off"]
    assert sum("no bias: the gradient sum covers 0" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("missing", "setting", "off"),
    [("gradient_sum", "bias", "bias_off"), ("target_count", "token_bias", "token_bias_off")],
)
def test_a_stream_checkpoint_saved_before_a_bias_sum_resumes_with_that_bias_off(
    tmp_path, caplog, missing, setting, off
):
    # faast.checkpoint files of a whole FaastModel written before ResidualOutput.bias lack the gradient sum, and those
    # written before ResidualOutput.token_bias the target counts. Resuming from one loads every other statistic
    # exactly and the missing sum empty (the layer lists both in OPTIONAL_IN_FILES); the bias that sum gives then
    # stays off, saying why, also after more learning (its sum stays partial).
    import json

    from faast.checkpoint import Checkpointer, load_checkpoint
    from faast.persist import read_verified, write_atomic

    config = FaastConfig(output=ResidualOutput(step=0.3, key_layers=[]), middle=MiddleLayers(num_layers=1))
    model = apply_faast(tiny_model("llama"), config)
    model.learn(ids(batch=2, seq=40, seed=3))
    path = Checkpointer(tmp_path).save(model, {"batches": 1, "rows": 78})
    tensors, metadata = read_verified(path)
    memories = json.loads(metadata["memories"])
    name = f"output_memory_layer.{missing}"
    del memories[name]
    tensors = {k: t for k, t in tensors.items() if not k.startswith(f"{name}.")}
    write_atomic(path, tensors, {**metadata, "memories": json.dumps(memories, sort_keys=True)})

    for load in ("restore", "load_checkpoint"):
        fresh = apply_faast(tiny_model("llama"), config)
        with caplog.at_level("INFO", logger="faast"):
            position = Checkpointer(tmp_path).restore(fresh) if load == "restore" else load_checkpoint(path, fresh)
        assert position["batches"] == 1
        assert any(f"has no {name}" in r.getMessage() for r in caplog.records)
        for (state, a), (_, b) in zip(fresh.learned_state(), model.learned_state(), strict=True):
            for key, tensor in b.state_dict().items():
                expected = torch.zeros_like(tensor) if state == name else tensor
                assert torch.equal(a.state_dict()[key], expected), (load, state, key)
    probe = ids(batch=2, seq=15, seed=9)
    with torch.no_grad():
        read = fresh(probe).logits
        assert not torch.equal(read, model(probe).logits)
        setattr(model.output_memory_layer, setting, 0.0)
        assert torch.equal(read, model(probe).logits)  # the saved model without that bias
    assert "0 of 78 positions" in fresh.output_memory_layer.last_tuning[off]
    fresh.learn(ids(batch=2, seq=40, seed=4))
    fresh.solve()
    assert "78 of 156 positions" in fresh.output_memory_layer.last_tuning[off]
    # A statistic its owner does not list as optional is still required.
    del memories["output_memory_layer.curvature"]
    tensors = {k: t for k, t in tensors.items() if not k.startswith("output_memory_layer.curvature.")}
    write_atomic(path, tensors, {**metadata, "memories": json.dumps(memories, sort_keys=True)})
    before = [t.clone() for _, m in fresh.learned_state() for t in m.state_dict().values()]
    with pytest.raises(ValueError, match="holds memories .* the object being restored has"):
        load_checkpoint(path, fresh)
    after = [t for _, m in fresh.learned_state() for t in m.state_dict().values()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_merging_two_streams_equals_learning_both():
    config = FaastConfig(output=ResidualOutput(step=0.2))
    a, b, both = (apply_faast(tiny_model("gpt2"), config) for _ in range(3))
    x1, x2 = ids(batch=2, seq=30, seed=1), ids(batch=2, seq=30, seed=2)
    a.learn(x1)
    b.learn(x2)
    both.learn(torch.cat([x1, x2]))
    states = (a.learned_state(), b.learned_state(), both.learned_state())
    for (name, mine), (_, theirs), (_, total) in zip(*states, strict=True):
        mine.merge(theirs)  # the memory and the curvature and token-mass accumulators alike
        assert mine.count.item() == total.count.item() > 0, name
        for x, y in zip(mine.summed_tensors(), total.summed_tensors(), strict=True):
            assert rel(x, y) <= 1e-6, name
    ma = a.output_memory_layer.folded(torch.device("cpu"), torch.float64)
    mb = both.output_memory_layer.folded(torch.device("cpu"), torch.float64)
    assert rel(ma, mb) <= 1e-5


def test_configuration_errors_name_the_field_and_old_configurations_load_as_the_papers_layer():
    for kwargs, field in (({"step": -1}, "ResidualOutput.step"), ({"step": "tuned"}, "ResidualOutput.step"),
                          ({"damping": 0}, "ResidualOutput.damping"), ({"alpha": -0.1}, "ResidualOutput.alpha"),
                          ({"tune_tokens": -5}, "ResidualOutput.tune_tokens"),
                          ({"tune_tokens": True}, "ResidualOutput.tune_tokens")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            ResidualOutput(**kwargs)
    with pytest.raises(ValueError, match="output.kind: expected 'residual' or 'embedding', got 'logits'"):
        FaastConfig.from_dict({"output": {"kind": "logits"}})
    # Written before the residual output layer existed (no output_* field but output_layer and output_mix).
    saved_before = {k: v for k, v in V1_DEFAULT.items() if not k.startswith("output_") or
                    k in ("output_layer", "output_mix")}  # fmt: skip
    assert FaastConfig.from_dict(saved_before, version=1).output == EmbeddingOutput(mix=0.9)
    assert FaastConfig().output == ResidualOutput()
    assert REORDER_REL < STAT_REL


def test_a_model_without_an_lm_head_of_the_hidden_size_is_refused_with_the_fix_named():
    model = tiny_model("llama")
    model.lm_head = torch.nn.Linear(16, VOCAB, bias=False)
    with pytest.raises(ValueError, match=r"use FaastConfig\(output=EmbeddingOutput\(\)\) or output=None"):
        apply_faast(model, FaastConfig())


def test_learn_takes_a_tokenizer_batch_by_keyword_and_labels_select_the_pairs():
    x = ids(batch=2, seq=30, seed=4)
    mask = torch.ones_like(x)
    mask[1, :6] = 0
    by_position = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=[1])))
    by_position.learn(x, mask)
    by_keyword = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=[1])))
    by_keyword.learn(**{"input_ids": x, "attention_mask": mask})
    for (name, a), (_, b) in zip(by_position.learned_state(), by_keyword.learned_state(), strict=True):
        for mine, theirs in zip(a.summed_tensors(), b.summed_tensors(), strict=True):
            assert torch.equal(mine, theirs), name

    # An instruction-style batch: only the answer (the last 12 positions) is learned.
    labels = x.clone()
    labels[:, :18] = -100
    exact = FaastConfig(output=ResidualOutput(head_dtype="float32", key_layers=[]), learn_dtype="model")
    model = apply_faast(tiny_model("llama"), exact)
    stats = model.learn(input_ids=x, labels=labels)
    every = torch.ones_like(x, dtype=torch.bool)
    k, _, _, _, _, _ = reference_statistics(model, x, every)
    h = final_states(model, x, every)
    chosen = (labels[:, 1:] != -100).reshape(-1)
    k = h[:, :-1].reshape(-1, h.shape[-1])[chosen]
    y = x[:, 1:].reshape(-1)[chosen]
    head = model.base_model.get_output_embeddings().weight.double()
    r = head[y] - torch.softmax(k @ head.T, -1) @ head
    memory = model.output_memory_layer.memory
    assert memory.count.item() == stats.pairs == int(chosen.sum()) == 2 * 12
    assert rel(memory.gram, k.T @ k) < STAT_REL and rel(memory.cross, k.T @ r) < STAT_REL
    with pytest.raises(ValueError, match="labels: expected token ids"):
        model.learn(input_ids=x, labels=torch.full_like(x, -5))
    with pytest.raises(ValueError, match="labels: expected shape"):
        model.learn(input_ids=x, labels=labels[:, :5])
    with pytest.raises(ValueError, match="input_ids: give the batch either"):
        model.learn(x, input_ids=x)
    with pytest.raises(ValueError, match="labels: only valid with an input_ids tensor"):
        model.learn(["some text"], labels=labels)


def test_solve_does_the_first_forward_pass_work_ahead_of_it():
    model = apply_faast(
        tiny_model("gpt2"), FaastConfig(output=ResidualOutput(tune_tokens=256), middle=MiddleLayers(layers=[1, 2]))
    )
    for layer in model.memory_layers.values():
        torch.nn.init.normal_(layer.readout.weight, std=0.3)
    x = ids(batch=8, seq=100, period=17)
    model.learn(x)
    assert model.output_memory_layer._folded is None
    report = model.solve()
    assert report == {"default": model.output_memory_layer.last_tuning}  # what it solved, as a copy
    assert report["default"] is not model.output_memory_layer.last_tuning
    assert model.output_memory_layer.last_tuning["tuned"]
    folded = model.output_memory_layer._folded
    calls = []
    original = model.memory_bank.solve
    model.memory_bank.solve = lambda *a, **k: calls.append(1) or original(*a, **k)
    with torch.no_grad():
        model(x[:1, :10])
    assert calls == [] and model.output_memory_layer._folded is folded  # nothing solved again


@pytest.mark.parametrize("kind", KINDS)
def test_probability_space_mixes_the_rows_the_model_keeps_and_leaves_an_empty_memory_bit_exact(kind):
    model = apply_faast(tiny_model(kind), FaastConfig(output=ResidualOutput(step=0.5, weight=0.3)))
    x = ids(batch=2, seq=12, period=5)
    with torch.no_grad():
        with model.disable_faast():
            base = model(x).logits
        assert torch.equal(model(x).logits, base)  # nothing learned: the head's logits untouched
        model.learn(ids(batch=8, seq=40, period=5))
        assert model.output_memory_layer.chosen_key_width() == 64  # h̃ and block 0's input: a wider key to slice
        full = model(x).logits
        last = model(x, logits_to_keep=1).logits  # what generation asks for: the head sees the last position only
    assert rel(last[:, -1], full[:, -1]) < 1e-6
    # Index tensors: the last positions read like the full pass; other positions would misalign the wider keys.
    with torch.no_grad():
        tail = model(x, logits_to_keep=torch.tensor([10, 11])).logits
        assert rel(tail, full[:, 10:]) < 1e-6
        with pytest.raises(ValueError, match="logits_to_keep: the output layer's wider keys"):
            model(x, logits_to_keep=torch.tensor([0, 3]))
    assert rel(full.exp().sum(-1), torch.ones(full.shape[:-1])) < 1e-5  # log-probabilities of a distribution
    assert not torch.allclose(full.log_softmax(-1), base.log_softmax(-1), atol=1e-3)


def width_nll(k, y, rows, out, fisher, head, width, chosen):
    """Float64 hand computation of the held-out NLL at `rows` of the correction fitted on the first `width` key
    columns without the `out` positions, read at chosen["step"] and chosen["weight"]; keys h̃ are the first 32
    columns of k. fisher: (Σ μμᵀ, Σ p) over all positions."""
    s_fit, t_fit, n_fit = fit_without(k, y, head, out)
    w = newton(s_fit[:width, :width], t_fit[:width], n_fit, *fisher, head, damping=1.0, n_curvature=k.shape[0])
    kh = held_keys(k, rows)
    z0 = kh[:, :32] @ head.T
    z = z0 + chosen["step"] * (kh[:, :width] @ w) @ head.T
    lam = chosen["weight"]
    mixture = (1 - lam) * torch.softmax(z0, -1) + lam * torch.softmax(z, -1)
    return float(-mixture.gather(-1, y[rows, None]).log().mean())


def noisy_phrase():
    """8 rows of 100 tokens: a repeated phrase with a fifth of its tokens replaced at random."""
    x, noise = ids(batch=8, seq=100, period=23), ids(batch=8, seq=100, seed=7)
    return torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.8, x, noise)


def test_the_key_width_is_the_one_whose_tuned_correction_predicts_the_held_out_tail_best():
    # The keys h̃ (32) and block 0's input ('auto' on 4 blocks: 64 in all). 792 positions, 160 held out and 320 left
    # out before them: 312 fitted, enough for either width (fit_per_key_dim × 64 = 256), so (η, λ) is tuned for both
    # and the lower held-out NLL wins; each width's recorded NLL is checked against a float64 hand computation at its
    # (η, λ).
    x = noisy_phrase()
    output = ResidualOutput(tune_tokens=4096, head_dtype="float32", weight="auto")
    config = FaastConfig(output=output, learn_dtype="model")
    model = apply_faast(tiny_model("llama"), config)
    model.learn(x)
    layer = model.output_memory_layer
    m, _ = layer.solution(torch.device("cpu"), torch.float64)
    tuning = layer.last_tuning
    by_width = tuning["by_key_width"]
    assert sorted(by_width) == [32, 64]
    k, y, _, _, mu_gram, mass = reference_statistics(model, x, torch.ones_like(x, dtype=torch.bool))
    held, out = tail_split([99] * 8, 4096)
    assert tuning["held_out_tokens"] == held.numel() and tuning["fitted_tokens"] == k.shape[0] - out.numel()
    head = model.base_model.get_output_embeddings().weight.double()
    for width, chosen in by_width.items():
        nll = width_nll(k, y, held, out, (mu_gram, mass), head, width, chosen)
        assert abs(nll - chosen["held_out_nll"]) < HELD_OUT_NLL_REL * nll, width
    width = min(by_width, key=lambda v: (by_width[v]["held_out_nll"], v))
    assert tuning["key_width"] == width == layer.chosen_key_width()
    assert (tuning["step"], tuning["weight"]) == (by_width[width]["step"], by_width[width]["weight"])
    assert m is not None and m.shape == (width, 32)
    # Too little fitted for the full keys (16 per dimension: the gaps would leave 312 < 512, so none; 632 < 1024):
    # tuned for h̃ alone, no choice made.
    few = apply_faast(tiny_model("llama"), FaastConfig(output=dataclasses.replace(output, policy=OutputPolicy(
        fit_per_key_dim=16)), learn_dtype="model"))  # fmt: skip
    few.learn(x)
    few.output_memory_layer.folded(torch.device("cpu"), torch.float32)
    assert few.output_memory_layer.last_tuning["key_width"] == 32 and few.output_memory_layer.last_tuning["tuned"]
    assert few.output_memory_layer.last_tuning["by_key_width"] == {}


@pytest.mark.parametrize("width", [32, 64])
def test_the_chosen_key_width_is_saved_with_the_step_and_a_loaded_model_reads_the_same(width, tmp_path, monkeypatch):
    # One width offered to the tuning, so that each is saved and restored once.
    monkeypatch.setattr(StepChoice, "widths", lambda self, fitted: [width])
    config = FaastConfig(output=ResidualOutput(tune_tokens=4096))
    model = apply_faast(tiny_model("llama"), config)
    model.learn(noisy_phrase())
    assert model.output_memory_layer.chosen_key_width() == width
    assert model.output_memory_layer.chosen_step() > 0
    path = model.save_fast_weights(tmp_path / "fw.safetensors")
    fresh = apply_faast(tiny_model("llama"), config).load_fast_weights(path)
    probe = ids(batch=2, seq=15, seed=9)
    with torch.no_grad():
        assert torch.equal(fresh(probe).logits, model(probe).logits)
    assert fresh.output_memory_layer.chosen_key_width() == width
    assert fresh.output_memory_layer.last_tuning["key_width"] == width
    # A saved width that is neither h̃'s nor the full keys' is refused, naming the field.
    with pytest.raises(ValueError, match=r"key_width: expected one of \[32, 64\] or None, got 48"):
        fresh.output_memory_layer.restore_step(0.1, 0.5, 48)
    from faast.checkpoint import save_state

    save_state(tmp_path / "bad.safetensors", per_layer_holder(model, copy=True), {"output_key_width": "64"})
    with pytest.raises(ValueError, match="output_key_width: expected an int > 0"):
        apply_faast(tiny_model("llama"), config).load_fast_weights(tmp_path / "bad.safetensors")


def test_output_key_layers_auto_resolves_to_an_early_block_and_old_configurations_keep_h_alone():
    model = apply_faast(tiny_model("llama", layers=14), FaastConfig())
    assert model.faast_config.output.key_layers == [2]  # 14 // 7
    assert model.output_memory_layer.memory.dim_key == 64
    assert FaastConfig.from_dict(model.faast_config.to_dict()).output.key_layers == [2]  # saved resolved
    saved_before = {k: v for k, v in V1_DEFAULT.items() if k != "output_key_layers"}
    assert FaastConfig.from_dict(saved_before, version=1).output.key_layers == []
    paper = apply_faast(tiny_model("llama"), FaastConfig(output=EmbeddingOutput()))
    assert paper.faast_config.output_key_blocks(4) == [] and paper.output_memory_layer.memory.dim_key == 32
    listed = "expected 'auto' or a list of block indices >= 0"
    for value, message in (([1, 1], "block indices must be distinct"), ([-1], listed), ("early", listed),
                           ([1.0], listed)):  # fmt: skip
        with pytest.raises(ValueError, match=f"ResidualOutput.key_layers: {message}"):
            FaastConfig(output=ResidualOutput(key_layers=value))
    with pytest.raises(ValueError, match=r"key_layers: indices \[4\] are out of range for a model with 4"):
        apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(key_layers=[4])))
    with pytest.raises(TypeError, match="key_layers does not apply to EmbeddingOutput .* a field of ResidualOutput"):
        EmbeddingOutput(key_layers=[1])


def test_the_untuned_step_grows_with_the_positions_learned_up_to_the_default():
    """Below DEFAULT_STEP_PER_DIM positions per hidden dimension the untuned step is default_step × positions /
    (DEFAULT_STEP_PER_DIM · d), and default_step from there on; a fixed step and a saved step are used as they are."""
    layer_of = lambda m: m.output_memory_layer  # noqa: E731
    full = DEFAULT_POLICY.default_step_per_dim * 32  # the tiny Qwen2's hidden size is 32
    steps = {}
    for positions in (29, 59, 111, 239, 399):  # all too few to tune on (the tail needs a 256-position fit)
        model = apply_faast(tiny_model("qwen2"), FaastConfig(output=ResidualOutput(default_step=0.04)))
        model.learn(ids(batch=1, seq=positions + 1, seed=positions))
        assert int(layer_of(model).memory.count) == positions and not layer_of(model).held_out_positions()
        steps[positions] = layer_of(model).chosen_step()
        assert steps[positions] == pytest.approx(0.04 * min(1.0, positions / full), rel=1e-12)
        assert layer_of(model).last_tuning["step"] == steps[positions] and not layer_of(model).last_tuning["tuned"]
    assert full < 239 and steps[29] < steps[59] < steps[111] < steps[239] == steps[399] == 0.04
    # The read uses the scaled step: M = η·W with η the scaled one.
    model = apply_faast(tiny_model("qwen2"), FaastConfig(output=ResidualOutput(default_step=0.04)))
    model.learn(ids(batch=1, seq=30, seed=29))
    scaled = layer_of(model).folded(torch.device("cpu"), torch.float64)
    fixed = apply_faast(tiny_model("qwen2"), FaastConfig(output=ResidualOutput(step=0.04)))
    fixed.learn(ids(batch=1, seq=30, seed=29))
    assert layer_of(fixed).chosen_step() == 0.04  # a fixed step is not scaled
    unscaled = layer_of(fixed).folded(torch.device("cpu"), torch.float64)
    torch.testing.assert_close(scaled, unscaled * (29 / full), rtol=1e-12, atol=0)
    # A step restored from a file is the step in use when it was saved: not scaled again.
    layer_of(model).restore_step(0.04, 0.5)
    assert layer_of(model).chosen_step() == 0.04 and layer_of(model).last_tuning["saved_step"]


def test_a_head_dtype_the_device_cannot_run_raises_before_anything_is_learned(monkeypatch):
    """head_dtype='int8' on a GPU raises in learn() before the pass, so no memory (middle or output) learns."""
    config = FaastConfig(output=ResidualOutput(step=0.5, head_dtype="int8"), middle=MiddleLayers(layers=[1, 2]))
    model = apply_faast(tiny_model("llama"), config)
    real = learning_module.products_dtype
    monkeypatch.setattr(learning_module, "products_dtype", lambda s, _, w: real(s, torch.empty(0, device="meta"), w))
    with pytest.raises(ValueError, match="ResidualOutput.head_dtype: 'int8' runs on a CPU only"):
        model.learn(ids(batch=2, seq=30))
    assert all(float(layer.memory.count) == 0 for layer in model.faast_layers())
    monkeypatch.setattr(learning_module, "products_dtype", real)
    model.learn(ids(batch=2, seq=30))  # on the CPU the same model learns
    assert all(float(layer.memory.count) > 0 for layer in model.faast_layers())
