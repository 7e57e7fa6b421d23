"""Saving and loading FastWeights: exact round trips, atomic writes, clear errors on bad files."""

from __future__ import annotations

import json
import os

import pytest
import torch

from faast import FastWeights
from faast.persist import write_atomic


def learned(**kwargs):
    g = torch.Generator().manual_seed(0)
    m = FastWeights(12, 3, **kwargs)
    batch = m.batch_shape
    m.update(torch.randn(*batch, 100, 12, generator=g), torch.randn(*batch, 100, 3, generator=g),
             torch.rand(*batch, 100, generator=g))  # fmt: skip
    return m


CONFIGS = [
    pytest.param({}, id="default"),
    pytest.param({"alpha": "auto", "batch_shape": (2,), "discount": 0.9, "dtype": torch.float64}, id="auto-batched"),
    pytest.param({"ridge": 0.5, "prior": torch.ones(12, 3), "prior_count": 7.0}, id="ridge-prior"),
    pytest.param({"mode": "blend", "blend_window": 40, "blend_chunk": 16, "blend_discount": 0.9}, id="blend"),
]


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_round_trip_is_bit_exact(tmp_path, kwargs):
    m = learned(**kwargs)
    path = m.save(tmp_path / "memory.safetensors")
    loaded = FastWeights.load(path)
    assert loaded.config() == m.config()
    for name, tensor in m.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(loaded.weights, m.weights)
    # ...and learning continues identically after the round trip.
    extra = (torch.ones(*m.batch_shape, 5, 12), torch.ones(*m.batch_shape, 5, 3))
    assert torch.equal(loaded.update(*extra).weights, m.update(*extra).weights)


def test_load_state_into_a_matching_memory(tmp_path):
    m = learned(alpha=0.7)
    path = m.save(tmp_path / "m.safetensors")
    other = FastWeights(12, 3, alpha=0.7)
    version = other.version
    other.load_state(path)
    assert other.version > version
    assert torch.equal(other.weights, m.weights)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"dim_value": 4}, "dim_value"), ({"batch_shape": (2,)}, "batch_shape"), ({"mode": "blend"}, "mode"),
     ({"weighted_least_squares": True}, "weighted_least_squares")],
)  # fmt: skip
def test_load_state_names_the_mismatch(tmp_path, kwargs, field):
    path = learned().save(tmp_path / "m.safetensors")
    other = FastWeights(12, kwargs.pop("dim_value", 3), **kwargs)
    with pytest.raises(ValueError, match=field):
        other.load_state(path)


def test_corrupted_files_are_reported(tmp_path):
    path = learned().save(tmp_path / "m.safetensors")
    blob = path.read_bytes()
    flipped = bytearray(blob)
    flipped[-3] ^= 0x10
    cases = {
        "bitflip": bytes(flipped),
        "truncated": blob[: len(blob) - 100],
        "header-garbage": b"\xff" * 8 + blob[8:],
        "empty": b"",
    }
    for name, content in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=str(bad.name)):
            FastWeights.load(bad)


def test_foreign_and_future_files_are_refused(tmp_path):
    foreign = tmp_path / "foreign.safetensors"
    write_atomic(foreign, {"x": torch.zeros(2)}, {"format": "something-else"})
    with pytest.raises(ValueError, match="not a faast.FastWeights file"):
        FastWeights.load(foreign)
    m = learned()
    future = tmp_path / "future.safetensors"
    write_atomic(future, dict(m.state_dict()), {"format": "faast.FastWeights", "format_version": "99",
                                                          "config": json.dumps(m.config())})  # fmt: skip
    with pytest.raises(ValueError, match="newer faast"):
        FastWeights.load(future)


def test_a_crash_while_writing_keeps_the_previous_file(tmp_path, monkeypatch):
    path = learned().save(tmp_path / "m.safetensors")
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash during rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        learned(alpha=0.5).save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary file left behind
    monkeypatch.undo()
    assert FastWeights.load(path).config()["alpha"] == 1.0


@pytest.mark.parametrize("requested", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_loading_moves_to_the_requested_device_and_keeps_float64(tmp_path, requested):
    saved = learned()
    path = saved.save(tmp_path / "m.safetensors")
    # The process's default device is another one (meta: no data), so only a load that honours `device` puts the
    # statistics on the requested device, with the saved values.
    with torch.device("meta"):
        loaded = FastWeights.load(path, device=requested)
    assert loaded.gram.dtype == torch.float64 and loaded.gram.device.type == requested
    state = loaded.state_dict()
    for name, tensor in saved.state_dict().items():
        assert state[name].device.type == requested and torch.equal(state[name].cpu(), tensor), name


@pytest.mark.parametrize(
    "metadata",
    [
        {"format": "faast.FastWeights", "format_version": "one", "config": "{}"},
        {"format": "faast.FastWeights", "format_version": "1", "config": "{not json"},
        {"format": "faast.FastWeights", "format_version": "1", "config": "[1, 2]"},
        {"format": "faast.FastWeights", "format_version": "1", "config": json.dumps({"dim_key": 12})},
    ],
    ids=["version-not-int", "config-not-json", "config-not-object", "config-incomplete"],
)
def test_malformed_metadata_is_reported(tmp_path, metadata):
    path = tmp_path / "bad.safetensors"
    write_atomic(path, dict(learned().state_dict()), metadata)
    with pytest.raises(ValueError, match="bad.safetensors"):
        FastWeights.load(path)


def test_every_save_creates_missing_parent_folders_and_loads_back_exactly(tmp_path):
    from faast.checkpoint import load_checkpoint, save_state
    from faast.hf import FaastConfig, MiddleLayers, apply_faast
    from hf_models import tiny_model

    memory = FastWeights(6, 2, dtype=torch.float64)
    memory.update(torch.randn(20, 6, dtype=torch.float64), torch.randn(20, 2, dtype=torch.float64))
    path = memory.save(tmp_path / "a" / "b" / "m.safetensors")
    assert torch.equal(FastWeights.load(path).gram, memory.gram)
    holder = torch.nn.Module()
    holder.memory = memory
    state = save_state(tmp_path / "c" / "d" / "s.safetensors", holder)
    fresh = torch.nn.Module()
    fresh.memory = FastWeights(6, 2, dtype=torch.float64)
    load_checkpoint(state, fresh)
    assert torch.equal(fresh.memory.cross, memory.cross)
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(layers=[1])))
    model.learn(torch.randint(3, 60, (2, 12)))
    model.save_pretrained(tmp_path / "e" / "adapter")
    fast = model.save_fast_weights(tmp_path / "f" / "g" / "fw.safetensors")
    assert (tmp_path / "e" / "adapter" / "faast_config.json").is_file() and fast.is_file()


# The blend window's buffers before it became the submodule `blend` (files written then must keep loading).
OLD_BLEND_NAMES = {
    "blend.gram": "blend_gram",
    "blend.cross": "blend_cross",
    "blend.sqnorm": "blend_sqnorm",
    "blend.rows": "blend_rows",
    "blend.cursor": "blend_cursor",
    "blend.folded_weights": "folded_weights",
    "blend.folded_count": "folded_count",
}
BLEND = {"mode": "blend", "blend_window": 40, "blend_chunk": 16, "blend_discount": 0.9}


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_blend_state_lives_in_its_submodule():
    m = learned(**BLEND)
    assert sorted(k for k in m.state_dict() if k.startswith("blend.")) == sorted(OLD_BLEND_NAMES)
    assert not any(k in m.state_dict() for k in OLD_BLEND_NAMES.values())


def test_blend_files_in_the_old_flat_layout_load_bit_exactly(tmp_path):
    from faast.checkpoint import load_checkpoint

    m = learned(**BLEND)
    old = {OLD_BLEND_NAMES.get(k, k): v for k, v in m.state_dict().items()}
    assert "blend_cursor" in old and "folded_count" in old and not any(k.startswith("blend.") for k in old)
    path = tmp_path / "old.safetensors"
    write_atomic(path, old, {"format": "faast.FastWeights", "format_version": "1",
                             "config": json.dumps(m.config(), sort_keys=True)})  # fmt: skip
    loaded = FastWeights.load(path)
    assert_same_state(loaded, m)
    assert torch.equal(loaded.weights, m.weights)
    into = FastWeights(12, 3, **BLEND)
    into.load_state(path)
    assert_same_state(into, m)

    # nn.Module.load_state_dict of a model holding the memory, old names under its prefix.
    holder = torch.nn.ModuleDict({"m": FastWeights(12, 3, **BLEND)})
    holder.load_state_dict({f"m.{k}": v for k, v in old.items()})
    assert_same_state(holder["m"], m)

    # A checkpoint of that time: flat names, and no format per memory (only FastWeights existed).
    checkpoint = tmp_path / "checkpoint.safetensors"
    metadata = {"format": "faast.Checkpoint", "format_version": "1", "rank": "0", "world_size": "1",
                "position": json.dumps({"batches": 3}),
                "memories": json.dumps({"m": {"config": m.config(), "has_prior": False}})}  # fmt: skip
    write_atomic(checkpoint, {f"m.{k}": v for k, v in old.items()}, metadata)
    restored = torch.nn.ModuleDict({"m": FastWeights(12, 3, **BLEND)})
    assert load_checkpoint(checkpoint, restored)["batches"] == 3
    assert_same_state(restored["m"], m)
    assert torch.equal(restored["m"].weights, m.weights)
