"""faast.hf on every model type of the attachment table (faast/hf/targets.py) and on discovered ones, each a tiny model
built in-process (2 blocks, hidden 32): the disabled model is the base model bit for bit, learned pairs are exact
under left and right padding, KV-cache generation equals generation without a cache, and the residual output layer
sees the model's own logits (logit scales folded in, softcapping refused). Discovery is checked on a transformers
type left out of the table and refused, with the missing part named, on models it cannot read."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from faast.hf import EmbeddingOutput, FaastConfig, MiddleLayers, ResidualOutput, apply_faast
from faast.hf import targets as targets_module
from faast.hf.output.head import head_logits, head_second_moment
from faast.hf.targets import TARGETS, discover_target, target_for
from hf_models import arch_model, transformers
from test_hf import ids, randomize_readouts
from test_hf_residual import mean_gradient_bias, token_bias
from tolerances import HF_PADDING_REL, rel

# A real transformers type the table leaves out on purpose: it is attached through discovery.
DISCOVERED = "persimmon"
ARCHS = [*sorted(TARGETS), DISCOVERED]

# The residual layer's logits are the head's own product on the same float32 input: equal up to reordered sums.
HEAD_LOGITS_REL = 1e-6
# The residual statistics: float64 sums of float32 keys and logits (as in test_hf_residual.py).
STAT_REL = 1e-6


# Types whose default config softcaps the logits: their residual output layer is refused
# (test_softcapped_logits_refuse_the_residual_output_layer), so the other tests give them the 'embedding' one.
SOFTCAPPED = {
    kind for kind, t in TARGETS.items()
    if t.logit_softcap and getattr(transformers.AutoConfig.for_model(kind), t.logit_softcap, None) is not None
}  # fmt: skip


def config_for(kind: str, step: float | str = "auto") -> FaastConfig:
    """MiddleLayers(num_layers=2) (a memory layer before each of the 2 blocks) and the default residual output layer
    with `step`, or the embedding one for a SOFTCAPPED type."""
    output = EmbeddingOutput() if kind in SOFTCAPPED else ResidualOutput(step=step)
    return FaastConfig(output=output, middle=MiddleLayers(num_layers=2))


def test_the_table_covers_the_common_decoder_lms():
    common = {
        "gpt2", "llama", "qwen2", "mistral", "mixtral", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo",
        "olmo2", "smollm3", "granite", "stablelm", "starcoder2", "gpt_neox", "falcon", "cohere",
    }  # fmt: skip
    assert common <= set(TARGETS)
    assert DISCOVERED not in TARGETS
    assert not any(t.discovered for t in TARGETS.values())


@pytest.mark.parametrize("kind", ARCHS)
def test_module_paths_resolve_to_the_blocks_and_the_final_norm(kind):
    model = arch_model(kind)
    target = target_for(model)
    assert target.discovered == (kind == DISCOVERED)
    blocks = model.get_submodule(target.blocks)
    assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == model.config.num_hidden_layers == 2
    assert model.get_submodule(target.backbone) is model.base_model
    # The final norm reads the last block's output and the LM head reads the norm's output.
    seen = {}

    def after_block(module, args, out):
        seen["block"] = out[0] if isinstance(out, tuple) else out

    def after_norm(module, args, out):
        seen["norm_in"], seen["norm_out"] = args[0], out

    handles = [
        blocks[-1].register_forward_hook(after_block),
        model.get_submodule(target.final_norm).register_forward_hook(after_norm),
        model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.__setitem__("head_in", a[0])),
    ]
    with torch.no_grad():
        model(ids(batch=2, seq=7), use_cache=False)
    for h in handles:
        h.remove()
    assert torch.equal(seen["norm_in"], seen["block"])
    assert torch.equal(seen["head_in"], seen["norm_out"])


@pytest.mark.parametrize("kind", ARCHS)
def test_disabled_faast_gives_the_base_logits_bitwise(kind):
    x = ids(batch=2, seq=9)
    with torch.no_grad():
        expected = arch_model(kind)(x).logits
    model = apply_faast(arch_model(kind), config_for(kind, step=0.5))
    randomize_readouts(model)
    assert torch.equal(model(x).logits, expected)  # nothing learned: every layer passes h through
    model.learn(ids(batch=2, seq=16, seed=1))
    assert not torch.allclose(model(x).logits, expected)  # learned: the memories change the output
    with model.disable_faast():
        assert torch.equal(model(x).logits, expected)


@pytest.mark.parametrize("kind", ARCHS)
def test_learned_pairs_are_exact_under_left_and_right_padding(kind):
    texts = [ids(batch=1, seq=n, seed=n)[0] for n in (5, 11, 8)]
    width = max(len(t) for t in texts)
    right, left = torch.zeros((3, width), dtype=torch.long), torch.zeros((3, width), dtype=torch.long)
    right_mask, left_mask = torch.zeros_like(right), torch.zeros_like(left)
    for r, t in enumerate(texts):
        right[r, : len(t)], right_mask[r, : len(t)] = t, 1
        left[r, width - len(t) :], left_mask[r, width - len(t) :] = t, 1
    # The truth: the non-pad next-token pairs, and the statistics of each text learned alone, unpadded.
    pairs = int((right_mask[:, :-1] * right_mask[:, 1:]).sum())
    assert pairs == sum(len(t) - 1 for t in texts)
    models = [apply_faast(arch_model(kind), config_for(kind)) for _ in range(3)]
    for m in models:
        randomize_readouts(m)
    a, b, one = models
    sa, sb = a.learn(right, right_mask), b.learn(left, left_mask)
    for t in texts:
        one.learn(t.unsqueeze(0))
    assert sa.pairs == sb.pairs == pairs
    for la, lb, lo in zip(a.faast_layers(), b.faast_layers(), one.faast_layers(), strict=True):
        assert la.memory.count.item() == lb.memory.count.item() == lo.memory.count.item() == pairs
        for mine in (la, lb):
            assert rel(mine.memory.gram, lo.memory.gram) < HF_PADDING_REL
            assert rel(mine.memory.cross, lo.memory.cross) < HF_PADDING_REL


@pytest.mark.parametrize("kind", ARCHS)
def test_generation_with_kv_cache_equals_without_when_learned(kind):
    model = apply_faast(arch_model(kind), config_for(kind, step=0.5))
    randomize_readouts(model, std=0.5)
    model.learn(ids(batch=12, seq=64, seed=3))
    layer = model.output_memory_layer
    if kind not in SOFTCAPPED:  # enough text for the full keys: the head reads the inputs of block 0 of each step
        assert layer.extra_key_size > 0 and layer.chosen_key_width() == layer.memory.dim_key
    prompt = ids(batch=1, seq=6, seed=4)
    cached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    with torch.no_grad():
        adapted = model(cached).logits
        with model.disable_faast():
            plain = model(cached).logits
    assert not torch.allclose(adapted, plain, atol=1e-3)  # the fast weights act on what was generated


# ---------------------------------------------------------------------------------------------------- the logits


def final_norm_output(model, x, mask=None):
    """The final norm's output [B, T, d] and the model's logits [B, T, V], faast disabled (positions count real
    tokens, as learn() does)."""
    norm = model.base_model.get_submodule(target_for(model.base_model).final_norm)
    mask = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    seen = {}
    handle = norm.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.detach()))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    try:
        with model.disable_faast(), torch.no_grad():
            logits = model(input_ids=x, attention_mask=mask.long(), position_ids=positions).logits
    finally:
        handle.remove()
    return seen["h"], logits


@pytest.mark.parametrize("kind", [k for k in ARCHS if k not in SOFTCAPPED])
def test_the_residual_output_layer_sees_the_models_own_logits(kind):
    model = apply_faast(arch_model(kind), FaastConfig())
    h, logits = final_norm_output(model, ids(batch=2, seq=9))
    assert rel(head_logits(model.output_memory_layer.head, h), logits) < HEAD_LOGITS_REL


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_scaled_logits_give_the_gradient_and_fisher_of_the_scaled_softmax(kind):
    # granite divides its logits by logits_scaling (4 here), cohere multiplies them by logit_scale (1/16): the
    # statistics must be those of p = softmax(s·h̃Hᵀ), i.e. r = s(H[y] − pH) and Σμμᵀ with μ = s·pH.
    config = FaastConfig(output=ResidualOutput(head_dtype="float32", key_layers=[]), learn_dtype="model")
    model = apply_faast(arch_model(kind), config)
    scale = 1 / model.config.logits_scaling if kind == "granite" else model.config.logit_scale
    assert scale != 1.0
    x = ids(batch=3, seq=20)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 15:] = False  # right padding
    mask[2, :4] = False  # left padding
    model.learn(x, mask)
    h, _ = final_norm_output(model, x, mask)
    pair = (mask[:, :-1] & mask[:, 1:]).reshape(-1)
    k = h[:, :-1].reshape(-1, h.shape[-1])[pair].double()
    y = x[:, 1:].reshape(-1)[pair]
    head = model.base_model.get_output_embeddings().weight.double() * scale
    p = torch.softmax(k @ head.T, -1)
    mu = p @ head
    layer = model.output_memory_layer
    assert layer.memory.count.item() == k.shape[0]
    assert rel(layer.memory.cross, k.T @ (head[y] - mu)) < STAT_REL
    assert rel(layer.curvature.gram, mu.T @ mu) < STAT_REL
    assert rel(layer.token_mass.probability, p.sum(0)) < STAT_REL
    assert (
        rel(head_second_moment(layer.head.weight, layer.token_mass.probability), (head.T * p.sum(0)) @ head) < STAT_REL
    )
    assert rel(layer.gradient_sum.gradient, (head[y] - mu).sum(0)) < STAT_REL
    # Read in probability space, the model's logits are the log of the mixture of its own scaled softmax and the
    # corrected one, with the bias, and the token bias u in the scaled logits of both (the head hook divides them by
    # the scale the model multiplies by again).
    layer.step, layer.weight = 0.5, 0.4
    m = layer.folded(torch.device("cpu"), torch.float64).double()
    bias = layer.folded_bias(torch.device("cpu"), torch.float64)
    expected = mean_gradient_bias(y, p.sum(0), mu.T @ mu, head, k.shape[0], layer.damping, layer.bias)
    assert rel(bias, expected) < STAT_REL
    u = token_bias(y, p.sum(0), head.shape[0], layer.token_bias)
    assert rel(layer.folded_token_bias(torch.device("cpu"), torch.float64), u) < STAT_REL
    probe = ids(batch=1, seq=7, seed=4)
    hp, base = final_norm_output(model, probe)
    hp = hp.double()
    with torch.no_grad():
        logits = model(probe).logits.double()
    mixture = 0.6 * torch.softmax(hp @ head.T + u, -1) + 0.4 * torch.softmax((hp + hp @ m + bias) @ head.T + u, -1)
    assert rel(base.double(), hp @ head.T) < HEAD_LOGITS_REL
    assert rel(logits, mixture.log()) < HEAD_LOGITS_REL


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_softcapped_logits_refuse_the_residual_output_layer(kind):
    capped = arch_model(kind, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=rf"model type '{kind}' softcaps its logits \(config.final_logit_softcapping"
                                         r"=30.0.*output=EmbeddingOutput\(\)"):  # fmt: skip
        apply_faast(capped, FaastConfig())
    # The other layers do not read the logits; without softcapping the residual layer is exact again.
    apply_faast(capped, FaastConfig(output=EmbeddingOutput())).learn(ids(batch=2, seq=8))
    uncapped = apply_faast(arch_model(kind, final_logit_softcapping=None), FaastConfig())
    h, logits = final_norm_output(uncapped, ids(batch=2, seq=9))
    assert rel(head_logits(uncapped.output_memory_layer.head, h), logits) < HEAD_LOGITS_REL


# ---------------------------------------------------------------------------------------------------- discovery


def test_discovery_finds_the_layout_and_logs_once_per_type(caplog, monkeypatch):
    monkeypatch.setattr(targets_module, "_DISCOVERY_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="faast.hf"):
        target = discover_target(arch_model(DISCOVERED))
        apply_faast(arch_model(DISCOVERED), FaastConfig())
    assert (target.backbone, target.blocks, target.final_norm) == ("model", "model.layers", "model.final_layernorm")
    assert target.discovered and target.logits_from_head
    logged = [r for r in caplog.records if "discovered" in r.getMessage()]
    assert len(logged) == 1 and f"model type {DISCOVERED!r} is not in faast.hf.targets.TARGETS" in logged[0].message


def test_discovery_agrees_with_the_table_on_every_type_it_can_read():
    # Types whose norm reads the last block's output through no other module: discovery must find the table's paths.
    for kind in ("llama", "gpt2", "gpt_neox", "phi", "opt", "mpt", "falcon", "bloom"):
        model = arch_model(kind)
        found, listed = discover_target(model), TARGETS[kind]
        assert (found.backbone, found.blocks, found.final_norm) == (listed.backbone, listed.blocks, listed.final_norm)


def unknown(model: torch.nn.Module, model_type: str = "faast_unknown") -> torch.nn.Module:
    model.config.model_type = model_type  # an instance attribute: the class keeps its own
    return model


def test_discovery_refuses_a_model_without_a_block_list_and_says_what_it_found():
    model = unknown(arch_model("llama"))
    model.config.num_hidden_layers = 3  # no ModuleList of 3 blocks
    expected = "no nn.ModuleList under 'model' has config.num_hidden_layers=3 entries (found {'layers': 2})"
    with pytest.raises(ValueError, match=re.escape(expected)):
        apply_faast(model, FaastConfig())
    model.model.layers = torch.nn.Sequential(*model.model.layers)  # not a ModuleList at all
    model.config.num_hidden_layers = 2
    expected = (
        r"got 'faast_unknown' \(LlamaForCausalLM\), and discovery failed: no block list: .*\(found none\); "
        r"add an entry to faast.hf.targets.TARGETS"
    )
    with pytest.raises(ValueError, match=expected):
        apply_faast(model, FaastConfig())


def test_discovery_refuses_a_model_without_a_final_norm_or_a_backbone():
    model = unknown(arch_model("llama"))
    model.model.norm = torch.nn.Identity()
    with pytest.raises(ValueError, match="discovery failed: no final norm: no norm module under 'model' outside"):
        apply_faast(model, FaastConfig())
    model = unknown(arch_model("llama"))
    model.base_model_prefix = "decoder"
    with pytest.raises(ValueError, match="no backbone: base_model_prefix is 'decoder'"):
        apply_faast(model, FaastConfig())

    class Bare(torch.nn.Module):
        config = type("C", (), {"model_type": "bert"})()

    with pytest.raises(ValueError, match=r"got 'bert' \(Bare\), and discovery failed: config.num_hidden_layers"):
        apply_faast(Bare(), FaastConfig())


def test_discovery_refuses_the_residual_layer_when_the_logits_are_not_the_head_of_the_norm():
    # gemma2 under another name: discovery reads its layout but sees softcapped logits (c = 0.5 bends tiny logits).
    model = unknown(arch_model("gemma2", final_logit_softcapping=0.5))
    target = discover_target(model)
    assert target.final_norm == "model.norm" and not target.logits_from_head
    with pytest.raises(ValueError, match="are not the LM head applied to the final norm's output"):
        apply_faast(model, FaastConfig())
    learned = apply_faast(model, FaastConfig(output=EmbeddingOutput(), middle=MiddleLayers(num_layers=1)))
    learned.learn(ids(batch=2, seq=8))
    assert learned.output_memory_layer.memory.count.item() == 2 * 7
