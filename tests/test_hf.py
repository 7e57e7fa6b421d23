"""faast.hf on tiny GPT-2 / Llama / Qwen2 models built in-process: attachment, learning, padding, persistence,
generation, and errors. The real SmolLM2 path is in test_hf_smollm2.py (slow)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from faast.hf import EmbeddingOutput, FaastConfig, FaastModel, MiddleLayers, Regulariser, apply_faast, from_pretrained
from faast.hf.targets import TARGETS
from hf_models import KINDS, VOCAB, CharTokenizer, tiny_model
from tolerances import BF16_MODEL_REL, HF_PADDING_REL, rel


def randomize_readouts(model, seed=1, std=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.memory_layers.values():
            layer.readout.weight.copy_(torch.randn(layer.readout.weight.shape, generator=g) * std)
            if layer.scorer is not None:
                layer.scorer.weight.copy_(torch.randn(layer.scorer.weight.shape, generator=g) * std)


def ids(batch=3, seq=17, seed=0):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------- placement


def test_placement_follows_the_authors_rule_and_the_papers_default():
    config = FaastConfig(middle=MiddleLayers(num_layers=15))
    # int((i+1)·L/(n+1)) exactly as docs/authors.md §1.2 (gpt2-xl, 15 layers -> 3, 6, ..., 45).
    assert config.block_indices(48, 1_500_000_000) == [int((i + 1) * 48 / 16) for i in range(15)]
    assert config.block_indices(48, 1_500_000_000)[:3] == [3, 6, 9]
    # Default: every block below 1B parameters, every other block above (the paper's appendix).
    assert FaastConfig(middle=MiddleLayers(num_layers=None)).block_indices(12, 124_000_000) == list(range(12))
    assert len(FaastConfig(middle=MiddleLayers(num_layers=None)).block_indices(28, 7_000_000_000)) == 14
    assert FaastConfig().block_indices(12, 124_000_000) == []  # the default: the output layer only
    assert FaastConfig(middle=MiddleLayers(layers=[5, 1])).block_indices(12, 1) == [1, 5]
    with pytest.raises(ValueError, match="layers: indices \\[12\\] are out of range"):
        FaastConfig(middle=MiddleLayers(layers=[12])).block_indices(12, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_layers_attach_where_configured(kind):
    model = apply_faast(tiny_model(kind), FaastConfig(middle=MiddleLayers(layers=[0, 2])))
    assert model.faast_config.middle.layers == [0, 2]
    assert list(model.memory_layers) == ["0", "2"]
    assert model.faast_config.model_type == kind and model.faast_config.hidden_size == 32
    layer = model.memory_layers["2"]
    assert layer.memory.dim_key == 32 and layer.readout.weight.shape == (32, 32)
    assert torch.count_nonzero(layer.readout.weight) == 0  # zero-initialised: no intrusion before training
    assert all(not p.requires_grad for p in model.base_model.parameters())


def test_unknown_model_type_names_the_supported_ones():
    class Fake(torch.nn.Module):
        config = type("C", (), {"model_type": "bert"})()

    # Types outside the table go through discovery (test_hf_archs.py); a model it cannot read is refused.
    supported = re.escape(str(sorted(TARGETS)))
    expected = rf"supports model types {supported}, got 'bert' \(Fake\), and discovery failed"
    with pytest.raises(ValueError, match=expected):
        apply_faast(Fake(), FaastConfig())
    assert {"gpt2", "llama", "qwen2"} <= set(TARGETS)


def test_config_round_trip_and_errors(tmp_path):
    config = FaastConfig(
        middle=MiddleLayers(num_layers=3, dropout=0.2), regulariser=Regulariser(alpha="auto"), base_model="x"
    )
    assert FaastConfig.from_json(config.to_json()) == config
    config.save(tmp_path / "c.json")
    assert FaastConfig.load(tmp_path / "c.json") == config
    assert json.loads((tmp_path / "c.json").read_text())["faast_version"]
    with pytest.raises(ValueError, match="unknown fields \\['num_layer'\\]"):
        FaastConfig.from_dict({"num_layer": 3})
    with pytest.raises(ValueError, match="EmbeddingOutput.mix"):
        EmbeddingOutput(mix=1.5)
    with pytest.raises(ValueError, match="alpha"):
        FaastConfig(regulariser=Regulariser(alpha=-1))
    with pytest.raises(ValueError, match="layers: block indices must be distinct"):
        FaastConfig(middle=MiddleLayers(layers=[1, 1]))


# ---------------------------------------------------------------------------------------------------- reading


@pytest.mark.parametrize("kind", KINDS)
def test_empty_and_disabled_memories_give_the_base_logits_exactly(kind):
    base = tiny_model(kind)
    x = ids()
    expected = base(x).logits
    model = apply_faast(base, FaastConfig(middle=MiddleLayers(num_layers=2)))
    randomize_readouts(model)
    assert torch.equal(model(x).logits, expected)  # nothing learned yet: every layer passes h through
    model.learn(x)
    assert not torch.allclose(model(x).logits, expected)  # the memory now changes the output
    with model.disable_faast():
        assert torch.equal(model(x).logits, expected)
        first = next(iter(model.memory_layers.values()))
        before = first.memory.count.clone()
        model(x)
        assert torch.equal(first.memory.count, before)
    assert not torch.allclose(model(x).logits, expected)
    model.reset_fast_weights()
    assert torch.equal(model(x).logits, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_inference_is_h_plus_h_w_p_through_the_folded_matrix(kind):
    model = apply_faast(tiny_model(kind), FaastConfig(output=None, middle=MiddleLayers(layers=[1])))
    randomize_readouts(model)
    model.learn(ids(seq=30))
    layer = model.memory_layers["1"]
    h = torch.randn(2, 5, 32)
    w = layer.memory.weights.double()
    p = layer.readout.weight.detach().double().mT
    expected = h.double() + (h.double() @ w) @ p
    assert rel(layer(h), expected) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_generate_with_kv_cache_equals_without(kind):
    model = apply_faast(tiny_model(kind), FaastConfig(middle=MiddleLayers(num_layers=2)))
    randomize_readouts(model, std=0.5)
    model.learn(ids(batch=4, seq=40, seed=3))
    prompt = ids(batch=1, seq=6, seed=4)
    cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    with model.disable_faast():
        plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert not torch.equal(plain, cached)  # the fast weights change what is generated


# ---------------------------------------------------------------------------------------------------- learning


def captured_states(model, x, mask):
    """Block inputs and the final norm input from plain hooks on the base model, with faast disabled."""
    base = model.base_model
    target = TARGETS[model.faast_config.model_type]
    blocks = base.get_submodule(target.blocks)
    seen, handles = {}, []
    for i in model.faast_config.middle.layers:
        handles.append(
            blocks[i].register_forward_pre_hook(
                lambda m, a, k, i=i: seen.__setitem__(i, (a[0] if a else k["hidden_states"]).detach()),
                with_kwargs=True,
            )
        )
    norm = base.get_submodule(target.final_norm)
    handles.append(norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("out", a[0].detach())))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with model.disable_faast(), torch.no_grad():
        base(input_ids=x, attention_mask=mask.long(), position_ids=positions)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_statistics_equal_a_hand_computation_from_hooked_hidden_states(kind):
    model = apply_faast(
        tiny_model(kind),
        FaastConfig(output=EmbeddingOutput(), middle=MiddleLayers(layers=[0, 2]), learn_dtype="model"),
    )
    randomize_readouts(model)  # non-trivial scorer weights
    x = ids(batch=3, seq=12)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 9:] = False  # right padding
    mask[2, :4] = False  # left padding
    model.learn(x, mask)
    seen = captured_states(model, x, mask)
    pair = (mask[:, :-1] & mask[:, 1:]).reshape(-1)
    for i in (0, 2):
        h = seen[i].double()
        k = h[:, :-1].reshape(-1, 32)[pair]
        v = h[:, 1:].reshape(-1, 32)[pair]
        a = model.memory_layers[str(i)].scorer.weight.double()
        s = torch.sigmoid(torch.cat([k, v], -1) @ a.mT).squeeze(-1)
        memory = model.memory_layers[str(i)].memory
        assert rel(memory.gram, k.mT @ k) < 1e-12
        assert rel(memory.cross, k.mT @ (s.unsqueeze(-1) * v)) < 1e-6  # scores computed in float32
        assert memory.count.item() == pair.sum().item()
    h = seen["out"].double()
    k = h[:, :-1].reshape(-1, 32)[pair]
    e = model.base_model.get_input_embeddings().weight.double()[x[:, 1:].reshape(-1)[pair]]
    out = model.output_memory_layer.memory
    assert rel(out.gram, k.mT @ k) < 1e-12
    assert rel(out.cross, k.mT @ e) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_left_and_right_padding_learn_the_same_pairs(kind):
    texts = [ids(batch=1, seq=n, seed=n)[0] for n in (5, 11, 8)]
    width = max(len(t) for t in texts)
    right = torch.zeros((3, width), dtype=torch.long)
    left = torch.zeros((3, width), dtype=torch.long)
    right_mask = torch.zeros((3, width), dtype=torch.long)
    left_mask = torch.zeros((3, width), dtype=torch.long)
    for r, t in enumerate(texts):
        right[r, : len(t)], right_mask[r, : len(t)] = t, 1
        left[r, width - len(t) :], left_mask[r, width - len(t) :] = t, 1
    a = apply_faast(tiny_model(kind), FaastConfig(middle=MiddleLayers(num_layers=2)))
    b = apply_faast(tiny_model(kind), FaastConfig(middle=MiddleLayers(num_layers=2)))
    one = apply_faast(tiny_model(kind), FaastConfig(middle=MiddleLayers(num_layers=2)))
    randomize_readouts(a), randomize_readouts(b), randomize_readouts(one)
    sa = a.learn(right, right_mask)
    sb = b.learn(left, left_mask)
    for t in texts:  # one unpadded text at a time: the truth
        one.learn(t.unsqueeze(0))
    assert sa.pairs == sb.pairs == sum(len(t) - 1 for t in texts)
    assert sa.tokens == sum(len(t) for t in texts)
    for la, lb, lo in zip(a.faast_layers(), b.faast_layers(), one.faast_layers(), strict=True):
        assert la.memory.count.item() == lb.memory.count.item() == sa.pairs
        assert rel(la.memory.gram, lo.memory.gram) < HF_PADDING_REL
        assert rel(lb.memory.gram, lo.memory.gram) < HF_PADDING_REL
        assert rel(lb.memory.cross, lo.memory.cross) < HF_PADDING_REL


def test_learning_texts_streams_every_pair_once():
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=1)))
    texts = ["def f(x):\n    return x + 1\n" * 3, "short", "y", "class A:\n    pass\n" * 5]
    stats = model.learn(iter(texts), tokenizer=CharTokenizer(), max_length=16, batch_size=2, progress=False)
    # Windows overlap by one token, so a text of n tokens gives n - 1 pairs however it is cut; "y" gives none.
    assert stats.pairs == sum(len(t) - 1 for t in texts)
    assert next(iter(model.memory_layers.values())).memory.count.item() == stats.pairs
    assert stats.tokens_per_second > 0


def test_learning_batches_in_a_stream_equals_learning_them_at_once():
    whole = apply_faast(tiny_model("qwen2"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    streamed = apply_faast(tiny_model("qwen2"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    x = ids(batch=6, seq=10)
    whole.learn(x)
    streamed.learn([{"input_ids": x[:2]}, {"input_ids": x[2:5], "attention_mask": torch.ones(3, 10)}, x[5:]])
    for a, b in zip(whole.faast_layers(), streamed.faast_layers(), strict=True):
        assert rel(b.memory.gram, a.memory.gram) < HF_PADDING_REL
        assert a.memory.count.item() == b.memory.count.item() == 6 * 9


def test_learning_rejects_bad_input_with_the_argument_named():
    model = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(num_layers=1)))
    with pytest.raises(TypeError, match="input_ids: expected an int64 tensor"):
        model.learn(torch.randn(2, 5))
    with pytest.raises(ValueError, match="input_ids: token ids must lie in \\[0, 61\\)"):
        model.learn(torch.tensor([[1, 2, 99]]))
    with pytest.raises(ValueError, match="attention_mask: expected shape \\[2, 5\\]"):
        model.learn(ids(2, 5), torch.ones(2, 4))
    with pytest.raises(ValueError, match="attention_mask: expected 0/1"):
        model.learn(ids(2, 5), torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="input_ids: expected a non-empty"):
        model.learn(torch.zeros((2, 0), dtype=torch.long))
    with pytest.raises(ValueError, match="tokenizer: required"):
        model.learn(["some text"])
    with pytest.raises(TypeError, match="inputs\\[0\\]: expected a text"):
        model.learn([3.5])
    with pytest.raises(ValueError, match="FAAST is already applied"):
        apply_faast(model, FaastConfig())
    assert all(layer.memory.count.item() == 0 for layer in model.faast_layers())  # nothing partial was learned


# ---------------------------------------------------------------------------------------------------- persistence


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_give_identical_outputs_and_write_nothing_of_the_base(kind, tmp_path):
    model = apply_faast(
        tiny_model(kind), FaastConfig(middle=MiddleLayers(num_layers=2), regulariser=Regulariser(alpha=0.8))
    )
    randomize_readouts(model)
    model.learn(ids(batch=4, seq=20, seed=7))
    x = ids(batch=2, seq=9, seed=8)
    expected = model(x).logits
    model.save_pretrained(tmp_path / "adapter")
    model.save_fast_weights(tmp_path / "state.safetensors")

    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "faast_adapter.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {f"layers.{i}.{p}.weight" for i in model.memory_layers for p in ("readout", "scorer")}

    # save_pretrained keeps what was learned: the reloaded model reads exactly like this one.
    fresh = from_pretrained(tiny_model(kind), tmp_path / "adapter")
    assert fresh.faast_config == model.faast_config
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, expected)
    for a, b in zip(model.faast_layers(), fresh.faast_layers(), strict=True):
        assert torch.equal(a.memory.gram, b.memory.gram) and torch.equal(a.memory.cross, b.memory.cross)
    # memories=False: the configuration and trained weights only (and no stale memories file left behind).
    model.save_pretrained(tmp_path / "adapter", memories=False)
    assert not (tmp_path / "adapter" / "faast_memories.safetensors").exists()
    bare = FaastModel.from_pretrained(tiny_model(kind), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(bare(x).logits, tiny_model(kind)(x).logits)  # readout loaded, nothing learned
    bare.load_fast_weights(tmp_path / "state.safetensors")
    assert torch.equal(bare(x).logits, expected)


def test_inherited_saves_that_would_drop_the_learned_state_raise_naming_save_pretrained(tmp_path):
    model = apply_faast(tiny_model("llama"), FaastConfig())
    model.learn(ids(batch=2, seq=12, seed=3))
    for name in ("push_to_hub", "save_model"):
        with pytest.raises(NotImplementedError, match="save_pretrained"):
            getattr(model, name)("somewhere")
    # from_pretrained on the wrapper is faast's, not the base model's (which would load a bare base model).
    model.save_pretrained(tmp_path / "a")
    fresh = model.from_pretrained(tiny_model("llama"), tmp_path / "a")
    x = ids(batch=1, seq=7, seed=4)
    with torch.no_grad():
        assert isinstance(fresh, FaastModel) and torch.equal(fresh(x).logits, model(x).logits)


def test_loading_into_a_different_model_is_refused(tmp_path):
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    model.save_pretrained(tmp_path / "a")
    model.save_fast_weights(tmp_path / "s.safetensors")
    with pytest.raises(ValueError, match="model_type"):
        from_pretrained(tiny_model("gpt2"), tmp_path / "a")
    other = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=3)))
    with pytest.raises(ValueError, match="layers"):
        other.load_adapter(tmp_path / "a")
    with pytest.raises(ValueError, match="holds memories"):
        other.load_fast_weights(tmp_path / "s.safetensors")
    with pytest.raises(FileNotFoundError, match="no faast_config.json"):
        from_pretrained(tiny_model("llama"), tmp_path)
    blob = bytearray((tmp_path / "a" / "faast_adapter.safetensors").read_bytes())
    blob[-3] ^= 0xFF
    (tmp_path / "a" / "faast_adapter.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="checksum mismatch"):
        model.load_adapter(tmp_path / "a")


def test_readout_and_scorer_stay_float32_master_weights_in_a_bf16_model():
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    model.to(torch.bfloat16)
    assert model.base_model.dtype == torch.bfloat16
    for layer in model.memory_layers.values():
        assert layer.readout.weight.dtype == torch.float32 and layer.scorer.weight.dtype == torch.float32
        assert layer.memory.gram.dtype == torch.float64
    randomize_readouts(model)
    model.learn(ids())
    out = model(ids(seed=5)).logits
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    # The same model in float32, learning the same tokens: the bf16 path's statistics and logits agree with it to
    # bfloat16 rounding, while the memories move the logits far more than that (so a broken bf16 path shows).
    reference = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    randomize_readouts(reference)
    reference.learn(ids())
    expected = reference(ids(seed=5)).logits
    for name, layer in model.memory_layers.items():
        assert rel(layer.memory.gram, reference.memory_layers[name].memory.gram) <= BF16_MODEL_REL, name
    assert rel(out, expected) <= BF16_MODEL_REL
    with reference.disable_faast():
        assert rel(reference(ids(seed=5)).logits, expected) > 10 * BF16_MODEL_REL


def test_state_size_does_not_grow_with_tokens_learned():
    model = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    size = model.fast_weight_bytes()
    model.learn(ids(batch=8, seq=60))
    assert model.fast_weight_bytes() == size
    model.learn(ids(batch=8, seq=60, seed=2))
    assert model.fast_weight_bytes() == size


def test_batches_built_from_texts_or_ids_go_to_the_model_device_and_given_tensors_keep_theirs():
    # The first GPU run failed here: token-id lists became CPU tensors for a CUDA model (gpu_h100_run1.md).
    from faast.hf.inputs import batches

    meta = torch.device("meta")
    built = list(batches([[1, 2, 3, 4, 5], {"input_ids": [[1, 2, 3]]}], None, 4, 2, meta))
    assert built[0][0].device == meta and built[1][0].device == meta
    given = torch.tensor([[1, 2, 3]])
    assert next(batches([given], None, 4, 2, meta))[0] is given


def test_a_bf16_model_reads_a_bf16_folded_matrix_within_one_rounding_of_float32():
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    randomize_readouts(model)
    model.learn(ids())
    layer = next(iter(model.memory_layers.values()))
    m32 = layer.folded(torch.device("cpu"), torch.float32)
    m16 = layer.folded(torch.device("cpu"), torch.bfloat16)
    assert m32.dtype == torch.float32 and m16.dtype == torch.bfloat16
    torch.testing.assert_close(m16.float(), m32, rtol=2**-8, atol=1e-6 * float(m32.abs().max()))
    hidden = torch.randn(2, 5, 32).bfloat16()
    expected = hidden.double() + hidden.double() @ m32.double()
    torch.testing.assert_close(layer(hidden).double(), expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))


def test_applying_faast_to_an_already_wrapped_base_model_is_refused_until_removed():
    base = tiny_model("llama")
    model = apply_faast(base, FaastConfig())
    with pytest.raises(ValueError, match="already applied to this base model.*remove_faast"):
        apply_faast(model.base_model, FaastConfig())
    again = apply_faast(model.remove_faast(), FaastConfig())  # hooks gone: it may be wrapped anew
    x = ids(batch=1, seq=6, seed=2)
    with torch.no_grad():
        assert torch.equal(again(x).logits, tiny_model("llama")(x).logits)


def test_learning_nothing_is_an_error(tmp_path):
    model = apply_faast(tiny_model("llama"), FaastConfig())
    for empty in ([], iter(())):
        with pytest.raises(ValueError, match="inputs: nothing to learn"):
            model.learn(empty)
    assert all(int(m.count.sum()) == 0 for m in model.fast_weights())


def test_a_learn_that_fails_part_way_leaves_every_memory_as_it_was():
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    model.learn(ids(batch=2, seq=10, seed=1))
    before = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in model.learned_state()}
    x = ids(batch=1, seq=8, seed=5)
    with torch.no_grad():
        expected = model(x).logits
    good = [list(range(3, 15))] * 10  # two batches of 8 and 2 windows, the bad item in the second
    with pytest.raises((TypeError, ValueError)):
        model.learn(good + [["not", "token", "ids"]], batch_size=8)
    for name, m in model.learned_state():
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[name][k]), (name, k)
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)  # no stale solution either
