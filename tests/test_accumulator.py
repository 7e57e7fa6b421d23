"""faast.Accumulator: float64 sums against hand sums, clear errors that leave it untouched, device moves without
casts, and files and checkpoints handled exactly as a FastWeights' (bit-exact, all or nothing)."""

from __future__ import annotations

import json

import pytest
import torch

import faast
from faast import Accumulator, FastWeights
from faast.checkpoint import Checkpointer, learn_stream, load_checkpoint, save_state
from faast.persist import write_atomic

D, V = 5, 7


def batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    mu = torch.randn(3 + i, D, generator=g, dtype=torch.float64)
    p = torch.rand(3 + i, V, generator=g)  # float32: added in float64
    return {"count": mu.shape[0], "gram": mu.T @ mu, "probability": p.sum(0)}


def filled(n: int = 4) -> Accumulator:
    acc = Accumulator({"gram": (D, D), "probability": (V,)})
    for i in range(n):
        acc.add(**batch(i))
    return acc


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_add_merge_discount_reset_against_hand_sums():
    acc = filled(4)
    parts = [batch(i) for i in range(4)]
    gram = sum(p["gram"] for p in parts)
    probability = sum(p["probability"].to(torch.float64) for p in parts)
    assert acc.gram.dtype == acc.probability.dtype == acc.count.dtype == torch.float64
    assert torch.allclose(acc.gram, gram, rtol=1e-15, atol=0) and torch.equal(acc.probability, probability)
    assert float(acc.count) == sum(p["count"] for p in parts)
    assert set(acc.sums()) == {"gram", "probability"} and acc.names == ("gram", "probability")

    other = Accumulator({"gram": (D, D), "probability": (V,)})
    other.add(**batch(9))
    merged = filled(4).merge(other)
    assert torch.equal(merged.gram, acc.gram + batch(9)["gram"]) and float(merged.count) == float(acc.count) + 12

    discounted = filled(4).apply_discount(0.5)
    assert torch.equal(discounted.gram, acc.gram * 0.5) and float(discounted.count) == float(acc.count) / 2

    acc.reset()
    assert not acc.gram.any() and not acc.probability.any() and float(acc.count) == 0


def test_count_may_be_a_tensor_on_the_device():
    acc = Accumulator({"mass": (3,)})
    acc.add(count=torch.tensor(4), mass=torch.ones(3))
    acc.add(count=torch.tensor(2.5, dtype=torch.float64), mass=torch.ones(3))
    assert float(acc.count) == 6.5 and torch.equal(acc.mass, torch.full((3,), 2.0, dtype=torch.float64))


def without(name: str):
    return lambda args: {k: v for k, v in args.items() if k != name}


def replaced(**change: object):
    return lambda args: {**args, **change}


ADD_CASES = [
    pytest.param(without("probability"), ValueError, "sums: expected keyword arguments", id="missing-sum"),
    pytest.param(replaced(extra=torch.zeros(1)), ValueError, "sums: expected keyword arguments", id="unknown-sum"),
    pytest.param(replaced(gram=torch.zeros(D, D + 1)), ValueError, "gram: expected shape", id="wrong-shape"),
    pytest.param(replaced(gram=torch.zeros(D, D, dtype=torch.int64)), TypeError, "gram: expected dtype", id="int"),
    pytest.param(replaced(gram=[[0.0]]), TypeError, "gram: expected a torch.Tensor", id="not-a-tensor"),
    pytest.param(replaced(gram=torch.zeros(D, D, device="meta")), ValueError, "gram: expected device", id="device"),
    pytest.param(replaced(gram=torch.full((D, D), float("nan"))), ValueError, "gram: expected finite", id="nan"),
    pytest.param(
        replaced(probability=torch.full((V,), float("inf"))), ValueError, "probability: expected finite", id="inf"
    ),
    pytest.param(replaced(count=-1), ValueError, "count: expected a finite number >= 0", id="negative-count"),
    pytest.param(replaced(count=float("inf")), ValueError, "count: expected a finite number", id="inf-count"),
    pytest.param(
        replaced(count=torch.tensor(-2.0)), ValueError, "count: expected a finite number >= 0", id="negative-tensor"
    ),
    pytest.param(replaced(count=torch.ones(2)), ValueError, "count: expected shape", id="count-not-scalar"),
    pytest.param(replaced(count="3"), TypeError, "count: expected a real number", id="count-string"),
    pytest.param(without("count"), TypeError, "count", id="count-missing"),
]


@pytest.mark.parametrize(("change", "error", "match"), ADD_CASES)
def test_bad_add_raises_naming_the_argument_and_leaves_it_untouched(change, error, match):
    acc = filled(2)
    before, version = snapshot(acc), acc.version
    with pytest.raises(error, match=match):
        acc.add(**change(batch(5)))
    assert_same(snapshot(acc), before)
    assert acc.version == version


@pytest.mark.parametrize(
    ("sums", "error", "match"),
    [
        pytest.param({}, TypeError, "sums: expected a non-empty mapping", id="empty"),
        pytest.param({"count": (2,)}, ValueError, "sums: expected identifiers other than 'count'", id="count"),
        pytest.param({"add": (2,)}, ValueError, "Accumulator's attributes, got 'add'", id="attribute"),
        pytest.param({"not a name": (2,)}, ValueError, "sums: expected identifiers", id="not-identifier"),
        pytest.param({"x": 3}, TypeError, "sums: the shape of 'x' must be a sequence", id="int-shape"),
        pytest.param({"x": (2, -1)}, ValueError, "sums: the shape of 'x' must hold ints >= 0", id="negative"),
    ],
)
def test_constructor_rejects(sums, error, match):
    with pytest.raises(error, match=match):
        Accumulator(sums)


def test_merge_rejects_another_structure_and_leaves_it_untouched():
    acc = filled(2)
    before = snapshot(acc)
    with pytest.raises(ValueError, match="other: expected sums"):
        acc.merge(Accumulator({"gram": (D, D)}))
    with pytest.raises(TypeError, match="other: expected a faast.Accumulator"):
        acc.merge(FastWeights(D, D))
    with pytest.raises(ValueError, match="gamma"):
        acc.apply_discount(1.5)
    assert_same(snapshot(acc), before)


def test_state_key_follows_every_change_in_place_edits_included():
    acc = filled(1)
    key, version = acc.state_key, acc.version
    acc.gram.mul_(2)  # behind its back: the tensor version counter changes
    assert acc.state_key != key and acc.version == version
    acc.mark_changed()
    assert acc.version == version + 1
    key = acc.state_key
    acc.add(**batch(1))
    assert acc.state_key != key and acc.version == version + 2


def test_device_moves_and_dtype_casts_keep_float64():
    holder = torch.nn.Module()
    holder.linear = torch.nn.Linear(2, 2)
    holder.stats = filled(2)
    before, version = snapshot(holder.stats), holder.stats.version
    holder.half()
    assert holder.linear.weight.dtype == torch.float16
    assert all(t.dtype == torch.float64 for t in holder.stats.buffers())
    assert_same(snapshot(holder.stats), before)
    assert holder.stats.version > version  # moves mark it changed
    holder.to("meta")
    assert holder.stats.gram.device.type == "meta" and holder.stats.gram.dtype == torch.float64
    assert holder.stats.device.type == "meta"


def test_save_and_load_round_trip_is_bit_exact(tmp_path):
    acc = filled(3)
    path = acc.save(tmp_path / "sub" / "acc.safetensors")
    loaded = Accumulator.load(path)
    assert loaded.config() == acc.config() == {"sums": {"gram": [D, D], "probability": [V]}}
    assert_same(snapshot(loaded), snapshot(acc))
    fresh = Accumulator({"gram": (D, D), "probability": (V,)})
    version = fresh.version
    fresh.load_state(path)
    assert_same(snapshot(fresh), snapshot(acc)) and fresh.version > version


def test_loading_refuses_other_structures_and_bad_values(tmp_path):
    path = filled(3).save(tmp_path / "acc.safetensors")
    other = Accumulator({"gram": (D, D)})
    with pytest.raises(ValueError, match="saved with sums=.*this accumulator has"):
        other.load_state(path)
    memory_file = FastWeights(D, D).save(tmp_path / "fw.safetensors")
    with pytest.raises(ValueError, match="not a faast.Accumulator file"):
        Accumulator.load(memory_file)
    acc = filled(1)
    state = snapshot(acc)
    state["count"] = torch.tensor(-1.0, dtype=torch.float64)
    bad = tmp_path / "negative.safetensors"
    metadata = {"format": "faast.Accumulator", "format_version": "1", "config": json.dumps(acc.config())}
    write_atomic(bad, state, metadata)
    before = snapshot(acc)
    with pytest.raises(ValueError, match="tensor count holds negative entries"):
        acc.load_state(bad)
    with pytest.raises(ValueError, match="tensor gram has shape"):
        acc.load_statistics({**before, "gram": torch.zeros(D, D + 1, dtype=torch.float64)})
    assert_same(snapshot(acc), before)


class Mixed(torch.nn.Module):
    """A FastWeights and two Accumulators in one module, as the residual output layer holds them."""

    def __init__(self, vocab: int = V) -> None:
        super().__init__()
        self.memory = FastWeights(D, 3)
        self.curvature = Accumulator({"gram": (D, D)})
        self.token_mass = Accumulator({"probability": (vocab,)})


def step(model: Mixed, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> int:
    keys, values, probability = data
    model.memory.update(keys, values)
    model.curvature.add(count=keys.shape[0], gram=keys.T @ keys)
    model.token_mass.add(count=keys.shape[0], probability=probability.sum(0))
    return keys.shape[0]


def stream(start: int = 0, crash_at: int | None = None):
    for i in range(start, 8):
        if i == crash_at:
            raise KeyboardInterrupt(f"simulated crash before batch {i}")
        g = torch.Generator().manual_seed(7 + i)
        n = 2 + i
        f64 = {"generator": g, "dtype": torch.float64}
        yield torch.randn(n, D, **f64), torch.randn(n, 3, **f64), torch.rand(n, V, **f64)


def test_checkpoint_round_trip_mixing_fast_weights_and_accumulators_is_bit_exact(tmp_path):
    model = Mixed()
    learn_stream(model, stream(), step=step)
    path = save_state(tmp_path / "state.safetensors", model, {"note": "x"})
    fresh = Mixed()
    assert load_checkpoint(path, fresh)["note"] == "x"
    assert_same(snapshot(fresh), snapshot(model))
    assert torch.equal(fresh.memory.weights, model.memory.weights)


def test_resume_with_accumulators_is_bitwise_uninterrupted(tmp_path):
    expected = Mixed()
    learn_stream(expected, stream(), step=step)
    with pytest.raises(KeyboardInterrupt):
        learn_stream(Mixed(), stream(crash_at=5), step=step, checkpoint_dir=tmp_path, every=2)
    resumed = Mixed()
    position = learn_stream(resumed, stream(), step=step, checkpointer=Checkpointer(tmp_path), every=2)
    assert position["resumed_from"] == 4
    assert_same(snapshot(resumed), snapshot(expected))


def test_checkpoint_loading_is_all_or_nothing_across_kinds(tmp_path):
    model = Mixed()
    learn_stream(model, stream(), step=step)
    path = save_state(tmp_path / "state.safetensors", model)
    wider = Mixed(vocab=V + 1)  # its token mass does not fit: nothing may be loaded, the FastWeights included
    before = snapshot(wider)
    with pytest.raises(ValueError, match=r"memory token_mass\): saved with sums="):
        load_checkpoint(path, wider)
    assert_same(snapshot(wider), before)
    swapped = Mixed()
    swapped.curvature = FastWeights(D, D)  # the file holds an Accumulator under this name
    with pytest.raises(ValueError, match=r"memory curvature\): holds a faast.Accumulator"):
        load_checkpoint(path, swapped)


def test_distributed_finds_accumulators_and_fast_weights_keeps_its_kind():
    model = Mixed()
    found = faast.distributed.find_memories(model)
    assert [name for name, _ in found] == ["memory", "curvature", "token_mass"]
    assert all(isinstance(m, faast.SummedStatistics) for _, m in found)
    assert [name for name, _ in faast.distributed.find_memories(model, FastWeights)] == ["memory"]
