"""faast.hf's shared memory bank: the middle layers learn in one Gram accumulation and solve in one eigh, each layer's
`.memory` is a view of its slot, per-layer fast-weight files still load exactly, and readout training through the
batched solve gives the per-layer gradients."""

from __future__ import annotations

import collections

import pytest
import torch

import faast.ops._dispatch as dispatch
from faast import FastWeights
from faast.checkpoint import load_checkpoint, save_state
from faast.hf import EmbeddingOutput, FaastConfig, MiddleLayers, apply_faast
from faast.ops import paths
from hf_models import KINDS, VOCAB, tiny_model
from tolerances import REORDER_REL, rel


def ids(batch=3, seq=17, seed=0):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def randomize(model, seed=1, std=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.memory_layers.values():
            layer.readout.weight.copy_(torch.randn(layer.readout.weight.shape, generator=g) * std)
            layer.scorer.weight.copy_(torch.randn(layer.scorer.weight.shape, generator=g) * std)


@pytest.fixture
def backend_calls(monkeypatch):
    """Counts calls of the backend implementations faast.ops dispatches to, by op, with the first argument's shape."""
    calls = collections.defaultdict(list)
    resolve = dispatch.resolve

    def counting_resolve(op, device, *args, **kwargs):
        name, impl = resolve(op, device, *args, **kwargs)

        def counted(*args, **kwargs):
            calls[op].append(tuple(args[0].shape))
            return impl(*args, **kwargs)

        # The measured choices of modes (faast.ops.paths) resolve to the mode, not to an op on tensors.
        return (name, impl) if op in paths.PATHS else (name, counted)

    monkeypatch.setattr(dispatch, "resolve", counting_resolve)
    return calls


# ---------------------------------------------------------------------------------------------------- batching


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_is_one_gram_accumulation_and_a_solve_one_eigh_for_all_middle_layers(kind, backend_calls):
    model = apply_faast(
        tiny_model(kind), FaastConfig(middle=MiddleLayers(layers=[0, 1, 2, 3]))
    )  # 4 middle layers + the output layer
    randomize(model)
    model.learn(ids(batch=2, seq=12))
    # One accumulation for the 4 middle layers (their rows stacked [4, rows, d]) and one for the output layer.
    assert len(backend_calls["accumulate_gram"]) == 2, backend_calls["accumulate_gram"]
    assert backend_calls["accumulate_gram"][0] == (4, 2 * 11, 32)
    assert backend_calls["eigh"] == []  # learning never solves
    backend_calls.clear()

    model(ids(batch=1, seq=5, seed=1))  # reading solves every memory once
    assert sorted(backend_calls["eigh"]) == [(1, 32, 32), (4, 32, 32)], backend_calls["eigh"]
    assert "accumulate_gram" not in backend_calls
    backend_calls.clear()
    model(ids(batch=1, seq=5, seed=2))
    model.generate(ids(batch=1, seq=4, seed=3), max_new_tokens=3, do_sample=False)
    assert backend_calls["eigh"] == []  # cached until the statistics change

    model.learn(ids(batch=2, seq=12, seed=4))
    assert len(backend_calls["accumulate_gram"]) == 2


def test_host_syncs_per_learned_batch_do_not_grow_with_the_number_of_layers(monkeypatch):
    syncs = collections.Counter()
    for method in ("__bool__", "item", "tolist", "__int__", "__float__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            syncs[_method] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)

    def syncs_of_learning(layers):
        model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=layers)))
        model.learn(ids(batch=2, seq=12))  # first batch: nothing cached yet
        syncs.clear()
        model.learn(ids(batch=2, seq=12, seed=1))
        learned = sum(syncs.values())
        model(ids(batch=1, seq=5))  # the solve: checks once per solve are allowed
        syncs.clear()
        model(ids(batch=1, seq=5, seed=2))
        return learned, sum(syncs.values())

    one_layer, one_read = syncs_of_learning([1])
    four_layers, four_read = syncs_of_learning([0, 1, 2, 3])
    assert four_layers == one_layer
    assert one_read == four_read == 0  # a forward pass with warm caches asks the device nothing


# -------------------------------------------------------------------------------------------------- the per-layer view


def test_each_layer_memory_is_a_view_of_its_slot_of_the_bank():
    model = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(layers=[0, 2, 3])))
    randomize(model)
    model.learn(ids(batch=3, seq=15))
    bank = model.memory_bank
    assert bank.batch_shape == (3,) and [layer.slot for layer in model.memory_layers.values()] == [0, 1, 2]
    for slot, layer in enumerate(model.memory_layers.values()):
        memory = layer.memory
        assert memory.dim_key == memory.dim_value == 32 and memory.batch_shape == ()
        assert memory.count.item() == 3 * 14
        assert torch.equal(memory.gram, bank.gram[slot]) and torch.equal(memory.cross, bank.cross[slot])
        assert torch.equal(memory.weights, bank.weights[slot])
        info = memory.solve_info
        assert info.rank.shape == () and info.rank.item() == bank.solve_info.rank[slot].item()
        # The names and shapes a per-layer FastWeights(d, d) had, so per-layer code keeps working.
        assert {k: v.shape for k, v in memory.state_dict().items()} == {
            k: v.shape for k, v in FastWeights(32, 32).state_dict().items()
        }
    # The configuration reads like a per-layer memory's, with the bank's solve settings.
    assert model.memory_layers["2"].memory.config() == {**FastWeights(32, 32).config(), "batch_shape": []}


def test_solve_settings_written_through_one_layer_apply_to_every_middle_layer():
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=[0, 1])))
    randomize(model)
    model.learn(ids(batch=2, seq=30))
    x = ids(batch=1, seq=6, seed=1)
    before = model(x).logits
    first, second = model.memory_layers.values()
    first.memory.alpha = 0.3
    assert second.memory.alpha == 0.3 and model.memory_bank.alpha == 0.3
    assert model.output_memory_layer.memory.alpha == 1.0  # the output layer has a memory of its own
    assert not torch.equal(model(x).logits, before)  # the folded weights follow the new filter
    first.memory.compute_dtype = torch.float32
    assert second.memory.compute_dtype == torch.float32 == model.memory_bank.compute_dtype
    second.memory.ridge = "auto"
    assert first.memory.ridge == "auto"
    with pytest.raises(ValueError, match="alpha"):
        first.memory.alpha = -1
    with pytest.raises(TypeError, match="compute_dtype: expected torch.float32 or torch.float64"):
        first.memory.compute_dtype = torch.float16
    assert first.memory.alpha == 0.3 and first.memory.compute_dtype == torch.float32  # refused writes change nothing


def test_per_layer_update_discount_and_reset_touch_only_that_slot():
    model = apply_faast(tiny_model("qwen2"), FaastConfig(middle=MiddleLayers(layers=[1, 3])))
    first, second = (layer.memory for layer in model.memory_layers.values())
    g = torch.Generator().manual_seed(0)
    k, v, s = torch.randn(2, 7, 32, generator=g), torch.randn(2, 7, 32, generator=g), torch.rand(2, 7, generator=g)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    reference = FastWeights(32, 32).update(k, v, s, mask=mask)
    second.update(k, v, s, mask=mask)
    assert first.count.item() == 0 and torch.count_nonzero(first.gram) == 0
    for name in ("gram", "cross", "count", "target_sqnorm"):
        assert torch.equal(getattr(second, name), getattr(reference, name)), name
    assert torch.equal(second.weights, reference.weights)

    x = ids(batch=1, seq=6)
    model(x)  # the empty slot passes h through while the other one reads its memory
    assert model.memory_layers["1"].folded(x.device, torch.float32) is None
    assert model.memory_layers["3"].folded(x.device, torch.float32) is not None

    first.update(k, v, mask=mask)
    gram_first = first.gram.clone()
    second.apply_discount(0.5)
    reference.apply_discount(0.5)
    assert torch.equal(second.gram, reference.gram) and second.count.item() == reference.count.item()
    assert torch.equal(first.gram, gram_first)
    second.reset()
    assert second.count.item() == 0 and torch.count_nonzero(second.cross) == 0
    assert torch.equal(first.gram, gram_first)
    with pytest.raises(ValueError, match="keys: expected shape"):
        first.update(torch.randn(4, 31), torch.randn(4, 32))
    assert torch.equal(first.gram, gram_first)  # a refused update leaves the slot untouched


# ---------------------------------------------------------------------------------------------------- persistence


def per_layer_file(path, model, seed=0):
    """A fast-weight file as faast wrote it while every middle layer owned a FastWeights(d, d): a faast.Checkpoint
    with one memory per layer at memory_layers.<block>.memory and the output layer's at output_memory_layer.memory."""
    g = torch.Generator().manual_seed(seed)
    holder = torch.nn.Module()
    holder.memory_layers = torch.nn.ModuleDict()
    memories = {}
    for key in model.memory_layers:
        memory = FastWeights(32, 32)  # what the per-layer code built: FastWeights(d, d, alpha, ridge, compute_dtype)
        memory.update(torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g), torch.rand(40, generator=g))
        layer = torch.nn.Module()
        layer.memory = memory
        holder.memory_layers[key] = layer
        memories[key] = memory
    holder.output_memory_layer = torch.nn.Module()
    holder.output_memory_layer.memory = FastWeights(32, 32)
    holder.output_memory_layer.memory.update(torch.randn(9, 32, generator=g), torch.randn(9, 32, generator=g))
    memories["output"] = holder.output_memory_layer.memory
    save_state(path, holder)
    return holder, memories


@pytest.mark.parametrize("kind", KINDS)
def test_per_layer_fast_weight_files_load_into_the_bank_exactly(kind, tmp_path):
    # Files of that layout were written by models with the paper's output layer (the only one there was).
    model = apply_faast(tiny_model(kind), FaastConfig(output=EmbeddingOutput(), middle=MiddleLayers(layers=[0, 2, 3])))
    _, old = per_layer_file(tmp_path / "old.safetensors", model)
    model.load_fast_weights(tmp_path / "old.safetensors")
    for key, layer in model.memory_layers.items():
        for name, tensor in old[key].state_dict().items():
            assert torch.equal(layer.memory.state_dict()[name], tensor), (key, name)
        assert rel(layer.memory.weights, old[key].weights) <= REORDER_REL
    for name, tensor in old["output"].state_dict().items():
        assert torch.equal(model.output_memory_layer.memory.state_dict()[name], tensor)

    # Files written now keep that layout: what the per-layer code read, bit for bit.
    model.save_fast_weights(tmp_path / "new.safetensors")
    reader, _ = per_layer_file(tmp_path / "scratch.safetensors", model, seed=5)
    load_checkpoint(tmp_path / "new.safetensors", reader)
    for key in model.memory_layers:
        for name, tensor in old[key].state_dict().items():
            assert torch.equal(reader.memory_layers[key].memory.state_dict()[name], tensor), (key, name)

    other = apply_faast(tiny_model(kind), FaastConfig(output=EmbeddingOutput(), middle=MiddleLayers(layers=[0, 2])))
    with pytest.raises(ValueError, match=r"old\.safetensors: holds memories"):
        other.load_fast_weights(tmp_path / "old.safetensors")
    assert other.memory_bank.count.sum().item() == 0  # all or nothing


def test_a_checkpoint_of_the_model_itself_loads_with_load_fast_weights(tmp_path):
    from faast.checkpoint import Checkpointer

    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=[1, 2])))
    randomize(model)
    model.learn(ids(batch=2, seq=20))
    path = Checkpointer(tmp_path).save(model, {"batches": 1})  # the bank layout: memory_bank + output memory
    fresh = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=[1, 2])))
    fresh.load_fast_weights(path)
    assert torch.equal(fresh.memory_bank.gram, model.memory_bank.gram)
    assert torch.equal(fresh.output_memory_layer.memory.cross, model.output_memory_layer.memory.cross)


# ---------------------------------------------------------------------------------------------------- readout training


def test_the_batched_training_solve_gives_the_per_layer_loss_and_gradients():
    def run(batched):
        model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=[0, 1, 3], dropout=0.0)))
        randomize(model)
        model.learn(ids(batch=2, seq=16, seed=3))
        params = [p for layer in model.memory_layers.values() for p in (layer.readout.weight, layer.scorer.weight)]
        for p in params:
            p.requires_grad_(True)
        learn = ids(batch=2, seq=14, seed=4)
        mask = torch.ones_like(learn)
        mask[0, :3] = 0
        model.learn_batch(learn, mask, differentiable=True)
        if batched:
            model.begin_training_step()
        else:
            for layer in model.memory_layers.values():
                layer.begin_training_step()
        x = ids(batch=2, seq=10, seed=5)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        model.end_training_step()
        return loss.detach(), [p.grad.clone() for p in params]

    loss_batched, grads_batched = run(True)
    loss_layers, grads_layers = run(False)
    assert rel(loss_batched, loss_layers) <= REORDER_REL
    for a, b in zip(grads_batched, grads_layers, strict=True):
        assert b.abs().sum() > 0  # readouts and scorers all get a gradient
        assert rel(a, b) <= REORDER_REL
